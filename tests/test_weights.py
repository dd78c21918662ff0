"""weights.py on this machine over loopback: seed from a mirror, peers from the seed, resume,
corruption repair, disk refusal, revision switch. The simulated-cluster run does the same on hosts."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, bundled, free_port, wait_port

from glm_infra.agent import weights as w
import glm_infra.agent.weights.cli  # noqa: F401  (loads every module of it: w.base, w.relay, ...)
from testbed import STANDINS

WEIGHTS = bundled("weights")  # the one file a host gets (agent/bundle.py)
MAKE = STANDINS / "make-checkpoint"


def serve(directory: Path, tmp: Path, name: str) -> tuple[str, Path, subprocess.Popen]:
    """The mirror stand-in (weights.py serve: every file) over ``directory``."""
    port = free_port()
    log = tmp / f"{name}.log"
    args = [sys.executable, str(WEIGHTS), "serve", "--dir", str(directory), "--bind", f"127.0.0.1:{port}"]
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    wait_port(port)
    return f"http://127.0.0.1:{port}", log, p


RELAY_KEY = "r" * 64  # the stack's relay key of these tests
KEYFILE = Path()  # its file, made for each test


@pytest.fixture(autouse=True)
def keyfile(tmp_path) -> Path:
    global KEYFILE
    KEYFILE = tmp_path / "relay.env"
    KEYFILE.write_text(f"GLM_RELAY_KEY={RELAY_KEY}\n")
    KEYFILE.chmod(0o600)
    return KEYFILE


def stage(*args: str) -> subprocess.CompletedProcess:
    """weights.py stage; a peer (or a host that serves) with the stack's relay key (KEYFILE) unless given one."""
    if ("peer" in args or "--serve" in args) and "--relay-key-file" not in args:
        args = (*args, "--relay-key-file", str(KEYFILE))
    return subprocess.run([sys.executable, str(WEIGHTS), "stage", *args], capture_output=True, text=True, timeout=120)


def relay(seed_path: Path, tmp: Path, children: str = "c") -> tuple[str, subprocess.Popen]:
    """The staged revision rev1 at ``seed_path`` served to ``children`` by weights.py relay, with the key."""
    port = free_port()
    p = subprocess.Popen([sys.executable, str(WEIGHTS), "relay", "--revision", "rev1", "--path", str(seed_path),
                          "--bind", f"127.0.0.1:{port}", "--children", children, "--stall", "5", "--relay-key-file",
                          str(KEYFILE)], stdout=open(tmp / "relay.log", "a"), stderr=subprocess.STDOUT)
    wait_port(port)
    return f"http://127.0.0.1:{port}", p


@pytest.fixture
def mirror(tmp_path):
    src = tmp_path / "mirror"
    for rev in ("rev1", "rev2"):
        subprocess.run([sys.executable, str(MAKE), str(src), "--revision", rev, "--shards", "6", "--shard-mb", "1"],
                       check=True, capture_output=True)
    url, log, p = serve(src, tmp_path, "mirror")
    yield url, log, src
    p.terminate()
    p.wait()


def manifest(src: Path, rev: str) -> dict:
    return json.loads((src / rev / "manifest.json").read_text())


def requests(log: Path) -> list[str]:
    return [l for l in log.read_text().splitlines() if '"GET ' in l]


