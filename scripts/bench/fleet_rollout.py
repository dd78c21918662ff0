"""A three-stack fleet rollout of a vLLM pin change on the simulated cluster (`glm-infra fleet up`): the
three one-host stacks of testbed/bench/rollout.py (fleet-a on sim-1, fleet-b on sim-2, fleet-c on sim-3),
each in its own wave, each stack's doctor and SLA gate between waves.

    venv/bin/python scripts/bench/fleet_rollout.py [--json FILE]

Measured: the first rollout (three stacks deployed); the pin change 0.33.0 → 0.33.1 rolled through every
wave (the total); then the pin back with a regression planted on the second wave's stack (its TPOT over the
SLA): the time until `fleet up` exits, the time from the second stack's failed gate to that exit, and that
the third stack did not start. The stacks are destroyed at the end, also on failure; the simulated hosts are
booted (and taken down again) only when they were not running.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import time
from pathlib import Path

import _repo  # noqa: F401  (the repository on sys.path)
import yaml

from testbed import ROOT
from testbed.bench.common import SIM_STACK, Project, sim
from testbed.bench.rollout import NEW_VLLM, OLD_VLLM, SLOW, STACKS, build_vllm_wheel, fleet_doc, one_host_stack


def host_key() -> str:
    from testbed.cluster import rootfs

    return " ".join((rootfs() / "etc/ssh/ssh_host_ed25519_key.pub").read_text().split()[:2])


def running() -> bool:
    p = subprocess.run([str(ROOT / "scripts/sim"), "status"], capture_output=True, text=True)
    return p.returncode == 0 and all(f"{h}" in p.stdout and "running" in p.stdout for h, _ in STACKS.values())


class Fleet:
    def __init__(self, project: Project):
        self.p = project
        self.file = project.dir / "fleet.yaml"

    def run(self, action: str) -> tuple[float, subprocess.CompletedProcess, float]:
        """``glm-infra fleet ACTION``: (seconds, the process, the second its stderr said fleet-b failed)."""
        env = dict(os.environ, PULUMI_CONFIG_PASSPHRASE="glm-infra-sim",
                   PULUMI_BACKEND_URL=f"file://{self.p.dir / 'state'}")
        cmd = f". {ROOT}/scripts/lib/pulumi-env.sh; cd {self.p.dir}; {ROOT}/venv/bin/glm-infra fleet {action} {self.file}"
        t0 = time.monotonic()
        proc = subprocess.Popen(["bash", "-c", cmd], env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        failed_at = 0.0
        err = []
        assert proc.stderr is not None
        for line in proc.stderr:  # the rollout's progress, as it happens
            err.append(line)
            if "STOPPED at wave" in line and not failed_at:
                failed_at = time.monotonic() - t0
        out = proc.stdout.read() if proc.stdout else ""
        proc.wait()
        return time.monotonic() - t0, subprocess.CompletedProcess(cmd, proc.returncode, out, "".join(err)), failed_at

    def edit(self, stack: str, change) -> None:
        f = self.p.dir / "stacks" / f"Pulumi.{stack}.yaml"
        doc = yaml.safe_load(f.read_text())
        change(doc["config"])
        f.write_text(yaml.safe_dump(doc, sort_keys=False))


def outcomes(stdout: str) -> dict[str, str]:
    return {m[1]: m[2] for m in re.finditer(r"^(fleet-[abc]): ([a-z ]+?)(?: \(\d+ s\))?(?::|$)", stdout, re.M)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="FILE", help="also write the figures here")
    args = ap.parse_args()
    booted = not running()
    if booted:
        sim("up", SIM_STACK)
    build_vllm_wheel(NEW_VLLM)
    subprocess.run([str(ROOT / "scripts/sim"), "tokenizer"], check=True, capture_output=True)  # the SLA gate's
    project = Project()
    fleet = Fleet(project)
    figures: dict[str, object] = {}
    try:
        key = host_key()
        for stack, (host, address) in STACKS.items():
            doc = one_host_stack(host, address)
            doc["config"]["glm-infra:hosts"][0]["hostKey"] = key
            doc["config"]["glm-infra:ssh"]["privateKeyPath"] = os.path.expanduser(
                doc["config"]["glm-infra:ssh"]["privateKeyPath"])  # the benchmark's HOME is its own
            project.write_stack(stack, doc["config"])
            project.init(stack)
        fleet.file.write_text(yaml.safe_dump(fleet_doc("bench"), sort_keys=False))
        steps = [("first rollout (3 stacks deployed)", lambda: None, "passed"),
                 (f"vLLM pin {OLD_VLLM} → {NEW_VLLM} through 3 waves",
                  lambda: [fleet.edit(s, lambda c: c["glm-infra:runtime"].update(vllmVersion=NEW_VLLM)) for s in STACKS],
                  "passed"),
                 (f"vLLM pin back to {OLD_VLLM}, a regression planted on wave 2's stack",
                  lambda: [fleet.edit(s, lambda c: c["glm-infra:runtime"].update(vllmVersion=OLD_VLLM)) for s in STACKS]
                  + [fleet.edit("fleet-b", lambda c: c["glm-infra:colocated"].setdefault("env", {}).update({SLOW: "150"}))],
                  "stopped")]
        for label, change, expect in steps:
            change()
            seconds, p, failed_at = fleet.run("up")
            got = outcomes(p.stdout)
            print(f"{label}: {seconds:.1f} s, exit {p.returncode}: {got}", flush=True)
            if expect == "passed":
                assert p.returncode == 0 and set(got.values()) == {"passed"}, p.stdout + p.stderr[-3000:]
                figures[label] = {"seconds": round(seconds, 1)}
            else:
                assert p.returncode == 1, p.stdout + p.stderr[-3000:]
                assert got == {"fleet-a": "passed", "fleet-b": "failed", "fleet-c": "not started"}, p.stdout
                figures[label] = {"seconds until fleet up exits": round(seconds, 1),
                                  "seconds from fleet-b's failed gate to the exit": round(seconds - failed_at, 2),
                                  "fleet-c": got["fleet-c"]}
                print(f"  stopped {seconds - failed_at:.2f} s after fleet-b's gate failed; fleet-c {got['fleet-c']}")
    finally:
        for stack in STACKS:
            project.pulumi(f"destroy -s {stack} --yes --skip-preview --non-interactive", check=False)
        project.cleanup()
        if booted:
            sim("down", SIM_STACK)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
