"""Pulumi timings on the simulated cluster, medians over runs:

  * first `pulumi up` on 1 host vs 3 hosts (same per-host work; the ratio shows whether hosts are
    provisioned in parallel — goal ≤ 1.25),
  * a no-op `pulumi up` right after (goal: 0 changes and ≤ 15% of the first up),
  * `pulumi preview` of prod-b300 and of a generated 96-host stack (no host is contacted).

    venv/bin/python scripts/bench/pulumi_timing.py [--runs 3] [--skip-up]
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys

import _repo  # noqa: F401  (the repository on sys.path)
import yaml

from testbed.bench.common import ROOT, Project, b300_fleet, median, sim, sim_config


def first_and_noop_up(n_hosts: int, runs: int) -> tuple[list[float], list[float], list[int]]:
    firsts, noops, changes = [], [], []
    for run in range(runs):
        project = Project()
        try:
            stack = f"bench-{n_hosts}h"
            path = project.write_stack(stack, sim_config(n_hosts))
            sim("down", path)  # fresh hosts: overlays are thrown away
            sim("up", path)
            project.init(stack)
            t_first, _ = project.pulumi(f"up -s {stack} --yes --skip-preview --non-interactive")
            t_noop, p = project.pulumi(f"up -s {stack} --yes --skip-preview --non-interactive")
            summary = p.stdout.split("Resources:")[-1]
            changed = sum(int(n) for n in re.findall(r"(\d+) (?:created|updated|replaced|deleted)", summary))
            firsts.append(t_first)
            noops.append(t_noop)
            changes.append(changed)
            print(f"  {n_hosts} host(s), run {run + 1}: first up {t_first:.1f}s, no-op up {t_noop:.1f}s "
                  f"({changed} changes)", flush=True)
            project.pulumi(f"destroy -s {stack} --yes --skip-preview --non-interactive")
        finally:
            sim("down", path)
            project.cleanup()
    return firsts, noops, changes


def preview_times(runs: int, fleet_hosts: list[int], cli: str = "") -> dict[str, list[float]]:
    """Median previews of prod-b300 and of fleet stacks (``b300_fleet``), these also with
    PULUMI_SKIP_CHECKPOINTS=true. ``cli``: another pulumi binary's folder (with a trailing /), to set
    one engine release beside another (Pulumi 3.274 serializes its whole snapshot after every step of
    a preview, which grows with n²; 3.260 does not)."""
    out: dict[str, list[float]] = {}
    project = Project()
    try:
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(project.home / ".ssh/glm-infra_ed25519")],
                       check=True)
        prod = yaml.safe_load((ROOT / "stacks/Pulumi.prod-b300.yaml").read_text())["config"]
        cases = [("prod-b300", prod, runs, "")]
        for n_hosts in fleet_hosts:
            cases += [(f"b300-{n_hosts}hosts", b300_fleet(n_hosts), runs, ""),
                      (f"b300-{n_hosts}hosts", b300_fleet(n_hosts), 1, "PULUMI_SKIP_CHECKPOINTS=true ")]
        for stack, cfg, n, env in cases:
            if not (project.dir / "stacks" / f"Pulumi.{stack}.yaml").exists():
                project.write_stack(stack, cfg)
                project.init(stack)
            times, cpu = [], []
            for _ in range(n):
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                t, p = project.pulumi(f"preview -s {stack} --non-interactive", env_prefix=env + cli)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                times.append(t)
                cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
            creates = p.stdout.split("Resources:")[-1].strip().splitlines()[0].strip()
            count = int(re.search(r"\+ (\d+) to create", p.stdout).group(1))
            hosts = len(cfg["glm-infra:hosts"])
            label = f"{env}{stack}"
            print(f"  preview {label}: {', '.join(f'{t:.1f}s' for t in times)} ({creates}; {count / hosts:.1f} per host; "
                  f"CPU {', '.join(f'{c:.0f}s' for c in cpu)}; load {os.getloadavg()[0]:.1f})", flush=True)
            out[label] = times
    finally:
        project.cleanup()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--skip-up", action="store_true", help="only the preview timings (no simulated hosts)")
    ap.add_argument("--preview-hosts", default="96", help="fleet stacks to preview, host counts: 24,96")
    ap.add_argument("--cli", default="", help="folder of another pulumi binary to preview with (default: the pinned one)")
    args = ap.parse_args()
    rows = []
    if not args.skip_up:
        f1, n1, c1 = first_and_noop_up(1, args.runs)
        f3, n3, c3 = first_and_noop_up(3, args.runs)
        rows += [
            ("first pulumi up, 1 host", f"{median(f1):.1f} s", ""),
            ("first pulumi up, 3 hosts", f"{median(f3):.1f} s", f"ratio 3/1 = {median(f3) / median(f1):.2f} (goal ≤ 1.25)"),
            ("no-op pulumi up, 3 hosts", f"{median(n3):.1f} s",
             f"{median(n3) / median(f3):.0%} of the first up (goal ≤ 15%); changes: {max(c1 + c3)}"),
        ]
    previews = preview_times(args.runs, [int(n) for n in args.preview_hosts.split(",")],
                             f"{args.cli.rstrip('/')}/" if args.cli else "")
    rows += [(f"pulumi preview {k}", f"{median(v):.1f} s", "") for k, v in previews.items()]
    print(f"\nmedians over {args.runs} runs")
    print("| measurement | median | note |\n| --- | --- | --- |")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