def test_seed_then_peer_copies_only_from_the_seed(mirror, tmp_path):
    url, mirror_log, src = mirror
    seed_path, peer_path = tmp_path / "seed" / "model", tmp_path / "peer" / "model"
    r = stage("--role", "seed", "--source", "mirror", "--url", url, "--revision", "rev1", "--path", str(seed_path),
              "--margin-gb", "0")
    assert r.returncode == 0, r.stderr
    assert "seed: 9 files from the mirror source, 0 already here" in r.stdout
    assert os.readlink(seed_path) == "model.revisions/rev1"
    fetched = requests(mirror_log)
    assert len([l for l in fetched if "/rev1/" in l and "manifest" not in l]) == 9

    fan_url, fan = relay(seed_path, tmp_path)
    try:
        r = stage("--role", "peer", "--peer", fan_url, "--revision", "rev1", "--path", str(peer_path), "--margin-gb", "0",
                  "--name", "c")
    finally:
        fan.terminate()
        fan.wait()
    assert r.returncode == 0, r.stderr
    assert "peer: 9 files copied" in r.stdout
    assert requests(mirror_log) == fetched, "the peer never touches the source"
    for e in manifest(src, "rev1")["files"]:
        assert (peer_path / e["path"]).read_bytes() == (src / "rev1" / e["path"]).read_bytes()
    assert (peer_path / ".glm-complete").exists()


def test_a_relay_serves_only_hosts_that_sign_with_the_stack_key_and_a_peer_takes_only_what_it_signed(mirror, tmp_path):
    """Any process on a host may bind a relay's port before it (or answer for it): a peer of another key is
    refused by the relay, and a peer takes nothing from a server without the key (exit 3, nothing written)."""
    import urllib.error
    import urllib.request

    url, _, _ = mirror
    seed_path = tmp_path / "seed" / "model"
    assert stage("--role", "seed", "--source", "mirror", "--url", url, "--revision", "rev1", "--path", str(seed_path),
                 "--margin-gb", "0").returncode == 0
    fan_url, fan = relay(seed_path, tmp_path)
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{fan_url}/config.json")
        assert e.value.code == 401
        other = tmp_path / "other.env"
        other.write_text("GLM_RELAY_KEY=" + "o" * 64 + "\n")
        r = stage("--role", "peer", "--peer", fan_url, "--revision", "rev1", "--path", str(tmp_path / "x" / "model"),
                  "--margin-gb", "0", "--name", "c", "--relay-key-file", str(other))
        assert r.returncode == 3 and "HTTP 401: unauthenticated relay client: not signed with this stack's relay " \
            "key (this host's relay key is not the one its source holds)" in r.stderr, r.stderr
    finally:
        fan.terminate()
        fan.wait()
    # The seed's folder served by a plain file server on the same port (a squatter): refused as forged.
    squat_url, _, squat = serve(seed_path.parent / "model.revisions" / "rev1", tmp_path, "squatter")
    try:
        r = stage("--role", "peer", "--peer", squat_url, "--revision", "rev1", "--path", str(tmp_path / "y" / "model"),
                  "--margin-gb", "0", "--name", "c", "--timeout", "20")
    finally:
        squat.terminate()
        squat.wait()
    assert r.returncode == 3, r.stderr
    assert f"refusing the manifest from {squat_url}/.glm-progress.json: not signed" in r.stderr
    assert os.listdir(tmp_path / "y" / "model.revisions" / "rev1") == [] and not (tmp_path / "y" / "model").exists()


def test_second_run_changes_nothing(mirror, tmp_path):
    url, log, _ = mirror
    path = tmp_path / "h" / "model"
    args = ("--role", "seed", "--source", "mirror", "--url", url, "--revision", "rev1", "--path", str(path), "--margin-gb", "0")
    assert stage(*args).returncode == 0
    before = len(requests(log))
    r = stage(*args)
    assert r.returncode == 0
    assert "seed: 0 files from the mirror source, 9 already here and verified" in r.stdout
    assert len(requests(log)) == before + 1  # only the manifest


