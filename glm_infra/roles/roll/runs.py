"""The `pulumi up` a process belongs to, and the record of a step that failed in it, which the hosts waiting
for a turn read (lease.sh).

Why: after a step fails, the engine starts nothing new but waits for every operation already running, and
a host's turn-acquire runs while it waits for the pool's slot. When the failed step was in the holder's turn,
the holder never gives the slot back in this run, and the waiter would wait out its whole bound (one turn's
step timeouts: hours) before `pulumi up` could end. The program's error hook writes this record as the step
fails; each waiter of the same run sees it within a poll and stops, naming the step."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from glm_infra.spec import paths

RUN_FAILED = "run-failed"  # the record's name: run-failed.<pid>.<start time>, in the stack's lease folder
LEASE_PID = "GLM_INFRA_LEASE_PID"  # names the run instead of the pulumi process above (the tests' runs)
LEASES = "GLM_INFRA_LEASES"  # where the lease folders are, instead of paths.LEASES


def lease_root(folder: str, environ: Mapping[str, str] = os.environ) -> Path:
    """The stack's lease folder as lease.sh finds it (``${GLM_INFRA_LEASES:-paths.LEASES}/folder``)."""
    return Path(environ.get(LEASES) or paths.LEASES) / folder


def started(pid: int, proc: Path = Path("/proc")) -> str | None:
    """The start time of ``pid`` (clock ticks since boot, field 22 of /proc/PID/stat); None if it is gone."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(") ", 1)[-1].split()  # after the command name, which may hold spaces
    return fields[19] if len(fields) > 19 else None


def this_run(environ: Mapping[str, str] = os.environ, proc: Path = Path("/proc"),
             pid: int | None = None) -> tuple[int, str] | None:
    """The run this process is part of, as lease.sh names it: the nearest process above it named ``pulumi``
    (or $GLM_INFRA_LEASE_PID) and that process's start time. None when there is none or it cannot be read
    (lease.sh then names its own parent, which no record names: its wait keeps its bound)."""
    if environ.get(LEASE_PID):
        holder = int(environ[LEASE_PID])
    else:
        holder, current = None, os.getpid() if pid is None else pid
        while current > 1:
            try:
                stat = (proc / str(current) / "stat").read_text()
                parent = int(stat.rsplit(") ", 1)[-1].split()[1])
                comm = (proc / str(parent) / "comm").read_text().strip()
            except (OSError, ValueError, IndexError):
                return None
            if comm == "pulumi":
                holder = parent
                break
            current = parent
        if holder is None:
            return None
    start = started(holder, proc)
    return (holder, start) if start is not None else None


def record_failure(root: Path, run: tuple[int, str], what: str) -> Path:
    """Record that ``what`` (a step's resource name and operation) failed in ``run``, once: the first
    failure is what the waiters name (a later one finds the record there). Written whole, then linked into
    place, so that no reader sees half of it; lease.sh treats a record it cannot read as a failure all the same."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{RUN_FAILED}.{run[0]}.{run[1]}"
    tmp = root / f".{path.name}.{os.getpid()}.{id(what)}"
    try:
        tmp.write_text(what.replace("\n", " ") + "\n")
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)
    return path
