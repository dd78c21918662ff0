"""Shared by the benchmarks (scripts/bench): a throwaway copy of the project with generated stacks, the Pulumi
environment of scripts/lib/pulumi-env.sh, the simulated hosts, and medians."""

from __future__ import annotations

import copy
import ipaddress
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import yaml

from testbed import ROOT
from testbed.cluster import fleet_config  # the one generator of simulated stacks

SIM_STACK = ROOT / "stacks" / "Pulumi.sim.yaml"
PASSPHRASE = "glm-infra-sim"
# A benchmark carries a test session of its own: a test session ending meanwhile on this machine kills
# the watched programs (pulumi, nspawn, scripts/sim, …) that carry none and hang below nothing older
# than itself — a benchmark started from a fresh shell looks just like that (seen: `sim up` SIGKILLed).
os.environ.setdefault("GLM_INFRA_TEST_SESSION", f"bench-{os.getpid()}")


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
               env_prefix: str = "", pre: str = "") -> tuple[float, subprocess.CompletedProcess]:
        env = dict(os.environ, PULUMI_CONFIG_PASSPHRASE=PASSPHRASE, PULUMI_BACKEND_URL=f"file://{self.dir / 'state'}")
        t0 = time.monotonic()
        cmd = f"{pre}. {ROOT}/scripts/lib/pulumi-env.sh; cd {self.dir}; HOME={self.home} {env_prefix}pulumi {args}"
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


def sim_config(n_hosts: int, subnet: str = "10.88.0.0/24", prefix: str = "sim") -> dict:
    """The sim stack with the colocated topology on n simulated hosts PREFIX-1..n of ``subnet``
    (``scripts/sim fleet``'s stack): the same per-host work on each host, so a first `up` on 1 and on
    n hosts compares like with like."""
    cfg = fleet_config(n_hosts, ipaddress.ip_network(subnet), prefix)["config"]
    # The benchmarks run pulumi with a HOME of their own: name the sim key by its absolute path.
    cfg["glm-infra:ssh"]["privateKeyPath"] = os.path.expanduser(cfg["glm-infra:ssh"]["privateKeyPath"])
    return cfg


def parallel_for(cfg: dict) -> int:
    """The --parallel a benchmark's `pulumi up` of this stack config passes: what the stack needs
    (topology.parallel_needed: below it `up` is refused), and never below pulumi's default here (4 per CPU)."""
    from glm_infra.plan import topology
    from glm_infra.stack import load_dict, unprefixed

    stack = load_dict(unprefixed(cfg), "benchmark").config
    return max(topology.parallel_needed(stack, topology.plan(stack)), 4 * (os.cpu_count() or 1))


def sim(command: str, stack_file: Path) -> None:
    subprocess.run([str(ROOT / "scripts/sim"), "--stack", str(stack_file), command], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def b300_fleet(n_hosts: int, address=lambda i: f"10.0.{i // 200}.{i % 200 + 10}") -> dict:
    """prod-b300's settings on n hosts b300-000…: the first two thirds prefill (2 × TP1 DP4 EP each),
    the rest decode (TP1 DP8 EP), the router on the first decode host, its standby on the last (behind
    ``address(n)``, when there are two decode hosts), Prometheus on the first host; ``address(i)`` of host i.
    96 hosts: 64 prefill, 32 decode (the fleet-sized preview's stack)."""
    cfg = copy.deepcopy(yaml.safe_load((ROOT / "stacks/Pulumi.prod-b300.yaml").read_text())["config"])
    nics = cfg["glm-infra:hosts"][0]["computeNics"]
    names = [f"b300-{i:03d}" for i in range(n_hosts)]
    cfg["glm-infra:hosts"] = [{"name": name, "address": address(i), "computeNics": nics} for i, name in enumerate(names)]
    n_prefill = n_hosts * 2 // 3
    cfg["glm-infra:prefill"]["hosts"] = names[:n_prefill]
    cfg["glm-infra:decode"]["hosts"] = names[n_prefill:]
    cfg["glm-infra:router"]["host"] = names[n_prefill]
    if n_hosts - n_prefill > 1:
        cfg["glm-infra:router"].update(standbyHosts=[names[-1]], virtualAddress=address(n_hosts))
    else:
        cfg["glm-infra:router"] = {k: v for k, v in cfg["glm-infra:router"].items()
                                   if k not in ("standbyHosts", "virtualAddress")}
    cfg["glm-infra:monitoring"] = {**cfg.get("glm-infra:monitoring", {}), "host": names[0]}
    return cfg
