"""CPU-seconds of each test of the whole suite, as CI runs it: what the suite's wall time is made of once its
lanes and fast tier keep both cores busy (the suite is then CPU-bound, and only less CPU makes it faster).

    venv/bin/python scripts/bench/suite_cpu.py [--top 30] [-- PYTEST ARGS]   (as root, as scripts/test)
    venv/bin/python scripts/bench/suite_cpu.py --report DIR [--top 30]       (the table of an earlier run)

It runs scripts/test with this file as a pytest plugin: each pytest-xdist worker moves itself into a cpuacct
cgroup of its own (cgroup v1, /sys/fs/cgroup/cpuacct/glm-suite-cpu/<run>/<worker>), so whatever it starts, the
simulated hosts of its lane included, is counted to it, and writes one line per test to DIR/<worker>.jsonl:
wall seconds, the worker's CPU-seconds (user and system), and the machine's busy and idle CPU-seconds over
the same time (/proc/stat). The table: per lane and the fast tier, wall and CPU-seconds; the machine's idle
share; the tests that took the most CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
OUT_VAR = "GLM_SUITE_CPU_DIR"  # where the plugin writes; set by main(), so the plugin does nothing without it
ROOT = Path(__file__).resolve().parents[2]

_worker: dict = {}


def machine_cpu() -> tuple[float, float]:
    """The machine's busy and idle CPU-seconds since boot (/proc/stat's first line: busy is user, nice,
    system, irq and softirq; idle is idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    user, nice, system, idle, iowait, irq, softirq = fields
    hz = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / hz, (idle + iowait) / hz


def remove_groups(*groups: Path) -> None:
    """Each group in turn, innermost first, while it can go (no process left in it, no group under it)."""
    for group in groups:
        try:
            group.rmdir()
        except OSError:
            return


def cgroup_cpu(group: Path) -> tuple[float, float, float]:
    """CPU-seconds of everything that ran in ``group`` (cpuacct.usage), and its user and system split."""
    stat = dict(line.split() for line in (group / "cpuacct.stat").read_text().splitlines())
    hz = os.sysconf("SC_CLK_TCK")
    return int((group / "cpuacct.usage").read_text()) / 1e9, int(stat["user"]) / hz, int(stat["system"]) / hz


# --- the plugin (pytest -p suite_cpu, in every xdist worker) ---------------------------------------------


def pytest_configure(config):
    out, worker = os.environ.get(OUT_VAR), os.environ.get("PYTEST_XDIST_WORKER")
    if not out or not worker:
        return
    group = CPUACCT / "glm-suite-cpu" / Path(out).name / worker
    group.mkdir(parents=True, exist_ok=True)
    (group / "cgroup.procs").write_text(str(os.getpid()))  # this worker; what it starts from now on follows
    _worker.update(group=group, log=open(Path(out) / f"{worker}.jsonl", "a", buffering=1))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if "group" not in _worker:
        yield
        return
    t0, c0, m0 = time.monotonic(), cgroup_cpu(_worker["group"]), machine_cpu()
    yield
    t1, c1, m1 = time.monotonic(), cgroup_cpu(_worker["group"]), machine_cpu()
    _worker["log"].write(json.dumps({
        "id": item.nodeid, "wall": t1 - t0, "cpu": c1[0] - c0[0], "user": c1[1] - c0[1], "system": c1[2] - c0[2],
        "machine_busy": m1[0] - m0[0], "machine_idle": m1[1] - m0[1]}) + "\n")


def pytest_unconfigure(config):
    group = _worker.pop("group", None)
    if group is None:
        return
    _worker.pop("log").close()
    # Back to the machine's root group, so that this run's group can go (a cgroup with a process cannot).
    (CPUACCT / "cgroup.procs").write_text(str(os.getpid()))
    remove_groups(group, group.parent, group.parent.parent)  # the worker's, the run's (the last worker), ours


# --- the run and its table --------------------------------------------------------------------------------


def read_rows(out: Path) -> list[dict]:
    rows = []
    for log in sorted(out.glob("*.jsonl")):
        rows += [dict(json.loads(line), worker=log.stem) for line in log.read_text().splitlines() if line.strip()]
    return rows


def report(rows: list[dict], top: int, machine: tuple[float, float] | None = None) -> str:
    sys.path.insert(0, str(ROOT / "tests"))
    import conftest  # the suite's own lanes (CLUSTER_LANES), so the table says lane a, b, ... and fast tier

    per: dict[str, list[float]] = {}
    for r in rows:
        wall_cpu = per.setdefault(conftest.lane_label(r["id"]), [0.0, 0.0])
        wall_cpu[0] += r["wall"]
        wall_cpu[1] += r["cpu"]
    lines = ["| where | tests' wall s | CPU-s | cores used |", "| --- | --- | --- | --- |"]
    for label, (wall, cpu) in sorted(per.items()):
        lines.append(f"| {label} | {wall:.0f} | {cpu:.0f} | {cpu / wall if wall else 0:.2f} |")
    total = sum(cpu for _, cpu in per.values())
    lines.append(f"| all | | {total:.0f} | |")
    if machine:
        busy, idle = machine
        lines.append(f"\nthe machine over the run: {busy:.0f} CPU-s busy, {idle:.0f} idle ({idle / (busy + idle):.0%})")
    lines += ["", f"the {top} tests that took the most CPU:", "| CPU-s | wall s | test |", "| --- | --- | --- |"]
    for r in sorted(rows, key=lambda r: -r["cpu"])[:top]:
        lines.append(f"| {r['cpu']:.1f} | {r['wall']:.1f} | {r['id']} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=30, help="how many of the costliest tests to list")
    parser.add_argument("--report", type=Path, help="only print the table of an earlier run's folder")
    parser.add_argument("pytest_args", nargs="*", help="after --: more arguments for scripts/test")
    args = parser.parse_args()
    if args.report:
        print(report(read_rows(args.report), args.top))
        return 0
    if not (CPUACCT / "cgroup.procs").exists():
        sys.exit(f"{CPUACCT} is not there: this benchmark counts by cgroup v1's cpuacct controller")
    out = Path(tempfile.mkdtemp(prefix="glm-suite-cpu-"))
    env = dict(os.environ, **{OUT_VAR: str(out)},
               PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")])))
    m0 = machine_cpu()
    status = subprocess.run([str(ROOT / "scripts/test"), "-p", "suite_cpu", *args.pytest_args], cwd=ROOT, env=env).returncode
    m1 = machine_cpu()
    print(report(read_rows(out), args.top, (m1[0] - m0[0], m1[1] - m0[1])))
    print(f"\n(each test's line: {out})")
    # A worker's group that a process of its test still held when it ended, empty by now.
    run_group = CPUACCT / "glm-suite-cpu" / out.name
    for worker_group in [g for g in run_group.glob("*") if g.is_dir()]:
        remove_groups(worker_group)
    remove_groups(run_group, run_group.parent)
    return status


if __name__ == "__main__":
    sys.exit(main())