def test_interrupted_download_resumes_with_a_range_request(mirror, tmp_path):
    url, log, src = mirror
    path = tmp_path / "h" / "model"
    root = path.parent / "model.revisions" / "rev1"
    root.mkdir(parents=True)
    shard = "model-00003-of-00006.safetensors"
    data = (src / "rev1" / shard).read_bytes()
    (root / (shard + ".partial")).write_bytes(data[: len(data) // 3])
    r = stage("--role", "seed", "--source", "mirror", "--url", url, "--revision", "rev1", "--path", str(path),
              "--margin-gb", "0")
    assert r.returncode == 0, r.stderr
    assert (root / shard).read_bytes() == data
    line = next(l for l in requests(log) if shard in l)
    assert '" 206 ' in line, line  # resumed, not restarted


def test_corrupted_shard_is_refetched_not_served(mirror, tmp_path):
    url, log, src = mirror
    path = tmp_path / "h" / "model"
    args = ("--role", "seed", "--source", "mirror", "--url", url, "--revision", "rev1", "--path", str(path), "--margin-gb", "0")
    assert stage(*args).returncode == 0
    shard = path / "model-00002-of-00006.safetensors"
    blob = bytearray(shard.read_bytes())
    blob[1000] ^= 0xFF  # same size, different bytes
    shard.write_bytes(bytes(blob))
    v = subprocess.run([sys.executable, str(WEIGHTS), "verify", "--revision", "rev1", "--path", str(path)],
                       capture_output=True, text=True)
    assert v.returncode == 1 and "model-00002-of-00006.safetensors: missing or corrupt" in v.stderr
    r = stage(*args)
    assert r.returncode == 0
    assert "model-00002-of-00006.safetensors: does not match the manifest, fetching it again" in r.stdout
    assert "seed: 1 files from the mirror source, 8 already here" in r.stdout
    assert shard.read_bytes() == (src / "rev1" / shard.name).read_bytes()


def test_a_source_serving_bad_bytes_fails(mirror, tmp_path):
    url, _, src = mirror
    shard = src / "rev1" / "model-00004-of-00006.safetensors"
    blob = bytearray(shard.read_bytes())
    blob[-1] ^= 0x01
    shard.write_bytes(bytes(blob))
    r = stage("--role", "seed", "--source", "mirror", "--url", url, "--revision", "rev1",
              "--path", str(tmp_path / "h" / "model"), "--margin-gb", "0")
    assert r.returncode == 1
    assert "model-00004-of-00006.safetensors: sha256 mismatch twice" in r.stderr
    assert not (tmp_path / "h" / "model").exists(), "nothing is switched to a bad checkpoint"


def test_not_enough_disk_is_refused_before_downloading(mirror, tmp_path):
    url, log, _ = mirror
    r = stage("--role", "seed", "--source", "mirror", "--url", url, "--revision", "rev1",
              "--path", str(tmp_path / "h" / "model"), "--margin-gb", "1000000")
    assert r.returncode == 1
    assert "GB free at" in r.stderr and "the checkpoint needs 0.0 GB more + 1e+06 GB margin" in r.stderr
    assert not any("safetensors" in l for l in requests(log))


def test_new_revision_switches_atomically_and_prune_removes_the_old(mirror, tmp_path):
    url, _, src = mirror
    path = tmp_path / "h" / "model"
    for rev in ("rev1", "rev2"):
        r = stage("--role", "seed", "--source", "mirror", "--url", url, "--revision", rev, "--path", str(path),
                  "--margin-gb", "0")
        assert r.returncode == 0, r.stderr
        assert json.loads((path / "config.json").read_text())["revision"] == rev
    assert (path.parent / "model.revisions" / "rev1").is_dir()  # kept until the services restarted
    subprocess.run([sys.executable, str(WEIGHTS), "prune", "--revision", "rev2", "--path", str(path)], check=True,
                   capture_output=True)
    assert sorted(p.name for p in (path.parent / "model.revisions").iterdir()) == [".lock", "rev2"]


def test_local_source_verifies_in_place(mirror, tmp_path):
    _, _, src = mirror
    r = stage("--source", "local", "--path", str(src / "rev1"))
    assert r.returncode == 0, r.stderr
    (src / "rev1" / "model-00006-of-00006.safetensors").unlink()
    r = stage("--source", "local", "--path", str(src / "rev1"))
    assert r.returncode == 1 and "model-00006-of-00006.safetensors" in r.stderr


def test_peer_gives_up_when_the_seed_never_answers(tmp_path):
    r = stage("--role", "peer", "--peer", f"http://127.0.0.1:{free_port()}", "--revision", "rev1",
              "--path", str(tmp_path / "model"), "--timeout", "2")
    assert r.returncode == 1 and "did not answer within 2s" in r.stderr


def verify(path: Path, revision: str = "rev1") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(WEIGHTS), "verify", "--revision", revision, "--path", str(path)],
                          capture_output=True, text=True, timeout=60)


