"""Processes the test suite started, read from /proc: whole trees to kill, and what is left at the end.

A killed ``pulumi up`` leaves its plugins (the command provider, the language host) running with
parent 1, so killing a process group is not enough: trees are collected before anything is killed.
Every process the suite starts inherits ``SESSION_VAR`` from pytest's environment, which is how the
leak check tells them from anything else running on the machine.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from dataclasses import dataclass

SESSION_VAR = "GLM_INFRA_TEST_SESSION"
# What the issue names: pulumi and its plugins, nspawn hosts, the stand-ins and the servers the
# fixtures start. Matched on the program's base name (argv[0]) or, for python servers, the module.
WATCHED_PROGRAMS = ("pulumi", "pulumi-resource-command", "pulumi-language-python", "pulumi-language-python-exec",
                    "systemd-nspawn", "llm-d-inference-sim", "vllm", "vllm-router", "postgres", "nginx", "uv")
WATCHED_ARGS = ("http.server", "hub_standin.py", "weights.py", "glm_infra.agent.weights", "testbed/cluster.py",
                "testbed.cluster")


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    started: float  # seconds since the epoch
    argv: tuple[str, ...]

    @property
    def program(self) -> str:
        return os.path.basename(self.argv[0]) if self.argv else ""

    def __str__(self) -> str:
        return f"pid {self.pid} (parent {self.ppid}, {time.time() - self.started:.0f}s old): {' '.join(self.argv)[:300]}"


def new_session_id() -> str:
    return uuid.uuid4().hex


def _boot_time() -> float:
    """When the machine booted, to 10 ms: now less the uptime. (/proc/stat's btime is whole seconds, truncated:
    a process's start came out up to a second early, and one started after ``since`` looked older than it.)"""
    with open("/proc/uptime") as f:
        return time.time() - float(f.read().split()[0])


def processes() -> dict[int, Proc]:
    boot, ticks = _boot_time(), os.sysconf("SC_CLK_TCK")
    out: dict[int, Proc] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = tuple(a.decode(errors="replace") for a in f.read().split(b"\0") if a)
        except OSError:
            continue  # gone meanwhile
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(entry)] = Proc(int(entry), int(fields[1]), boot + int(fields[19]) / ticks, argv)
    return out


def descendants(pid: int, table: dict[int, Proc] | None = None) -> list[int]:
    table = table if table is not None else processes()
    children: dict[int, list[int]] = {}
    for p in table.values():
        children.setdefault(p.ppid, []).append(p.pid)
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> list[int]:
    """Signal pid and every process below it, collected first (children outlive a killed parent)."""
    victims = [pid, *descendants(pid)]
    for p in victims:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass
    return victims


def session_of(pid: int) -> str | None:
    """The test session id in pid's environment, if any."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    prefix = f"{SESSION_VAR}=".encode()
    return next((e[len(prefix):].decode() for e in env if e.startswith(prefix)), None)


def owner(pid: int, table: dict[int, Proc], keep: set[int] = frozenset()) -> str | None:
    """The session of pid or of its nearest ancestor that has one (a host's processes are started by
    its own systemd, without the variable, but below the nspawn that the session started), not looking
    past ``keep`` (pytest and its ancestors: an xdist worker was started with its controller's id)."""
    seen = set()
    while pid in table and pid not in seen and pid > 1 and pid not in keep:
        seen.add(pid)
        s = session_of(pid)
        if s is not None:
            return s
        pid = table[pid].ppid
    return None


def watched(p: Proc) -> bool:
    return p.program in WATCHED_PROGRAMS or any(a in arg for arg in p.argv[:3] for a in WATCHED_ARGS)


def _above(pid: int, table: dict[int, Proc]):
    """pid's ancestors below init, nearest first."""
    seen = set()
    pid = table[pid].ppid if pid in table else 0
    while pid in table and pid not in seen and pid > 1:
        seen.add(pid)
        yield pid
        pid = table[pid].ppid


def under_older(pid: int, table: dict[int, Proc], since: float, keep: set[int]) -> bool:
    """Whether an ancestor of pid (below init, other than pytest and its ancestors) was running before
    ``since``: pid belongs to something that was there before the session (simulated hosts someone
    booted by hand, a demo), not to it."""
    return any(a not in keep and table[a].started < since for a in _above(pid, table))


def beside(pid: int, table: dict[int, Proc], keep: set[int]) -> bool:
    """Whether pid hangs below one of pytest's ancestors but not below pytest: a tree someone else
    started beside the suite (a benchmark or a second suite under the same shell), not its own."""
    for a in _above(pid, table):
        if a == os.getpid():
            return False
        if a in keep:
            return True
    return False


def leftovers(session: str, since: float, keep: set[int]) -> list[Proc]:
    """Processes still alive that this session started: they or an ancestor carry its id in their
    environment, or they are a watched program started since the session began, below nothing older
    than the session (an orphan, or a tree the session started with a bare environment), that no
    other test session owns and that is not in a tree beside the suite's (another suite, a cluster
    booted by hand or a benchmark is left alone). ``keep``: pytest and its ancestors."""
    table = processes()
    out = []
    for p in table.values():
        if p.pid in keep or p.pid == os.getpid():
            continue
        who = owner(p.pid, table, keep)
        if who == session or (who is None and watched(p) and p.started >= since
                                 and not under_older(p.pid, table, since, keep) and not beside(p.pid, table, keep)):
            out.append(p)
    return out


def ancestors(pid: int) -> set[int]:
    table = processes()
    out = set()
    while pid in table and pid not in out:
        out.add(pid)
        pid = table[pid].ppid
    return out
