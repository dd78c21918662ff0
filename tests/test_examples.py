"""The programs in examples/: under the mocks (what they register), and `pulumi preview` of each
through the real engine. The first is deployed on the simulated hosts in tests/e2e/test_examples.py."""

from __future__ import annotations

import json
import os
import runpy
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from pulumi_harness import run_callable

EXAMPLES = ROOT / "examples"
KEY = "-----BEGIN OPENSSH PRIVATE KEY-----\nnot-a-real-key\n-----END OPENSSH PRIVATE KEY-----\n"
PASSPHRASE = "glm-infra-sim"


def example_config(name: str, stack: str) -> dict:
    return yaml.safe_load((EXAMPLES / name / f"Pulumi.{stack}.yaml").read_text())["config"]


def run_example(name: str, stack: str, extra: dict, secret: list[str]):
    cwd = os.getcwd()
    os.chdir(EXAMPLES / name)  # the programs name files relative to their folder, as pulumi runs them
    try:
        config = {**example_config(name, stack), **extra}
        return run_callable(lambda: runpy.run_path("__main__.py", run_name="__pulumi_main__") and None,
                            config=config, secret_keys=secret)[0]
    finally:
        os.chdir(cwd)


def commands(run) -> dict:
    return {r.name: r for r in run.resources if r.type.startswith("command:")}


def test_cluster_from_inventory_under_mocks(tmp_path):
    key = tmp_path / "key"
    key.write_text(KEY)
    cfg = example_config("cluster-from-inventory", "sim")["glm-example:cluster"]
    cfg["ssh"]["private_key_path"] = str(key)
    run = run_example("cluster-from-inventory", "sim", {
        "glm-example:cluster": cfg, "glm-example:apiKey": "sk-example-0123456789",
        # Under the mocks a local command answers what it echoes: the inventory.
        "glm-example:inventoryCommand": "echo " + json.dumps({"sim-1": "10.88.0.11", "sim-2": "10.88.0.12"}),
    }, ["glm-example:apiKey"])
    cmds = commands(run)
    assert set(n for n in cmds if n.endswith("-unit")) == {"small-prefill-0-unit", "small-decode-0-unit",
                                                             "small-router-unit"}
    prefill = cmds["small-prefill-0-unit"].inputs["stdin"]
    assert "-tp 1 -dp 8" in prefill and "--host 10.88.0.11 --port 8100" in prefill
    # The router reaches them through its gates, which pass to the addresses the inventory gave.
    assert "--prefill http://127.0.0.1:8010 --decode http://127.0.0.1:8011" in cmds["small-router-unit"].inputs["stdin"]
    gates = cmds["small-router-gates-conf"].inputs["stdin"]
    assert "server 10.88.0.11:8100 max_fails=0;" in gates and "server 10.88.0.12:8200 max_fails=0;" in gates


def test_hosts_only_under_mocks(tmp_path):
    key = tmp_path / "key"
    key.write_text(KEY)
    hosts = example_config("hosts-only", "sim")["glm-example:hosts"]
    hosts["ssh"]["private_key_path"] = str(key)
    run = run_example("hosts-only", "sim", {"glm-example:hosts": hosts}, [])
    names = set(commands(run))
    assert {"sim-1-my-engine-ready", "fleet-weights-sim-1-stage", "fleet-sim-2-health-gate"} <= names
    assert not any("vllm" in n or "router" in n for n in names)
    ready = commands(run)["sim-1-my-engine-ready"]
    assert any(d.endswith("::fleet-weights-sim-1-stage") for d in ready.dependencies)


# --- through the real engine ---------------------------------------------------------------------


def pulumi(cwd: Path, args: str, env: dict) -> subprocess.CompletedProcess:
    e = dict(os.environ, PULUMI_CONFIG_PASSPHRASE=PASSPHRASE, **env)
    return subprocess.run(["bash", "-c", f". {ROOT}/scripts/lib/pulumi-env.sh; cd {cwd}; pulumi {args}"],
                          env=e, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The examples beside the repository's venv, scripts and stacks, as they sit in a checkout."""
    p = subprocess.run([str(ROOT / "scripts/toolchain")], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    root = tmp_path_factory.mktemp("examples")
    shutil.copytree(EXAMPLES, root / "examples", ignore=shutil.ignore_patterns("node_modules", "sdks", "bin"))
    for name in ("venv", "scripts", "stacks"):
        (root / name).symlink_to(ROOT / name)
    (root / "state").mkdir()
    home = root / "home"
    cache = os.environ.get("GLM_INFRA_CACHE", os.path.expanduser("~/.cache/glm-infra"))
    # The keys the stacks name (~/.ssh/… for prod-b300, the sim key under ~/.cache/glm-infra/…), of
    # this home's own: a preview reads them and contacts no host, and the suite may run before any
    # simulated host (and so the sim key) exists.
    for key in (home / ".ssh/glm-infra_ed25519", home / ".cache/glm-infra/sim/ssh/id_ed25519"):
        key.parent.mkdir(parents=True)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    env = {"PULUMI_BACKEND_URL": f"file://{root / 'state'}", "HOME": str(home), "GLM_INFRA_CACHE": cache,
           "PULUMI_HOME": f"{cache}/pulumi-home"}
    return root, env


def preview(project: Path, stack: str, env: dict, *config: str) -> dict:
    assert pulumi(project, f"stack init {stack} --secrets-provider passphrase", env).returncode == 0
    for c in config:
        r = pulumi(project, f"config set -s {stack} {c}", env)
        assert r.returncode == 0, r.stderr
    r = pulumi(project, f"preview -s {stack} --json --non-interactive", env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    return json.loads(r.stdout)


def created_types(preview_json: dict) -> list[str]:
    return [s["urn"].split("::")[-2].split("$")[-1] for s in preview_json["steps"] if s["op"] == "create"]


def test_examples_preview_through_the_engine(workspace):
    root, env = workspace
    ex = root / "examples"
    types = created_types(preview(ex / "cluster-from-inventory", "sim", env, "--secret glm-example:apiKey sk-preview-0123456789"))
    assert types.count("glm-infra:index:VllmService") == 2 and types.count("glm-infra:index:Router") == 1
    assert "command:local:Command" in types  # the inventory lookup
    types = created_types(preview(ex / "hosts-only", "sim", env))
    assert types.count("glm-infra:index:Hosts") == 1 and "glm-infra:index:VllmService" not in types