def test_verify_fails_when_the_model_path_serves_another_revision(mirror, tmp_path):
    url, _, _ = mirror
    path = tmp_path / "h" / "model"
    for rev in ("rev1", "rev2"):
        assert stage("--role", "seed", "--source", "mirror", "--url", url, "--revision", rev, "--path", str(path),
                     "--margin-gb", "0").returncode == 0
    assert verify(path, "rev2").returncode == 0
    r = verify(path, "rev1")  # staged and intact, but not what the path serves
    assert r.returncode == 1 and f"{path} serves rev2, not rev1" in r.stderr, r.stderr
    path.unlink()
    path.mkdir()  # something else at the model path
    r = verify(path, "rev2")
    assert r.returncode == 1 and f"{path} serves nothing glm-infra staged, not rev2" in r.stderr, r.stderr


# --- names and bytes from other hosts: a parent or a mirror that lies ------------------------------


class FakeParent:
    """A relay parent that serves whatever the test gives it — its progress document (the manifest), signed
    with the stack's key, and the same bytes for every other path — as a host of the stack that lies would.
    It runs in a thread of the test and stops with it."""

    def __init__(self, doc: dict, body: bytes) -> None:
        import http.server
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server API)
                data = json.dumps(doc).encode() if ".glm-progress.json" in self.path else body
                self.send_response(200)
                # It holds the stack's key (a host of the stack that lies): its manifest is signed.
                fields = self.headers.get(w.signing.AUTH_HEADER, "").split(" ")
                self.send_header(w.signing.MAC_HEADER, w.signing.sign(RELAY_KEY.encode(), fields[2] if len(fields) == 4 else "", data))
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def files_under(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if not p.is_dir() or p.is_symlink())


@pytest.mark.parametrize("bad", ["ABSOLUTE", "../x", "a/../../x", "link/x", ".glm-complete"])
def test_a_parent_naming_a_file_outside_the_model_dir_is_refused_before_anything_is_written(tmp_path, bad):
    outside = tmp_path / "outside"
    outside.mkdir()
    bad = str(outside / "abs") if bad == "ABSOLUTE" else bad
    path = tmp_path / "peer" / "model"
    root = path.parent / "model.revisions" / "rev1"
    root.mkdir(parents=True)
    if bad.startswith("link/"):  # a folder here that is a symlink to elsewhere: never written through
        (root / "link").symlink_to(outside, target_is_directory=True)
    before = files_under(tmp_path)
    body = b"pwned\n"
    sha = hashlib.sha256(body).hexdigest()
    doc = {"revision": "rev1", "complete": True, "received": 0, "published": ["config.json", bad],
           "files": [{"path": "config.json", "size": len(body), "sha256": sha},
                     {"path": bad, "size": len(body), "sha256": sha}]}
    parent = FakeParent(doc, body)
    try:
        r = stage("--role", "peer", "--peer", parent.url, "--revision", "rev1", "--path", str(path),
                  "--margin-gb", "0", "--stall", "2", "--timeout", "20")
    finally:
        parent.close()
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"refusing the manifest from {parent.url}: " in r.stderr and repr(bad) in r.stderr, r.stderr
    after = [f for f in files_under(tmp_path) if f != "peer/model.revisions/.lock"]  # the staging's own lock
    assert after == before, "nothing written: not outside, not the good file, not the manifest"
    assert not path.exists(), "nothing switched"


