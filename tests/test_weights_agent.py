"""weights.py in this process, function by function and through its ``main``: what it takes from other
hosts (names, manifests, headers, redirects, signatures), its hash cache, its transfers, its relay
server, the seed and the peer against loopback servers in threads of the test (a mirror of its own, the
relay of another staging, or a fake host that lies). Fast, so that it is the selection of the mutation
run of weights.py; test_weights.py and test_weights_relay.py run the same program as processes."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import importlib
import http.server
import json
import os
import pkgutil
import re
import shutil
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import free_port

from glm_infra.agent import weights as w

# Every module of the package (w.base, w.relay, ...), less __main__ (it runs the program).
MODULES = [importlib.import_module(f"{w.__name__}.{m.name}") for m in pkgutil.iter_modules(w.__path__)
           if m.name != "__main__"]

# --- helpers ---------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def host_name(monkeypatch):
    monkeypatch.setattr(w.base, "HOST", "t")


RELAY_KEY = b"k" * 40  # the stack's relay key in these tests
AUTH = w.signing.Auth(RELAY_KEY, "c")  # the peer "c" of most tests
KEYFILE = ""  # its file (GLM_RELAY_KEY=...), made for each test


@pytest.fixture(autouse=True)
def relay_keyfile(tmp_path_factory):
    global KEYFILE
    f = tmp_path_factory.mktemp("key") / "relay.env"
    f.write_text("GLM_RELAY_KEY=" + RELAY_KEY.decode() + "\n")
    KEYFILE = str(f)
    return f


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def entry(name: str, data: bytes) -> dict:
    return {"path": name, "size": len(data), "sha256": sha(data)}


CHECKPOINT = {
    "config.json": b'{"model_type": "glm_moe_dsa"}\n',
    "model-00001-of-00002.safetensors": bytes(range(256)) * 40,
    "model-00002-of-00002.safetensors": bytes(reversed(range(256))) * 30,
    "model.safetensors.index.json": json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                                               "b": "model-00002-of-00002.safetensors"}}).encode(),
    "sub/tokenizer.json": b'{"v": 1}\n',
}


HUB_COMMIT = "c0ffee" + "0" * 34  # the commit a source resolves a revision to (the stand-in hub: every one)


def write_checkpoint(d: Path, files: dict[str, bytes] = CHECKPOINT) -> list[dict]:
    for name, data in files.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data)
    return sorted((entry(n, b) for n, b in files.items()), key=lambda e: e["path"])


def mirror_of(tmp: Path, revision: str = "rev1", files: dict[str, bytes] = CHECKPOINT) -> Path:
    """A mirror folder laid out like testbed/standins/make-checkpoint's: REVISION/ with manifest.json."""
    d = tmp / "mirror" / revision
    d.mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps({"files": write_checkpoint(d, files)}))
    return tmp / "mirror"


@contextlib.contextmanager
def running(server: http.server.HTTPServer) -> Iterator[str]:
    """Serve in a thread of the test; stopped (and its port closed) when the block ends."""
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        t.join()


Route = tuple[int, dict, bytes] | Callable[[http.server.BaseHTTPRequestHandler], None] | list


class Fake:
    """Another host that answers what the test says, path by path (the query ignored), and records
    each request's path and headers: a mirror or a relay parent that misbehaves or lies."""

    def __init__(self, routes: dict[str, Route] | None = None, port: int = 0) -> None:
        self.routes: dict[str, Route] = dict(routes or {})
        self.requests: list[tuple[str, dict]] = []
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server API)
                fake.requests.append((self.path, dict(self.headers)))
                route = fake.routes.get(urllib.parse.urlsplit(self.path).path, (404, {}, b"not here\n"))
                if isinstance(route, list):  # answers in turn, the last one for good
                    route = route.pop(0) if len(route) > 1 else route[0]
                if callable(route):
                    return route(self)
                status, headers, body = route
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                if "Content-Length" not in headers:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)

    def paths(self) -> list[str]:
        return [p for p, _ in self.requests]


def raw(body: bytes, status: int = 200, headers: dict | None = None) -> Callable:
    """A response without Content-Length, ended by closing the connection (HTTP/1.0)."""

    def send(h: http.server.BaseHTTPRequestHandler) -> None:
        h.send_response(status)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(body)
        h.close_connection = True

    return send


class Clock:
    """weights.time with sleeps recorded and shortened; monotonic is the real one."""

    def __init__(self) -> None:
        self.sleeps: list[float] = []

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        time.sleep(min(s, 0.01))

    monotonic = staticmethod(time.monotonic)
    time = staticmethod(time.time)


@pytest.fixture(autouse=True)
def clock(monkeypatch) -> Clock:
    """Every test: weights' pauses recorded and cut short (its deadlines and stalls stay in real time)."""
    c = Clock()
    for module in MODULES:  # each module of the package that reads the clock
        if getattr(module, "time", None) is time:
            monkeypatch.setattr(module, "time", c)
    return c


def run(*argv: str) -> int:
    return w.cli.main(list(argv))


# --- names that come from other hosts --------------------------------------------------------------


@pytest.mark.parametrize("name", ["config.json", "a/b.safetensors", "dir/.hidden", "x.partial.json", "ü.json",
                                  "a b", "a" * 255, "é" * 127 + "a", "a/.glm-x", ".cache/x", "glm-x"])
def test_plain_relative_names_pass(name):
    assert w.base.name_problem(name) is None
    assert w.base.safe_name(name, "o") == name


@pytest.mark.parametrize(("name", "problem"), [
    (None, "not a file name"), ("", "not a file name"), (5, "not a file name"), (["a"], "not a file name"),
    ("a\0b", "a NUL byte"), ("a\\b", "a backslash"), ("a\\..\\x", "a backslash"),
    ("a\nb", "a control character"), ("a\x1fb", "a control character"), ("a\x7fb", "a control character"),
    ("\x00", "a NUL byte"),
    ("/etc/passwd", "an absolute path"), ("//x", "an absolute path"),
    ("../x", "a '..' component"), ("a/../../x", "a '..' component"), ("a/..", "a '..' component"), ("..", "a '..' component"),
    ("a//b", "an empty or '.' component"), ("a/", "an empty or '.' component"), ("./a", "an empty or '.' component"),
    ("a/./b", "an empty or '.' component"), (".", "an empty or '.' component"),
    (".glm-manifest.json", "glm-infra's own file"), (".glm-complete", "glm-infra's own file"),
    (".glm-x/y", "glm-infra's own file"),
    ("x.partial", "the name of a transfer in progress"), ("a/x.partial", "the name of a transfer in progress"),
    ("\udc80.json", "not UTF-8"),
    ("a" * 256, "a component longer than 255 bytes"), ("d/" + "b" * 256, "a component longer than 255 bytes"),
    ("é" * 128, "a component longer than 255 bytes"),
])
def test_unsafe_names_are_refused_naming_the_problem(name, problem):
    assert w.base.name_problem(name) == problem
    with pytest.raises(w.base.StageError) as e:
        w.base.safe_name(name, "http://parent:1")
    assert str(e.value) == f"refusing the manifest from http://parent:1: unsafe file name {name!r} ({problem})"


def test_a_name_lands_inside_unless_a_symlink_leads_out(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "real").mkdir(parents=True)
    outside.mkdir()
    (outside / "f").write_bytes(b"x")
    (root / "out").symlink_to(outside, target_is_directory=True)
    (root / "in").symlink_to(root / "real", target_is_directory=True)
    (root / "file").symlink_to(outside / "f")
    (root / "t.partial").symlink_to(outside / "t")
    assert w.base.inside(str(root), "real/x") == str(root / "real" / "x")
    assert w.base.inside(str(root), "in/x") == str(root / "in" / "x"), "a link that stays inside is fine"
    for name in ("out/x", "file", "t"):
        with pytest.raises(w.base.StageError) as e:
            w.base.inside(str(root), name, "http://p:1")
        assert f"refusing the manifest from http://p:1: {name!r} would land at {outside}" in str(e.value)
        assert f"outside {root} (through a symlink)" in str(e.value)
    alias = tmp_path / "alias"  # the model folder itself reached through a link: still inside
    alias.symlink_to(root, target_is_directory=True)
    assert w.base.inside(str(alias), "real/x") == str(alias / "real" / "x")


def test_a_manifest_is_checked_entry_by_entry_and_sorted():
    a, b = entry("b/x.safetensors", b"1"), entry("a.json", b"22")
    assert w.base.manifest_files([{**a, "extra": 1}, b], "o") == [b, a]
    assert w.base.manifest_files([], "o") == []
    assert w.base.manifest_files([{"path": "e", "size": 0, "sha256": sha(b"")}], "o")[0]["size"] == 0


@pytest.mark.parametrize(("files", "problem"), [
    ("x", "no list of files"), (None, "no list of files"), ({"files": []}, "no list of files"),
    (["a.json"], "an entry is not an object: 'a.json'"),
    ([{"size": 1, "sha256": "0" * 64}], "unsafe file name None (not a file name)"),
    ([{"path": "../a", "size": 1, "sha256": "0" * 64}], "unsafe file name '../a'"),
    ([{"path": "a", "size": "1", "sha256": "0" * 64}], "a: size '1' is not a byte count"),
    ([{"path": "a", "size": -1, "sha256": "0" * 64}], "a: size -1 is not a byte count"),
    ([{"path": "a", "size": True, "sha256": "0" * 64}], "a: size True is not a byte count"),
    ([{"path": "a", "size": 1.0, "sha256": "0" * 64}], "a: size 1.0 is not a byte count"),
    ([{"path": "a", "sha256": "0" * 64}], "a: size None is not a byte count"),
    ([{"path": "a", "size": 1, "sha256": "A" * 64}], "a: sha256 'AAAA"),
    ([{"path": "a", "size": 1, "sha256": "0" * 63}], "a: sha256 '000"),
    ([{"path": "a", "size": 1, "sha256": "0" * 65}], "a: sha256 '000"),
    ([{"path": "a", "size": 1, "sha256": None}], "a: sha256 None is not a sha256"),
    ([{"path": "a", "size": 1, "sha256": 7}], "a: sha256 7 is not a sha256"),
    ([{"path": "a", "size": 1, "sha256": "0" * 64}, {"path": "a", "size": 2, "sha256": "1" * 64}], "a is listed twice"),
    ([{"path": "a", "size": 1, "sha256": "0" * 64}, {"path": "a/b", "size": 1, "sha256": "0" * 64}],
     "a is a file and a folder of another"),
    ([{"path": "x/y/z/f", "size": 1, "sha256": "0" * 64}, {"path": "x/y", "size": 1, "sha256": "0" * 64}],
     "x/y is a file and a folder of another"),
])
def test_a_bad_manifest_is_refused_whole_naming_its_origin_and_entry(files, problem):
    with pytest.raises(w.base.StageError) as e:
        w.base.manifest_files(files, "http://p:1/rev/manifest.json")
    assert str(e.value).startswith("refusing the manifest from http://p:1/rev/manifest.json: ")
    assert problem in str(e.value)


def test_from_the_hub_a_small_file_may_have_a_git_blob_id_instead():
    blob = "ce013625030ba8dba906f756967f9e9ca394464a"
    got = w.base.manifest_files([{"path": "c.json", "size": 6, "sha256": None, "git_blob": blob},
                            {"path": "m.safetensors", "size": 1, "sha256": "0" * 64, "git_blob": blob}], "hub", blobs=True)
    assert got == [{"path": "c.json", "size": 6, "sha256": None, "git_blob": blob},
                   {"path": "m.safetensors", "size": 1, "sha256": "0" * 64}]
    for bad in (None, "x" * 40, blob[:-1], blob.upper()):
        with pytest.raises(w.base.StageError) as e:
            w.base.manifest_files([{"path": "c.json", "size": 6, "sha256": None, "git_blob": bad}], "hub", blobs=True)
        assert "c.json: neither a sha256 nor a git blob id" in str(e.value)
    with pytest.raises(w.base.StageError, match="sha256 None is not a sha256"):  # elsewhere: a sha256 or nothing
        w.base.manifest_files([{"path": "c.json", "size": 6, "sha256": None, "git_blob": blob}], "mirror")


def test_index_shards(tmp_path):
    assert w.base.index_shards(str(tmp_path)) == set()
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "s1", "b": "s2", "c": "s1", "d": 4}}))
    assert w.base.index_shards(str(tmp_path)) == {"s1", "s2"}
    index.write_text(json.dumps({"weight_map": ["s1"]}))
    assert w.base.index_shards(str(tmp_path)) == set()
    index.write_text(json.dumps({"metadata": {}}))
    assert w.base.index_shards(str(tmp_path)) == set()


def test_paths_of_revisions():
    assert w.base.revisions_dir("/data/model/") == "/data/model.revisions"
    assert w.base.revision_dir("/data/model", "abc") == "/data/model.revisions/abc"


def test_json_files_are_written_whole(tmp_path):
    p = tmp_path / "x.json"
    w.base.write_json(str(p), {"b": [1], "a": "é"})
    assert json.loads(p.read_text()) == {"a": "é", "b": [1]}
    assert p.read_text() == '{\n "a": "\\u00e9",\n "b": [\n  1\n ]\n}'
    assert os.listdir(tmp_path) == ["x.json"], "no temporary file left"
    assert w.base.read_json(str(p)) == {"a": "é", "b": [1]}


# --- digests and their cache -----------------------------------------------------------------------


def test_digests_are_sha256_and_git_blob_ids(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"hello\n")
    assert w.base.sha256_file(str(f)) == "5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03"
    assert w.base.git_blob_sha1(str(f)) == "ce013625030ba8dba906f756967f9e9ca394464a"  # `git hash-object`
    big = bytes(range(256)) * 20000  # several reads
    f.write_bytes(big)
    assert w.base.sha256_file(str(f)) == sha(big)
    assert w.base.git_blob_sha1(str(f)) == hashlib.sha1(b"blob %d\0" % len(big) + big).hexdigest()


@pytest.fixture
def counted(monkeypatch):
    """The files each hasher read, in order."""
    reads: list[tuple[str, str]] = []
    for algo, real in list(w.base.HASHERS.items()):
        monkeypatch.setitem(w.base.HASHERS, algo, lambda p, algo=algo, real=real: reads.append((algo, os.path.basename(p))) or real(p))
    return reads


def test_the_cache_reads_a_file_once_until_it_changes(tmp_path, counted):
    f = tmp_path / "f"
    f.write_bytes(b"one")
    cache = tmp_path / ".glm-hashes.json"
    h = w.base.Hashes(str(tmp_path), str(cache))
    assert h.digest("f") == sha(b"one") and counted == [("sha256", "f")]
    assert h.digest("f") == sha(b"one") and len(counted) == 1, "cached"
    assert h.digest("f", "git-blob") == hashlib.sha1(b"blob 3\0one").hexdigest() and len(counted) == 2, "per algorithm"
    assert not cache.exists(), "written by save()"
    h.save()
    again = w.base.Hashes(str(tmp_path), str(cache))
    assert again.digest("f") == sha(b"one") and len(counted) == 2, "kept across stagings"
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # mtime
    assert again.digest("f") == sha(b"one") and len(counted) == 3
    st = f.stat()
    g = tmp_path / "g"
    g.write_bytes(b"two")  # another inode, same size, same mtime: replaced by a rename
    os.utime(g, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(g, f)
    assert again.digest("f") == sha(b"two") and len(counted) == 4
    os.truncate(f, 2)  # size
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert again.digest("f") == sha(b"tw") and len(counted) == 5
    assert again.digest("f") == sha(b"tw") and len(counted) == 5


def test_without_a_cache_every_digest_reads_the_file(tmp_path, counted):
    (tmp_path / "f").write_bytes(b"one")
    h = w.base.Hashes(str(tmp_path))
    h.digest("f")
    h.remember("f", "0" * 64)
    assert h.digest("f") == sha(b"one") and len(counted) == 2
    h.save()
    assert os.listdir(tmp_path) == ["f"]


def test_a_file_written_while_it_is_read_is_not_cached(tmp_path, monkeypatch):
    f = tmp_path / "f"
    f.write_bytes(b"one")

    def racing(p: str) -> str:
        value = w.base.sha256_file(p)
        with open(p, "ab") as out:
            out.write(b"+")
        return value

    monkeypatch.setitem(w.base.HASHERS, "sha256", racing)
    h = w.base.Hashes(str(tmp_path), str(tmp_path / "c.json"))
    h.digest("f")
    assert h.known == {} and not h.changed


def test_remembered_digests_are_not_read_again_and_saved_once(tmp_path, counted, monkeypatch):
    (tmp_path / "f").write_bytes(b"one")
    cache = tmp_path / "c.json"
    h = w.base.Hashes(str(tmp_path), str(cache))
    h.remember("f", sha(b"one"))
    assert h.digest("f") == sha(b"one") and counted == []
    writes: list[str] = []
    monkeypatch.setattr(w.base, "write_json", lambda p, d: writes.append(p) or Path(p).write_text(json.dumps(d)))
    h.save()
    h.save()
    assert writes == [str(cache)], "unchanged: not written again"
    assert w.base.Hashes(str(tmp_path), str(cache)).known == h.known


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"sha256:f": 3}', '{"sha256:f": {"digest": "x"}}',
                                     '{"sha256:f": {"stat": STAT}}', '{"sha256:f": {"stat": STAT, "digest": 7}}'])
def test_an_unreadable_cache_is_ignored(tmp_path, counted, content):
    (tmp_path / "f").write_bytes(b"one")
    content = content.replace("STAT", json.dumps(w.base.Hashes.stamp(os.stat(tmp_path / "f"))))
    (tmp_path / "c.json").write_text(content)
    assert w.base.Hashes(str(tmp_path), str(tmp_path / "c.json")).digest("f") == sha(b"one") and len(counted) == 1


def test_a_file_is_ok_with_its_size_and_digest(tmp_path, counted):
    (tmp_path / "f").write_bytes(b"one")
    (tmp_path / "d").mkdir()
    h = w.base.Hashes(str(tmp_path))
    assert h.ok(entry("f", b"one"))
    assert not h.ok(entry("f", b"two")), "same size, other bytes"
    assert not h.ok(entry("f", b"three")) and not h.ok(entry("missing", b"x"))
    assert not h.ok({"path": "d", "size": (tmp_path / "d").stat().st_size, "sha256": "0" * 64}), "not a file"
    n = len(counted)
    assert h.ok(entry("f", b"two"), full=False) and len(counted) == n, "sizes only: nothing read"
    blob = hashlib.sha1(b"blob 3\0one").hexdigest()
    assert h.ok({"path": "f", "size": 3, "sha256": None, "git_blob": blob})
    assert not h.ok({"path": "f", "size": 3, "sha256": sha(b"one"), "git_blob": "0" * 40})


def test_check_files_names_what_is_missing_or_corrupt_and_shards_the_manifest_forgot(tmp_path):
    files = write_checkpoint(tmp_path)
    assert w.base.check_files(str(tmp_path), {"files": files}, full=True) == []
    (tmp_path / "config.json").write_bytes(b"x" * len(CHECKPOINT["config.json"]))
    (tmp_path / "sub" / "tokenizer.json").unlink()
    assert w.base.check_files(str(tmp_path), {"files": files}, full=True) == ["config.json", "sub/tokenizer.json"]
    assert w.base.check_files(str(tmp_path), {"files": files}, full=False) == ["sub/tokenizer.json"]
    shard = "model-00002-of-00002.safetensors"
    less = [e for e in files if e["path"] not in (shard, "config.json", "sub/tokenizer.json")]
    assert w.base.check_files(str(tmp_path), {"files": less}, full=True) == [f"{shard} (in the index, not in the manifest)"]


# --- transfers: what another host's answer may and may not do ---------------------------------------

DATA = bytes(range(256)) * 64  # 16 KiB


def ranged(data: bytes) -> Callable:
    """A server that honours ``Range: bytes=N-`` like the relay and the hub (206, Content-Range)."""

    def send(h: http.server.BaseHTTPRequestHandler) -> None:
        rng = h.headers.get("Range")
        start = int(rng[6:-1]) if rng else 0
        h.send_response(206 if rng else 200)
        h.send_header("Content-Length", str(len(data) - start))
        if rng:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        h.wfile.write(data[start:])

    return send


def test_a_download_lands_whole_hashed_on_the_way(tmp_path):
    fake = Fake({"/f": (200, {}, DATA)})
    got: list[int] = []
    umask = os.umask(0o022)
    try:
        with running(fake.server) as url:
            digest = w.transfer.download(f"{url}/f", str(tmp_path / "f"), len(DATA), on_bytes=got.append)
    finally:
        os.umask(umask)
    assert (tmp_path / "f").stat().st_mode & 0o777 == 0o644
    assert digest == sha(DATA) and (tmp_path / "f").read_bytes() == DATA
    assert sum(got) == len(DATA) and os.listdir(tmp_path) == ["f"]
    assert "Range" not in fake.requests[0][1]


def test_a_download_resumes_its_partial_file_with_a_range_request(tmp_path):
    (tmp_path / "f.partial").write_bytes(DATA[:5000])
    fake = Fake({"/f": ranged(DATA)})
    with running(fake.server) as url:
        assert w.transfer.download(f"{url}/f", str(tmp_path / "f"), len(DATA)) == sha(DATA)
    assert fake.requests[0][1]["Range"] == "bytes=5000-"
    assert (tmp_path / "f").read_bytes() == DATA and not (tmp_path / "f.partial").exists()


