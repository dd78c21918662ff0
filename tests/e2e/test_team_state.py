"""Team state: the sim stack with its state in PostgreSQL (Pulumi's DIY backend, `postgres://`), the
server from Debian's package started by scripts/pg-state. A second `pulumi up` while one runs is
refused by the backend's lock and leaves the state intact; secrets stay encrypted in the rows."""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import subprocess
import time

import pytest

import proctree
from e2e.harness import PASSPHRASE, ROOT, SIM_STACK, sh

UP = "pulumi up -s sim --yes --skip-preview --non-interactive"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def postgres(tmp_path_factory):
    """A PostgreSQL server of the test's own, and the environment that points pulumi at it."""
    state_dir = tmp_path_factory.mktemp("pg-state") / "pg"
    script = str(ROOT / "scripts" / "pg-state")
    p = subprocess.run([script, "start", "--dir", str(state_dir), "--port", str(free_port())],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    env = dict(re.findall(r"^export (\w+)='([^']*)'$", p.stdout, re.M))
    assert env["PULUMI_BACKEND_URL"].startswith("postgres://pulumi@127.0.0.1:") and "PGPASSFILE" in env
    try:
        yield env
    finally:
        subprocess.run([script, "remove", "--dir", str(state_dir)], capture_output=True, timeout=120)


def sql(env: dict, query: str) -> str:
    url = env["PULUMI_BACKEND_URL"].split("?")[0]
    p = subprocess.run(["psql", "-Atq", url, "-c", query], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PGPASSFILE=env["PGPASSFILE"]))
    assert p.returncode == 0, p.stderr
    return p.stdout


@pytest.fixture(scope="module")
def team_stack(toolchain, sim, postgres):
    original = SIM_STACK.read_text()
    sh("pulumi stack init sim --secrets-provider passphrase", env=postgres)
    try:
        yield postgres
    finally:
        sh("pulumi destroy -s sim --yes --skip-preview --non-interactive", check=False, env=postgres)
        sh("pulumi stack rm -s sim --yes --preserve-config --force", check=False, env=postgres)
        SIM_STACK.write_text(original)


def test_a_second_up_is_refused_by_the_lock_and_state_stays_intact(team_stack):
    env = team_stack
    first = subprocess.Popen(["bash", "-c", f". scripts/lib/pulumi-env.sh; exec {UP}"], cwd=ROOT, text=True,
                             env=dict(os.environ, PULUMI_CONFIG_PASSPHRASE=PASSPHRASE, **env),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not sql(env, "SELECT key FROM pulumi_state WHERE key LIKE '%.pulumi/locks/%'").strip():
            assert first.poll() is None and time.monotonic() < deadline, "the first up holds the stack's lock"
            time.sleep(0.5)
        second = sh(UP, check=False, env=env)
        assert second.returncode != 0
        message = second.stdout + second.stderr
        assert "the stack is currently locked by 1 lock(s)" in message, message[-2000:]
        # Where the lock is and who holds it, with the credentials masked.
        assert "postgres://****:****@127.0.0.1:" in message, message[-2000:]
        assert "/.pulumi/locks/organization/glm-infra/sim/" in message and f"(pid {first.pid})" in message
        out, _ = first.communicate(timeout=1800)
    except BaseException:
        proctree.kill_tree(first.pid)
        first.communicate()
        raise
    assert first.returncode == 0, out[-4000:]
    assert not sql(env, "SELECT key FROM pulumi_state WHERE key LIKE '%.pulumi/locks/%'").strip(), "lock released"
    # The state the first up wrote is whole: the refused run changed nothing, and no change is pending.
    exported = json.loads(sh("pulumi stack export -s sim", env=env).stdout)
    resources = exported["deployment"]["resources"]
    assert sum(r["type"] == "glm-infra:index:VllmService" for r in resources) == 5
    sh("pulumi preview -s sim --expect-no-changes --non-interactive", env=env)


def test_secrets_stay_encrypted_in_the_rows(team_stack):
    env = team_stack
    outputs = json.loads(sh("pulumi stack output -s sim --json --show-secrets", env=env).stdout)
    api_key = outputs["routerApiKey"]
    assert len(api_key) >= 16
    # Each row holds a blob as {"data": base64}: search the rows as stored and as decoded.
    rows = sql(env, "SELECT key || ' ' || data::text FROM pulumi_state")
    blobs = {}
    for line in rows.splitlines():
        key, _, data = line.partition(" ")
        blobs[key] = base64.b64decode(json.loads(data)["data"]).decode()
    (checkpoint,) = [k for k in blobs if k.endswith("/.pulumi/stacks/glm-infra/sim.json")]
    assert api_key not in rows and not any(api_key in b for b in blobs.values()), "the API key is in the rows"
    assert '"ciphertext"' in blobs[checkpoint], "secrets are kept as ciphertext"
    assert '"routerApiKey"' in blobs[checkpoint]
    # The checkpoint, megabytes written after every step, is stored with lz4 (scripts/pg-state), not pglz.
    stored = sql(env, "SELECT pg_column_compression(data) FROM pulumi_state "
                      "WHERE key LIKE '%/.pulumi/stacks/glm-infra/sim.json'")
    assert stored.split() == ["lz4"], stored


def test_the_state_moves_to_another_backend_intact(team_stack, tmp_path):
    """The operator's guide's move between backends (here the team's PostgreSQL to a file backend,
    the other way round works alike): export, init the stack in the new backend, import; the
    new backend then sees the hosts as deployed — no change pending — and the secrets still as ciphertext."""
    env = team_stack
    state = tmp_path / "sim.state.json"
    sh(f"pulumi stack export -s sim --file {state}", env=env)
    other = {"PULUMI_BACKEND_URL": f"file://{tmp_path / 'backend'}"}
    (tmp_path / "backend").mkdir()
    sh("pulumi stack init sim --secrets-provider passphrase", env=other)
    try:
        sh(f"pulumi stack import -s sim --file {state}", env=other)
        sh("pulumi preview -s sim --expect-no-changes --non-interactive", env=other)
        api_key = json.loads(sh("pulumi stack output -s sim --json --show-secrets", env=env).stdout)["routerApiKey"]
        moved = json.loads(sh("pulumi stack output -s sim --json --show-secrets", env=other).stdout)["routerApiKey"]
        assert moved == api_key and api_key not in "".join(
            p.read_text() for p in (tmp_path / "backend").rglob("*.json"))
    finally:  # the team's backend keeps managing the hosts: only the copy's record goes
        sh("pulumi stack rm -s sim --yes --force --preserve-config", check=False, env=other)


def test_destroy_through_the_team_backend(team_stack):
    env = team_stack
    sh("pulumi destroy -s sim --yes --skip-preview --non-interactive", env=env)
    exported = json.loads(sh("pulumi stack export -s sim", env=env).stdout)
    assert [r["type"] for r in exported["deployment"].get("resources") or []] == []
