"""Shared by the benchmarks: a throwaway copy of the project with generated stacks, the Pulumi
environment of scripts/lib/pulumi-env.sh, the simulated hosts, and medians."""

from __future__ import annotations

import copy
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SIM_STACK = ROOT / "stacks" / "Pulumi.sim.yaml"
PASSPHRASE = "glm-infra-sim"


def median(xs: list[float]) -> float:
    return statistics.median(xs)


class Project:
    """A copy of the project in a temporary folder with its own file backend, so benchmarks never
    touch the repository's stacks or state."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="glm-bench-"))
        for name in ("Pulumi.yaml", "__main__.py", "glm_infra"):
            src = ROOT / name
            (shutil.copytree if src.is_dir() else shutil.copy)(src, self.dir / name)
        (self.dir / "stacks").mkdir()
        (self.dir / "venv").symlink_to(ROOT / "venv")
        (self.dir / "state").mkdir()
        self.home = self.dir / "home"
        (self.home / ".ssh").mkdir(parents=True)

    def write_stack(self, name: str, config: dict) -> Path:
        salt = yaml.safe_load(SIM_STACK.read_text()).get("encryptionsalt")
        doc = {"config": config, **({"encryptionsalt": salt} if salt else {})}
        path = self.dir / "stacks" / f"Pulumi.{name}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    def pulumi(self, args: str, check: bool = True, timeout: int = 3600,
               env_prefix: str = "") -> tuple[float, subprocess.CompletedProcess]:
        env = dict(os.environ, PULUMI_CONFIG_PASSPHRASE=PASSPHRASE, PULUMI_BACKEND_URL=f"file://{self.dir / 'state'}")
        t0 = time.monotonic()
        cmd = f". {ROOT}/scripts/lib/pulumi-env.sh; cd {self.dir}; HOME={self.home} {env_prefix}pulumi {args}"
        p = subprocess.run(["bash", "-c", cmd],
                           env=env, text=True, capture_output=True, timeout=timeout)
        elapsed = time.monotonic() - t0
        if check and p.returncode != 0:
            raise RuntimeError(f"pulumi {args} exited {p.returncode}:\n{p.stdout[-4000:]}\n{p.stderr[-2000:]}")
        return elapsed, p

    def init(self, stack: str) -> None:
        self.pulumi(f"stack init {stack} --secrets-provider passphrase")

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def sim_config(n_hosts: int) -> dict:
    """The sim stack with the colocated topology on n simulated hosts: the same per-host work on each
    host, so a first `up` on 1 and on 3 hosts compares like with like."""
    cfg = copy.deepcopy(yaml.safe_load(SIM_STACK.read_text())["config"])
    hosts = cfg["glm-infra:hosts"][:n_hosts]
    for i, h in enumerate(hosts):
        h["name"], h["address"] = f"sim-{i + 1}", f"10.88.0.{11 + i}"
    cfg["glm-infra:hosts"] = hosts
    for key in ("glm-infra:prefill", "glm-infra:decode"):
        cfg.pop(key, None)
    cfg["glm-infra:colocated"] = {
        "hosts": [h["name"] for h in hosts], "tp": 1, "dp": 8, "speculativeTokens": 3, "gpuMemoryUtilization": 0.9,
    }
    cfg["glm-infra:router"] = {"host": "sim-1", "port": 8000}
    # The benchmarks run pulumi with a HOME of their own: name the sim key by its absolute path.
    cfg["glm-infra:ssh"]["privateKeyPath"] = os.path.expanduser(cfg["glm-infra:ssh"]["privateKeyPath"])
    return cfg


def sim(command: str, stack_file: Path) -> None:
    subprocess.run([str(ROOT / "scripts/sim"), "--stack", str(stack_file), command], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
