"""Helpers of the end-to-end suite: pulumi through the environment of scripts/lib/pulumi-env.sh,
commands on the simulated hosts, the stack under test."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import proctree

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
PASSPHRASE = "glm-infra-sim"  # the sim stack's secrets provider passphrase (committed salt)
SIM_STACK = ROOT / "stacks" / "Pulumi.sim.yaml"


def sh(cmd: str, check: bool = True, timeout: int = 3600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run cmd in bash from the repository root with the Pulumi environment of scripts/lib/pulumi-env.sh.
    On a timeout or an interruption, cmd is killed with everything it started (pulumi's plugins too)."""
    e = dict(os.environ, PULUMI_CONFIG_PASSPHRASE=PASSPHRASE)
    e.update(env or {})
    proc = subprocess.Popen(["bash", "-c", f". scripts/lib/pulumi-env.sh; {cmd}"], cwd=ROOT, env=e, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proctree.kill_tree(proc.pid)
        out, err = proc.communicate()
        raise AssertionError(f"`{cmd}` ran over {timeout}s and was killed with its process tree\n{out[-3000:]}\n{err[-2000:]}")
    except BaseException:
        proctree.kill_tree(proc.pid)
        proc.communicate()
        raise
    p = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
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