def test_a_server_that_sends_it_all_again_starts_the_file_over(tmp_path):
    (tmp_path / "f.partial").write_bytes(b"junk" * 100)
    fake = Fake({"/f": (200, {}, DATA)})
    with running(fake.server) as url:
        assert w.transfer.download(f"{url}/f", str(tmp_path / "f"), len(DATA)) == sha(DATA)
    assert (tmp_path / "f").read_bytes() == DATA


def test_a_partial_file_longer_than_the_file_is_dropped(tmp_path):
    (tmp_path / "f.partial").write_bytes(DATA + b"more")
    fake = Fake({"/f": ranged(DATA)})
    with running(fake.server) as url:
        assert w.transfer.download(f"{url}/f", str(tmp_path / "f"), len(DATA)) == sha(DATA)
    assert "Range" not in fake.requests[0][1]


def test_a_transfer_file_that_is_a_symlink_is_never_written_through(tmp_path):
    outside = tmp_path / "outside"
    outside.write_bytes(b"precious")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f.partial").symlink_to(outside)
    fake = Fake({"/f": ranged(DATA)})
    with running(fake.server) as url:
        assert w.transfer.download(f"{url}/f", str(tmp_path / "d" / "f"), len(DATA)) == sha(DATA)
    assert outside.read_bytes() == b"precious" and "Range" not in fake.requests[0][1]
    assert (tmp_path / "d" / "f").read_bytes() == DATA and not (tmp_path / "d" / "f").is_symlink()


@pytest.mark.parametrize(("route", "have", "message"), [
    ((206, {"Content-Range": f"bytes 0-{len(DATA) - 1}/{len(DATA)}"}, DATA), 0, "HTTP 206 for a request of bytes 0-"),
    ((206, {}, DATA[100:]), 100, "Content-Range None for bytes 100-16383 (of 16384)"),
    ((206, {"Content-Range": f"bytes 99-{len(DATA) - 1}/{len(DATA)}"}, DATA[99:]), 100, "Content-Range 'bytes 99-"),
    ((206, {"Content-Range": f"bytes 100-{len(DATA) - 2}/{len(DATA)}"}, DATA[100:-1]), 100, "Content-Range 'bytes 100-16382/"),
    ((206, {"Content-Range": f"bytes 100-{len(DATA) - 1}/*"}, DATA[100:]), 100, "Content-Range 'bytes 100-16383/*'"),
    ((206, {"Content-Range": f"bytes 100-{len(DATA) - 1}/{len(DATA) + 1}"}, DATA[100:]), 100, "/16385'"),
    ((206, {"Content-Range": f"bytes=100-{len(DATA) - 1}/{len(DATA)}"}, DATA[100:]), 100, "Content-Range 'bytes=100"),
    ((204, {}, b""), 0, "HTTP 204 for a request of bytes 0-"),
    ((200, {"Content-Length": "9"}, b"123456789"), 0, "Content-Length '9', not the 16384 bytes left of 16384"),
    ((206, {"Content-Range": f"bytes 100-{len(DATA) - 1}/{len(DATA)}", "Content-Length": "9"}, b"123456789"), 100,
     "Content-Length '9', not the 16284 bytes left of 16384"),
    (raw(DATA[100:] + b"x", 206, {"Content-Range": f"bytes 100-{len(DATA) - 1}/{len(DATA)}"}), 100,
     "more than 16384 bytes (partial file dropped)"),
    ((500, {}, b"no"), 0, "HTTP 500"),
    ((502, {}, b"no"), 0, "HTTP 502"),
    (raw(DATA + b"x"), 0, "more than 16384 bytes (partial file dropped)"),
    (raw(DATA[:1000]), 0, "short body (1000 of 16384 bytes)"),
])
def test_an_answer_that_is_not_the_bytes_asked_for_fails_the_source(tmp_path, route, have, message):
    if have:
        (tmp_path / "f.partial").write_bytes(DATA[:have])
    fake = Fake({"/f": route})
    with running(fake.server) as url, pytest.raises(w.transfer.SourceFailed) as e:
        w.transfer.download(f"{url}/f", str(tmp_path / "f"), len(DATA))
    assert message in str(e.value) and str(e.value).startswith(f"{url}/f: ")
    assert not (tmp_path / "f").exists()
    if "dropped" in message:
        assert not (tmp_path / "f.partial").exists()


def test_a_manifest_of_unknown_size_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(w.transfer, "MAX_JSON", 100)
    fake = Fake({"/small": raw(b"x" * 100), "/big": raw(b"x" * 101)})
    with running(fake.server) as url:
        assert w.transfer.download(f"{url}/small", str(tmp_path / "s"), None) == sha(b"x" * 100)
        with pytest.raises(w.transfer.SourceFailed, match="more than 100 bytes"):
            w.transfer.download(f"{url}/big", str(tmp_path / "b"), None)
    assert sorted(os.listdir(tmp_path)) == ["s"]


def test_range_answers_are_checked():
    w.transfer.check_range("u", "bytes 5-9/10", 5, 10)
    w.transfer.check_range("u", " bytes 5-99/* ", 5, None)
    for header, start, size in (("bytes 5-9/10", 4, 10), ("bytes 5-8/10", 5, 10), ("bytes 5-9/11", 5, 10),
                                ("bytes 5-9", 5, 10), ("bytes ٥-9/10", 5, 10), ("", 5, None), (None, 5, 10)):
        with pytest.raises(w.transfer.SourceFailed) as e:
            w.transfer.check_range("u", header, start, size)
        assert str(e.value).startswith(f"u: Content-Range {header!r} for bytes {start}-")
    with pytest.raises(w.transfer.SourceFailed, match=r"for bytes 5-9 \(of 10\)"):
        w.transfer.check_range("u", "bytes 4-9/10", 5, 10)
    with pytest.raises(w.transfer.SourceFailed, match=r"for bytes 5- \(of \?\)"):
        w.transfer.check_range("u", "bytes 4-9/10", 5, None)


def test_a_partial_file_already_whole_is_kept_on_416(tmp_path):
    (tmp_path / "f.partial").write_bytes(DATA)
    fake = Fake({"/f": (416, {}, b"")})
    with running(fake.server) as url:
        assert w.transfer.download(f"{url}/f", str(tmp_path / "f"), len(DATA)) == sha(DATA)
    assert (tmp_path / "f").read_bytes() == DATA


def test_a_416_for_a_partial_file_not_whole_drops_it(tmp_path):
    (tmp_path / "f.partial").write_bytes(DATA[:10])
    fake = Fake({"/f": (416, {}, b"")})
    with running(fake.server) as url, pytest.raises(w.transfer.SourceFailed) as e:
        w.transfer.download(f"{url}/f", str(tmp_path / "f"), len(DATA))
    assert str(e.value) == f"{url}/f: HTTP 416 for bytes 10- (partial file dropped)"
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(("status", "error"), [(404, w.base.NotThere), (401, w.base.StageError), (403, w.base.StageError)])
def test_missing_and_refused_are_told_apart_from_a_failed_source(tmp_path, status, error):
    fake = Fake({"/f": (status, {}, b"")})
    with running(fake.server) as url, pytest.raises(error) as e:
        w.transfer.download(f"{url}/f", str(tmp_path / "f"), 3)
    assert not isinstance(e.value, w.transfer.SourceFailed) and str(e.value) == f"{url}/f: HTTP {status}"


def test_a_host_that_does_not_answer_fails_the_source(tmp_path):
    fake = Fake()
    with running(fake.server) as url:
        pass
    with pytest.raises(w.transfer.SourceFailed) as e:
        w.transfer.download(f"{url}/f", str(tmp_path / "f"), 3)
    assert str(e.value) == f"{url}/f: [Errno 111] Connection refused"


def test_a_mirror_may_redirect_to_http_but_a_relay_host_never(tmp_path):
    fake = Fake({"/f": (302, {"Location": "/g"}, b""), "/g": (200, {}, DATA),
                 "/ftp": (301, {"Location": "ftp://127.0.0.1/x"}, b""), "/file": (307, {"Location": "file:///etc/passwd"}, b"")})
    with running(fake.server) as url:
        assert w.transfer.download(f"{url}/f", str(tmp_path / "f"), len(DATA)) == sha(DATA)
        with pytest.raises(w.transfer.SourceFailed) as e:
            w.transfer.download(f"{url}/f", str(tmp_path / "r"), len(DATA), follow=False)
        assert str(e.value) == f"{url}/f: HTTP 302 to '{url}/g' (a relay host never redirects)"
        with pytest.raises(w.transfer.SourceFailed) as e:
            w.transfer.download(f"{url}/ftp", str(tmp_path / "x"), len(DATA))
        assert str(e.value) == f"{url}/ftp: HTTP 301 to 'ftp://127.0.0.1/x' (not http or https)"
        fake.routes["/tls"] = (302, {"Location": url.replace("http:", "https:") + "/g"}, b"")
        with pytest.raises(w.transfer.SourceFailed) as e:  # followed: this loopback server speaks no TLS
            w.transfer.download(f"{url}/tls", str(tmp_path / "x"), len(DATA))
        assert "not http or https" not in str(e.value) and str(e.value).startswith(f"{url}/tls: ")
        with pytest.raises(w.transfer.SourceFailed, match=f"{url}/file: HTTP 307"):  # urllib's own refusal
            w.transfer.download(f"{url}/file", str(tmp_path / "x"), len(DATA))
        with w.transfer.open_url(f"{url}/f", 5, follow=True) as r:
            assert r.read() == DATA
        with pytest.raises(w.transfer.SourceFailed, match="never redirects"):
            w.transfer.open_url(f"{url}/f", 5)
    assert sorted(os.listdir(tmp_path)) == ["f"]


def test_fetch_retries_the_mirror_with_growing_pauses(tmp_path, clock):
    fake = Fake({"/f": [(500, {}, b""), (500, {}, b""), (200, {}, DATA)]})
    with running(fake.server) as url:
        assert w.transfer.fetch(f"{url}/f", str(tmp_path / "f"), len(DATA)) == sha(DATA)
        assert clock.sleeps == [2, 4]
        clock.sleeps.clear()
        fake.routes["/f"] = (500, {}, b"")
        with pytest.raises(w.base.StageError) as e:
            w.transfer.fetch(f"{url}/f", str(tmp_path / "g"), 3, tries=7)
        assert not isinstance(e.value, w.transfer.SourceFailed)
        assert str(e.value) == f"{url}/f: HTTP 500 (after 7 tries)"
        assert clock.sleeps == [2, 4, 6, 8, 10, 10]
        clock.sleeps.clear()
        with pytest.raises(w.base.StageError, match=r"\(after 5 tries\)"):
            w.transfer.fetch(f"{url}/f", str(tmp_path / "g"), 3)
        assert len(clock.sleeps) == 4
        fake.routes["/f"] = (404, {}, b"")
        with pytest.raises(w.base.NotThere):
            w.transfer.fetch(f"{url}/f", str(tmp_path / "g"), 3)


def test_fetch_verified_fetches_twice_then_fails_and_remembers_what_it_verified(tmp_path, monkeypatch, capsys, counted):
    fake = Fake({"/f": (200, {}, DATA), "/bad": (200, {}, DATA[::-1])})
    h = w.base.Hashes(str(tmp_path), str(tmp_path / "c.json"))
    with running(fake.server) as url:
        w.transfer.fetch_verified(f"{url}/f", h, entry("d/f", DATA))
        assert (tmp_path / "d" / "f").read_bytes() == DATA
        assert h.ok(entry("d/f", DATA)) and counted == [], "hashed on the way in"
        with pytest.raises(w.base.StageError) as e:
            w.transfer.fetch_verified(f"{url}/bad", h, entry("g", DATA))
    assert str(e.value) == f"g: sha256 mismatch twice from {url}/bad"
    assert capsys.readouterr().out.count("t: weights: g: sha256 mismatch after download, fetching again") == 2
    assert fake.paths().count("/bad") == 2 and not (tmp_path / "g").exists()
    with pytest.raises(w.base.StageError, match="would land at"):
        (tmp_path / "l").symlink_to(tmp_path.parent, target_is_directory=True)
        w.transfer.fetch_verified("http://127.0.0.1:9/x", h, entry("l/x", DATA))


# --- what a host serves: its relay (published files only, signed progress), the mirror stand-in ----