@pytest.mark.parametrize("bad", ["../escape", ".glm-manifest.json", "a\\..\\x"])
def test_a_mirror_manifest_naming_an_unsafe_file_is_refused(mirror, tmp_path, bad):
    url, log, src = mirror
    body = b"{}\n"
    (src / "rev3").mkdir()
    (src / "rev3" / "config.json").write_bytes(body)
    entry = {"size": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    (src / "rev3" / "manifest.json").write_text(json.dumps(
        {"files": [{"path": "config.json", **entry}, {"path": bad, **entry}]}))
    path = tmp_path / "h" / "model"
    r = stage("--role", "seed", "--source", "mirror", "--url", url, "--revision", "rev3", "--path", str(path),
              "--margin-gb", "0")
    assert r.returncode == 1
    assert f"refusing the manifest from {url}/rev3/manifest.json: unsafe file name {bad!r}" in r.stderr, r.stderr
    assert files_under(tmp_path / "h") == ["model.revisions/.lock"], "nothing written"
    assert not any("/rev3/config.json" in l for l in requests(log)), "nothing fetched"


def peer_from_fanout(seed_path: Path, peer_path: Path, tmp: Path) -> subprocess.CompletedProcess:
    """A peer staged from the seed's staged revision (weights.py relay, with the stack's key)."""
    fan_url, fan = relay(seed_path, tmp)
    try:
        return stage("--role", "peer", "--peer", fan_url, "--revision", "rev1", "--path", str(peer_path),
                     "--margin-gb", "0", "--stall", "5", "--timeout", "60", "--name", "c")
    finally:
        fan.terminate()
        fan.wait()


def test_a_peer_staging_again_takes_a_shard_changed_at_the_source_with_the_same_size(mirror, tmp_path):
    url, _, src = mirror
    seed_path, peer_path = tmp_path / "seed" / "model", tmp_path / "peer" / "model"
    seed = ("--role", "seed", "--source", "mirror", "--url", url, "--revision", "rev1", "--path", str(seed_path),
            "--margin-gb", "0")
    seed_root = seed_path.parent / "model.revisions" / "rev1"
    assert stage(*seed).returncode == 0
    assert peer_from_fanout(seed_path, peer_path, tmp_path).returncode == 0
    # The source replaces one shard under the same revision: same size, other bytes, a new manifest.
    shard = "model-00002-of-00006.safetensors"
    data = bytearray((src / "rev1" / shard).read_bytes())
    data[2000] ^= 0xFF
    (src / "rev1" / shard).write_bytes(bytes(data))
    m = manifest(src, "rev1")
    next(e for e in m["files"] if e["path"] == shard)["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    (src / "rev1" / "manifest.json").write_text(json.dumps(m))
    r = stage(*seed)
    assert r.returncode == 0 and "seed: 1 files from the mirror source, 8 already here" in r.stdout, r.stdout
    r = peer_from_fanout(seed_path, peer_path, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "peer: 1 files copied" in r.stdout and "8 already here and verified" in r.stdout, r.stdout
    assert (peer_path / shard).read_bytes() == bytes(data)
    v = verify(peer_path)
    assert v.returncode == 0, v.stderr


def test_a_peer_staging_again_copies_a_shard_corrupted_here(mirror, tmp_path):
    url, _, src = mirror
    seed_path, peer_path = tmp_path / "seed" / "model", tmp_path / "peer" / "model"
    assert stage("--role", "seed", "--source", "mirror", "--url", url, "--revision", "rev1", "--path",
                 str(seed_path), "--margin-gb", "0").returncode == 0
    seed_root = seed_path.parent / "model.revisions" / "rev1"
    assert peer_from_fanout(seed_path, peer_path, tmp_path).returncode == 0
    shard = peer_path / "model-00005-of-00006.safetensors"
    blob = bytearray(shard.read_bytes())
    blob[777] ^= 0x01  # same size, other bytes: the disk went bad since the last staging
    shard.write_bytes(bytes(blob))
    r = peer_from_fanout(seed_path, peer_path, tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"{shard.name}: does not match its sha256, copying it again" in r.stdout, r.stdout
    assert "peer: 1 files copied" in r.stdout and "8 already here and verified" in r.stdout, r.stdout
    assert shard.read_bytes() == (src / "rev1" / shard.name).read_bytes()


# --- the Hugging Face source: the real huggingface_hub and `hf` CLI against a loopback hub ----------

COMMIT = "3f0c5a1e9b7d2c4a6e8f0b1d3c5e7a9b2d4f6a8c"
REPO = "nvidia/GLM-5.2-NVFP4"
HF_PYTHON = Path(sys.executable)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    src = tmp_path / "hub"
    subprocess.run([sys.executable, str(MAKE), str(src), "--revision", COMMIT, "--shards", "6", "--shard-mb", "1"],
                   check=True, capture_output=True)
    port = free_port()
    log = tmp_path / "hub.log"
    p = subprocess.Popen([sys.executable, str(ROOT / "testbed" / "hub_standin.py"), "--dir", str(src), "--repo", REPO,
                          "--bind", f"127.0.0.1:{port}", "--token", "hf_secret_123"],
                         stdout=open(log, "w"), stderr=subprocess.STDOUT)
    wait_port(port)
    # The library reads its endpoint from the environment; its caches stay inside the test.
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    token = tmp_path / "hf.env"
    token.write_text("HF_TOKEN=hf_secret_123\n")
    yield src, log, token
    p.terminate()
    p.wait()


def hf_stage(path: Path, token: Path, revision: str = COMMIT, hf_python: Path = HF_PYTHON) -> subprocess.CompletedProcess:
    return stage("--role", "seed", "--source", "huggingface", "--repo", REPO, "--revision", revision,
                 "--hf-python", str(hf_python), "--token-file", str(token), "--path", str(path), "--margin-gb", "0")


def recording_hf_venv(tmp: Path) -> tuple[Path, Path]:
    """A venv bin folder whose ``python`` and ``hf`` record the argv and the environment they were
    started with (one file each per process), then exec the real ones: what the staging gave the
    processes it started, as they saw it."""
    bin_dir, seen = tmp / "hf-venv" / "bin", tmp / "started"
    bin_dir.mkdir(parents=True)
    seen.mkdir()
    for name, real in (("python", HF_PYTHON), ("hf", HF_PYTHON.parent / "hf")):
        script = bin_dir / name
        script.write_text("#!/bin/sh\n"
                          f"printf '%s\\0' \"$0\" \"$@\" > {seen}/argv.$$\n"
                          f"env -0 > {seen}/env.$$\n"
                          f"exec {real} \"$@\"\n")
        script.chmod(0o755)
    return bin_dir / "python", seen


def hub_downloads(log: Path) -> list[str]:
    return [l for l in log.read_text().splitlines() if l.startswith('"GET /nvidia/') and "/resolve/" in l]


def test_huggingface_source_downloads_verifies_and_publishes(hub, tmp_path):
    src, log, token = hub
    path = tmp_path / "seed" / "model"
    r = hf_stage(path, token)
    assert r.returncode == 0, r.stderr
    assert "seed: 9 files from the huggingface source, 0 already here" in r.stdout
    assert os.readlink(path) == f"model.revisions/{COMMIT}"
    for e in manifest(src, COMMIT)["files"]:
        assert (path / e["path"]).read_bytes() == (src / COMMIT / e["path"]).read_bytes()
    assert len(hub_downloads(log)) == 9
    progress = json.loads((path / ".glm-progress.json").read_text())
    assert progress["complete"] and len(progress["published"]) == 9, "every file is served to the peers"


def test_a_branch_is_staged_from_the_commit_it_resolves_to_and_that_commit_is_recorded(hub, tmp_path):
    """A stack pinning a branch ("main") deploys what the branch points to that day: the staging reads
    the commit the hub resolves it to (ModelInfo.sha), downloads every file from that commit, and
    records it in the revision's manifest and .glm-complete, and the step's log says it."""
    _, log, token = hub
    path = tmp_path / "seed" / "model"
    r = hf_stage(path, token, revision="main")
    assert r.returncode == 0, r.stderr
    assert os.readlink(path) == "model.revisions/main"
    staged = json.loads((path / ".glm-manifest.json").read_text())
    assert staged["revision"] == "main" and staged["commit"] == COMMIT
    assert (path / ".glm-complete").read_text().endswith(f", commit {COMMIT}\n")
    assert f"main (commit {COMMIT}): 9 files" in r.stdout
    downloads = hub_downloads(log)
    assert len(downloads) == 9 and all(f"/resolve/{COMMIT}/" in d for d in downloads), downloads


def test_the_hf_token_reaches_the_hub_client_only_through_its_environment(hub, tmp_path):
    _, _, token = hub
    python, seen = recording_hf_venv(tmp_path)
    r = hf_stage(tmp_path / "seed" / "model", token, hf_python=python)
    assert r.returncode == 0, r.stderr
    assert "hf_secret_123" not in " ".join(r.args)
    started = {pid.name.split(".")[1]: pid.read_bytes().split(b"\0")[:-1] for pid in seen.glob("argv.*")}
    programs = sorted(Path(argv[0].decode()).name for argv in started.values())
    assert programs.count("python") == 1 and programs.count("hf") >= 2, programs  # the listing, the downloads
    for pid, argv in started.items():
        assert not any(b"hf_secret_123" in a for a in argv), f"the token is in the argv of {argv!r}"
        env = (seen / f"env.{pid}").read_bytes().split(b"\0")
        assert b"HF_TOKEN=hf_secret_123" in env, f"{argv!r} ran without the token in its environment"


def test_huggingface_second_run_downloads_nothing(hub, tmp_path):
    _, log, token = hub
    path = tmp_path / "seed" / "model"
    assert hf_stage(path, token).returncode == 0
    before = len(hub_downloads(log))
    r = hf_stage(path, token)
    assert r.returncode == 0, r.stderr
    assert "seed: 0 files from the huggingface source, 9 already here and verified" in r.stdout
    assert len(hub_downloads(log)) == before


def test_huggingface_corrupted_shard_is_downloaded_again(hub, tmp_path):
    src, log, token = hub
    path = tmp_path / "seed" / "model"
    assert hf_stage(path, token).returncode == 0
    shard = path / "model-00003-of-00006.safetensors"
    data = bytearray(shard.read_bytes())
    data[4096] ^= 0xFF
    shard.write_bytes(bytes(data))
    config = path / "config.json"  # kept in git on the hub: checked by its blob id
    config.write_text(config.read_text().replace("glm_moe_dsa", "glm_moe_xxx"))
    before = len(hub_downloads(log))
    r = hf_stage(path, token)
    assert r.returncode == 0, r.stderr
    assert "seed: 2 files from the huggingface source, 7 already here" in r.stdout
    for f in (shard, config):
        assert f.read_bytes() == (src / COMMIT / f.name).read_bytes()
    again = sorted(hub_downloads(log)[before:])
    assert len(again) == 2 and "config.json" in again[0] and shard.name in again[1]


def test_huggingface_branch_resolves_and_bad_token_is_named(hub, tmp_path):
    _, _, token = hub
    r = hf_stage(tmp_path / "a" / "model", token, revision="main")
    assert r.returncode == 0, r.stderr
    bad = tmp_path / "bad.env"
    bad.write_text("HF_TOKEN=hf_wrong\n")
    r = hf_stage(tmp_path / "b" / "model", bad)
    assert r.returncode != 0
    assert f"cannot list {REPO}@{COMMIT}: GatedRepoError: 401" in r.stderr, r.stderr
    assert "is restricted" in r.stderr
    assert not (tmp_path / "b" / "model").exists(), "nothing switched to a half-staged revision"
