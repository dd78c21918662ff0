"""Where the state lives (glm_infra/state_backend.py): `up` refuses a backend inside the checkout unless the
stack says its hosts are disposable; preview warns. The backend is resolved as the CLI does it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from glm_infra import state_backend


@pytest.fixture
def tree(tmp_path):
    """A checkout (a .git folder) with the project one level down, and a home outside it."""
    repo, home = tmp_path / "repo", tmp_path / "home"
    (repo / ".git").mkdir(parents=True)
    (repo / "deploy").mkdir()
    home.mkdir()
    return repo, repo / "deploy", home


def verdict(tree, env, allowed=False, dry_run=False):
    _, cwd, home = tree
    return state_backend.verdict("my-b300", allowed, dry_run, env=env, cwd=cwd, home=home)


@pytest.mark.parametrize("url", ["file://{repo}/.pulumi-state", "file://{repo}/deploy/state?no_legacy_dirs=true",
                                 "file://state", "file://{repo}/deploy/../.pulumi-state"])
def test_up_refuses_a_backend_inside_the_checkout_and_says_what_to_do(tree, url):
    repo = tree[0]
    level, why = verdict(tree, {"PULUMI_BACKEND_URL": url.format(repo=repo)})
    assert level == "error"
    assert why.startswith(f"stack my-b300: its state would live in {repo}/")
    assert f"inside the checkout {repo}" in why and "from PULUMI_BACKEND_URL" in why
    assert "Refused" in why and "PULUMI_BACKEND_URL=postgres://" in why and "stateInCheckout: true" in why


def test_a_preview_warns_instead(tree):
    level, why = verdict(tree, {"PULUMI_BACKEND_URL": f"file://{tree[0]}/.pulumi-state"}, dry_run=True)
    assert level == "warning" and "`pulumi up` refuses it" in why


def test_a_link_into_the_checkout_is_inside_it(tree):
    repo, _, home = tree
    (home / "state-link").symlink_to(repo / "deploy")
    assert verdict(tree, {"PULUMI_BACKEND_URL": "file://~/state-link/state"})[0] == "error"


@pytest.mark.parametrize("url", ["file://{home}/state", "file://~/state", "postgres://pulumi@db:5432/pulumi",
                                 "s3://bucket/glm", "https://api.pulumi.com"])
def test_a_backend_outside_the_checkout_passes(tree, url):
    assert verdict(tree, {"PULUMI_BACKEND_URL": url.format(home=tree[2])}) is None


def test_a_disposable_stack_may_keep_its_state_in_the_checkout(tree):
    assert verdict(tree, {"PULUMI_BACKEND_URL": f"file://{tree[0]}/.pulumi-state"}, allowed=True) is None


def test_the_login_is_read_when_the_variable_is_unset_or_empty(tree):
    repo, _, home = tree
    (home / ".pulumi").mkdir()
    (home / ".pulumi" / "credentials.json").write_text(json.dumps({"current": f"file://{repo}/.pulumi-state"}))
    for env in ({}, {"PULUMI_BACKEND_URL": ""}):
        level, why = verdict(tree, env)
        assert level == "error" and f"`pulumi login` ({home}/.pulumi/credentials.json)" in why
    # PULUMI_HOME moves the credentials, as it does for the CLI; the variable wins over the login.
    elsewhere = tree[0].parent / "pulumi-home"
    elsewhere.mkdir()
    (elsewhere / "credentials.json").write_text(json.dumps({"current": "postgres://db/pulumi"}))
    assert verdict(tree, {"PULUMI_HOME": str(elsewhere)}) is None
    assert verdict(tree, {"PULUMI_BACKEND_URL": f"file://{home}/s"}) is None


@pytest.mark.parametrize("content", ['{"current": ""}', '{"current": null}', "{}", '{"accounts": {}}'])
def test_a_login_naming_no_backend_is_pulumi_cloud(tree, content):
    """Nothing set, no login file, or a login that names no current backend: the CLI's default, Pulumi Cloud."""
    assert verdict(tree, {}) is None
    home = tree[2]
    (home / ".pulumi").mkdir()
    (home / ".pulumi" / "credentials.json").write_text(content)
    assert verdict(tree, {}) is None


@pytest.mark.parametrize("content", ["", "{", "[]", '"file://x"', '{"current": 3}', '{"current": ["file://x"]}', '{"current": 0}'])
def test_a_login_that_cannot_be_read_refuses_up_instead_of_passing(tree, content):
    """A login file there but unreadable is not Pulumi Cloud: where the state lives is unknown, so `up` is
    refused (fail closed) and a preview warns, both naming the file."""
    home = tree[2]
    (home / ".pulumi").mkdir()
    (home / ".pulumi" / "credentials.json").write_text(content)
    level, why = verdict(tree, {})
    assert level == "error" and why.startswith(f"stack my-b300: cannot tell where its state lives: {home}/.pulumi/")
    assert "credentials.json" in why and "Refused" in why and "PULUMI_BACKEND_URL=" in why
    assert verdict(tree, {}, dry_run=True)[0] == "warning"
    assert verdict(tree, {"PULUMI_BACKEND_URL": "postgres://db/pulumi"}) is None, "the variable wins: no file read"
    assert verdict(tree, {}, allowed=True) is None, "a disposable stack is not judged"


def test_a_login_file_that_is_a_folder_refuses_up(tree):
    home = tree[2]
    (home / ".pulumi" / "credentials.json").mkdir(parents=True)
    level, why = verdict(tree, {})
    assert level == "error" and "cannot be read" in why


def test_a_disposable_stack_reads_no_login(tree, monkeypatch):
    """allowed is checked first: a stack that may keep its state here never reads the login."""
    monkeypatch.setattr(state_backend, "backend_url", lambda env, home: pytest.fail("read the login"))
    assert verdict(tree, {}, allowed=True) is None


def test_without_git_the_project_folder_is_the_checkout(tmp_path):
    assert state_backend.checkout(tmp_path) == tmp_path.resolve()
    level, _ = state_backend.verdict("s", False, False, env={"PULUMI_BACKEND_URL": f"file://{tmp_path}/state"},
                                     cwd=tmp_path, home=Path("/nonexistent"))
    assert level == "error"