def get(url: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    """Status, headers (as sent: names keep their case) and body of a GET."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=5) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, {**dict(e.headers), "reason": e.reason}, e.read()


def test_env_files_are_read_and_a_missing_one_is_an_error(tmp_path):
    f = tmp_path / "hf.env"
    f.write_text("# comment\nOTHER=1\nHF_TOKEN=\n  HF_TOKEN=hf_abc=def  \nHF_TOKEN=second\n")
    assert w.base.env_value(str(f), "HF_TOKEN") == "hf_abc=def"
    assert w.base.env_value(str(f), "NOPE") is None
    with pytest.raises(w.base.StageError) as e:
        w.base.env_value(str(tmp_path / "missing.env"), "HF_TOKEN")
    assert str(e.value) == f"cannot read {tmp_path / 'missing.env'}: No such file or directory"


def test_the_relay_key_comes_from_its_file_and_is_long(tmp_path):
    f = tmp_path / "relay.env"
    f.write_text("GLM_RELAY_KEY=" + "k" * 32 + "\n")
    assert w.signing.relay_key(str(f)) == b"k" * 32
    for text in ("GLM_RELAY_KEY=" + "k" * 31 + "\n", "OTHER=" + "k" * 40 + "\n", ""):
        f.write_text(text)
        with pytest.raises(w.base.StageError) as e:
            w.signing.relay_key(str(f))
        assert str(e.value) == f"{f}: no GLM_RELAY_KEY of at least 32 characters"


def test_a_signature_covers_the_nonce_and_the_document():
    key = b"k" * 32
    assert w.signing.sign(key, "n1", b"{}") == hmac.new(key, b"server\nn1\n{}", hashlib.sha256).hexdigest()
    assert w.signing.sign(key, "n2", b"{}") != w.signing.sign(key, "n1", b"{}") != w.signing.sign(b"j" * 32, "n1", b"{}")


def test_a_client_signs_its_name_time_nonce_and_what_it_asks(monkeypatch, clock):
    key = b"k" * 32
    assert w.signing.client_mac(key, "c", "100", "n", "/x?y") == \
        hmac.new(key, b"client\nc\n100\nn\nGET /x?y", hashlib.sha256).hexdigest()
    monkeypatch.setattr(clock, "time", lambda: 1234.9)
    headers, nonce = w.signing.Auth(key, "b300-2").headers("http://h:1/a%2Fb?moved=1")
    name, at, sent, mac = headers[w.signing.AUTH_HEADER].split(" ")
    assert (name, at, sent) == ("b300-2", "1234", nonce) and w.signing.NONCE.fullmatch(nonce)
    assert mac == w.signing.client_mac(key, "b300-2", "1234", nonce, "/a%2Fb?moved=1")
    assert w.signing.Auth(key, "c").headers("http://h:1")[0][w.signing.AUTH_HEADER].split(" ")[3] != mac
    assert w.signing.Auth(key, "c").headers("http://h:1")[1] != w.signing.Auth(key, "c").headers("http://h:1")[1], "a fresh nonce"


def signed(key: bytes = RELAY_KEY, name: str = "c1", target: str = "/", at: float | None = None,
           nonce: str | None = None) -> dict:
    """The authentication header of a relay client's GET of ``target``."""
    nonce = nonce or os.urandom(16).hex()
    at_s = str(int(time.time() if at is None else at))
    return {w.signing.AUTH_HEADER: f"{name} {at_s} {nonce} {w.signing.client_mac(key, name, at_s, nonce, target)}"}


def test_a_relay_takes_only_requests_signed_with_its_key_once_and_in_time():
    r = w.relay.Relay("r", "p")
    h = signed(target="/a")[w.signing.AUTH_HEADER]
    assert r.authenticate(h, "/a") == (None, "this relay has no key")
    r.key = RELAY_KEY
    name, nonce = r.authenticate(h, "/a")
    assert name == "c1" and nonce == h.split(" ")[2]
    assert r.authenticate(h, "/a") == (None, "a nonce already taken (replayed)")
    assert r.authenticate(signed(target="/a")[w.signing.AUTH_HEADER], "/b") == (None, "not signed with this stack's relay key")
    assert r.authenticate(signed(b"j" * 40, target="/a")[w.signing.AUTH_HEADER], "/a") == \
        (None, "not signed with this stack's relay key")
    assert r.authenticate(None, "/a") == (None, f"no {w.signing.AUTH_HEADER} header of NAME TIME NONCE MAC")
    assert r.authenticate("c1 1 2", "/a")[0] is None
    for bad in ("-x 1 " + "a" * 32 + " m", "c1 x1 " + "a" * 32 + " m", "c1 1 " + "A" * 32 + " m", "c1 1 abc m"):
        assert r.authenticate(bad, "/a") == (None, f"a malformed {w.signing.AUTH_HEADER} header")
    old = time.time() - w.signing.AUTH_WINDOW_S - 5
    name, why = r.authenticate(signed(target="/a", at=old)[w.signing.AUTH_HEADER], "/a")
    assert name is None and why.startswith(f"signed at {int(old)}, ") and why.endswith(
        f"s from this host's clock (more than {w.signing.AUTH_WINDOW_S} s: replayed, or the hosts' clocks differ)")
    assert r.authenticate(signed(target="/a", at=time.time() + w.signing.AUTH_WINDOW_S - 2)[w.signing.AUTH_HEADER], "/a")[0] == "c1"
    assert r.authenticate(signed(target="/a", at=time.time() + w.signing.AUTH_WINDOW_S + 5)[w.signing.AUTH_HEADER], "/a")[0] is None


def test_a_relay_forgets_nonces_only_once_they_could_not_be_in_time_any_more(monkeypatch, clock):
    r = w.relay.Relay("r", "p")
    r.key = RELAY_KEY
    now = [1000.0]
    monkeypatch.setattr(clock, "time", lambda: now[0])
    first = signed(target="/a", at=1000)[w.signing.AUTH_HEADER]
    assert r.authenticate(first, "/a")[0] == "c1"
    now[0] = 1000 + 2 * w.signing.AUTH_WINDOW_S
    assert r.authenticate(signed(target="/a", at=now[0])[w.signing.AUTH_HEADER], "/a")[0] == "c1"
    assert first.split(" ")[2] in r.nonces, "kept while a replay of it could still be in time"
    now[0] += 1
    assert r.authenticate(signed(target="/a", at=now[0])[w.signing.AUTH_HEADER], "/a")[0] == "c1"
    assert first.split(" ")[2] not in r.nonces and len(r.nonces) == 2


def test_the_relay_state_lists_and_withdraws(tmp_path):
    r = w.relay.Relay("rev1", "me")
    r.progress_path = str(tmp_path / "p.json")
    a, b = entry("a", b"1"), entry("b", b"2")
    assert r.adopt([a, b]) == []
    r.got(5)
    r.got(6)
    r.publish("a")
    r.publish("b")
    r.publish("a")
    assert json.loads((tmp_path / "p.json").read_text()) == {
        "revision": "rev1", "files": [a, b], "published": ["a", "b"], "complete": False, "received": 11}
    b2 = entry("b", b"3")
    assert r.adopt([a, b2]) == ["b"], "a published file whose entry changed is withdrawn"
    assert r.snapshot()["published"] == ["a"] and r.snapshot()["files"] == [a, b2]
    assert r.adopt([b2]) == ["a"], "and one the manifest no longer lists"
    r.publish(complete=True)
    r.publish()
    assert json.loads((tmp_path / "p.json").read_text())["complete"] is True
    r.seen("c", active=1)
    r.seen("c", active=1)
    r.seen("c", active=-1, done=True)
    r.seen("c")
    assert r.clients["c"]["active"] == 1 and r.clients["c"]["done"] is True
    assert r.clients["c"]["last"] > time.monotonic() - 5
    assert w.relay.Relay("r", "n").snapshot() == {"revision": "r", "files": [], "published": [], "complete": False,
                                            "received": 0}


@pytest.fixture
def relay_of(tmp_path, capsys):
    """A staging's relay over a folder with the checkpoint (and a name that starts like a path's
    separator letters would not): nothing published yet. It logs nothing per request it takes."""
    root = tmp_path / "root"
    root.mkdir()
    files = write_checkpoint(root, {**CHECKPOINT, "X/Xtra.json": b"{}"})
    relay = w.relay.Relay("rev1", "p")
    relay.key = RELAY_KEY
    relay.adopt(files)
    server = w.relay.start_relay(relay, str(root), "[::1]:0", 5)
    try:
        yield relay, f"http://[::1]:{server.server_address[1]}", root
    finally:
        server.shutdown()
        server.server_close()
    assert capsys.readouterr().err == ""


def sget(url: str, headers: dict | None = None, name: str = "c1", key: bytes = RELAY_KEY) -> tuple[int, dict, bytes]:
    """A GET signed as a relay client named ``name``."""
    parts = urllib.parse.urlsplit(url)
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    return get(url, {**(headers or {}), **signed(key, name, target)})


def test_the_relay_serves_its_progress_and_only_published_files(relay_of):
    relay, url, root = relay_of
    status, headers, body = sget(f"{url}/.glm-progress.json")
    assert status == 200 and json.loads(body) == relay.snapshot()
    assert headers["Content-Type"] == "application/json" and headers["Content-Length"] == str(len(body))
    status, headers, _ = sget(f"{url}/config.json")
    assert (status, headers["reason"]) == (404, "not published"), "not published yet"
    relay.publish("config.json")
    relay.publish("sub/tokenizer.json")
    relay.publish("X/Xtra.json")
    assert sget(f"{url}/X/Xtra.json")[2] == b"{}"
    status, headers, body = sget(f"{url}/config.json")
    assert (status, body) == (200, CHECKPOINT["config.json"])
    assert headers["Content-Type"] == "application/octet-stream"
    assert headers["Content-Length"] == str(len(body)) and "Content-Range" not in headers
    assert sget(f"{url}/sub%2Ftokenizer.json")[2] == CHECKPOINT["sub/tokenizer.json"]
    assert sget(f"{url}/")[0] == 404 and sget(f"{url}/sub")[0] == 404, "no listing"
    assert sget(f"{url}/.glm-manifest.json")[0] == 404
    status, headers, body = sget(f"{url}/config.json", {"Range": "bytes=3-"})
    assert (status, body) == (206, CHECKPOINT["config.json"][3:])
    n = len(CHECKPOINT["config.json"])
    assert headers["Content-Range"] == f"bytes 3-{n - 1}/{n}" and headers["Content-Length"] == str(n - 3)
    assert sget(f"{url}/config.json", {"Range": f"bytes={n - 1}-"})[2] == CHECKPOINT["config.json"][-1:]
    assert sget(f"{url}/config.json", {"Range": f"bytes={n}-"})[0] == 416
    for odd in ("bytes=\xb2-", "bytes=3-5", "items=3-", "bytes=-3"):  # not a resume: the whole file
        assert sget(f"{url}/config.json", {"Range": odd})[:3:2] == (200, CHECKPOINT["config.json"])
    # The server counts a transfer off after its last byte left, which the client may read first.
    deadline = time.monotonic() + 5
    while relay.clients["c1"]["active"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert relay.clients["c1"]["active"] == 0 and not relay.clients["c1"]["done"]
    status, headers, body = sget(f"{url}/.glm-done")
    assert (status, body, headers["Content-Type"], headers["Content-Length"]) == (200, b"ok\n", "text/plain", "3")
    assert relay.clients["c1"]["done"]


def test_the_relay_serves_and_counts_only_clients_that_sign_with_its_key(relay_of, capsys):
    """Not by the name a request gives (?host= once let any peer mark another host done), nor its address."""
    relay, url, _ = relay_of
    relay.publish("config.json")
    # None, another key, or signed for another request: refused whatever the request names itself.
    for headers in ({}, signed(b"j" * 40, "c1", "/.glm-done"), signed(RELAY_KEY, "c1", "/sub/tokenizer.json")):
        for what in ("/.glm-done?host=c1", "/.glm-done", "/.glm-progress.json", "/config.json"):
            status, answer, body = get(f"{url}{what}", headers)
            assert status == 401 and body.startswith(b"unauthenticated relay client: "), (what, headers)
            assert w.signing.MAC_HEADER not in answer
    assert relay.clients == {}, "nobody counted, nobody done"
    err = capsys.readouterr()
    assert err.out.count("refused a request from ::1: ") == 1, "logged once a minute per address"
    assert f"t: weights: refused a request from ::1: no {w.signing.AUTH_HEADER} header of NAME TIME NONCE MAC" in err.out
    once = signed(RELAY_KEY, "b300-7.dc:1", "/.glm-done")
    assert get(f"{url}/.glm-done", once)[0] == 200 and relay.clients["b300-7.dc:1"]["done"]
    assert get(f"{url}/.glm-done", once)[0] == 401, "replayed"
    assert sorted(relay.clients) == ["b300-7.dc:1"]


def test_the_relay_signs_its_progress_with_the_nonce_of_the_request(relay_of):
    relay, url, _ = relay_of
    h = signed(RELAY_KEY, "c", "/.glm-progress.json", nonce="ab" * 16)
    _, headers, body = get(f"{url}/.glm-progress.json", h)
    assert headers[w.signing.MAC_HEADER] == hmac.new(RELAY_KEY, b"server\n" + b"ab" * 16 + b"\n" + body,
                                             hashlib.sha256).hexdigest()


def test_a_relay_is_never_served_without_a_key(tmp_path):
    with pytest.raises(w.base.StageError) as e:
        w.relay.start_relay(w.relay.Relay("r", "n"), str(tmp_path), "127.0.0.1:0", 1)
    assert str(e.value) == ("no relay key: a relay is served only with the stack's key (--relay-key-file), never by "
                            "its port 127.0.0.1:0 alone")


def keyed(revision: str = "r") -> w.relay.Relay:
    r = w.relay.Relay(revision, "n")
    r.key = RELAY_KEY
    return r


def test_the_relay_cannot_serve_on_a_port_in_use_and_names_who_holds_it(tmp_path):
    fake = Fake()
    with running(fake.server) as url:
        bind = url.removeprefix("http://")
        with pytest.raises(w.base.StageError) as e:
            w.relay.start_relay(keyed(), str(tmp_path), bind, 1)
    assert str(e.value) == (f"cannot serve the relay on {bind}: Address already in use (held by pid {os.getpid()} "
                            f"({Path('/proc/self/comm').read_text().strip()}, user root))")


def test_the_holder_of_an_ipv6_relay_port_is_named(tmp_path):
    """The port is the bind's last field: an IPv6 address (as hostplan gives it) has colons of its own."""
    import socket

    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        s.listen()
        bind = f"::1:{s.getsockname()[1]}"
        with pytest.raises(w.base.StageError) as e:
            w.relay.start_relay(keyed(), str(tmp_path), bind, 1)
    assert str(e.value) == (f"cannot serve the relay on {bind}: Address already in use (held by pid {os.getpid()} "
                            f"({Path('/proc/self/comm').read_text().strip()}, user root))")


def test_who_holds_a_port_is_read_from_proc(tmp_path):
    import socket

    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        port = s.getsockname()[1]
        assert w.relay.port_holder(port) is None, "bound, not listening"
        s.listen()
        assert w.relay.port_holder(port) == f"pid {os.getpid()} ({Path('/proc/self/comm').read_text().strip()}, user root)"
    assert w.relay.port_holder(port) is None


def test_the_relay_drops_a_client_that_sends_nothing(tmp_path):
    import socket

    server = w.relay.start_relay(keyed(), str(tmp_path), "::1:0", 0.3)  # an IPv6 address as hostplan gives it
    try:
        with socket.create_connection(server.server_address[:2], timeout=3) as s:
            start = time.monotonic()
            assert s.recv(10) == b"", "closed by the relay"
            assert time.monotonic() - start < 2
    finally:
        server.shutdown()
        server.server_close()


def test_the_mirror_serves_every_file_of_its_folder_and_logs_it(tmp_path, capsys):
    write_checkpoint(tmp_path)
    (tmp_path / ".glm-progress.json").write_text(json.dumps({"published": []}))  # a mirror publishes nothing
    with running(w.relay.files_server(str(tmp_path), "127.0.0.1:0")) as url:
        assert get(f"{url}/model.safetensors.index.json")[2] == CHECKPOINT["model.safetensors.index.json"]
        assert get(f"{url}/config.json")[2] == CHECKPOINT["config.json"]
        assert get(f"{url}/sub/")[0] == 404 and get(f"{url}/nope")[0] == 404
    assert '"GET /model.safetensors.index.json HTTP/1.1" 200' in capsys.readouterr().err, "the mirror logs"


def test_serve_serves_the_folder_given(tmp_path, monkeypatch):
    """``serve`` until stopped: here it answers one request and returns."""
    (tmp_path / "f").write_bytes(b"x")
    answers: list[int] = []

    def one_request(server: w.relay._Server) -> None:
        url = f"http://[{server.server_address[0]}]:{server.server_address[1]}/f"
        t = threading.Thread(target=lambda: answers.append(get(url)[0]))
        t.start()
        server.handle_request()
        t.join()

    monkeypatch.setattr(w.relay._Server, "serve_forever", one_request)
    assert run("serve", "--dir", str(tmp_path), "--bind", "[::1]:0") == 0
    (tmp_path / "f").unlink()
    assert run("serve", "--dir", str(tmp_path), "--bind", "[::1]:0") == 0
    assert answers == [200, 404]


# --- how long a host serves: until every host that copies from it is done or gone -------------------


def test_a_relay_with_no_children_stops_at_once():
    assert w.relay.wait_for_children(w.relay.Relay("r", "n"), [], 5) == []


def test_a_relay_waits_for_its_children_to_say_they_are_done(capsys, clock):
    relay = w.relay.Relay("r", "n")
    relay.seen("a")

    def later() -> None:
        time.sleep(0.3)
        relay.seen("a", done=True)
        relay.seen("b", done=True)

    t = threading.Thread(target=later)
    start = time.monotonic()  # before the thread starts: its 0.3 s sleep cannot begin earlier
    t.start()
    assert w.relay.wait_for_children(relay, ["a", "b"], 5) == []
    t.join()
    assert 0.3 <= time.monotonic() - start < 2
    assert capsys.readouterr().out.count("t: weights: serving a, b until they have every file") == 1
    assert set(clock.sleeps) == {0.2}


def test_a_child_that_never_came_or_went_silent_is_left_behind(capsys):
    relay = w.relay.Relay("r", "n")
    relay.seen("gone")
    relay.seen("done", done=True)
    start = time.monotonic()
    assert w.relay.wait_for_children(relay, ["gone", "never", "done"], 0.3) == ["gone"]
    assert time.monotonic() - start < 1.5
    out = capsys.readouterr().out
    assert "t: weights: gone made no request for 0.3s: not waiting for it any longer" in out
    assert "t: weights: never never came for 0.3s: not waiting for it any longer" in out
    assert out.count("not waiting") == 2


def test_a_child_that_comes_back_after_it_was_left_is_waited_for_again(capsys):
    relay = w.relay.Relay("r", "n")
    relay.seen("a")
    relay.seen("c", active=1)  # still receiving: the relay keeps serving meanwhile

    def later() -> None:
        time.sleep(0.5)
        relay.seen("a")  # left at 0.2 s, back at 0.5 s
        time.sleep(0.3)
        relay.seen("a", done=True)
        time.sleep(0.1)
        relay.seen("c", active=-1, done=True)

    t = threading.Thread(target=later)
    start = time.monotonic()
    t.start()
    assert w.relay.wait_for_children(relay, ["a", "b", "c"], 0.2) == [], "a came back and finished"
    t.join()
    assert time.monotonic() - start >= 0.9
    out = capsys.readouterr().out
    assert out.count("a made no request for 0.2s") == 1 and out.count("b never came for 0.2s") == 1


def test_a_child_still_receiving_is_waited_for_past_the_stall():
    relay = w.relay.Relay("r", "n")
    relay.seen("a", active=1)

    def later() -> None:
        time.sleep(0.6)
        relay.seen("a", active=-1, done=True)

    t = threading.Thread(target=later)
    start = time.monotonic()
    t.start()
    assert w.relay.wait_for_children(relay, ["a"], 0.2) == []
    t.join()
    assert time.monotonic() - start >= 0.6


# --- the seed --------------------------------------------------------------------------------------


@pytest.fixture
def mirror(tmp_path):
    """The mirror stand-in (weights.py serve --all) over a checkpoint at revision rev1."""
    src = mirror_of(tmp_path)
    with running(w.relay.files_server(str(src), "127.0.0.1:0")) as url:
        yield url, src / "rev1"


def gets(err: str) -> list[str]:
    return [l.split('"GET ')[1].split()[0] for l in err.splitlines() if '"GET ' in l]


def seed(url: str, path: Path, *more: str) -> int:
    return run("stage", "--role", "seed", "--source", "mirror", "--url", url + "/", "--revision", "rev1", "--path",
               str(path), "--margin-gb", "0", "--name", "s", *more)


@pytest.mark.parametrize(("commit", "recorded"), [(HUB_COMMIT, HUB_COMMIT), ("main", None)])
def test_a_mirror_manifest_naming_its_commit_is_recorded_and_a_bad_one_refused(mirror, tmp_path, capsys, commit, recorded):
    """A mirror serves a revision as it was staged there; a manifest.json that names its commit passes
    it on like the hub's, one that names something else as the commit is refused before any download."""
    url, src = mirror
    manifest = json.loads((src / "manifest.json").read_text())
    (src / "manifest.json").write_text(json.dumps({**manifest, "commit": commit}))
    path = tmp_path / "h" / "model"
    assert seed(url, path) == (0 if recorded else 1)
    out, err = capsys.readouterr()
    if recorded:
        staged = json.loads((path / ".glm-manifest.json").read_text())
        assert staged["commit"] == recorded and f"s: weights: rev1 (commit {recorded}): 5 files" in out
    else:
        assert f"s: weights: refusing the manifest from {url}/rev1/manifest.json: 'commit' 'main' is not a commit id" in err
        assert gets(err) == ["/rev1/manifest.json"], "nothing downloaded"


def test_the_seed_stages_from_the_mirror_verifies_publishes_and_switches(mirror, tmp_path, capsys):
    url, src = mirror
    path = tmp_path / "h" / "model"
    assert seed(url, path) == 0
    out, err = capsys.readouterr()
    root = path.parent / "model.revisions" / "rev1"
    files = json.loads((src / "manifest.json").read_text())["files"]
    for name, data in CHECKPOINT.items():
        assert (path / name).read_bytes() == data
    assert os.readlink(path) == "model.revisions/rev1"
    total = sum(len(d) for d in CHECKPOINT.values())
    assert (root / ".glm-complete").read_text() == f"5 files, {total} bytes\n"
    assert json.loads((root / ".glm-manifest.json").read_text()) == {"revision": "rev1", "files": files}
    progress = json.loads((root / ".glm-progress.json").read_text())
    assert progress == {"revision": "rev1", "files": files, "published": [e["path"] for e in files],
                        "complete": True, "received": total}
    assert "s: weights: seed: 5 files from the mirror source, 0 already here and verified" in out
    assert f"s: weights: rev1: 5 files, 0.00 GB verified at {path}" in out
    assert f"s: weights: {path} -> model.revisions/rev1" in out
    assert sorted(gets(err)) == sorted(["/rev1/manifest.json"] + [f"/rev1/{n}" for n in CHECKPOINT])
    assert sorted(os.listdir(root)) == sorted([".glm-complete", ".glm-hashes.json", ".glm-manifest.json",
                                               ".glm-progress.json", "config.json", "model-00001-of-00002.safetensors",
                                               "model-00002-of-00002.safetensors", "model.safetensors.index.json", "sub"])


def test_the_seed_staging_again_reads_only_the_manifest_and_no_file(mirror, tmp_path, capsys, counted):
    url, _ = mirror
    path = tmp_path / "h" / "model"
    assert seed(url, path) == 0
    capsys.readouterr()
    assert seed(url, path) == 0
    out, err = capsys.readouterr()
    assert "s: weights: seed: 0 files from the mirror source, 5 already here and verified" in out
    assert gets(err) == ["/rev1/manifest.json"]
    assert counted == [], "every digest from the cache"
    progress = json.loads((tmp_path / "h" / "model" / ".glm-progress.json").read_text())
    assert progress["complete"] and sorted(progress["published"]) == sorted(CHECKPOINT), "what it kept, served"


def test_the_seed_fetches_again_what_does_not_match(mirror, tmp_path, capsys):
    url, src = mirror
    path = tmp_path / "h" / "model"
    assert seed(url, path) == 0
    (path / "config.json").write_bytes(b"x" * len(CHECKPOINT["config.json"]))
    (path / "sub" / "tokenizer.json").unlink()
    capsys.readouterr()
    assert seed(url, path) == 0
    out, err = capsys.readouterr()
    assert "s: weights: config.json: does not match the manifest, fetching it again" in out
    assert "tokenizer.json: does not match" not in out, "missing is not a mismatch"
    assert "s: weights: seed: 2 files from the mirror source, 3 already here and verified" in out
    assert sorted(gets(err)) == ["/rev1/config.json", "/rev1/manifest.json", "/rev1/sub/tokenizer.json"]
    assert (path / "config.json").read_bytes() == CHECKPOINT["config.json"]


@pytest.mark.parametrize(("manifest", "problem"), [
    (b"{not json", "URL/rev1/manifest.json: not a JSON manifest"),
    (b"[]", "refusing the manifest from URL/rev1/manifest.json: no list of files"),
    (b'{"files": {}}', "refusing the manifest from URL/rev1/manifest.json: no list of files"),
    (json.dumps({"files": [entry("../x", b"1")]}).encode(), "unsafe file name '../x'"),
    (json.dumps({"files": [{"path": "a", "size": 1}]}).encode(), "a: sha256 None is not a sha256"),
])
def test_a_bad_mirror_manifest_fails_the_seed_before_anything_is_fetched(mirror, tmp_path, capsys, manifest, problem):
    url, src = mirror
    (src / "manifest.json").write_bytes(manifest)
    path = tmp_path / "h" / "model"
    assert seed(url, path) == 1
    out, err = capsys.readouterr()
    assert problem.replace("URL", url) in err and "\ns: weights: " in "\n" + err
    assert gets(err) == ["/rev1/manifest.json"]
    assert os.listdir(path.parent / "model.revisions" / "rev1") == [], "nothing written, the manifest's copy gone"
    assert not path.exists()


def test_a_mirror_without_the_revision_fails_naming_it(mirror, tmp_path, capsys):
    url, _ = mirror
    assert run("stage", "--role", "seed", "--source", "mirror", "--url", url + "/", "--revision", "rev9",
               "--path", str(tmp_path / "m"), "--name", "s") == 1
    assert f"s: weights: {url}/rev9/manifest.json: HTTP 404" in capsys.readouterr().err


def test_the_seed_refuses_when_the_disk_cannot_hold_it(mirror, tmp_path, capsys):
    url, _ = mirror
    assert seed(url, tmp_path / "h" / "model", "--margin-gb", "1e9") == 1
    out, err = capsys.readouterr()
    total = sum(len(d) for d in CHECKPOINT.values())
    assert f"the checkpoint needs {total / 1e9:.1f} GB more + 1e+09 GB margin" in err and " GB free at " in err
    assert gets(err) == ["/rev1/manifest.json"]


def test_need_disk_counts_what_is_already_there(tmp_path, monkeypatch):
    (tmp_path / "a").write_bytes(b"x" * 600)
    (tmp_path / "b.partial").write_bytes(b"x" * 250)
    files = [{"path": "a", "size": 1000}, {"path": "b", "size": 1000}, {"path": "c", "size": 500}]

    class Vfs:
        f_bavail, f_frsize = 1650, 1

    monkeypatch.setattr(os, "statvfs", lambda p: Vfs)
    args = type("A", (), {"margin_gb": 0})()
    w.base.need_disk(args, str(tmp_path), {"files": files})  # 400 + 750 + 500 missing
    args.margin_gb = 1e-6  # 1000 bytes
    with pytest.raises(w.base.StageError) as e:
        w.base.need_disk(args, str(tmp_path), {"files": files})
    assert str(e.value) == f"0.0 GB free at {tmp_path}, the checkpoint needs 0.0 GB more + 1e-06 GB margin"
    Vfs.f_bavail = 2650
    w.base.need_disk(args, str(tmp_path), {"files": files})
    Vfs.f_bavail = 2649
    with pytest.raises(w.base.StageError):
        w.base.need_disk(args, str(tmp_path), {"files": files})
    Vfs.f_bavail, Vfs.f_frsize = 1325, 2
    w.base.need_disk(args, str(tmp_path), {"files": files})


def test_tree_bytes_counts_every_file_below(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 3)
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "e" / "b").write_bytes(b"x" * 4)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    assert w.seed._tree_bytes(str(tmp_path)) == 7


# --- the seed from the hub: a stand-in `hf` venv (the real one runs in test_weights.py) --------------

GIT_KEPT = ("config.json", "model.safetensors.index.json", "sub/tokenizer.json")


def listing(files: dict[str, bytes] = CHECKPOINT) -> list[dict]:
    """What HfApi().model_info(files_metadata=True).siblings gives (huggingface_hub's RepoSibling): an
    LFS file's sha256, a git-kept file's blob id only."""
    return [{"path": n, "size": len(b), "blob": hashlib.sha1(b"blob %d\0" % len(b) + b).hexdigest(),
             "sha256": None if n in GIT_KEPT else sha(b)} for n, b in sorted(files.items())]


FAKE_HUB = """\"\"\"A stand-in for huggingface_hub's HfApi.model_info(repo_id, revision=..., files_metadata=True)
(huggingface_hub/hf_api.py): a ModelInfo with the commit the revision resolves to (sha) whose siblings are RepoSibling(rfilename, size, blob_id, lfs), lfs a
BlobLfsInfo(size, sha256, pointer_size) for an LFS file and None for a file kept in git. What it lists comes
from the JSON file $FAKE_HUB_SPEC; "raw" prints that text instead (a client gone wrong), "stderr"/"rc" fail
the call as the real client does when the hub refuses (its traceback, exit 1).\"\"\"
import json, os, sys
from types import SimpleNamespace
HUB_COMMIT = "c0ffee" + "0" * 34


class HfApi:
    def model_info(self, repo_id, revision=None, files_metadata=False):
        spec = json.load(open(os.environ["FAKE_HUB_SPEC"]))
        if spec.get("stderr") or spec.get("rc"):
            sys.stderr.write(spec["stderr"])
            sys.exit(spec["rc"])
        if "raw" in spec:
            sys.stdout.write(spec["raw"])
            sys.exit(0)
        assert files_metadata, "sizes and digests come with files_metadata=True only"
        return SimpleNamespace(sha=spec.get("sha", HUB_COMMIT), siblings=[
            SimpleNamespace(rfilename=f["path"], size=f["size"], blob_id=f["blob"],
                            lfs=SimpleNamespace(sha256=f["sha256"], size=f["size"], pointer_size=134) if f["sha256"] else None)
            for f in spec["listing"]])
"""


def hf_venv(tmp: Path, listed: object, rc: int = 0, stderr: str = "", hf_rc: int = 0, corrupt: str = "") -> Path:
    """A venv bin folder: ``python`` is this interpreter with the huggingface_hub stand-in above (the
    seed runs its listing as ``python -c CODE REPO REV``); ``hf download REPO FILE... --revision R
    --local-dir D`` (huggingface_hub's CLI) writes the files of CHECKPOINT there and, like the real
    one, its record of each under D/.cache/huggingface/download/FILE.metadata; a file it has a record of
    is not downloaded again (huggingface_hub/_local_folder.py). Each records its argv and HF_TOKEN in
    ``calls``. ``listed``: the siblings, or a text the client prints as it is."""
    bin_dir = tmp / "hf-venv" / "bin"
    (bin_dir / "lib" / "huggingface_hub").mkdir(parents=True)
    (bin_dir / "lib" / "huggingface_hub" / "__init__.py").write_text(FAKE_HUB)
    spec = {"stderr": stderr, "rc": rc, **({"raw": listed} if isinstance(listed, str) else {"listing": listed})}
    (bin_dir / "spec.json").write_text(json.dumps(spec))
    (bin_dir / "python").write_text(f"#!/bin/sh\necho \"python $HF_TOKEN $*\" >> {bin_dir}/calls\n"
                                    f"PYTHONPATH={bin_dir}/lib FAKE_HUB_SPEC={bin_dir}/spec.json exec {os.sys.executable} \"$@\"\n")
    (bin_dir / "checkpoint.json").write_text(json.dumps({n: b.hex() for n, b in CHECKPOINT.items()}))
    (bin_dir / "hf").write_text(f"""#!{os.sys.executable}
import json, os, sys, time
args = sys.argv[1:]
with open({str(bin_dir / 'calls')!r}, "a") as f:
    f.write("hf " + os.environ.get("HF_TOKEN", "") + " " + " ".join(args) + "\\n")
files, local = args[2:args.index("--revision")], args[args.index("--local-dir") + 1]
data = json.load(open({str(bin_dir / 'checkpoint.json')!r}))
for name in files:
    record = os.path.join(local, ".cache", "huggingface", "download", name + ".metadata")
    if os.path.exists(record) and os.path.exists(os.path.join(local, name)):
        continue  # it trusts its record
    os.makedirs(os.path.dirname(os.path.join(local, name)), exist_ok=True)
    body = bytes.fromhex(data[name])
    with open(os.path.join(local, name), "wb") as out:
        out.write(body[::-1] if name == {corrupt!r} else body)
    os.makedirs(os.path.dirname(record), exist_ok=True)
    open(record, "w").close()
print("hf: downloaded", len(files), "files")
time.sleep(0.1)
sys.exit({hf_rc})
""")
    for f in ("python", "hf"):
        (bin_dir / f).chmod(0o755)
    return bin_dir


def hf_seed(path: Path, bin_dir: Path, token: Path | None, *more: str) -> int:
    return run("stage", "--role", "seed", "--source", "huggingface", "--repo", "org/m", "--revision", "rev1",
               "--hf-python", str(bin_dir / "python"), *(["--token-file", str(token)] if token else []),
               "--path", str(path), "--margin-gb", "0", "--name", "s", *more)


@pytest.fixture
def token(tmp_path):
    t = tmp_path / "hf.env"
    t.write_text("HF_TOKEN=hf_tok_1\n")
    return t


def test_the_seed_downloads_from_the_hub_git_kept_files_first_and_hashes_them(tmp_path, token, capfd, monkeypatch, clock):
    monkeypatch.setattr(w.seed, "HF_BATCH", 1)
    bin_dir = hf_venv(tmp_path, listing())
    path = tmp_path / "h" / "model"
    assert hf_seed(path, bin_dir, token) == 0
    out = capfd.readouterr().out
    assert "hf: downloaded" not in out, "the hub client's chatter is not the step's output"
    assert 2 in clock.sleeps and 3 not in clock.sleeps, "it looks at the download every 2 s"
    calls = (bin_dir / "calls").read_text().splitlines()
    assert calls[0].startswith("python hf_tok_1 -c ") and calls[0].endswith(" org/m rev1")
    assert calls[1:] == [
        # the git-kept files at once, before the batches; each from the commit rev1 resolved to
        f"hf hf_tok_1 download org/m config.json model.safetensors.index.json sub/tokenizer.json --revision {HUB_COMMIT} "
        f"--local-dir {path.parent}/model.revisions/rev1",
        f"hf hf_tok_1 download org/m model-00001-of-00002.safetensors --revision {HUB_COMMIT} --local-dir {path.parent}/model.revisions/rev1",
        f"hf hf_tok_1 download org/m model-00002-of-00002.safetensors --revision {HUB_COMMIT} --local-dir {path.parent}/model.revisions/rev1",
    ], calls
    root = path.parent / "model.revisions" / "rev1"
    staged = json.loads((root / ".glm-manifest.json").read_text())
    assert staged["files"] == write_checkpoint(tmp_path / "x")
    assert staged["revision"] == "rev1" and staged["commit"] == HUB_COMMIT, "the commit the revision resolved to"
    assert (root / ".glm-complete").read_text().endswith(f", commit {HUB_COMMIT}\n")
    assert f"s: weights: rev1 (commit {HUB_COMMIT}): 5 files" in out
    assert "s: weights: 1/2 files downloaded from org/m" in out and "s: weights: 2/2 files downloaded from org/m" in out
    assert "s: weights: seed: 5 files from the huggingface source, 0 already here and verified" in out
    progress = json.loads((root / ".glm-progress.json").read_text())
    assert progress["complete"] and progress["received"] == sum(len(b) for b in CHECKPOINT.values()), \
        "what the client wrote, each byte once"
    assert sorted(progress["published"]) == sorted(CHECKPOINT)


def test_the_batches_of_hf_download(tmp_path, token, monkeypatch):
    bin_dir = hf_venv(tmp_path, listing())
    assert hf_seed(tmp_path / "h" / "model", bin_dir, token) == 0
    calls = (bin_dir / "calls").read_text().splitlines()
    assert len(calls) == 3 and " config.json model.safetensors.index.json sub/tokenizer.json " in calls[1]
    assert " model-00001-of-00002.safetensors model-00002-of-00002.safetensors " in calls[2]


def test_the_seed_from_the_hub_again_keeps_what_matches(tmp_path, token, capsys, monkeypatch):
    bin_dir = hf_venv(tmp_path, listing())
    path = tmp_path / "h" / "model"
    assert hf_seed(path, bin_dir, token) == 0
    (path / "config.json").write_bytes(CHECKPOINT["config.json"].upper())
    (path / "model-00002-of-00002.safetensors").write_bytes(b"\0" * len(CHECKPOINT["model-00002-of-00002.safetensors"]))
    # the client still has its records of both: they go with the bad files, or it keeps them
    (bin_dir / "calls").unlink()
    capsys.readouterr()
    assert hf_seed(path, bin_dir, token) == 0
    out = capsys.readouterr().out
    assert "s: weights: model-00002-of-00002.safetensors: does not match the hub's sha256, downloading it again" in out
    assert "s: weights: seed: 2 files from the huggingface source, 3 already here and verified" in out
    assert [c.split(" --revision")[0] for c in (bin_dir / "calls").read_text().splitlines()[1:]] == [
        "hf hf_tok_1 download org/m config.json", "hf hf_tok_1 download org/m model-00002-of-00002.safetensors"]
    assert (path / "config.json").read_bytes() == CHECKPOINT["config.json"]


@pytest.mark.parametrize(("listed", "rc", "stderr", "problem"), [
    ("", 1, "Traceback (most recent call last):\n  File x\nhuggingface_hub.errors.GatedRepoError: 401 Client Error.\n"
     "Access to model org/m is restricted.\n", "cannot list org/m@rev1: GatedRepoError: 401 Client Error. Access to model org/m is restricted."),
    ("", 1, "requests.exceptions.ConnectionError: refused\n", "cannot list org/m@rev1: ConnectionError: refused"),
    ("", 1, "it broke\n", "cannot list org/m@rev1: it broke"),
    ("", 2, "", "cannot list org/m@rev1: (no output)"),
    ("not json", 0, "", "cannot list org/m@rev1: the hub client printed no list of files"),
    ("{}", 0, "", "cannot list org/m@rev1: the hub client printed no list of files"),
    ('{"commit": "main", "files": []}', 0, "", "cannot list org/m@rev1: the hub named no commit it resolves to (got 'main')"),
    ([{"path": "a.safetensors", "size": None, "blob": "0" * 40, "sha256": "0" * 64}], 0, "",
     "refusing the manifest from org/m@rev1: a.safetensors: size None is not a byte count"),
    (f'{{"commit": "{HUB_COMMIT}", "files": ["a"]}}', 0, "", "refusing the manifest from org/m@rev1: an entry is not an object: 'a'"),
    ([{"path": "../a", "size": 1, "blob": "0" * 40, "sha256": None}], 0, "", "unsafe file name '../a'"),
    ([{"path": "a", "size": 1, "blob": None, "sha256": None}], 0, "", "a: neither a sha256 nor a git blob id"),
])
def test_a_hub_listing_that_fails_or_is_incomplete_fails_the_seed(tmp_path, token, capsys, listed, rc, stderr, problem):
    bin_dir = hf_venv(tmp_path, listed, rc, stderr)
    assert hf_seed(tmp_path / "h" / "model", bin_dir, token) == 1
    err = capsys.readouterr().err
    assert (f"s: weights: {problem}\n" in err) if problem.startswith("cannot list") else problem in err, err
    assert err.startswith("s: weights: ")
    assert (bin_dir / "calls").read_text().count("\n") == 1, "nothing downloaded"


def test_hf_download_failing_or_delivering_bad_bytes_fails_the_seed(tmp_path, token, capsys, monkeypatch):
    bin_dir = hf_venv(tmp_path / "a", listing(), hf_rc=3)
    assert hf_seed(tmp_path / "a" / "model", bin_dir, token) == 1
    assert "s: weights: hf download of 3 files from org/m@rev1 exited 3" in capsys.readouterr().err
    bin_dir = hf_venv(tmp_path / "b", listing(), corrupt="model-00001-of-00002.safetensors")
    assert hf_seed(tmp_path / "b" / "model", bin_dir, token) == 1
    err = capsys.readouterr().err
    assert "s: weights: model-00001-of-00002.safetensors: the hub delivered bytes that do not match its sha256/size" in err
    assert not (tmp_path / "b" / "model").exists()


def test_the_hub_token_is_read_from_its_file_only(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "from_the_environment")
    bin_dir = hf_venv(tmp_path, listing())
    empty = tmp_path / "empty.env"
    empty.write_text("# a public repository: no token\n")
    assert hf_seed(tmp_path / "a" / "model", bin_dir, empty) == 0
    assert all(" from_the_environment " in c for c in (bin_dir / "calls").read_text().splitlines())
    assert hf_seed(tmp_path / "b" / "model", bin_dir, tmp_path / "missing.env") == 1
    assert f"s: weights: cannot read {tmp_path / 'missing.env'}: No such file or directory" in capsys.readouterr().err
    args = type("A", (), {"token_file": None})()
    assert w.seed.hf_env(args)["HF_TOKEN"] == "from_the_environment"


# --- a peer: what it takes from its parent, how it moves on --------------------------------------------


def progress_doc(files: dict[str, bytes] = CHECKPOINT, revision: str = "rev1", published: list | None = None,
                 complete: bool = True, received: int = 0) -> dict:
    return {"revision": revision, "files": sorted((entry(n, b) for n, b in files.items()), key=lambda e: e["path"]),
            "published": sorted(files) if published is None else published, "complete": complete, "received": received}


def signing(key: bytes, doc: dict | Callable[[], dict]) -> Callable:
    """A relay host's progress ``doc`` (or what the callable gives each time), signed with ``key`` and the
    nonce of the request's authentication header, as a relay with the stack's key answers."""

    def send(h: http.server.BaseHTTPRequestHandler) -> None:
        body = json.dumps(doc() if callable(doc) else doc).encode()
        fields = h.headers.get(w.signing.AUTH_HEADER, "").split(" ")
        nonce = fields[2] if len(fields) == 4 else ""
        h.send_response(200)
        h.send_header(w.signing.MAC_HEADER, hmac.new(key, b"server\n" + nonce.encode() + b"\n" + body,
                                             hashlib.sha256).hexdigest())
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    return send


def parent(files: dict[str, bytes] = CHECKPOINT, doc: dict | None = None, port: int = 0, **kw) -> Fake:
    """A relay host with the stack's key that serves ``doc`` (default: every file of ``files`` published),
    signed for each request, and the files."""
    routes: dict[str, Route] = {"/.glm-progress.json": signing(RELAY_KEY, doc or progress_doc(files, **kw)),
                                "/.glm-done": (200, {}, b"ok\n")}
    routes.update({f"/{n}": (200, {}, b) for n, b in files.items()})
    return Fake(routes, port)


def peer(path: Path, *urls: str, stall: str = "0.3", timeout: str = "5", more: tuple = ()) -> int:
    argv = ["stage", "--role", "peer", "--revision", "rev1", "--path", str(path), "--margin-gb", "0", "--name", "c",
            "--stall", stall, "--timeout", timeout]
    if "--relay-key-file" not in more:
        argv += ["--relay-key-file", KEYFILE]
    argv += more
    for u in urls:
        argv += ["--peer", u + "/"]
    return run(*argv)


def signed_as(fake: Fake, name: str = "c") -> bool:
    """Every request ``fake`` got was signed with the stack's key by ``name``, for what it asked."""
    for target, headers in fake.requests:
        fields = headers.get(w.signing.AUTH_HEADER, "").split(" ")
        if len(fields) != 4 or fields[0] != name or \
                fields[3] != w.signing.client_mac(RELAY_KEY, name, fields[1], fields[2], target):
            return False
    return bool(fake.requests)


def test_a_peer_copies_what_its_parent_published_and_says_when_it_is_done(tmp_path, capsys):
    p = parent()
    path = tmp_path / "c" / "model"
    with running(p.server) as url:
        assert peer(path, url) == 0
    out = capsys.readouterr().out
    for name, data in CHECKPOINT.items():
        assert (path / name).read_bytes() == data
    root = path.parent / "model.revisions" / "rev1"
    assert json.loads((root / ".glm-manifest.json").read_text()) == {"revision": "rev1", "files": progress_doc()["files"]}
    assert f"c: weights: peer: 5 files copied (5 from {url}), 0 already here and verified" in out
    assert p.paths()[0] == "/.glm-progress.json" and p.paths()[-1] == "/.glm-done"
    assert sorted(p.paths()[1:-1]) == sorted(f"/{n}" for n in CHECKPOINT)
    progress = json.loads((root / ".glm-progress.json").read_text())
    assert progress["complete"] is True and sorted(progress["published"]) == sorted(CHECKPOINT)
    assert progress["received"] == sum(len(b) for b in CHECKPOINT.values()), "its children see it receiving"
    assert (root / ".glm-complete").exists() and (root / ".glm-hashes.json").exists()


@pytest.mark.parametrize(("doc", "problem"), [
    ([], "not a progress document"),
    ({**progress_doc(), "revision": 1}, "'revision' is missing or not a str"),
    ({k: v for k, v in progress_doc().items() if k != "files"}, "'files' is missing or not a list"),
    ({**progress_doc(), "published": "config.json"}, "'published' is missing or not a list"),
    ({**progress_doc(), "complete": 1}, "'complete' is missing or not a bool"),
    ({**progress_doc(), "received": -1}, "'received' is missing or not a byte count"),
    ({**progress_doc(), "received": True}, "'received' is missing or not a byte count"),
    ({k: v for k, v in progress_doc().items() if k != "received"}, "'received' is missing or not a byte count"),
    ({**progress_doc(), "published": ["config.json", "nope.json"]}, "it publishes 'nope.json', which it does not list"),
    ({**progress_doc(), "published": [["config.json"]]}, "it publishes ['config.json'], which it does not list"),
    ({**progress_doc(), "files": progress_doc()["files"] + [entry("/etc/x", b"1")]}, "unsafe file name '/etc/x'"),
    ({**progress_doc(), "commit": "main"}, "'commit' 'main' is not a commit id"),
])
def test_a_progress_document_is_checked_whole(doc, problem):
    with pytest.raises(w.base.StageError) as e:
        w.peer.parent_doc(doc, "http://p:1")
    assert str(e.value) == f"refusing the manifest from http://p:1: {problem}" or problem in str(e.value)
    assert str(e.value).startswith("refusing the manifest from http://p:1: ")


def test_a_good_progress_document_comes_back_normalised():
    doc = progress_doc(published=["config.json"], complete=False, received=7)
    doc["files"] = [{**e, "note": 1} for e in reversed(doc["files"])]
    got = w.peer.parent_doc(doc, "p")
    assert got["files"] == progress_doc()["files"] and got["published"] == ["config.json"]
    assert (got["revision"], got["complete"], got["received"]) == ("rev1", False, 7)


def test_a_peer_records_the_commit_its_parent_staged_and_passes_it_on(tmp_path, capsys):
    """The seed resolved the revision to a commit; every host's manifest and .glm-complete say which."""
    p = parent(doc={**progress_doc(), "commit": HUB_COMMIT})
    path = tmp_path / "c" / "model"
    with running(p.server) as url:
        assert peer(path, url) == 0
    root = path.parent / "model.revisions" / "rev1"
    assert json.loads((root / ".glm-manifest.json").read_text())["commit"] == HUB_COMMIT
    assert json.loads((root / ".glm-progress.json").read_text())["commit"] == HUB_COMMIT, "its children get it"
    assert (root / ".glm-complete").read_text().endswith(f", commit {HUB_COMMIT}\n")
    assert f"c: weights: rev1 (commit {HUB_COMMIT}): 5 files" in capsys.readouterr().out


def test_a_parent_that_lies_about_a_name_gets_nothing_written(tmp_path, capsys):
    bad = progress_doc()
    bad["files"].append(entry("x/../../y", b"1"))
    p = parent(doc=bad)
    path = tmp_path / "c" / "model"
    with running(p.server) as url:
        assert peer(path, url) == 1
    assert f"c: weights: refusing the manifest from {url}: unsafe file name 'x/../../y'" in capsys.readouterr().err
    assert os.listdir(path.parent / "model.revisions" / "rev1") == []
    assert p.paths() == ["/.glm-progress.json"]


def test_a_symlink_in_the_peer_folder_that_leads_out_fails_the_manifest(tmp_path, capsys):
    p = parent()
    path = tmp_path / "c" / "model"
    root = path.parent / "model.revisions" / "rev1"
    root.mkdir(parents=True)
    (root / "sub").symlink_to(tmp_path, target_is_directory=True)
    with running(p.server) as url:
        assert peer(path, url) == 1
    assert f"refusing the manifest from {url}: 'sub/tokenizer.json' would land at {tmp_path}/tokenizer.json" in \
        capsys.readouterr().err
    assert sorted(os.listdir(root)) == ["sub"] and not (tmp_path / "tokenizer.json").exists()


def test_a_peer_takes_only_a_manifest_signed_for_its_request_and_fails_as_forged(tmp_path, capsys):
    """Whatever answers on the parent's port (any local user may bind it first) is not trusted by the port:
    unsigned, signed with another key, replayed for another request, or a 401: exit 3, nothing written."""
    p = parent()
    with running(p.server) as url:
        p.routes["/.glm-progress.json"] = (200, {}, json.dumps(progress_doc()).encode())
        assert peer(tmp_path / "a" / "model", url) == w.signing.EXIT_FORGED == 3
        err = capsys.readouterr().err
        assert (f"c: weights: refusing the manifest from {url}/.glm-progress.json: not signed (not signed with this "
                "stack's relay key: another process on that port, a host of another stack, or a forgery)\n") in err
        p.routes["/.glm-progress.json"] = signing(b"j" * 40, progress_doc())
        assert peer(tmp_path / "b" / "model", url) == 3
        assert ": a wrong signature (not signed with this stack's relay key" in capsys.readouterr().err
        body = json.dumps(progress_doc()).encode()
        replayed = {w.signing.MAC_HEADER: hmac.new(RELAY_KEY, b"server\n" + b"0" * 32 + b"\n" + body, hashlib.sha256).hexdigest()}
        p.routes["/.glm-progress.json"] = (200, replayed, body)
        assert peer(tmp_path / "e" / "model", url) == 3
        assert ": a wrong signature (" in capsys.readouterr().err
        p.routes["/.glm-progress.json"] = (401, {}, b"unauthenticated relay client: not signed with this stack's key\n")
        assert peer(tmp_path / "f" / "model", url) == 3
        assert (f"c: weights: refusing {url}/.glm-progress.json: HTTP 401: unauthenticated relay client: not signed "
                "with this stack's key (this host's relay key is not the one its source holds)") in capsys.readouterr().err
        p.routes["/.glm-progress.json"] = signing(RELAY_KEY, progress_doc())
        assert peer(tmp_path / "c" / "model", url) == 0
        assert signed_as(p), "every request it made was signed, by its name"
        nonces = [h[w.signing.AUTH_HEADER].split(" ")[2] for _, h in p.requests]
        assert len(set(nonces)) == len(nonces) and all(len(n) == 32 for n in nonces), "a fresh nonce each time"
        assert peer(tmp_path / "d" / "model", url, more=("--relay-key-file", str(tmp_path / "none.env"))) == 1
    assert f"cannot read {tmp_path / 'none.env'}" in capsys.readouterr().err
    for forged in "abef":
        assert os.listdir(tmp_path / forged / "model.revisions" / "rev1") == [], "nothing written"
    assert not (tmp_path / "d" / "model.revisions").exists(), "the key is read before anything is made"


def test_a_peer_refused_by_its_source_file_by_file_fails_as_forged(tmp_path, capsys):
    p = parent()
    p.routes["/config.json"] = (401, {}, b"unauthenticated relay client: not signed with this stack's relay key\n")
    with running(p.server) as url:
        assert peer(tmp_path / "c" / "model", url) == 3
    assert (f"c: weights: {url}/config.json: HTTP 401: unauthenticated relay client: not signed with this stack's "
            "relay key (this host's relay key is not the one its source holds)") in capsys.readouterr().err


@pytest.mark.parametrize("more", [("--serve", "127.0.0.1:0", "--children", "x"), ("--role", "peer")])
def test_serving_and_copying_need_the_relay_key(tmp_path, capsys, more):
    argv = ["stage", "--revision", "rev1", "--path", str(tmp_path / "m"), "--url", "http://127.0.0.1:9", "--name", "t",
            *more]
    if "peer" in more:
        argv += ["--peer", "http://127.0.0.1:9/"]
    assert run(*argv) == 1
    what = "--serve" if "--serve" in more else "--role peer"
    assert capsys.readouterr().err == (f"t: weights: {what} needs --relay-key-file F (the stack's relay key): a relay "
                                       "host is never served, nor trusted, by its port alone\n")
    assert not (tmp_path / "m.revisions").exists()


def test_a_signed_relay_serves_a_peer_with_the_same_key(tmp_path, mirror, capsys):
    url, _ = mirror
    keyfile = KEYFILE
    port = Fake().server  # a free port, released for the seed's relay
    bind = f"127.0.0.1:{port.server_address[1]}"
    port.server_close()
    rc: list[int] = []
    t = threading.Thread(target=lambda: rc.append(seed(url, tmp_path / "s" / "model", "--serve", bind, "--children",
                                                        "c", "--stall", "5", "--relay-key-file", str(keyfile))))
    t.start()
    try:
        assert peer(tmp_path / "c" / "model", f"http://{bind}", stall="5",
                    more=("--relay-key-file", str(keyfile))) == 0
    finally:
        t.join()
    assert rc == [0]
    out = capsys.readouterr().out
    assert f"peer: 5 files copied (5 from http://{bind})" in out  # (the log prefix is one per process)
    assert f"relay on {bind} stopped: every host copying from here is done or left" in out


def test_get_json_bounds_and_parses(tmp_path, monkeypatch):
    monkeypatch.setattr(w.peer, "MAX_JSON", 10)
    fake = Fake({"/ok": (200, {}, b'{"a": 123}'), "/big": (200, {}, b'{"a": 1234}'), "/bad": (200, {}, b"{nope}")})
    with running(fake.server) as url:
        assert w.peer.get_json(f"{url}/ok?x", 5) == {"a": 123}, "10 bytes: as many as it takes"
        with pytest.raises(w.transfer.SourceFailed, match=r"/big\?x: more than 10 bytes"):
            w.peer.get_json(f"{url}/big?x", 5)
        with pytest.raises(w.transfer.SourceFailed, match=r"/bad\?x: not JSON"):
            w.peer.get_json(f"{url}/bad?x", 5)
        with pytest.raises(w.transfer.SourceFailed, match=r"/none\?x: HTTP 404$"):
            w.peer.get_json(f"{url}/none?x", 5)
    assert fake.paths() == ["/ok?x", "/big?x", "/bad?x", "/none?x"], "no nonce without a key"
    with pytest.raises(w.transfer.SourceFailed) as e:
        w.peer.get_json(f"{url}/ok?x", 5)
    assert str(e.value) == f"{url}/ok?x: [Errno 111] Connection refused"


def test_a_peer_moves_to_the_next_source_when_its_parent_fails_a_file(tmp_path, capsys):
    bad = parent()
    bad.routes["/config.json"] = (500, {}, b"")
    good = parent()
    with running(bad.server) as up, running(good.server) as top:
        assert peer(tmp_path / "c" / "model", up, top) == 0
    out = capsys.readouterr().out
    assert f"c: weights: {up}: failed ({up}/config.json: HTTP 500); copying from {top} (the seed) now" in out
    assert f"c: weights: peer: 5 files copied (5 from {top}), 0 already here and verified" in out  # config.json first
    assert "/.glm-done?moved=1" in bad.paths() and "/.glm-done" in good.paths()
    assert (tmp_path / "c" / "model" / "config.json").read_bytes() == CHECKPOINT["config.json"]


def test_a_peer_rejects_bad_bytes_and_takes_them_from_an_ancestor(tmp_path, capsys):
    liar = parent()
    liar.routes["/model-00001-of-00002.safetensors"] = (200, {}, bytes(len(CHECKPOINT["model-00001-of-00002.safetensors"])))
    a, b = parent(), parent()
    with running(liar.server) as p1, running(a.server) as p2, running(b.server) as p3:
        assert peer(tmp_path / "c" / "model", p1, p2, p3) == 0
    out = capsys.readouterr().out
    assert (f"c: weights: {p1}: model-00001-of-00002.safetensors: sha256 mismatch (bytes rejected); "
            f"copying from {p2} (an ancestor) now") in out
    assert f"c: weights: peer: 5 files copied (1 from {p1}, 4 from {p2}), 0 already here and verified" in out
    assert "model-00001-of-00002.safetensors" in [p.split("?")[0].lstrip("/") for p in a.paths()]
    assert b.paths() == ["/.glm-done"], "the seed was not needed"
    assert (tmp_path / "c" / "model" / "model-00001-of-00002.safetensors").read_bytes() == \
        CHECKPOINT["model-00001-of-00002.safetensors"]


def test_a_parent_staging_another_revision_is_left_after_the_stall(tmp_path, capsys, clock):
    old, good = parent(revision="rev0"), parent()
    with running(old.server) as up, running(good.server) as top:
        start = time.monotonic()
        assert peer(tmp_path / "c" / "model", up, top) == 0
        assert time.monotonic() - start > 0.3
    assert 1 in clock.sleeps and 2 not in clock.sleeps, "it looks again every second"
    out = capsys.readouterr().out
    assert f"c: weights: {up}: serves revision 'rev0', not rev1; copying from {top} (the seed) now" in out


def test_a_parent_that_does_not_answer_is_left_for_the_first_ancestor_that_does(tmp_path, capsys):
    gone, also, good = Fake(), Fake(), parent()
    with running(gone.server) as up, running(also.server) as mid:
        pass
    with running(good.server) as top:
        assert peer(tmp_path / "c" / "model", up, mid, top) == 0
    out = capsys.readouterr().out
    assert f"c: weights: {up}: did not answer within 0.3s; copying from {top} (the seed) now" in out
    assert signed_as(good), "every request is signed by who asks"


def test_a_parent_not_started_yet_is_waited_for(tmp_path, capsys):
    """Within the stall a parent that does not answer yet is waited for, even when an ancestor answers."""
    late, top = Fake(), parent()
    port = late.server.server_address[1]
    late.server.server_close()  # nothing listens there for now
    later = parent(port=0)  # its routes, served on ``port`` 0.4 s after the peer started
    servers: list[http.server.HTTPServer] = []

    def start_late() -> None:
        time.sleep(0.4)
        servers.append(http.server.ThreadingHTTPServer(("127.0.0.1", port), later.server.RequestHandlerClass))
        servers[0].serve_forever(poll_interval=0.01)

    later.server.server_close()
    t = threading.Thread(target=start_late)
    t.start()
    try:
        with running(top.server) as seed_url:
            assert peer(tmp_path / "c" / "model", f"http://127.0.0.1:{port}", seed_url, stall="3") == 0
    finally:
        while t.is_alive() and not servers:
            time.sleep(0.01)
        if servers:
            servers[0].shutdown()
            servers[0].server_close()
        t.join()
    out = capsys.readouterr().out
    assert f"peer: 5 files copied (5 from http://127.0.0.1:{port})" in out, out
    assert out.count(f"c: weights: waiting for http://127.0.0.1:{port} to serve (nothing answers: not started yet, "
                     "or its staging is over)") == 1, "said once (then every minute)"
    assert top.paths() == ["/.glm-done"], "the seed was only told it is done"


def test_a_source_that_answers_then_fails_is_left_at_once(tmp_path, capsys):
    flaky = parent(published=["config.json"], complete=False)
    doc = flaky.routes["/.glm-progress.json"]
    flaky.routes["/.glm-progress.json"] = [doc, (500, {}, b"")]
    good = parent()
    with running(flaky.server) as up, running(good.server) as top:
        assert peer(tmp_path / "c" / "model", up, top, stall="5") == 0
    assert (f"c: weights: {up}: failed ({up}/.glm-progress.json: HTTP 500); copying from {top} (the seed) now"
            in capsys.readouterr().out)


def test_a_source_that_accepts_and_says_nothing_is_left_after_the_stall(tmp_path, capsys):
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # connections wait in the backlog: nothing ever answers them
    good = parent()
    try:
        with running(good.server) as top:
            start = time.monotonic()
            assert peer(tmp_path / "c" / "model", f"http://127.0.0.1:{silent.getsockname()[1]}", top) == 0
            assert time.monotonic() - start < 15  # the stall, then 3 s + 5 s telling it we are done
    finally:
        silent.close()
    assert "did not answer within 0.3s; copying from" in capsys.readouterr().out


def test_a_peer_whose_sources_never_answer_fails_naming_them(tmp_path, capsys, clock):
    gone = Fake()
    with running(gone.server) as up:
        pass
    start = time.monotonic()
    assert peer(tmp_path / "c" / "model", up, up, timeout="1") == 1
    assert 1 <= time.monotonic() - start < 4
    out, err = capsys.readouterr()
    assert f"c: weights: {up}, {up} did not answer within 1s" in err
    assert set(clock.sleeps) == {1}
    assert out.count(f"c: weights: waiting for {up} to serve") == 1


def test_a_source_that_never_completes_fails_the_peer_in_time(tmp_path, capsys, monkeypatch):
    stuck = parent(published=["config.json"], complete=False)
    with running(stuck.server) as up:
        # The deadline is real time: 3 s leaves room for the 0.3 s stall on a loaded machine.
        assert peer(tmp_path / "c" / "model", up, timeout="3") == 1
    out, err = capsys.readouterr()
    assert f"c: weights: timed out after 3s with 1 files (sources: {up})" in err
    assert f"c: weights: {up}: no progress for 0.3s; copying from {up} (the seed) now" in out
    assert "/.glm-done?moved=1" not in stuck.paths(), "it did not move: nothing to tell"


def test_a_peer_goes_round_its_sources_parent_first_seed_last(tmp_path, capsys):
    stuck = [parent(published=[], complete=False) for _ in range(3)]
    with running(stuck[0].server) as p, running(stuck[1].server) as a, running(stuck[2].server) as s:
        # The deadline is real time: 3 s leaves room for four 0.2 s stalls on a loaded machine (1 s did not).
        assert peer(tmp_path / "c" / "model", p, a, s, stall="0.2", timeout="3") == 1
    out, err = capsys.readouterr()
    assert f"c: weights: timed out after 3s with 0 files (sources: {p}, {a}, {s})" in err
    moves = [l.split("; ")[1] for l in out.splitlines() if "no progress for 0.2s" in l]
    cycle = [f"copying from {a} (an ancestor) now", f"copying from {s} (the seed) now",
             f"copying from {p} (its parent) now"]
    assert len(moves) >= 4 and moves == [cycle[i % 3] for i in range(len(moves))], out
    assert "/.glm-done?moved=1" in stuck[0].paths()


def test_a_source_still_working_is_not_left(tmp_path, capsys, clock):
    """Progress is the published list or the bytes received growing: a source that shows it is kept."""
    docs = [progress_doc(published=[], complete=False, received=n) for n in range(40)] + [progress_doc()]

    def next_doc() -> dict:
        time.sleep(0.02)
        return docs.pop(0) if len(docs) > 1 else docs[0]

    slow = parent()
    slow.routes["/.glm-progress.json"] = signing(RELAY_KEY, next_doc)
    with running(slow.server) as up:
        assert peer(tmp_path / "c" / "model", up, stall="0.2") == 0
    assert "no progress" not in capsys.readouterr().out
    assert 0.5 in clock.sleeps and 1.5 not in clock.sleeps, "it looks twice a second"


def test_a_parent_that_cuts_a_file_short_or_stalls_in_it_or_redirects_is_left(tmp_path, capsys):
    data = CHECKPOINT["config.json"]

    def stall(h: http.server.BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data[:5])
        h.wfile.flush()
        time.sleep(6)

    for route, said in ((raw(data[:-3]), f"config.json: short body ({len(data) - 3} of {len(data)} bytes)"),
                        (stall, "config.json: timed out"),
                        ((302, {"Location": "/elsewhere"}, b""), "(a relay host never redirects)")):
        bad, good = parent(), parent()
        bad.routes["/config.json"] = route
        with running(bad.server) as up, running(good.server) as top:
            start = time.monotonic()
            assert peer(tmp_path / str(len(said)) / "model", up, top) == 0
            assert time.monotonic() - start < 4
        out = capsys.readouterr().out
        assert f"c: weights: {up}: failed ({up}/" in out and f"{said}); copying from {top} (the seed) now" in out, out


def test_a_file_withdrawn_meanwhile_is_copied_in_a_later_round(tmp_path, capsys):
    p = parent()
    p.routes["/config.json"] = [(404, {}, b""), (200, {}, CHECKPOINT["config.json"])]
    with running(p.server) as url:
        assert peer(tmp_path / "c" / "model", url) == 0
    assert p.paths().count("/.glm-progress.json") == 2
    assert "failed" not in capsys.readouterr().out


def test_a_peer_with_a_complete_copy_needs_no_parent(tmp_path, capsys, counted):
    path = tmp_path / "c" / "model"
    p, s = parent(), Fake()
    with running(p.server) as url, running(s.server) as top:
        assert peer(path, url, top) == 0
    counted.clear()
    capsys.readouterr()
    start = time.monotonic()
    assert peer(path, url, top) == 0  # their stagings are over: nothing answers
    assert time.monotonic() - start > 0.3
    out = capsys.readouterr().out
    assert (f"c: weights: every file already here and verified; none of {url}, {top} answered within 0.3s, "
            "none needed") in out
    assert "c: weights: peer: 0 files copied (none), 5 already here and verified" in out
    assert counted == [], "verified through the cache"
    progress = json.loads((path / ".glm-progress.json").read_text())
    assert progress["complete"] and sorted(progress["published"]) == sorted(CHECKPOINT), "served to its children"


def test_a_peer_staging_again_copies_what_the_source_changed_and_keeps_the_rest(tmp_path, capsys):
    path = tmp_path / "c" / "model"
    with running(parent().server) as url:
        assert peer(path, url) == 0
    changed = {**CHECKPOINT, "config.json": CHECKPOINT["config.json"].upper()}  # same size, a new manifest
    del changed["sub/tokenizer.json"]
    changed["extra.json"] = b"{}"
    capsys.readouterr()
    with running(parent(changed).server) as url:
        assert peer(path, url) == 0
    out = capsys.readouterr().out
    assert (f"c: weights: {url}: its manifest differs for 2 files verified here before (config.json, "
            "sub/tokenizer.json): checking them again") in out
    assert "c: weights: config.json: does not match its sha256, copying it again" in out
    assert f"c: weights: peer: 2 files copied (2 from {url}), 3 already here and verified" in out
    assert (path / "config.json").read_bytes() == changed["config.json"]
    assert run("verify", "--revision", "rev1", "--path", str(path)) == 0
    assert json.loads((path / ".glm-manifest.json").read_text())["files"] == progress_doc(changed)["files"]


def test_a_peer_staging_again_copies_what_went_bad_here(tmp_path, capsys):
    path = tmp_path / "c" / "model"
    with running(parent().server) as url:
        assert peer(path, url) == 0
        shard = path / "model-00002-of-00002.safetensors"
        shard.write_bytes(bytes(len(CHECKPOINT["model-00002-of-00002.safetensors"])))
        capsys.readouterr()
        assert peer(path, url) == 0
    out = capsys.readouterr().out
    assert "c: weights: model-00002-of-00002.safetensors: does not match its sha256, copying it again" in out
    assert f"peer: 1 files copied (1 from {url}), 4 already here and verified" in out
    assert shard.read_bytes() == CHECKPOINT["model-00002-of-00002.safetensors"]


@pytest.mark.parametrize(("n", "named"), [(5, "f0.json, f1.json, f2.json, f3.json, f4.json"),
                                          (6, "f0.json, f1.json, f2.json, f3.json, f4.json ...")])
def test_changed_files_are_named_five_at_most(tmp_path, capsys, n, named):
    files = {f"f{i}.json": b"%d" % i for i in range(n)}
    path = tmp_path / "c" / "model"
    with running(parent(files).server) as url:
        assert peer(path, url) == 0
    capsys.readouterr()
    with running(parent({f: b"x" for f in files}).server) as url:
        assert peer(path, url) == 0
    assert f"its manifest differs for {n} files verified here before ({named}): checking them again" \
        in capsys.readouterr().out


def test_a_symlink_planted_under_an_earlier_staging_fails_it(tmp_path, capsys):
    path = tmp_path / "c" / "model"
    with running(parent().server) as url:
        assert peer(path, url) == 0
        root = path.parent / "model.revisions" / "rev1"
        shutil.rmtree(root / "sub")
        (root / "sub").symlink_to(tmp_path, target_is_directory=True)
        assert peer(path, url) == 1
    assert ("c: weights: refusing the manifest from the earlier staging: 'sub/tokenizer.json' would land at "
            f"{tmp_path}/tokenizer.json") in capsys.readouterr().err


@pytest.mark.parametrize(("earlier", "said"), [
    ("{not json", "no earlier manifest kept: "),
    (json.dumps({"revision": "rev1", "files": [entry("../x", b"1")]}), "unsafe file name '../x'"),
    (json.dumps({"revision": "rev1", "files": {}}), "no list of files"),
    (json.dumps(["rev1"]), None),
    (json.dumps({"revision": "rev0", "files": []}), None),
])
def test_an_earlier_manifest_that_is_not_this_revisions_or_not_sound_keeps_nothing(tmp_path, capsys, earlier, said):
    root = tmp_path / "c" / "model.revisions" / "rev1"
    root.mkdir(parents=True)
    write_checkpoint(root)
    (root / ".glm-manifest.json").write_text(earlier)
    assert w.peer.earlier_files(str(root), "rev1") is None
    out = capsys.readouterr().out
    assert (said in out) if said else out == ""
    if said and ("refusing" in said or "no list" in said):
        assert f"refusing the manifest from the earlier staging ({root}): " in out
    with running(parent().server) as url:
        assert peer(tmp_path / "c" / "model", url) == 0
    assert f"peer: 0 files copied (none), 5 already here and verified" in capsys.readouterr().out


def test_an_earlier_manifest_of_this_revision_is_kept(tmp_path):
    (tmp_path / ".glm-manifest.json").write_text(json.dumps({"revision": "rev1", "files": progress_doc()["files"]}))
    assert w.peer.earlier_files(str(tmp_path), "rev1") == progress_doc()["files"]
    assert w.peer.earlier_files(str(tmp_path / "nope"), "rev1") is None


def test_a_peer_refuses_a_manifest_its_disk_cannot_hold(tmp_path, capsys):
    with running(parent().server) as url:
        assert peer(tmp_path / "c" / "model", url, more=("--margin-gb", "1e9")) == 1
    assert " GB free at " in capsys.readouterr().err
    assert os.listdir(tmp_path / "c" / "model.revisions" / "rev1") == []


def test_first_answering_looks_after_the_current_source_then_wraps(tmp_path):
    gone = Fake()
    with running(gone.server) as dead:
        pass
    with running(parent().server) as a, running(parent().server) as b:
        assert w.peer.first_answering([a, dead, b], 1, AUTH) == 2
        assert w.peer.first_answering([a, dead, b], 2, AUTH) == 0
        assert w.peer.first_answering([dead, a, dead], 0, AUTH) == 1
        assert w.peer.first_answering([dead, dead], 0, AUTH) is None
        assert w.peer.first_answering([a, b], 0, AUTH) == 1


def test_done_is_said_to_a_host_that_listens_and_to_one_gone_or_garbled_without_failing():
    import socket

    p = parent()
    with running(p.server) as url:
        w.peer.say_done(f"{url}/.glm-done", AUTH)
    assert p.paths() == ["/.glm-done"]
    w.peer.say_done(f"{url}/.glm-done", AUTH, timeout=1)
    garbled = socket.socket()
    garbled.bind(("127.0.0.1", 0))
    garbled.listen(1)

    def answer() -> None:
        conn, _ = garbled.accept()
        conn.recv(4096)
        conn.sendall(b"garbage\r\n\r\n")
        conn.close()

    t = threading.Thread(target=answer)
    t.start()
    w.peer.say_done(f"http://127.0.0.1:{garbled.getsockname()[1]}/.glm-done", AUTH, timeout=2)
    t.join()
    garbled.close()


# --- the staging around them, and the other commands ---------------------------------------------------


def test_a_peer_needs_a_source(tmp_path, capsys):
    assert run("stage", "--role", "peer", "--revision", "rev1", "--path", str(tmp_path / "m"), "--name", "c") == 1
    assert capsys.readouterr().err == "c: weights: --role peer needs at least one --peer URL (its parent, then its ancestors)\n"
    assert not (tmp_path / "m.revisions").exists()


@pytest.mark.parametrize("revision", ["", ".", "..", "../x", "a/b", "-rf", ".lock", "a" * 101, "x\n"])
def test_a_revision_that_is_not_a_folder_name_is_refused(tmp_path, capsys, revision):
    for argv in (["stage", "--role", "seed", "--url", "http://127.0.0.1:9", "--path", str(tmp_path / "m")],
                 ["verify", "--path", str(tmp_path / "m")], ["prune", "--path", str(tmp_path / "m")],
                 ["install", "--path", str(tmp_path / "m"), "--into", str(tmp_path / "i")],
                 ["stage", "--source", "directory", "--from", str(tmp_path), "--path", str(tmp_path / "m")]):
        assert run(*argv, f"--revision={revision}") == 1
        assert capsys.readouterr().err.endswith(f": weights: {revision!r} is not a revision\n")
    assert os.listdir(tmp_path) == []


def test_the_local_source_takes_no_revision(tmp_path, capsys):
    files = write_checkpoint(tmp_path)
    (tmp_path / ".glm-manifest.json").write_text(json.dumps({"revision": "x", "files": files}))
    assert run("stage", "--source", "local", "--path", str(tmp_path), "--name", "h") == 0
    assert f"h: weights: {tmp_path}: checkpoint present and verified in place" in capsys.readouterr().out


def test_the_local_source_verifies_in_place(tmp_path, capsys):
    with pytest.raises(w.base.StageError) as e:
        w.revisions.verify_in_place(str(tmp_path / "none"))
    assert str(e.value) == f"{tmp_path / 'none'} is not a directory (model.source local: the checkpoint must be there)"
    files = write_checkpoint(tmp_path)
    w.revisions.verify_in_place(str(tmp_path))  # no manifest: the index's shards are there
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(w.base.StageError) as e:
        w.revisions.verify_in_place(str(tmp_path))
    assert str(e.value) == f"{tmp_path}: missing or corrupt: model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").unlink()
    with pytest.raises(w.base.StageError) as e:
        w.revisions.verify_in_place(str(tmp_path))
    assert str(e.value) == f"{tmp_path}: missing or corrupt: model.safetensors.index.json"
    write_checkpoint(tmp_path)
    manifest = tmp_path / ".glm-manifest.json"
    manifest.write_text(json.dumps({"files": files}))
    assert w.revisions.verify_in_place(str(tmp_path)) == 0
    (tmp_path / "config.json").write_bytes(b"x" * len(CHECKPOINT["config.json"]))
    with pytest.raises(w.base.StageError, match="missing or corrupt: config.json$"):
        w.revisions.verify_in_place(str(tmp_path))
    (tmp_path / "model.safetensors.index.json").unlink()
    many = [entry(f"f{i}", b"x") for i in range(6)]
    manifest.write_text(json.dumps({"files": many}))
    with pytest.raises(w.base.StageError) as e:
        w.revisions.verify_in_place(str(tmp_path))
    assert str(e.value).endswith("missing or corrupt: f0, f1, f2, f3, f4 ...")
    manifest.write_text(json.dumps({"files": many[:5]}))
    with pytest.raises(w.base.StageError) as e:
        w.revisions.verify_in_place(str(tmp_path))
    assert str(e.value).endswith("missing or corrupt: f0, f1, f2, f3, f4")
    for bad in ("{", "[]"):
        manifest.write_text(bad)
        with pytest.raises(w.base.StageError) as e:
            w.revisions.verify_in_place(str(tmp_path))
        assert str(e.value).startswith(f"{manifest}: unreadable (")
    manifest.write_text(json.dumps({"files": [entry("/x", b"")]}))
    with pytest.raises(w.base.StageError) as e:
        w.revisions.verify_in_place(str(tmp_path))
    assert str(e.value).startswith(f"refusing the manifest from {manifest}: unsafe file name '/x'")


