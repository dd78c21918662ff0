"""CPU-seconds of `pulumi preview`'s process tree for fleet-sized stacks, this checkout beside a git revision's
program, in one run (alternating, so that both see the same machine): prod-b300's settings on N hosts
(``testbed.bench.common.b300_fleet``), no host contacted.

    venv/bin/python scripts/bench/preview_cpu.py --against REF [--hosts 24,96] [--runs 2]

The total is exact (``getrusage`` of the waited-for process tree); its split between the program (python), the
engine (pulumi) and the command provider is sampled from /proc every 0.2 s (a process's last sample: a
little under its real share). CPU-seconds vary less than wall time on a shared machine. Pulumi's automatic log
is off in glm-infra's own PULUMI_HOME (scripts/lib/pulumi-env.sh); PULUMI_HOME=DIR (with DIR/plugins the
toolchain's) measures with it on.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import _repo  # noqa: F401  (the repository on sys.path)

from testbed.bench.common import PASSPHRASE, ROOT, Project, b300_fleet
from testbed.cluster import CACHE

KINDS = {"python": "program", "pulumi": "engine", "pulumi-resource": "provider", "pulumi-language": "language host"}


def at_revision(ref: str) -> Project:
    """A bench project whose program and glm_infra are ``ref``'s (git archive), the rest as this checkout's."""
    p = Project()
    subprocess.run(["rm", "-rf", str(p.dir / "glm_infra"), str(p.dir / "__main__.py")], check=True)
    subprocess.run(f"git -C {ROOT} archive {ref} __main__.py glm_infra | tar -x -C {p.dir}", shell=True, check=True)
    return p


def sample(root: int, stop: threading.Event, seen: dict[int, tuple[str, float]]) -> None:
    tck = os.sysconf("SC_CLK_TCK")
    while not stop.is_set():
        stats = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    s = open(f"/proc/{d}/stat").read()
                except OSError:
                    continue
                r = s.rsplit(")", 1)[1].split()
                stats[int(d)] = (int(r[1]), s[s.index("(") + 1:s.rindex(")")], (int(r[11]) + int(r[12])) / tck)
        tree, grew = {root}, True
        while grew:
            grew = False
            for pid, (ppid, _, _) in stats.items():
                if ppid in tree and pid not in tree:
                    tree.add(pid)
                    grew = True
        for pid in tree & stats.keys():
            _, comm, cpu = stats[pid]
            seen[pid] = (comm, max(cpu, seen.get(pid, ("", 0.0))[1]))
        stop.wait(0.2)


def preview(p: Project, stack: str) -> tuple[float, float, dict[str, float], int]:
    env = dict(os.environ, PULUMI_CONFIG_PASSPHRASE=PASSPHRASE, PULUMI_BACKEND_URL=f"file://{p.dir / 'state'}")
    cmd = f". {ROOT}/scripts/lib/pulumi-env.sh; cd {p.dir}; HOME={p.home} pulumi preview -s {stack} --non-interactive"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.Popen(["bash", "-c", cmd], env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stop, seen = threading.Event(), {}
    watcher = threading.Thread(target=sample, args=(proc.pid, stop, seen))
    watcher.start()
    out, err = proc.communicate()
    stop.set()
    watcher.join()
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"pulumi preview -s {stack} exited {proc.returncode}:\n{out[-3000:]}\n{err[-2000:]}")
    split: dict[str, float] = defaultdict(float)
    for comm, cpu in seen.values():
        split[KINDS.get(comm, "other")] += cpu
    creates = int(re.search(r"\+ (\d+) to create", out).group(1))
    return wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, split, creates


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, metavar="REF", help="the revision to set beside this checkout")
    ap.add_argument("--hosts", default="24,96", help="host counts (default 24,96)")
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    ref = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.against], capture_output=True,
                         text=True, check=True).stdout.strip()
    projects = {"this checkout": Project(), ref: at_revision(args.against)}
    rows = []
    try:
        for p in projects.values():
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(p.home / ".ssh/glm-infra_ed25519")],
                           check=True)
        for n in [int(x) for x in args.hosts.split(",")]:
            stack = f"b300-{n}hosts"
            for p in projects.values():
                p.write_stack(stack, b300_fleet(n))
                p.init(stack)
            results: dict[str, list] = {k: [] for k in projects}
            for run in range(args.runs):
                for label, p in projects.items():
                    wall, cpu, split, creates = preview(p, stack)
                    results[label].append((wall, cpu, split, creates))
                    print(f"  {n} hosts, {label}, run {run + 1}: {wall:.1f} s, {cpu:.1f} CPU-s ({creates} resources; "
                          + ", ".join(f"{k} {v:.1f}" for k, v in sorted(split.items(), key=lambda kv: -kv[1])) + ")",
                          flush=True)
            for label, rs in results.items():
                med = {k: statistics.median(r[2].get(k, 0.0) for r in rs) for k in ("program", "engine", "provider")}
                rows.append((n, label, statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs),
                             med, rs[0][3]))
    finally:
        for p in projects.values():
            p.cleanup()
    # scripts/lib/pulumi-env.sh turns it off in glm-infra's own PULUMI_HOME; one set in the environment keeps it.
    home = Path(os.environ.get("PULUMI_HOME") or CACHE / "pulumi-home")
    print(f"\nPulumi's automatic log: {'off' if (home / 'logs').is_file() else 'on'} ({home}/logs)")
    print(f"medians over {args.runs} runs")
    print("| hosts | program of | resources | wall | CPU-s (tree) | program | engine | provider |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for n, label, wall, cpu, med, creates in rows:
        print(f"| {n} | {label} | {creates} | {wall:.1f} s | {cpu:.1f} | {med['program']:.1f} | {med['engine']:.1f} | "
              f"{med['provider']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
