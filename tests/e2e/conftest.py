"""The end-to-end suite: the real Pulumi engine, the real command provider and SSH against the
simulated cluster (scripts/sim). As root; part of scripts/test, or alone with scripts/e2e."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from e2e.harness import ROOT, SIM_STACK, Stack, set_host_keys, sh


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


@pytest.fixture(scope="module")
def stack(toolchain, sim):
    """The sim stack through the real engine (file backend); destroyed and removed at the end of the
    module, whatever happened, so the next module finds the hosts as destroy leaves them."""
    original = SIM_STACK.read_text()
    # A fresh stack on fresh hosts: state left by an earlier run describes hosts that are gone, and
    # a run killed midway leaves the file backend's lock behind.
    shutil.rmtree(ROOT / ".pulumi-state/.pulumi/locks", ignore_errors=True)
    sh("pulumi stack rm -s sim --yes --force --preserve-config", check=False)
    sh("pulumi stack init sim --secrets-provider passphrase")
    set_host_keys()  # every connection checks the host's key
    s = Stack()
    try:
        yield s
    finally:
        sh("pulumi cancel -s sim --yes", check=False)
        sh("pulumi destroy -s sim --yes --skip-preview --non-interactive", check=False)
        sh("pulumi stack rm -s sim --yes --preserve-config --force", check=False)
        SIM_STACK.write_text(original)