def staged(tmp_path: Path, mirror_url: str, revisions=("rev1",)) -> Path:
    path = tmp_path / "h" / "model"
    for rev in revisions:
        assert run("stage", "--role", "seed", "--source", "mirror", "--url", mirror_url, "--revision", rev,
                   "--path", str(path), "--margin-gb", "0", "--name", "h") == 0
    return path


def test_verify_checks_every_byte_and_what_the_path_serves(tmp_path, capsys):
    src = mirror_of(tmp_path)
    (src / "rev2").mkdir()
    (src / "rev2" / "manifest.json").write_text(json.dumps({"files": write_checkpoint(src / "rev2")}))
    with running(w.relay.files_server(str(src), "127.0.0.1:0")) as url:
        path = staged(tmp_path, url, ("rev1", "rev2"))
    capsys.readouterr()
    assert run("verify", "--revision", "rev2", "--path", str(path)) == 0
    assert capsys.readouterr().out.endswith(": weights: rev2: all 5 files match their sha256\n")
    assert run("verify", "--revision", "rev2", "--path", str(path), "--quick") == 0
    assert capsys.readouterr().out.endswith(": weights: rev2: all 5 files match their size\n")
    assert run("verify", "--revision", "rev1", "--path", str(path)) == 1
    assert capsys.readouterr().err.endswith(f": weights: {path} serves rev2, not rev1\n")
    shard = path.parent / "model.revisions" / "rev2" / "config.json"
    shard.write_bytes(b"x" * len(CHECKPOINT["config.json"]))  # the cache of the staging is not used
    os.utime(shard, ns=(0, 0))
    assert run("verify", "--revision", "rev2", "--path", str(path), "--quick") == 0
    capsys.readouterr()
    assert run("verify", "--revision", "rev2", "--path", str(path)) == 1
    assert capsys.readouterr().err.endswith(": weights: config.json: missing or corrupt\n")
    shard.unlink()
    assert run("verify", "--revision", "rev2", "--path", str(path), "--quick") == 1
    assert capsys.readouterr().err.endswith(": weights: config.json: missing or of the wrong size\n")
    assert run("verify", "--revision", "rev3", "--path", str(path)) == 1
    assert capsys.readouterr().err.endswith(f": weights: rev3 is not staged at {path}\n")
    (path.parent / "model.revisions" / "rev1" / ".glm-manifest.json").write_text("[]")
    assert run("verify", "--revision", "rev1", "--path", str(path)) == 1
    assert f": weights: rev1 at {path}: unreadable manifest (" in capsys.readouterr().err
    (path.parent / "model.revisions" / "rev1" / ".glm-manifest.json").write_text(json.dumps({"files": [1]}))
    assert run("verify", "--revision", "rev1", "--path", str(path)) == 1
    assert (f"rev1 at {path}: unreadable manifest (refusing the manifest from {path.parent}/model.revisions/rev1: "
            "an entry is not an object: 1)") in capsys.readouterr().err
    path.unlink()
    path.mkdir()
    assert run("verify", "--revision", "rev2", "--path", str(path)) == 1
    assert f"h: weights: {path} serves nothing glm-infra staged, not rev2\n" in capsys.readouterr().err


