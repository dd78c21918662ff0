"""The end-to-end suite: the real Pulumi engine, the real command provider and SSH against the
simulated cluster (scripts/sim). Run by scripts/e2e, as root."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
PASSPHRASE = "glm-infra-sim"  # the sim stack's secrets provider passphrase (committed salt)
SIM_STACK = ROOT / "stacks" / "Pulumi.sim.yaml"


def sh(cmd: str, check: bool = True, timeout: int = 3600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run cmd in bash from the repository root with the Pulumi environment of scripts/lib/pulumi-env.sh."""
    e = dict(os.environ, PULUMI_CONFIG_PASSPHRASE=PASSPHRASE)
    e.update(env or {})
    p = subprocess.run(["bash", "-c", f". scripts/lib/pulumi-env.sh; {cmd}"], cwd=ROOT, env=e, text=True,
                       capture_output=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"`{cmd}` exited {p.returncode}\n--- stdout\n{p.stdout[-6000:]}\n--- stderr\n{p.stderr[-4000:]}")
    return p


def on_host(host: str, cmd: str, check: bool = True) -> str:
    p = subprocess.run([str(ROOT / "scripts/sim"), "ssh", host, cmd], capture_output=True, text=True, timeout=300)
    if check and p.returncode != 0:
        raise AssertionError(f"{host}: `{cmd}` exited {p.returncode}: {p.stderr[-2000:]}")
    return p.stdout


@dataclass
class Stack:
    name: str = "sim"

    def up(self, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
        return sh(f"pulumi up -s {self.name} --yes --skip-preview --non-interactive {' '.join(extra)}", check=check)

    def preview_json(self, *extra: str) -> dict:
        p = sh(f"pulumi preview -s {self.name} --json --non-interactive {' '.join(extra)}")
        return json.loads(p.stdout)

    def outputs(self) -> dict:
        return json.loads(sh(f"pulumi stack output -s {self.name} --json --show-secrets").stdout)

    def config_set(self, path: str, value: str) -> None:
        sh(f"pulumi config set -s {self.name} --path {shlex.quote(path)} {shlex.quote(value)}")

    def urn(self, name: str) -> str:
        state = json.loads(sh(f"pulumi stack export -s {self.name}").stdout)
        (urn,) = [r["urn"] for r in state["deployment"]["resources"] if r["urn"].endswith(f"::{name}")]
        return urn


@pytest.fixture(scope="session")
def toolchain():
    p = subprocess.run([str(ROOT / "scripts/toolchain")], cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        pytest.fail(f"scripts/toolchain failed (exit {p.returncode}):\n{p.stderr[-3000:]}", pytrace=False)


@pytest.fixture(scope="session")
def sim():
    if os.geteuid() != 0:
        pytest.fail("the simulated cluster needs root", pytrace=False)
    try:
        # Fresh hosts and fresh server logs, even when a cluster was left running (demo, benchmark).
        subprocess.run([str(ROOT / "scripts/sim"), "down"], check=True, timeout=600)
        subprocess.run([str(ROOT / "scripts/sim"), "up"], check=True, timeout=1800)
        yield
    finally:
        subprocess.run([str(ROOT / "scripts/sim"), "down"], timeout=600)


@pytest.fixture(scope="session")
def stack(toolchain, sim):
    """The sim stack through the real engine; destroyed and removed at the end, whatever happened."""
    original = SIM_STACK.read_text()
    # A fresh stack on fresh hosts: state left by an earlier run describes hosts that are gone, and
    # a run killed midway leaves the file backend's lock behind.
    shutil.rmtree(ROOT / ".pulumi-state/.pulumi/locks", ignore_errors=True)
    sh("pulumi stack rm -s sim --yes --force --preserve-config", check=False)
    sh("pulumi stack init sim --secrets-provider passphrase")
    s = Stack()
    try:
        yield s
    finally:
        sh("pulumi cancel -s sim --yes", check=False)
        sh("pulumi destroy -s sim --yes --skip-preview --non-interactive", check=False)
        sh("pulumi stack rm -s sim --yes --preserve-config --force", check=False)
        SIM_STACK.write_text(original)
