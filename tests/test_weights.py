"""weights.py on this machine over loopback: seed from a mirror, peers from the seed, resume,
corruption repair, disk refusal, revision switch. The simulated-cluster run does the same on hosts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, free_port, wait_port

WEIGHTS = ROOT / "glm_infra" / "host" / "weights.py"
MAKE = ROOT / "scripts" / "standins" / "make-checkpoint"


def serve(directory: Path, tmp: Path, name: str, all_files: bool) -> tuple[str, Path, subprocess.Popen]:
    port = free_port()
    log = tmp / f"{name}.log"
    args = [sys.executable, str(WEIGHTS), "serve", "--dir", str(directory), "--bind", f"127.0.0.1:{port}"]
    p = subprocess.Popen(args + (["--all"] if all_files else []), stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    wait_port(port)
    return f"http://127.0.0.1:{port}", log, p


def stage(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(WEIGHTS), "stage", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def mirror(tmp_path):
    src = tmp_path / "mirror"
    for rev in ("rev1", "rev2"):
        subprocess.run([sys.executable, str(MAKE), str(src), "--revision", rev, "--shards", "6", "--shard-mb", "1"],
                       check=True, capture_output=True)
    url, log, p = serve(src, tmp_path, "mirror", all_files=True)
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

    fan_url, _, fan = serve(seed_path.parent / "model.revisions" / "rev1", tmp_path, "fanout", all_files=False)
    try:
        r = stage("--role", "peer", "--peer", fan_url, "--revision", "rev1", "--path", str(peer_path), "--margin-gb", "0")
    finally:
        fan.terminate()
    assert r.returncode == 0, r.stderr
    assert "peer: 9 files copied" in r.stdout
    assert requests(mirror_log) == fetched, "the peer never touches the source"
    for e in manifest(src, "rev1")["files"]:
        assert (peer_path / e["path"]).read_bytes() == (src / "rev1" / e["path"]).read_bytes()
    assert (peer_path / ".glm-complete").exists()


def test_fanout_serves_only_published_files(mirror, tmp_path):
    url, _, _ = mirror
    seed_path = tmp_path / "seed" / "model"
    assert stage("--role", "seed", "--source", "mirror", "--url", url, "--revision", "rev1", "--path", str(seed_path),
                 "--margin-gb", "0").returncode == 0
    root = seed_path.parent / "model.revisions" / "rev1"
    progress = json.loads((root / ".glm-progress.json").read_text())
    progress["published"] = progress["published"][:2]
    (root / ".glm-progress.json").write_text(json.dumps(progress))
    fan_url, _, fan = serve(root, tmp_path, "fanout", all_files=False)
    try:
        import urllib.error
        import urllib.request

        ok = urllib.request.urlopen(f"{fan_url}/{progress['published'][0]}").status
        assert ok == 200
        unpublished = next(e["path"] for e in progress["files"] if e["path"] not in progress["published"])
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{fan_url}/{unpublished}")
        assert e.value.code == 404
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"{fan_url}/")  # no listing
    finally:
        fan.terminate()


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
    p = subprocess.Popen([sys.executable, str(ROOT / "tests" / "hub_standin.py"), "--dir", str(src), "--repo", REPO,
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


def hf_stage(path: Path, token: Path, revision: str = COMMIT) -> subprocess.CompletedProcess:
    return stage("--role", "seed", "--source", "huggingface", "--repo", REPO, "--revision", revision,
                 "--hf-python", str(HF_PYTHON), "--token-file", str(token), "--path", str(path), "--margin-gb", "0")


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
    # The token reached the hub from the file, never through the command line.
    assert "hf_secret_123" not in " ".join(r.args)


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