def test_prune_keeps_the_revision_served_and_remove_takes_everything(tmp_path, capsys):
    top = tmp_path / "model.revisions"
    for d in ("rev0", "rev1", "rev2"):
        (top / d).mkdir(parents=True)
    (top / ".lock").write_text("")
    (top / "stray-file").write_text("")
    assert run("prune", "--revision", "rev2", "--path", str(tmp_path / "model")) == 0
    assert sorted(os.listdir(top)) == [".lock", "rev2", "stray-file"]
    assert "weights: removed the old revision rev0" in capsys.readouterr().out
    assert run("prune", "--revision", "rev2", "--path", str(tmp_path / "other")) == 0
    (tmp_path / "model").symlink_to("model.revisions/rev2")
    assert run("remove", "--path", str(tmp_path / "model")) == 0
    assert os.listdir(tmp_path) == []
    assert f"weights: removed {tmp_path / 'model'} and its revisions" in capsys.readouterr().out
    assert run("remove", "--path", str(tmp_path / "model")) == 0


def test_switch_points_the_path_at_the_revision_atomically(tmp_path, capsys):
    path = str(tmp_path / "model")
    (tmp_path / "model.tmp-link").symlink_to("stale")
    w.revisions.switch(path, "r1")
    assert os.readlink(path) == "model.revisions/r1" and not os.path.lexists(path + ".tmp-link")
    assert capsys.readouterr().out == f"t: weights: {path} -> model.revisions/r1\n"
    w.revisions.switch(path, "r1")
    assert capsys.readouterr().out == "", "already so: nothing said"
    w.revisions.switch(path, "r2")
    assert os.readlink(path) == "model.revisions/r2"
    os.remove(path)
    os.mkdir(path)
    with pytest.raises(w.base.StageError) as e:
        w.revisions.switch(path, "r1")
    assert str(e.value) == f"{path} exists and is not a glm-infra symlink; move it away first"


