#!/usr/bin/env python3
"""Each glm-infra unit's memory as the host sees it, for node exporter's textfile collector (stdlib only;
runs on a host, from a timer).

    unit_memory.py --units FILE --out FILE [--cgroup-root DIR] [--proc DIR]

Why: vLLM 0.33.0 with more than one API server (every unit with -dp above 1) serves no ``process_*``
metric at all, so what the engine reports cannot show a leak; the host's cgroup of the unit always can,
and counts every process of the unit (API servers, engine cores, workers) however vLLM lays them out.

FILE (JSON): [{"unit": "glm-vllm-decode-0.service", "instance": "decode-0", "pool": "decode"}, …].
For each unit that is active, its anonymous memory (what a leak grows; page cache is not):

- ``cgroup``: the unit's own cgroup's memory.stat (``anon`` on cgroup v2, ``total_rss`` on v1), the
  kernel's count of the pages charged to it, shared ones once;
- ``procs``: where the memory controller is not the unit's (a v1 host whose memory hierarchy is not
  delegated, a container), the sum of ``RssAnon`` of every process in the unit's cgroup and below it.

Written whole (a new file renamed over the old), in the Prometheus text format:
``glm_unit_memory_anon_bytes{unit, glm_instance, pool, method}``, ``glm_unit_memory_measured`` (1, or 0
for an active unit whose memory could not be read: the reason goes to stderr), and
``glm_unit_memory_sample_time_seconds`` (the rules ignore samples older than a few periods: a stopped
timer is not a flat line). An inactive unit gets no sample (the instance-down alerts cover it).
Exit 1 when an active unit could not be measured; 2 when nothing could be (bad usage, an unreadable units
file, systemd not answering), and then the last file is left as it was.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

LABELS = ("unit", "instance", "pool")


def load_units(path: str) -> list[dict[str, str]]:
    try:
        units = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"unit-memory: {path}: cannot read: {e}") from None
    if not isinstance(units, list) or not all(
            isinstance(u, dict) and all(isinstance(u.get(k), str) and u[k] for k in LABELS) for u in units):
        raise SystemExit(f"unit-memory: {path}: expected a list of {{{', '.join(LABELS)}}} with non-empty strings")
    return units


def unit_states(names: list[str]) -> dict[str, tuple[str, str]]:
    """{unit: (ActiveState, ControlGroup)} from one ``systemctl show``."""
    if not names:
        return {}
    out = subprocess.run(["systemctl", "show", "--property=Id,ActiveState,ControlGroup", "--", *names],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    states: dict[str, tuple[str, str]] = {}
    for block in out.strip().split("\n\n"):
        fields = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
        if fields.get("Id"):
            states[fields["Id"]] = (fields.get("ActiveState", ""), fields.get("ControlGroup", ""))
    return states


def stat_value(path: Path, key: str) -> int | None:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        return None
    return None


def processes(directory: Path) -> list[int]:
    """Every pid in a cgroup and its children (cgroup.procs lists a cgroup's own members only)."""
    pids: list[int] = []
    for here, _, files in os.walk(directory):
        if "cgroup.procs" in files:
            try:
                pids += [int(p) for p in (Path(here) / "cgroup.procs").read_text().split()]
            except (OSError, ValueError):
                continue
    return pids


def rss_anon(proc: Path, pid: int) -> int | None:
    """RssAnon of a process in bytes; None when it is gone (it exited meanwhile) or has no such line."""
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                value, unit = line.split()[1:3]
                return int(value) * 1024 if unit == "kB" else None
    except (OSError, ValueError, IndexError):
        return None
    return 0  # a kernel thread has no such line: no user memory


def measure(cgroup_root: Path, proc: Path, control_group: str) -> tuple[int, str] | str:
    """(bytes, method) of one unit's cgroup, or why it cannot be measured."""
    relative = control_group.lstrip("/")
    if not relative:
        return "systemd names no cgroup"
    unified = (cgroup_root / "cgroup.controllers").exists()
    if unified:
        anon = stat_value(cgroup_root / relative / "memory.stat", "anon")
        members = cgroup_root / relative
    else:
        anon = stat_value(cgroup_root / "memory" / relative / "memory.stat", "total_rss")
        members = cgroup_root / "systemd" / relative
    if anon is not None:
        return anon, "cgroup"
    if not members.is_dir():
        return f"no cgroup {members}"
    pids = processes(members)
    if not pids:
        return f"no process in {members}"
    sizes = [rss_anon(proc, pid) for pid in pids]
    if all(s is None for s in sizes):
        return f"no readable process status under {proc} for {len(pids)} processes of {members}"
    return sum(s for s in sizes if s is not None), "procs"


def escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def exposition(units: list[dict[str, str]], states: dict[str, tuple[str, str]], cgroup_root: Path, proc: Path,
               now: float) -> tuple[str, list[str]]:
    memory, measured, problems = [], [], []
    for u in units:
        active, group = states.get(u["unit"], ("", ""))
        if active != "active":
            continue
        labels = f'unit="{escape(u["unit"])}",glm_instance="{escape(u["instance"])}",pool="{escape(u["pool"])}"'
        result = measure(cgroup_root, proc, group)
        if isinstance(result, str):
            problems.append(f"{u['unit']}: {result}")
            measured.append(f"glm_unit_memory_measured{{{labels}}} 0")
            continue
        value, method = result
        memory.append(f'glm_unit_memory_anon_bytes{{{labels},method="{method}"}} {value}')
        measured.append(f"glm_unit_memory_measured{{{labels}}} 1")
    lines = ["# HELP glm_unit_memory_anon_bytes Anonymous memory of a glm-infra unit's cgroup (all its processes).",
             "# TYPE glm_unit_memory_anon_bytes gauge", *memory,
             "# HELP glm_unit_memory_measured Whether an active unit's memory could be read (0: see the timer's journal).",
             "# TYPE glm_unit_memory_measured gauge", *measured,
             "# HELP glm_unit_memory_sample_time_seconds When these samples were taken.",
             "# TYPE glm_unit_memory_sample_time_seconds gauge", f"glm_unit_memory_sample_time_seconds {now:.3f}"]
    return "\n".join(lines) + "\n", problems


def write_whole(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    tmp.chmod(0o644)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="unit_memory.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--units", required=True, help="JSON list of the units to measure")
    parser.add_argument("--out", required=True, help="the .prom file node exporter's textfile collector reads")
    parser.add_argument("--cgroup-root", default="/sys/fs/cgroup")
    parser.add_argument("--proc", default="/proc")
    args = parser.parse_args(argv)
    try:
        units = load_units(args.units)
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    try:
        states = unit_states([u["unit"] for u in units])
    except (OSError, subprocess.SubprocessError) as e:
        print(f"unit-memory: systemctl show failed: {e}", file=sys.stderr)
        return 2
    text, problems = exposition(units, states, Path(args.cgroup_root), Path(args.proc), time.time())
    write_whole(Path(args.out), text)
    for p in problems:
        print(f"unit-memory: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
