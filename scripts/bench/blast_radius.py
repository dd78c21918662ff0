"""Blast radius of single-setting changes on the simulated P/D cluster (the sim stack): for each
change, what `pulumi preview` says it touches and which services `pulumi up` restarts.

    venv/bin/python scripts/bench/blast_radius.py
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import _repo  # noqa: F401  (the repository on sys.path)
import yaml

from testbed import STANDINS
from testbed.bench.common import SIM_STACK, Project, sim

CACHE = Path(os.environ.get("GLM_INFRA_CACHE", Path.home() / ".cache/glm-infra")) / "sim"
UNITS = {
    "sim-1": ["glm-vllm-prefill-0", "glm-vllm-prefill-1"],
    "sim-2": ["glm-vllm-prefill-2", "glm-vllm-prefill-3"],
    "sim-3": ["glm-vllm-decode-0", "glm-vllm-router"],
}
ALT_VLLM = "0.33.1+glmsim"
CHANGES = [
    ("decode flag: maxNumBatchedTokens 1024 → 2048", "glm-infra:decode.maxNumBatchedTokens", "2048"),
    ("prefill flag: gpuMemoryUtilization 0.92 → 0.91", "glm-infra:prefill.gpuMemoryUtilization", "0.91"),
    ("router flag: policy round_robin → power_of_two", "glm-infra:router.policy", "power_of_two"),
    (f"vLLM pin: 0.33.0+glmsim → {ALT_VLLM}", "glm-infra:runtime.vllmVersion", ALT_VLLM),
]


def starts() -> dict[str, int]:
    out = {}
    for host, units in UNITS.items():
        addr = {"sim-1": "10.88.0.11", "sim-2": "10.88.0.12", "sim-3": "10.88.0.13"}[host]
        cmd = " ; ".join(f"systemctl show -p ActiveEnterTimestampMonotonic --value {u}" for u in units)
        p = subprocess.run(["ssh", "-i", str(CACHE / "ssh/id_ed25519"), "-o", "BatchMode=yes", "-o",
                            "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR",
                            f"root@{addr}", cmd], capture_output=True, text=True, check=True)
        out.update(zip(units, (int(x) for x in p.stdout.split())))
    return out


def publish_alt_vllm() -> None:
    """A second stand-in vllm version beside the first in the sim wheel folder."""
    tmp = Path(tempfile.mkdtemp())
    try:
        subprocess.run([str(STANDINS / "build-wheels"), str(tmp)], check=True, capture_output=True,
                       env={**os.environ, "VLLM_STANDIN_VERSION": ALT_VLLM})
        for whl in tmp.glob("vllm-*.whl"):
            shutil.copy(whl, CACHE / "www/wheels" / whl.name)
        subprocess.run([sys.executable, str(STANDINS / "wheels.py"), "index", str(CACHE / "www/wheels")],
                       check=True, capture_output=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    project = Project()
    cfg = yaml.safe_load(SIM_STACK.read_text())["config"]
    cfg["glm-infra:ssh"]["privateKeyPath"] = str(Path(cfg["glm-infra:ssh"]["privateKeyPath"]).expanduser())
    path = project.write_stack("blast", cfg)
    rows = []
    try:
        sim("up", path)
        publish_alt_vllm()
        project.init("blast")
        project.pulumi("up -s blast --yes --skip-preview --non-interactive")
        for label, key, value in CHANGES:
            got = project.pulumi(f"config get -s blast --path {key} --json", check=False)[1]
            original = json.loads(got.stdout)["value"] if got.returncode == 0 else None  # None: the default
            before = starts()
            project.pulumi(f"config set -s blast --path {key} {value}")
            steps = json.loads(project.pulumi("preview -s blast --json --non-interactive")[1].stdout)["steps"]
            ops = Counter(s["op"] for s in steps if s["op"] not in ("same", "read"))
            names = sorted(s["urn"].split("::")[-1] for s in steps if s["op"] not in ("same", "read"))
            project.pulumi("up -s blast --yes --skip-preview --non-interactive")
            after = starts()
            restarted = sorted(u.removeprefix("glm-vllm-") for u in after if after[u] != before[u])
            rows.append((label, dict(ops), names, restarted))
            print(f"{label}: {dict(ops)} {names} restarted={restarted}", flush=True)
            if original is None:
                project.pulumi(f"config rm -s blast --path {key}")
            else:
                project.pulumi(f"config set -s blast --path {key} {shlex.quote(str(original))}")
            project.pulumi("up -s blast --yes --skip-preview --non-interactive")
        project.pulumi("destroy -s blast --yes --skip-preview --non-interactive")
    finally:
        sim("down", path)
        project.cleanup()
    print("\n| change | resources updated / replaced | services restarted |\n| --- | --- | --- |")
    for label, ops, names, restarted in rows:
        count = f"{ops.get('update', 0)} updated, {ops.get('replace', 0)} replaced"
        print(f"| {label} | {count} ({', '.join(names)}) | {len(restarted)}: {', '.join(restarted) or '-'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