def test_a_second_staging_waits_for_the_first(tmp_path):
    path = str(tmp_path / "model")
    with w.revisions.locked(path):
        assert os.path.isfile(tmp_path / "model.revisions" / ".lock")
        with open(tmp_path / "model.revisions" / ".lock") as f, pytest.raises(BlockingIOError):
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(tmp_path / "model.revisions" / ".lock") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_complete_is_written_only_after_every_file_passed_its_sha256(tmp_path, mirror, monkeypatch, capsys):
    """The gate at the end of a staging, whatever the role did: a file that does not match the manifest
    written here leaves no .glm-complete and no switch."""
    url, _ = mirror
    path = staged(tmp_path, url)
    root = path.parent / "model.revisions" / "rev1"
    os.remove(path)

    def bad_role(args, root_: str) -> None:
        (Path(root_) / "config.json").write_bytes(b"y" * len(CHECKPOINT["config.json"]))

    monkeypatch.setattr(w.revisions, "stage_seed", bad_role)
    capsys.readouterr()
    assert run("stage", "--role", "seed", "--source", "mirror", "--url", url, "--revision", "rev1", "--path",
               str(path), "--name", "h") == 1
    assert capsys.readouterr().err == "h: weights: after staging, missing or corrupt: config.json\n"
    assert not (root / ".glm-complete").exists() and not path.exists()
    json.loads((root / ".glm-hashes.json").read_text())  # saved all the same


def test_a_seed_whose_child_left_early_fails_so_that_the_next_up_serves_it_again(tmp_path, mirror, capsys):
    url, _ = mirror
    fake = Fake()
    bind = f"127.0.0.1:{fake.server.server_address[1]}"
    fake.server.server_close()

    def child_comes_and_goes() -> None:
        for _ in range(100):
            with contextlib.suppress(OSError):
                sget(f"http://{bind}/.glm-progress.json", name="kid")
                return
            time.sleep(0.02)

    t = threading.Thread(target=child_comes_and_goes)
    t.start()
    rc = seed(url, tmp_path / "s" / "model", "--serve", bind, "--children", "kid,never", "--stall", "0.3",
              "--relay-key-file", KEYFILE)
    t.join()
    assert rc == 1
    out, err = capsys.readouterr()
    assert "s: weights: kid made no request for 0.3s: not waiting for it any longer" in out
    assert "s: weights: never never came for 0.3s: not waiting for it any longer" in out
    assert err.endswith("\ns: weights: staged here, but kid stopped copying from this host before they had every "
                        "file; the next `pulumi up` stages both again\n")
    assert (tmp_path / "s" / "model" / ".glm-complete").exists(), "staged here all the same"
    with pytest.raises(OSError):
        get(f"http://{bind}/.glm-progress.json")  # the relay stopped with the step


def test_the_defaults_hostplan_relies_on():
    """weights-stage passes the revision, path, margin, role, source, peers and name; the rest are these."""
    a = w.cli.parser().parse_args(["stage", "--path", "/m"])
    assert (a.role, a.source, a.stall, a.timeout, a.margin_gb, a.revision) == ("seed", "mirror", 120, 86400, 10, "")
    assert a.hf_python == "/opt/glm-infra/hf/bin/python"  # paths.HF_ENV's python
    assert a.name == os.uname().nodename and a.peer == [] and a.children == ""
    assert (a.token_file, a.relay_key_file, a.serve, a.url, a.repo) == (None, None, None, None, None)
    a = w.cli.parser().parse_args(["stage", "--path", "/m", "--peer", "http://a", "--peer", "http://b", "--stall", "1.5",
                               "--timeout", "7", "--margin-gb", "0.5"])
    assert (a.peer, a.stall, a.timeout, a.margin_gb) == (["http://a", "http://b"], 1.5, 7, 0.5)
    assert not w.cli.parser().parse_args(["verify", "--revision", "r", "--path", "/m"]).quick
    assert w.cli.parser().parse_args(["verify", "--revision", "r", "--path", "/m", "--quick"]).quick
    assert (a.include, a.kind) == ([], [])
    a = w.cli.parser().parse_args(["install", "--revision", "r", "--path", "/m", "--into", "/h"])
    assert (a.owner, a.include, a.kind) == (None, [], [])
    for bad in (["serve", "--dir", "d", "--bind", "b", "--all"], ["stage"], ["stage", "--path", "/m", "--role", "relay"], ["stage", "--path", "/m", "--source", "s3"],
                ["verify", "--path", "/m"], ["prune", "--revision", "r"], ["remove"], ["serve", "--dir", "d"], [],
                ["stage", "--path", "/m", "--timeout", "1.5"], ["stage", "--path", "/m", "--stall", "x"],
                ["prune", "--revision", "r", "--path", "/m", "--quick"], ["serve", "--dir", "d", "--bind", "b", "--quick"]):
        with pytest.raises(SystemExit):
            w.cli.parser().parse_args(bad)


def test_an_error_names_the_host_that_had_it(tmp_path, capsys):
    assert run("stage", "--role", "peer", "--revision", "r", "--path", str(tmp_path / "m"), "--name", "b300-9") == 1
    assert capsys.readouterr().err.startswith("b300-9: weights: --role peer needs")
    assert run("verify", "--revision", "r", "--path", str(tmp_path / "m")) == 1
    assert capsys.readouterr().err == f"b300-9: weights: r is not staged at {tmp_path / 'm'}\n"


def test_a_mirror_that_cuts_a_file_short_fails_the_seed_naming_it(tmp_path, capsys, clock):
    files = write_checkpoint(tmp_path / "src")
    data = CHECKPOINT["config.json"]
    fake = Fake({"/rev1/manifest.json": (200, {}, json.dumps({"files": files}).encode()),
                 "/rev1/config.json": raw(data[:-4])})
    with running(fake.server) as url:
        assert seed(url, tmp_path / "h" / "model") == 1
    err = capsys.readouterr().err
    assert f"s: weights: {url}/rev1/config.json: short body ({len(data) - 4} of {len(data)} bytes) (after 5 tries)" in err
    assert clock.sleeps == [2, 4, 6, 8]
    assert fake.paths().count("/rev1/config.json") == 5


def test_a_symlink_in_the_seed_folder_that_leads_out_fails_the_mirror_manifest(mirror, tmp_path, capsys):
    url, _ = mirror
    root = tmp_path / "h" / "model.revisions" / "rev1"
    root.mkdir(parents=True)
    (root / "sub").symlink_to(tmp_path, target_is_directory=True)
    assert seed(url, tmp_path / "h" / "model") == 1
    assert (f"s: weights: refusing the manifest from {url}/rev1/manifest.json: 'sub/tokenizer.json' would land at "
            f"{tmp_path}/tokenizer.json, outside {root} (through a symlink)") in capsys.readouterr().err
    assert sorted(os.listdir(root)) == ["sub"] and not (tmp_path / "tokenizer.json").exists()


def test_after_moving_a_source_that_does_not_answer_yet_gets_the_stall(tmp_path, capsys):
    stuck, dead = parent(published=[], complete=False), Fake()
    with running(dead.server) as seed_url:
        pass
    with running(stuck.server) as up:
        # The deadline is real time: 3 s leaves room for two 0.2 s stalls on a loaded machine (1 s did not:
        # a CI run timed out with the seed still waited for).
        assert peer(tmp_path / "c" / "model", up, seed_url, stall="0.2", timeout="3") == 1
    out = capsys.readouterr().out
    assert f"c: weights: {seed_url}: did not answer within 0.2s; copying from {up} (its parent) now" in out
    assert f"{seed_url}: failed" not in out


# --- the directory source (a host's warm-start caches, for the others) and install -----------------------


KEY = "5e" * 32  # a cache's revision: a hex key of what built it

CACHE = {
    ".cache/vllm/torch_compile_cache/ab12/rank_0_0/backbone/computation_graph.py": b"def f(x): return x\n",
    ".cache/vllm/modelinfos/glm.json": b'{"arch": "GlmMoeDsaForCausalLM"}\n',
    ".triton/cache/XYZ/_fwd_kernel.cubin": bytes(range(256)) * 20,
    ".triton/cache/XYZ/__grp___fwd_kernel.json": b"{}",
}
INCLUDES = (".cache/vllm", ".triton/cache", ".cache/flashinfer")  # flashinfer's: not built on this host


def home_of(d: Path, files: dict[str, bytes] = CACHE) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data)
    return d


def cache_seed(home: Path, path: Path, *more: str, includes: tuple = INCLUDES) -> int:
    argv = ["stage", "--role", "seed", "--source", "directory", "--from", str(home), "--revision", KEY, "--path",
            str(path), "--margin-gb", "0", "--name", "s"]
    for rel in includes:
        argv += ["--include", rel]
    return run(*argv, *more)


def cache_manifest(path: Path) -> dict:
    return json.loads((path.parent / f"{path.name}.revisions" / KEY / ".glm-manifest.json").read_text())


def entries(files: dict[str, bytes]) -> list[dict]:
    return sorted((entry(n, b) for n, b in files.items()), key=lambda e: e["path"])


def install(path: Path, into: Path) -> int:
    return run("install", "--revision", KEY, "--path", str(path), "--into", str(into))


def test_the_directory_source_and_install_on_the_command_line():
    a = w.cli.parser().parse_args(["stage", "--path", "/m"])
    assert (a.from_dir, a.include) == (None, [])
    a = w.cli.parser().parse_args(["stage", "--path", "/m", "--source", "directory", "--from", "/root", "--include",
                               ".cache/vllm", "--include", ".triton"])
    assert (a.source, a.from_dir, a.include) == ("directory", "/root", [".cache/vllm", ".triton"])
    a = w.cli.parser().parse_args(["install", "--revision", "r", "--path", "/m", "--into", "/root"])
    assert (a.cmd, a.revision, a.path, a.into) == ("install", "r", "/m", "/root")
    for bad in (["install", "--revision", "r", "--path", "/m"], ["install", "--path", "/m", "--into", "/d"],
                ["install", "--revision", "r", "--into", "/d"]):
        with pytest.raises(SystemExit):
            w.cli.parser().parse_args(bad)


def test_the_directory_seed_stages_the_regular_files_under_its_includes_at_their_paths(tmp_path, capsys):
    home = home_of(tmp_path / "home", {**CACHE, ".ssh/id_ed25519": b"secret\n", ".cache/other/x": b"x"})
    (home / ".cache/vllm/key").symlink_to(home / ".ssh/id_ed25519")
    (home / ".cache/vllm/to-ssh").symlink_to(home / ".ssh", target_is_directory=True)
    os.mkfifo(home / ".triton/cache/fifo")
    (home / ".triton/cache/XYZ/x.partial").write_bytes(b"cut")
    (home / ".cache/vllm/bad\nname").write_bytes(b"b")
    path = tmp_path / "h" / "warm"
    assert cache_seed(home, path) == 0
    out = capsys.readouterr().out
    root = tmp_path / "h" / "warm.revisions" / KEY
    assert cache_manifest(path) == {"revision": KEY, "files": entries(CACHE)}, "paths under --from, no commit"
    for name, data in CACHE.items():
        assert (path / name).read_bytes() == data
    copied = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and not p.name.startswith(".glm-")]
    assert sorted(copied) == sorted(CACHE), "nothing else: not the symlinks' targets, nor what is outside the includes"
    for line in (f"{home}: '.cache/vllm/key' skipped (a symlink, not followed)",
                 f"{home}: '.cache/vllm/to-ssh' skipped (a symlink, not followed)",
                 f"{home}: '.triton/cache/fifo' skipped (not a regular file)",
                 f"{home}: '.triton/cache/XYZ/x.partial' skipped (the name of a transfer in progress)",
                 f"{home}: '.cache/vllm/bad\\nname' skipped (a control character)",
                 f"{home / '.cache/flashinfer'}: not there, skipped",
                 "seed: 4 files from the directory source, 0 already here and verified"):
        assert f"s: weights: {line}\n" in out, out
    total = sum(len(d) for d in CACHE.values())
    assert (root / ".glm-complete").read_text() == f"4 files, {total} bytes\n"
    assert f"s: weights: {KEY}: 4 files, 0.00 GB verified at {path}" in out
    progress = json.loads((root / ".glm-progress.json").read_text())
    assert progress == {"revision": KEY, "files": entries(CACHE), "published": sorted(CACHE), "complete": True,
                        "received": total}
    assert os.readlink(path) == f"warm.revisions/{KEY}"


