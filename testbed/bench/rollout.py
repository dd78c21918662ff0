"""A fleet of three one-host stacks over the simulated cluster's disjoint hosts (fleet-a on sim-1, fleet-b on
sim-2, fleet-c on sim-3) in three waves, and the second vLLM stand-in wheel a pin change installs: shared by
the fleet's end-to-end test (tests/e2e/test_fleet.py) and its benchmark (scripts/bench/fleet_rollout.py)."""

from __future__ import annotations

import subprocess
import sys

from testbed import STANDINS
from testbed.cluster import DEFAULT_NET, SIM, fleet_config

STACKS = {"fleet-a": ("sim-1", "10.88.0.11"), "fleet-b": ("sim-2", "10.88.0.12"), "fleet-c": ("sim-3", "10.88.0.13")}
OLD_VLLM, NEW_VLLM = "0.33.0+glmsim", "0.33.1+glmsim"
# The stand-in's time between tokens (default 10 ms): 150 ms puts TPOT far over the SLA's 20 ms, the
# regression a fleet's second wave is planted with.
SLOW = "GLM_SIM_ITL_MS"
SSH_OPTIONS = ["--ssh-option", "StrictHostKeyChecking=no", "--ssh-option", "UserKnownHostsFile=/dev/null"]


def one_host_stack(host: str, address: str) -> dict:
    """The sim stack's settings (the whole file, its salt included) on one host: two colocated instances
    (DP4 each: the canaries hold two instances' answers against each other, one alone cannot be) and the
    router there."""
    doc = fleet_config(1, DEFAULT_NET, prefix="one")
    cfg = doc["config"]
    cfg["glm-infra:hosts"][0].update(name=host, address=address)
    cfg["glm-infra:colocated"].update(hosts=[host], instancesPerHost=2, dp=4)
    cfg["glm-infra:router"]["host"] = host
    return doc


def fleet_doc(name: str) -> dict:
    """The fleet file: the three stacks in three waves, the SLA gate quick (one 16K bucket of two requests,
    no Prometheus cross-check: the simulated hosts' Prometheus sees too few requests to compare)."""
    return {
        "name": name,
        "waves": [{"name": "canary", "stacks": ["fleet-a"]}, {"name": "second", "stacks": ["fleet-b"]},
                  {"name": "third", "stacks": ["fleet-c"]}],
        "gate": {"doctorArgs": SSH_OPTIONS,
                 "slaArgs": ["--quiet", "--no-prometheus", "--contexts", "16384", "--requests", "2", *SSH_OPTIONS]},
    }


def build_vllm_wheel(version: str) -> None:
    """A second vLLM stand-in wheel, ``version``, beside the first in the machine's wheel index (what a vLLM
    upgrade installs on the simulated hosts); building it again replaces it with the same."""
    wheels = SIM / "www" / "wheels"
    sim_binary = subprocess.run([str(STANDINS / "build-llm-d-sim")], capture_output=True, text=True,
                                check=True).stdout.strip().splitlines()[-1]
    flashinfer = next(wheels.glob("flashinfer_python-*.whl")).name.split("-")[1].split("+")[0]
    subprocess.run([sys.executable, str(STANDINS / "wheels.py"), "build", "--name", "vllm", "--version", version,
                    "--tag", "py3-none-linux_x86_64", "--package", str(STANDINS / "vllm"), "--out", str(wheels),
                    "--requires", f"flashinfer-python=={flashinfer}", "--console-script", "vllm=vllm.cli:main",
                    "--executable", f"vllm/_bin/llm-d-inference-sim={sim_binary}"], check=True, capture_output=True)
    subprocess.run([sys.executable, str(STANDINS / "wheels.py"), "index", str(wheels)], check=True, capture_output=True)
