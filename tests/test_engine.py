"""The real Pulumi engine and Python language host, built by scripts/toolchain from the Go module
proxy (the command provider is not needed here: a bad stack stops before any resource)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, stack_file

from testbed.cluster import CACHE

PASSPHRASE = "glm-infra-test"


@pytest.fixture(scope="module")
def engine():
    p = subprocess.run([str(ROOT / "scripts/toolchain"), "--engine-only"], capture_output=True, text=True)
    assert p.returncode == 0, f"scripts/toolchain --engine-only failed:\n{p.stderr[-3000:]}"


def pulumi(project: Path, args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PULUMI_CONFIG_PASSPHRASE=PASSPHRASE, PULUMI_BACKEND_URL=f"file://{project / 'state'}")
    return subprocess.run(["bash", "-c", f". {ROOT}/scripts/lib/pulumi-env.sh; cd {project}; pulumi {args}"],
                          env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture
def project(tmp_path):
    """A copy of the project: the engine's stack init and config writes never touch the repository."""
    for name in ("Pulumi.yaml", "__main__.py", "glm_infra"):
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / name)
    (tmp_path / "stacks").mkdir()
    (tmp_path / "state").mkdir()
    (tmp_path / "venv").symlink_to(ROOT / "venv")
    return tmp_path


def _pinned(name: str) -> str:
    text = (ROOT / "scripts/lib/versions.sh").read_text()
    return re.search(rf"^{name}=(\S+)$", text, re.M).group(1)


def test_toolchain_versions(engine, project):
    assert pulumi(project, "version").stdout.strip() == f"v{_pinned('PULUMI_VERSION')}"
    about = pulumi(project, "plugin ls")
    assert about.returncode == 0


def test_glm_infras_pulumi_home_keeps_no_automatic_log_and_yours_is_left_alone(engine, project, tmp_path):
    """The CLI's automatic log (every verbose line, property values included, compressed on each run: about two
    thirds of a preview's engine CPU) is off in glm-infra's own PULUMI_HOME, a file where its folder would go
    (scripts/lib/pulumi-env.sh); a PULUMI_HOME of your own keeps its folder and the CLI writes its log there."""
    home = Path(pulumi(project, "version; echo \"$PULUMI_HOME\"").stdout.split()[-1])
    assert home == CACHE / "pulumi-home"
    before = sorted(p.name for p in home.iterdir())
    assert pulumi(project, "stack ls").returncode == 0
    assert (home / "logs").is_file() and (home / "logs").stat().st_size == 0
    assert sorted(p.name for p in home.iterdir()) == before, "no log file beside it either"

    yours = tmp_path / "your-pulumi-home"
    (yours / "logs").mkdir(parents=True)
    (yours / "logs" / "kept.log").write_text("yours\n")
    os.symlink(home / "plugins", yours / "plugins")
    env = dict(os.environ, PULUMI_HOME=str(yours))
    p = subprocess.run(["bash", "-c", f". {ROOT}/scripts/lib/pulumi-env.sh; cd {project}; pulumi version"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert (yours / "logs" / "kept.log").read_text() == "yours\n"
    assert [f for f in (yours / "logs").iterdir() if f.name.startswith("pulumi-")], "the CLI logs where it may"


def refused_before_any_resource(project, stack: str, cfg: dict) -> str:
    """Write ``cfg`` as STACK, then check that `preview` and `up` both fail cleanly (no traceback) and
    leave no resource in the state; returns what preview printed."""
    (project / f"stacks/Pulumi.{stack}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert pulumi(project, f"stack init {stack} --secrets-provider passphrase").returncode == 0
    out = pulumi(project, f"preview -s {stack} --non-interactive")
    assert out.returncode != 0
    assert "Traceback" not in out.stdout + out.stderr
    up = pulumi(project, f"up -s {stack} --yes --skip-preview --non-interactive")
    assert up.returncode != 0
    state = pulumi(project, f"stack export -s {stack}")
    resources = yaml.safe_load(state.stdout)["deployment"].get("resources") or []
    assert [r["type"] for r in resources if r["type"] != "pulumi:pulumi:Stack"] == [], "nothing was created"
    return out.stdout


def test_a_bad_stack_creates_no_resource_through_the_engine(engine, project):
    cfg = yaml.safe_load(stack_file("prod-b300").read_text())
    cfg["config"]["glm-infra:decode"]["tp"] = 0
    out = refused_before_any_resource(project, "bad", cfg)
    assert "glm-infra:decode.tp: Input should be greater than or equal to 1" in out


def test_a_decode_without_kv_room_for_one_max_request_is_refused_before_any_resource(engine, project):
    """The capacity rule (glm_infra/plan/capacity.py) stops `preview` and `up` like any other bad key: a
    decode of DP2 ranks keeps 2.9 GB of KV room per rank, short of one 1,048,576-token request."""
    cfg = yaml.safe_load(stack_file("prod-b300").read_text())
    cfg["config"]["glm-infra:decode"].update(dp=2, instancesPerHost=4)
    out = refused_before_any_resource(project, "tight", cfg)
    assert ("glm-infra:decode: a decode rank (tp1 dp2) cannot hold one request of the maximum context, 1,048,576 "
            "tokens (max_position_embeddings, real: config.json#max_position_embeddings): its KV room of 2.9 GB holds "
            "52,806 tokens") in out


def test_up_with_the_state_inside_the_checkout_is_refused_before_any_resource(engine, project):
    """prod-b300 as it is, its state in a file backend inside the project (here: no git, so the project folder
    is the checkout): `up` stops at the program's start, naming the folder and what to set; preview only warns."""
    cfg = yaml.safe_load(stack_file("prod-b300").read_text())
    (project / "stacks/Pulumi.prod-b300.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert pulumi(project, "stack init prod-b300 --secrets-provider passphrase").returncode == 0
    preview = pulumi(project, "preview -s prod-b300 --non-interactive")
    assert f"its state would live in {project / 'state'}" in preview.stdout + preview.stderr
    assert "`pulumi up` refuses it" in preview.stdout + preview.stderr
    up = pulumi(project, "up -s prod-b300 --yes --skip-preview --non-interactive")
    assert up.returncode != 0 and "Traceback" not in up.stdout + up.stderr
    assert f"inside the checkout {project}" in up.stdout and "Refused: choose a backend" in up.stdout
    state = yaml.safe_load(pulumi(project, "stack export -s prod-b300").stdout)
    assert [r["type"] for r in state["deployment"].get("resources") or []
            if r["type"] != "pulumi:pulumi:Stack"] == [], "nothing was created"