def test_without_an_include_the_whole_folder_is_staged_but_never_through_a_symlink_or_its_own_staging(tmp_path, capsys):
    home = home_of(tmp_path / "home")
    outside = home_of(tmp_path / "scratch", {"vllm/x": b"x"})
    (home / ".cache/link").symlink_to(outside / "vllm", target_is_directory=True)
    path = home / ".cache" / "glm" / "warm"  # the staging under the folder it reads
    assert cache_seed(home, path, includes=()) == 0
    assert cache_seed(home, path, includes=()) == 0  # again: its own copies are not read into it
    out = capsys.readouterr().out
    assert cache_manifest(path) == {"revision": KEY, "files": entries(CACHE)}
    assert f"s: weights: {home}: '.cache/link' skipped (a symlink, not followed)" in out
    assert f"s: weights: {home}: '.cache/glm/warm' skipped (a symlink, not followed)" in out
    assert "seed: 0 files from the directory source, 4 already here and verified" in out
    # An include reached through a symlink is not followed, one file can be an include, overlaps count once.
    other = tmp_path / "h" / "warm"
    cubin = ".triton/cache/XYZ/_fwd_kernel.cubin"
    assert cache_seed(home, other, includes=(".cache/link", ".cache/link/x", ".cache/vllm", ".cache/vllm/modelinfos",
                                             cubin)) == 0
    out = capsys.readouterr().out
    assert f"s: weights: {home}: '.cache/link' skipped (a symlink, not followed)" in out
    assert f"s: weights: {home}: '.cache/link/x' skipped (reached through a symlink, not followed)" in out
    assert cache_manifest(other)["files"] == entries({n: b for n, b in CACHE.items()
                                                      if n.startswith(".cache/vllm/") or n == cubin})
    assert "seed: 3 files from the directory source, 0 already here and verified" in out


def test_the_directory_seed_again_keeps_what_matches_and_stages_what_changed_anew(tmp_path, capsys, counted):
    home = home_of(tmp_path / "home")
    path = tmp_path / "h" / "warm"
    assert cache_seed(home, path) == 0
    capsys.readouterr()
    counted.clear()
    graph = ".cache/vllm/torch_compile_cache/ab12/rank_0_0/backbone/computation_graph.py"
    info = ".cache/vllm/modelinfos/glm.json"
    changed = {graph: b"def g(y): return y\n",  # the same size, other bytes
               info: b'{"arch": "GlmMoeDsaForCausalLM", "v": 2}\n', ".triton/cache/NEW/k.cubin": b"new"}
    assert len(changed[graph]) == len(CACHE[graph])
    home_of(home, changed)
    (home / ".triton/cache/XYZ/__grp___fwd_kernel.json").unlink()
    assert cache_seed(home, path) == 0
    out = capsys.readouterr().out
    now = {n: b for n, b in {**CACHE, **changed}.items() if n != ".triton/cache/XYZ/__grp___fwd_kernel.json"}
    assert cache_manifest(path) == {"revision": KEY, "files": entries(now)}, "made anew, with the new sha256s"
    for name, data in now.items():
        assert (path / name).read_bytes() == data
    assert "s: weights: seed: 3 files from the directory source, 1 already here and verified" in out
    assert counted == [], "what it copied was hashed on the way, what it kept came from the cache"
    progress = json.loads((path / ".glm-progress.json").read_text())
    assert progress["published"] == sorted(now), "a file gone from the source is not served"


def test_the_manifest_lists_the_bytes_copied_even_when_the_source_changes_meanwhile(tmp_path, capsys, monkeypatch):
    home = home_of(tmp_path / "home")
    name = ".cache/vllm/modelinfos/glm.json"
    real, inode = w.directory.copy_hashed, (home / name).stat().st_ino

    def rewritten_while_copied(src, dst, on_bytes=None, limit=None):
        got = real(src, dst, on_bytes, limit)
        if os.fstat(src.fileno()).st_ino == inode:  # (vLLM writes it again just as it was read)
            (home / name).write_bytes(b"written by vLLM meanwhile\n")
        return got

    monkeypatch.setattr(w.directory, "copy_hashed", rewritten_while_copied)
    path = tmp_path / "h" / "warm"
    assert cache_seed(home, path) == 0
    assert (path / name).read_bytes() == CACHE[name]
    assert entry(name, CACHE[name]) in cache_manifest(path)["files"]


def test_a_file_gone_between_listing_and_copying_is_skipped(tmp_path, capsys, monkeypatch):
    home = home_of(tmp_path / "home")
    name = ".triton/cache/XYZ/_fwd_kernel.cubin"
    real = w.directory.directory_files

    def listed_then_evicted(args):
        found = real(args)
        (home / name).unlink()
        return found

    monkeypatch.setattr(w.directory, "directory_files", listed_then_evicted)
    path = tmp_path / "h" / "warm"
    assert cache_seed(home, path) == 0
    out = capsys.readouterr().out
    assert f"s: weights: {home}: '{name}' skipped (cannot read it: No such file or directory)" in out
    assert cache_manifest(path)["files"] == entries({n: b for n, b in CACHE.items() if n != name})
    assert "seed: 3 files from the directory source" in out


def test_a_directory_source_with_nothing_to_stage_stages_an_empty_manifest(tmp_path, capsys):
    home = home_of(tmp_path / "home", {})
    path = tmp_path / "h" / "warm"
    assert cache_seed(home, path) == 0
    out = capsys.readouterr().out
    assert cache_manifest(path) == {"revision": KEY, "files": []}
    assert (path / ".glm-complete").read_text() == "0 files, 0 bytes\n"
    for rel in INCLUDES:
        assert f"s: weights: {home / rel}: not there, skipped" in out
    assert "s: weights: seed: 0 files from the directory source, 0 already here and verified" in out


@pytest.mark.parametrize(("more", "said"), [
    (["--role", "peer", "--peer", "http://127.0.0.1:9", "--from", "{home}"],
     "--source directory is the seed's (--role seed): a peer copies from its --peer hosts"),
    (["--include", ".cache/vllm"], "--source directory needs --from DIR: the folder whose files it stages"),
    (["--from", "{home}/none"], "--from {home}/none: not a directory"),
    (["--from", "{home}/.cache/vllm/modelinfos/glm.json"],
     "--from {home}/.cache/vllm/modelinfos/glm.json: not a directory"),
    (["--from", "{home}", "--include", "../etc"],
     "--include '../etc': a '..' component (it names a path under --from)"),
    (["--from", "{home}", "--include", "/etc"], "--include '/etc': an absolute path (it names a path under --from)"),
    (["--from", "{home}", "--include", ".cache/"],
     "--include '.cache/': an empty or '.' component (it names a path under --from)"),
], ids=["peer", "no-from", "from-missing", "from-a-file", "include-dotdot", "include-absolute", "include-slash"])
def test_the_directory_source_is_the_seeds_and_reads_the_folder_it_is_given(tmp_path, capsys, more, said):
    home = home_of(tmp_path / "home")
    argv = [a.format(home=home) for a in more]
    assert run("stage", "--source", "directory", "--revision", KEY, "--path", str(tmp_path / "m"), "--name", "s",
               *argv) == 1
    assert capsys.readouterr().err == f"s: weights: {said.format(home=home)}\n"
    assert not (tmp_path / "m.revisions").exists()


def copy_while(serve, bind: str, path: Path) -> None:
    """A peer "c" copies KEY into ``path`` from ``bind`` while ``serve`` (a seed or a relay) runs in a thread;
    both succeed."""
    rc: list[int] = []
    t = threading.Thread(target=lambda: rc.append(serve()))
    t.start()
    try:
        assert run("stage", "--role", "peer", "--peer", f"http://{bind}/", "--revision", KEY, "--path", str(path),
                   "--margin-gb", "0", "--name", "c", "--stall", "5", "--timeout", "30", "--relay-key-file",
                   KEYFILE) == 0
    finally:
        t.join(60)
    assert rc == [0]


@pytest.mark.parametrize("files", [CACHE, {}], ids=["cache", "empty"])
def test_a_directory_seed_serves_a_peer_that_verifies_every_file(tmp_path, capsys, files):
    home = home_of(tmp_path / "home", files)
    bind = f"127.0.0.1:{free_port()}"
    path = tmp_path / "c" / "warm"
    copy_while(lambda: cache_seed(home, tmp_path / "s" / "warm", "--serve", bind, "--children", "c", "--stall", "5",
                                  "--relay-key-file", KEYFILE),
               bind, path)
    out = capsys.readouterr().out
    assert cache_manifest(path) == cache_manifest(tmp_path / "s" / "warm") == {"revision": KEY, "files": entries(files)}
    for name, data in files.items():
        assert (path / name).read_bytes() == data
    copied = f"{len(files)} from http://{bind}" if files else "none"
    assert f"peer: {len(files)} files copied ({copied}), 0 already here and verified" in out
    assert f"relay on {bind} stopped: every host copying from here is done or left" in out
    assert (path / ".glm-complete").exists()
    assert run("verify", "--revision", KEY, "--path", str(path)) == 0


def test_a_staged_revision_is_relayed_by_a_process_of_its_own_until_its_children_are_done(tmp_path, capsys):
    """weights.py relay (the pool's first host's transient unit): a staged revision served as a relay parent
    serves it, every file published and the revision complete, until each child said it has every file."""
    seed = tmp_path / "s" / "warm"
    assert cache_seed(home_of(tmp_path / "home"), seed) == 0
    bind = f"127.0.0.1:{free_port()}"
    path = tmp_path / "c" / "warm"
    copy_while(lambda: run("relay", "--revision", KEY, "--path", str(seed), "--bind", bind, "--children", "c",
                           "--stall", "5", "--relay-key-file", KEYFILE), bind, path)
    assert cache_manifest(path) == cache_manifest(seed)
    out = capsys.readouterr().out
    assert f"serving {len(CACHE)} files on {bind} to c" in out
    assert f"relay on {bind} stopped: every host copying from here is done or left" in out


def test_a_relay_of_a_revision_not_staged_whole_or_of_a_child_that_never_came_ends(tmp_path, capsys):
    seed = tmp_path / "s" / "warm"
    bind = f"127.0.0.1:{free_port()}"
    assert run("relay", "--revision", KEY, "--path", str(seed), "--bind", bind, "--children", "c") == 1
    assert capsys.readouterr().err.endswith(": weights: relay needs --relay-key-file F (the stack's relay key): a "
                                            "relay is never served by its port alone\n")
    assert run("relay", "--revision", KEY, "--path", str(seed), "--bind", bind, "--children", "c",
               "--relay-key-file", KEYFILE) == 1
    assert f"{KEY} is not staged at {seed} (no .glm-complete): nothing to serve" in capsys.readouterr().err
    assert cache_seed(home_of(tmp_path / "home"), seed) == 0
    started = time.monotonic()
    assert run("relay", "--revision", KEY, "--path", str(seed), "--bind", bind, "--children", "c", "--stall", "1",
               "--relay-key-file", KEYFILE) == 0
    assert time.monotonic() - started < 10
    assert "c never came for 1s: not waiting for it any longer" in capsys.readouterr().out
    manifest = seed.parent / "warm.revisions" / KEY / ".glm-manifest.json"
    manifest.write_text("[")  # a staged revision whose manifest broke since: served by nobody, said so
    assert run("relay", "--revision", KEY, "--path", str(seed), "--bind", bind, "--children", "c",
               "--relay-key-file", KEYFILE) == 1
    assert f"{manifest}: unreadable" in capsys.readouterr().err


def staged_cache(tmp_path: Path) -> Path:
    path = tmp_path / "h" / "warm"
    assert cache_seed(home_of(tmp_path / "built"), path) == 0
    return path


def test_install_puts_what_is_missing_in_place_and_leaves_what_the_host_has(tmp_path, capsys):
    path = staged_cache(tmp_path)
    into = tmp_path / "home"
    own = ".cache/vllm/modelinfos/glm.json"
    home_of(into, {own: b"the host's own\n"})
    os.chmod(into / own, 0o600)
    capsys.readouterr()
    assert install(path, into) == 0
    out = capsys.readouterr().out
    size = sum(len(d) for n, d in CACHE.items() if n != own)
    assert out.endswith(f": weights: installed 3 files ({size} bytes) into {into}, 1 already there\n")
    assert out.count("\n") == 1
    for name, data in CACHE.items():
        if name != own:
            assert (into / name).read_bytes() == data
            assert stat_mode(into / name) == 0o644
    assert (into / own).read_bytes() == b"the host's own\n" and stat_mode(into / own) == 0o600
    assert not list(into.rglob(".glm-install-*")), "no temporary file left"
    before = {p: (p.stat().st_mtime_ns, p.stat().st_ino) for p in into.rglob("*")}
    assert install(path, into) == 0
    assert capsys.readouterr().out.endswith(f": weights: installed 0 files (0 bytes) into {into}, 4 already there\n")
    assert {p: (p.stat().st_mtime_ns, p.stat().st_ino) for p in into.rglob("*")} == before, "idempotent"


def stat_mode(p: Path) -> int:
    return p.stat().st_mode & 0o777


def test_install_refuses_a_revision_that_is_not_staged_whole(tmp_path, capsys):
    into = tmp_path / "home"
    path = tmp_path / "h" / "warm"
    said = f": weights: {KEY} is not staged at {path} (no .glm-complete): nothing installed\n"
    assert install(path, into) == 1
    assert capsys.readouterr().err.endswith(said)
    staged_cache(tmp_path)
    (tmp_path / "h" / "warm.revisions" / KEY / ".glm-complete").unlink()  # a staging cut short
    capsys.readouterr()
    assert install(path, into) == 1
    assert capsys.readouterr().err.endswith(said)
    assert not into.exists()


def test_install_refuses_a_manifest_that_would_write_outside_its_folder(tmp_path, capsys):
    path = staged_cache(tmp_path)
    manifest_path = tmp_path / "h" / "warm.revisions" / KEY / ".glm-manifest.json"
    good = json.loads(manifest_path.read_text())
    into = tmp_path / "home"
    into.mkdir()
    manifest_path.write_text(json.dumps({**good, "files": good["files"] + [{**good["files"][0], "path": "../escape"}]}))
    capsys.readouterr()
    assert install(path, into) == 1
    assert capsys.readouterr().err.endswith(f": weights: refusing the manifest from {manifest_path}: unsafe file name "
                                            f"'../escape' (a '..' component)\n")
    assert os.listdir(into) == [] and not (tmp_path / "escape").exists()
    manifest_path.write_text(json.dumps(good))
    outside = tmp_path / "outside"
    outside.mkdir()
    (into / ".triton").symlink_to(outside, target_is_directory=True)  # a link in the folder that leads out
    assert install(path, into) == 1
    err = capsys.readouterr().err
    real = os.path.realpath(outside / "cache" / "XYZ" / "__grp___fwd_kernel.json")
    assert err.endswith(f": weights: refusing the manifest from {manifest_path}: "
                        f"'.triton/cache/XYZ/__grp___fwd_kernel.json' would land at {real}, outside "
                        f"{os.path.realpath(into)} (through a symlink)\n"), err
    assert os.listdir(outside) == [] and os.listdir(into) == [".triton"], "nothing written before the check"


def test_install_takes_only_the_bytes_the_manifest_lists(tmp_path, capsys):
    path = staged_cache(tmp_path)
    name = ".triton/cache/XYZ/_fwd_kernel.cubin"
    blob = bytearray((path / name).read_bytes())
    blob[7] ^= 0xFF  # its disk went bad since it was staged: the same size, other bytes
    (path / name).write_bytes(bytes(blob))
    into = tmp_path / "home"
    capsys.readouterr()
    assert install(path, into) == 1
    src = f"{tmp_path}/h/warm.revisions/{KEY}/{name}"
    assert capsys.readouterr().err.endswith(f": weights: {src}: not the bytes its manifest lists (changed since it "
                                            f"was staged)\n")
    assert not (into / name).exists() and not list(into.rglob(".glm-install-*"))


# --- what the seed takes from a folder the services' user writes, and how install writes into it --------


def test_the_directory_seed_takes_only_the_kinds_asked_and_counts_the_rest(tmp_path, capsys):
    home = home_of(tmp_path / "home", {**CACHE, ".triton/cache/XYZ/__triton_launcher.so": b"\x7fELF",
                                       ".cache/vllm/modelinfos/loader.pyc": b"code"})
    path = tmp_path / "h" / "warm"
    assert cache_seed(home, path, "--kind", "*.json", "--kind", "*.cubin") == 0
    out = capsys.readouterr().out
    taken = {n: b for n, b in CACHE.items() if n.endswith((".json", ".cubin"))}
    assert cache_manifest(path)["files"] == entries(taken)
    assert (f"s: weights: {home}: 3 files of other kinds than *.json, *.cubin skipped "
            "('.cache/vllm/modelinfos/loader.pyc', '.cache/vllm/torch_compile_cache/ab12/rank_0_0/backbone/"
            "computation_graph.py', '.triton/cache/XYZ/__triton_launcher.so')\n") in out


@pytest.mark.parametrize(("n", "more"), [(3, ""), (4, " ..."), (5, " ...")])
def test_other_kinds_are_named_three_at_most(tmp_path, capsys, n, more):
    """The first three named, and " ..." past the third."""
    home = home_of(tmp_path / "home", {f".cache/vllm/{i}.so": b"x" for i in range(n)})
    assert cache_seed(home, tmp_path / "h" / "warm", "--kind", "*.json") == 0
    assert (f"{home}: {n} files of other kinds than *.json skipped ('.cache/vllm/0.so', '.cache/vllm/1.so', "
            f"'.cache/vllm/2.so'{more})\n") in capsys.readouterr().out


def test_a_file_of_exactly_the_bound_is_staged(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(w.directory, "MAX_DIRECTORY_FILE", 5120)
    home = home_of(tmp_path / "home")
    path = tmp_path / "h" / "warm"
    assert cache_seed(home, path) == 0
    big = ".triton/cache/XYZ/_fwd_kernel.cubin"
    assert (home / big).stat().st_size == 5120 and "skipped (5120 bytes" not in capsys.readouterr().out
    assert big in {e["path"] for e in cache_manifest(path)["files"]}


def test_a_file_larger_than_the_bound_is_not_staged(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(w.directory, "MAX_DIRECTORY_FILE", 100)
    home = home_of(tmp_path / "home")
    path = tmp_path / "h" / "warm"
    assert cache_seed(home, path) == 0
    big = ".triton/cache/XYZ/_fwd_kernel.cubin"
    assert f"s: weights: {home}: '{big}' skipped (5120 bytes, more than 100)\n" in capsys.readouterr().out
    assert big not in {e["path"] for e in cache_manifest(path)["files"]}


def test_a_file_that_grows_past_the_bound_while_copied_is_not_staged(tmp_path, capsys, monkeypatch):
    home = home_of(tmp_path / "home")
    name = ".cache/vllm/modelinfos/glm.json"
    real = w.directory.directory_files

    def listed_then_grown(args):
        found = real(args)
        (home / name).write_bytes(b"x" * 200)  # written again, larger, once listed
        return found

    monkeypatch.setattr(w.directory, "directory_files", listed_then_grown)
    monkeypatch.setattr(w.directory, "MAX_DIRECTORY_FILE", 150)
    path = tmp_path / "h" / "warm"
    assert cache_seed(home, path) == 0
    assert f"s: weights: {home}: '{name}' skipped (more than 150 bytes)\n" in capsys.readouterr().out
    assert name not in {e["path"] for e in cache_manifest(path)["files"]}
    assert not list((tmp_path / "h").rglob("*.partial"))


def test_a_folder_swapped_for_a_link_after_it_was_listed_is_never_read_through(tmp_path, capsys, monkeypatch):
    """The services' user owns the folder: between the listing and the copy it can put a link where a folder
    was. What is opened is opened beneath the folder, one component at a time: the link is not followed."""
    home = home_of(tmp_path / "home")
    secret_dir = tmp_path / "root-only"
    secret_dir.mkdir()
    (secret_dir / "_fwd_kernel.cubin").write_bytes(b"root's secret\n")
    (secret_dir / "__grp___fwd_kernel.json").write_bytes(b"root's secret\n")
    real = w.directory.directory_files

    def listed_then_swapped(args):
        found = real(args)
        shutil.rmtree(home / ".triton/cache/XYZ")
        (home / ".triton/cache/XYZ").symlink_to(secret_dir, target_is_directory=True)
        return found

    monkeypatch.setattr(w.directory, "directory_files", listed_then_swapped)
    path = tmp_path / "h" / "warm"
    assert cache_seed(home, path) == 0
    out = capsys.readouterr().out
    for name in (".triton/cache/XYZ/_fwd_kernel.cubin", ".triton/cache/XYZ/__grp___fwd_kernel.json"):
        assert f"s: weights: {home}: '{name}' skipped (cannot read it: " in out
    staged = path.parent / "warm.revisions" / KEY
    assert not any(b"root's secret" in p.read_bytes() for p in staged.rglob("*") if p.is_file())
    assert {e["path"] for e in cache_manifest(path)["files"]} == {n for n in CACHE if not n.startswith(".triton")}


def test_a_file_swapped_for_a_fifo_or_a_link_after_it_was_listed_is_skipped(tmp_path, capsys, monkeypatch):
    home = home_of(tmp_path / "home")
    real = w.directory.directory_files
    graph = ".cache/vllm/torch_compile_cache/ab12/rank_0_0/backbone/computation_graph.py"
    info = ".cache/vllm/modelinfos/glm.json"

    def listed_then_swapped(args):
        found = real(args)
        (home / graph).unlink()
        os.mkfifo(home / graph)  # opening it must not wait for a writer
        (home / info).unlink()
        (home / info).symlink_to("/etc/hostname")
        return found

    monkeypatch.setattr(w.directory, "directory_files", listed_then_swapped)
    path = tmp_path / "h" / "warm"
    assert cache_seed(home, path) == 0
    out = capsys.readouterr().out
    assert f"s: weights: {home}: '{graph}' skipped (cannot read it: no longer a regular file)\n" in out
    assert f"s: weights: {home}: '{info}' skipped (cannot read it: " in out
    assert {e["path"] for e in cache_manifest(path)["files"]} == {n for n in CACHE if n not in (graph, info)}


def test_install_gives_what_it_makes_to_the_owner_and_never_chowns_what_was_there(tmp_path, capsys):
    import pwd

    nobody = pwd.getpwnam("nobody")
    path = staged_cache(tmp_path)
    into = tmp_path / "home"
    home_of(into, {".triton/cache/OTHER/x.json": b"{}"})  # a folder of its own, left as it is
    capsys.readouterr()
    assert run("install", "--revision", KEY, "--path", str(path), "--into", str(into), "--owner", "nobody") == 0
    for name in CACHE:
        st = (into / name).stat()
        assert (st.st_uid, st.st_gid) == (nobody.pw_uid, nobody.pw_gid), name
    for made in (".cache", ".cache/vllm", ".triton/cache/XYZ"):
        assert (into / made).stat().st_uid == nobody.pw_uid, made
    assert (into / ".triton").stat().st_uid == 0 and (into / ".triton/cache/OTHER/x.json").stat().st_uid == 0
    assert run("install", "--revision", KEY, "--path", str(path), "--into", str(into), "--owner", "no-such-user") == 1
    assert capsys.readouterr().err.endswith(": weights: --owner no-such-user: no such user\n")


def test_install_never_writes_through_a_link_planted_after_its_check(tmp_path, capsys, monkeypatch):
    """The check of the manifest's paths comes first; the owner of the folder can plant a link after it. Each
    folder is opened without following a link: the install fails, nothing is written where the link leads."""
    path = staged_cache(tmp_path)
    into = tmp_path / "home"
    into.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    real = w.install.install_one

    def planted_once_checked(*a):
        if not (into / ".triton").is_symlink():  # every path was checked: the link comes now
            (into / ".triton").symlink_to(outside, target_is_directory=True)
        return real(*a)

    monkeypatch.setattr(w.install, "install_one", planted_once_checked)
    capsys.readouterr()
    assert install(path, into) == 1
    err = capsys.readouterr().err
    assert re.search(r": weights: cannot install \.triton/cache/XYZ/\S+ into \S+: (Too many levels of symbolic links|"
                     r"Not a directory)\n$", err), err
    assert os.listdir(outside) == [], "nothing written through the link"


def test_install_keeps_a_file_its_owner_made_meanwhile(tmp_path, capsys, monkeypatch):
    path = staged_cache(tmp_path)
    into = tmp_path / "home"
    name = ".cache/vllm/modelinfos/glm.json"
    real = w.directory.copy_hashed

    def raced(src, dst, on_bytes=None, limit=None):
        got = real(src, dst, on_bytes, limit)
        if os.path.basename(src.name) == "glm.json" and not (into / name).exists():
            (into / name).write_bytes(b"vLLM's own, written meanwhile\n")
        return got

    monkeypatch.setattr(w.install, "copy_hashed", raced)
    capsys.readouterr()
    assert install(path, into) == 0
    assert capsys.readouterr().out.endswith(f"installed 3 files ({sum(len(d) for n, d in CACHE.items() if n != name)} "
                                            f"bytes) into {into}, 1 already there\n")
    assert (into / name).read_bytes() == b"vLLM's own, written meanwhile\n", "what its owner built wins"
    assert not list(into.rglob(".glm-install-*"))


def test_install_refuses_a_manifest_entry_outside_its_includes_or_kinds(tmp_path, capsys):
    path = staged_cache(tmp_path)
    into = tmp_path / "home"
    manifest = tmp_path / "h" / "warm.revisions" / KEY / ".glm-manifest.json"
    capsys.readouterr()
    assert run("install", "--revision", KEY, "--path", str(path), "--into", str(into), "--include", ".triton/cache",
               "--kind", "*.cubin", "--kind", "*.json") == 1
    assert capsys.readouterr().err.endswith(
        f": weights: refusing the manifest from {manifest}: '.cache/vllm/modelinfos/glm.json' is not under "
        ".triton/cache or not of the kinds *.cubin, *.json\n")
    assert not into.exists(), "nothing written"
    assert run("install", "--revision", KEY, "--path", str(path), "--into", str(into), "--include", ".cache/vllm",
               "--include", ".triton/cache", "--kind", "*.cubin", "--kind", "*.json") == 1
    assert "'.cache/vllm/torch_compile_cache/ab12/rank_0_0/backbone/computation_graph.py' is not under " \
           ".cache/vllm, .triton/cache or not of the kinds *.cubin, *.json" in capsys.readouterr().err


@pytest.mark.parametrize(("name", "includes", "kinds", "taken"), [
    (".triton/cache/a/k.cubin", [], [], True),
    (".triton/cache/a/k.cubin", [".triton/cache"], ["*.cubin"], True),
    (".triton/cache/a/k.cubin", [".triton/cache/a/k.cubin"], [], True),
    (".triton/cachex/k.cubin", [".triton/cache"], [], False),
    (".triton/cache/a/k.so", [".triton/cache"], ["*.cubin", "*.json"], False),
    (".triton/cache/a/k.CUBIN", [], ["*.cubin"], False),
    ("x.cubin/k.so", [], ["*.cubin"], False),
])
def test_what_the_directory_source_takes(name, includes, kinds, taken):
    assert w.directory.wanted(name, includes, kinds) is taken


@pytest.mark.parametrize("abstract", [False, True])
def test_a_relay_tells_systemd_it_is_ready_once_it_listens(tmp_path, monkeypatch, abstract):
    """weights.py relay runs as a transient unit of Type=notify: its start (and the step) waits for READY=1."""
    import socket

    where = f"@glm-test-{os.getpid()}" if abstract else str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind("\0" + where[1:] if abstract else where)
        s.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", where)
        w.cli.notify_ready()
        assert s.recv(100) == b"READY=1"
    monkeypatch.delenv("NOTIFY_SOCKET")
    w.cli.notify_ready()  # not a unit of Type=notify: nothing to tell, no error


def test_the_relay_command_says_ready_only_once_it_listens(tmp_path, capsys, monkeypatch):
    seed = staged_cache(tmp_path)
    said: list[bool] = []
    real = w.relay.start_relay

    def started(*a):
        server = real(*a)
        said.append(False)
        return server

    monkeypatch.setattr(w.cli, "start_relay", started)
    monkeypatch.setattr(w.cli, "notify_ready", lambda: said.append(True))
    bind = f"127.0.0.1:{free_port()}"
    assert run("relay", "--revision", KEY, "--path", str(seed), "--bind", bind, "--children", "c", "--stall", "0.2",
               "--relay-key-file", KEYFILE) == 0
    assert said == [False, True]
    blocker = Fake()
    with running(blocker.server) as url:
        taken = url.removeprefix("http://")
        said.clear()
        assert run("relay", "--revision", KEY, "--path", str(seed), "--bind", taken, "--children", "c",
                   "--relay-key-file", KEYFILE) == 1
    assert said == [], "never ready: systemd fails the start, and the step"
    assert f"cannot serve the relay on {taken}: Address already in use (held by pid {os.getpid()}" in capsys.readouterr().err


# --- what the relay mutation run asked: the edges of what another host sends or asks -----------------------


def fake_proc(tmp_path: Path, tcp: list[str], tcp6: list[str], pids: dict[str, tuple[str, int, list[str]]]) -> Path:
    """A /proc of the test's own: its TCP tables' lines and, per pid, (comm, owner uid, the fds' links)."""
    proc = tmp_path / "proc"
    (proc / "net").mkdir(parents=True)
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    (proc / "net" / "tcp").write_text(header + "".join(line + "\n" for line in tcp))
    (proc / "net" / "tcp6").write_text(header + "".join(line + "\n" for line in tcp6))
    for pid, (comm, uid, links) in pids.items():
        (proc / pid / "fd").mkdir(parents=True)
        (proc / pid / "comm").write_text(comm + "\n")
        for i, link in enumerate(links):
            (proc / pid / "fd" / str(i)).symlink_to(link)
        os.chown(proc / pid, uid, 0)
    (proc / "self").mkdir()  # not a pid
    return proc


def tcp_line(address: str, port: int, state: str, inode: int) -> str:
    return f"   0: {address}:{port:04X} 00000000:0000 {state} 00000000:00000000 00:00000000 00000000     0        0 {inode}"


def test_who_holds_a_port_from_a_proc_of_the_tests_own(tmp_path):
    import pwd

    nobody = pwd.getpwnam("nobody").pw_uid
    proc = fake_proc(tmp_path, [tcp_line("0100007F", 8090, "0A", 111), tcp_line("0100007F", 8091, "01", 222),
                                "   1: short line"],
                     [tcp_line("00000000000000000000000001000000", 7090, "0A", 333)],
                     {"9": ("decoy", 0, ["socket:[999]", "/dev/null"]), "10": ("squatter", nobody, ["socket:[111]"]),
                      "100": ("other", 0, ["socket:[111]"]), "12": ("six", 4242424, ["socket:[333]"])})
    assert w.relay.port_holder(8090, str(proc)) == "pid 10 (squatter, user nobody)", "the lowest pid, by number"
    assert w.relay.port_holder(7090, str(proc)) == "pid 12 (six, user 4242424)", "IPv6, and a uid without a name"
    assert w.relay.port_holder(8091, str(proc)) is None, "connected, not listening"
    assert w.relay.port_holder(5555, str(proc)) is None
    (proc / "net" / "tcp6").unlink()  # one table gone: the other is read
    assert w.relay.port_holder(8090, str(proc)) == "pid 10 (squatter, user nobody)"
    shutil.rmtree(proc / "10")
    shutil.rmtree(proc / "100")
    assert w.relay.port_holder(8090, str(proc)) == "a socket of a process this host's /proc does not show"


def test_a_relay_that_cannot_bind_for_another_reason_names_no_holder(tmp_path):
    with pytest.raises(w.base.StageError) as e:
        w.relay.start_relay(keyed(), str(tmp_path), "192.0.2.1:0", 1)  # not an address of this host
    assert str(e.value) == "cannot serve the relay on 192.0.2.1:0: Cannot assign requested address"


def test_a_refusal_is_plain_text_of_its_length_and_logged_once_a_minute(relay_of, capsys, monkeypatch, clock):
    relay, url, _ = relay_of
    status, headers, body = get(f"{url}/.glm-progress.json")
    assert (status, headers["Content-Type"], headers["Content-Length"]) == (401, "text/plain", str(len(body)))
    assert body == f"unauthenticated relay client: no {w.signing.AUTH_HEADER} header of NAME TIME NONCE MAC\n".encode()
    now = [1000.0]
    monkeypatch.setattr(clock, "monotonic", lambda: now[0])
    relay.refused.clear()
    capsys.readouterr()
    for t in (1000.0, 1059.9, 1060.0, 1119.9, 1120.0):
        now[0] = t
        get(f"{url}/.glm-done")
    assert capsys.readouterr().out.count("refused a request from ::1") == 3, "at 1000, 1060 and 1120"


def test_a_client_header_of_other_spacing_or_at_the_edge_of_the_window(monkeypatch, clock):
    r = keyed()
    monkeypatch.setattr(clock, "time", lambda: 5000.0)
    h = signed(target="/a", at=5000)[w.signing.AUTH_HEADER]
    assert r.authenticate(h.replace(" ", "  ", 1), "/a") == (None, f"no {w.signing.AUTH_HEADER} header of NAME TIME NONCE MAC")
    assert r.authenticate(h.replace(" ", "\t", 1), "/a")[0] is None
    assert r.authenticate(signed(target="/a", at=5000 - w.signing.AUTH_WINDOW_S)[w.signing.AUTH_HEADER], "/a")[0] == "c1", "the edge"
    name, why = r.authenticate(signed(target="/a", at=5000 - w.signing.AUTH_WINDOW_S - 1)[w.signing.AUTH_HEADER], "/a")
    assert why == (f"signed at {5000 - w.signing.AUTH_WINDOW_S - 1}, {w.signing.AUTH_WINDOW_S + 1} s from this host's clock (more than "
                   f"{w.signing.AUTH_WINDOW_S} s: replayed, or the hosts' clocks differ)")


def test_a_401_from_a_source_is_named_in_its_words_cut_short(tmp_path):
    long = b"unauthenticated relay client: " + b"\xff" + b"x" * 400
    fake = Fake({"/f": (401, {}, long)})
    with running(fake.server) as url, pytest.raises(w.signing.Forged) as e:
        w.transfer.download(f"{url}/f", str(tmp_path / "f"), 3, follow=False, auth=AUTH)
    said = (long[:300].decode(errors="replace")).strip()
    assert str(e.value) == (f"{url}/f: HTTP 401: {said} (this host's relay key is not the one its source holds)")


@pytest.mark.parametrize(("name", "includes", "kinds", "taken"), [
    ("a/b/k.so", [], ["k.*"], True),
    ("k.so", [], ["k.*"], True),
    ("a b/k.so", [], ["k.*"], True),
])
def test_what_the_directory_source_takes_by_the_last_name(name, includes, kinds, taken):
    assert w.directory.wanted(name, includes, kinds) is taken


def test_copy_hashed_counts_every_chunk_against_its_limit(monkeypatch):
    import io

    monkeypatch.setattr(w.directory, "CHUNK", 4)
    out = io.BytesIO()
    assert w.directory.copy_hashed(io.BytesIO(b"x" * 10), out, limit=10) == (10, sha(b"x" * 10)), "exactly the limit"
    assert out.getvalue() == b"x" * 10
    with pytest.raises(w.base.StageError, match="more than 9 bytes"):
        w.directory.copy_hashed(io.BytesIO(b"x" * 10), io.BytesIO(), limit=9)
    got: list[int] = []
    w.directory.copy_hashed(io.BytesIO(b"y" * 9), io.BytesIO(), on_bytes=got.append)
    assert got == [4, 4, 1]


def test_the_directory_seed_writes_through_no_link_left_where_it_copies(tmp_path, capsys):
    home = home_of(tmp_path / "home")
    path = tmp_path / "h" / "warm"
    root = path.parent / "warm.revisions" / KEY
    name = ".cache/vllm/modelinfos/glm.json"
    victim = tmp_path / "victim"
    victim.write_text("root's\n")
    (root / name).parent.mkdir(parents=True)
    (root / (name + ".partial")).symlink_to(victim)  # a link planted where a cut copy would be: refused whole
    assert cache_seed(home, path) == 1
    assert capsys.readouterr().err.endswith(f"s: weights: refusing the manifest from {home}: {name!r} would land at "
                                            f"{victim}, outside {root} (through a symlink)\n")
    assert victim.read_text() == "root's\n"
    (root / (name + ".partial")).unlink()
    (root / (name + ".partial")).write_text("a cut copy")  # an earlier copy cut short
    old = os.umask(0)
    try:
        assert cache_seed(home, path) == 0
    finally:
        os.umask(old)
    assert not os.path.lexists(root / (name + ".partial")), "started over, renamed into place"
    assert (root / name).read_bytes() == CACHE[name] and stat_mode(root / name) == 0o644


def test_the_directory_seed_names_where_a_copy_fails_and_goes_on_after_a_file_it_skips(tmp_path, capsys, monkeypatch):
    home = home_of(tmp_path / "home", {**CACHE, ".cache/vllm/big.json": b"x" * 50})
    monkeypatch.setattr(w.directory, "MAX_DIRECTORY_FILE", 1 << 20)
    real = w.directory.copy_hashed

    def grows(src, dst, on_bytes=None, limit=None):
        if src.name and str(src.name).endswith("big.json") or os.fstat(src.fileno()).st_size == 50:
            raise w.base.StageError("more than 40 bytes")
        return real(src, dst, on_bytes, limit)

    monkeypatch.setattr(w.directory, "copy_hashed", grows)
    path = tmp_path / "h" / "warm"
    assert cache_seed(home, path) == 0
    assert f"s: weights: {home}: '.cache/vllm/big.json' skipped (more than 40 bytes)" in capsys.readouterr().out
    assert {e["path"] for e in cache_manifest(path)["files"]} == set(CACHE), "the files after it too"
    blocked = tmp_path / "h2" / "warm"
    (blocked.parent / "warm.revisions" / KEY).mkdir(parents=True)
    (blocked.parent / "warm.revisions" / KEY / ".cache").write_text("a file where a folder goes")
    monkeypatch.setattr(w.directory, "copy_hashed", real)
    assert cache_seed(home, blocked) == 1
    err = capsys.readouterr().err
    assert re.search(rf"s: weights: \.cache/\S+: cannot copy it from {home} into {blocked.parent}/warm.revisions/{KEY}: "
                     r"(Not a directory|File exists)", err), err


def test_a_folder_that_goes_or_cannot_be_opened_while_the_seed_walks_is_named(tmp_path, capsys, monkeypatch):
    home = home_of(tmp_path / "home")
    real_listdir, real_open = os.listdir, os.open

    def listdir(fd):
        names = real_listdir(fd)
        return [*names, "gone.json"] if "modelinfos" in names else names  # listed, gone before its stat

    def open_(name, flags, *a, **kw):
        if name == "XYZ":
            raise OSError(errno.ELOOP, "Too many levels of symbolic links")
        return real_open(name, flags, *a, **kw)

    import errno

    monkeypatch.setattr(os, "listdir", listdir)
    monkeypatch.setattr(os, "open", open_)
    path = tmp_path / "h" / "warm"
    assert cache_seed(home, path) == 0
    out = capsys.readouterr().out
    assert f"s: weights: {home}: '.cache/vllm/gone.json' skipped (No such file or directory)" in out
    assert f"s: weights: {home}: '.triton/cache/XYZ' skipped (cannot open it (Too many levels of symbolic links))" in out
    assert {e["path"] for e in cache_manifest(path)["files"]} == {n for n in CACHE if "XYZ" not in n}


def test_install_makes_its_folders_with_their_own_mode(tmp_path, capsys):
    path = staged_cache(tmp_path)
    into = tmp_path / "home"
    old = os.umask(0)
    try:
        assert install(path, into) == 0
    finally:
        os.umask(old)
    for folder in (".cache", ".cache/vllm", ".triton/cache/XYZ"):
        assert stat_mode(into / folder) == 0o755, folder
    assert stat_mode(into / ".triton/cache/XYZ/_fwd_kernel.cubin") == 0o644


def test_install_without_includes_or_kinds_says_so_when_it_refuses(tmp_path, capsys):
    path = staged_cache(tmp_path)
    manifest = tmp_path / "h" / "warm.revisions" / KEY / ".glm-manifest.json"
    good = json.loads(manifest.read_text())
    capsys.readouterr()
    assert run("install", "--revision", KEY, "--path", str(path), "--into", str(tmp_path / "i"), "--kind",
               "*.nothing") == 1
    assert capsys.readouterr().err.endswith(
        f": weights: refusing the manifest from {manifest}: {good['files'][0]['path']!r} is not under --into or not "
        "of the kinds *.nothing\n")
    assert run("install", "--revision", KEY, "--path", str(path), "--into", str(tmp_path / "i"), "--include",
               ".nothing") == 1
    assert "is not under .nothing or not of the kinds (any)\n" in capsys.readouterr().err


def test_the_relay_command_serves_the_commit_to_its_children_and_names_one_that_left(tmp_path, capsys):
    seed = staged_cache(tmp_path)
    manifest = tmp_path / "h" / "warm.revisions" / KEY / ".glm-manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "commit": HUB_COMMIT}))
    bind = f"127.0.0.1:{free_port()}"
    docs: list[dict] = []

    def child() -> None:
        for _ in range(100):
            with contextlib.suppress(Exception):
                status, _, body = sget(f"http://{bind}/.glm-progress.json", name="kid-a")
                if status == 200:
                    docs.append(json.loads(body))
                    return
            time.sleep(0.05)

    t = threading.Thread(target=child)
    t.start()
    rc = run("relay", "--revision", KEY, "--path", str(seed), "--bind", bind, "--children", "kid-a,kid-b",
             "--stall", "1", "--relay-key-file", KEYFILE, "--name", "seed-host")
    t.join()
    captured = capsys.readouterr()
    assert rc == 1 and docs and docs[0]["commit"] == HUB_COMMIT and docs[0]["complete"] is True
    assert f"seed-host: weights: {KEY}: serving 4 files on {bind} to kid-a, kid-b\n" in captured.out
    assert captured.err.endswith("seed-host: weights: kid-a stopped copying from this host before they had every file\n")
