#!/usr/bin/env python3
"""Stage a model checkpoint on a host: read once from the source on a seed host, relayed host to host
down a tree, verified everywhere, resumed after interruption, revisions switched atomically. Runs on
the hosts (stdlib only).

Layout under the model path P (what vLLM serves):
    P                          symlink → P.revisions/<revision>
    P.revisions/<revision>/    the checkpoint; ``.glm-manifest.json`` lists every file with size
                               and sha256, and the commit the revision resolved to where the source
                               says (the hub: always; a branch such as "main" moves, the commit does
                               not); ``.glm-complete`` exists once every file is verified
    P.revisions/.lock          held while a staging runs
    P.revisions/<revision>/.glm-hashes.json   digests by size, mtime, inode: what a staging again reads

    weights.py stage --role seed --source mirror --url URL --revision R --path P [RELAY] [COMMON]
    weights.py stage --role seed --source huggingface --repo ORG/NAME --revision R --path P
                     [--hf-python PY] [--token-file F] [RELAY] [COMMON]
    weights.py stage --role seed --source directory --from DIR [--include REL ...] --revision R --path P
                     [RELAY] [COMMON]
    weights.py stage --role peer --peer URL [--peer URL ...] --revision R --path P [RELAY] [COMMON]
        RELAY: --name HOST [--serve ADDR:PORT --children HOST,HOST] [--stall SECONDS] [--relay-key-file F]
        COMMON: [--margin-gb GB] [--timeout SECONDS]
    weights.py stage --source local --path P       (already on every host: verify only)
    weights.py serve --dir D --bind ADDR:PORT [--all]   (a static mirror: the simulated model source)
    weights.py verify --revision R --path P [--quick]   (sha256 of every file, or --quick sizes only;
                                                         exit 1 naming bad files)
    weights.py prune --revision R --path P         (remove every other revision)
    weights.py remove --path P                     (remove the checkpoint and its revisions)
    weights.py install --revision R --path P --into DIR   (copy each file of the staged revision that DIR
                                                           lacks to DIR/<its path>; exit 1 if not staged)
    weights.py relay --revision R --path P --bind ADDR:PORT --children HOST,HOST [--name HOST] [--stall SECONDS]
                     [--relay-key-file F]   (serve a staged revision to the relay children until each has
                                             every file or went silent; a process of its own, not a staging)

    --url            the mirror: files under URL/REVISION/, with URL/REVISION/manifest.json
    --hf-python      python of the venv with the hf CLI (default /opt/glm-infra/hf/bin/python)
    --token-file     EnvironmentFile with HF_TOKEN= (read by this program: never on a command line)
    --from           (directory) the folder whose regular files are staged, each at its path under it
    --include        (directory) a path under --from to stage, repeated (default: all of --from); one
                     that is not there is skipped
    --into           (install) the folder the files go to, each at its path in the manifest
    --peer           a host to copy from, repeated: the parent first, then each ancestor up to the seed
    --name           this host's name in the relay (default: its hostname)
    --serve          serve the verified files here while staging (hosts with --children, comma-separated)
    --stall          seconds without progress before a peer leaves the host it copies from (default 120)
    --relay-key-file EnvironmentFile with GLM_RELAY_KEY=: progress documents go out signed with it, with
                     the nonce of each request, and a peer takes only documents signed so
    --margin-gb      free disk to leave beside the checkpoint (default 10)
    --timeout        seconds a peer may take in all (default 86400)
    --all            (serve) every file, not only those the folder's progress file published

Every host publishes each file in ``.glm-progress.json`` only after verifying it; with ``--serve`` a
thread of the staging serves the published files (never a partial one) to the hosts that copy from
this one (``--children``) and the staging ends once each has said it has every file (``/.glm-done``)
or went silent for ``--stall`` seconds. A peer copies each file as soon as the first of its
``--peer`` hosts (its parent; then each ancestor up to the seed) has published it, verifies it
against the sha256 there, and moves to the next one when its source fails: refused or reset after
it answered, a short body, bad bytes, no progress for ``--stall`` seconds.

The directory source moves what one host built to the others (vLLM's warm-start caches under its
HOME: JIT, autotune and compile caches). The seed copies each regular file under the includes into
the revision directory, hashing the bytes it copies (a cache file may change while it is read), and
writes the manifest anew on every run (paths relative to --from, no commit); the relay carries it
like a checkpoint. ``install`` then puts each file at DIR/<path> on every host where DIR has none
there: a file the host has is left as it is (vLLM keys its caches itself).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import fcntl
import functools
import hashlib
import hmac
import http.client
import http.server
import json
import os
import re
import secrets
import shutil
import socket
import socketserver
import stat
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

MANIFEST = ".glm-manifest.json"
PROGRESS = ".glm-progress.json"
COMPLETE = ".glm-complete"
DONE = ".glm-done"  # a host that copied from this one GETs it once it has every file
CHUNK = 4 << 20
COMMIT_ID = re.compile(r"[0-9a-f]{40}")  # a git commit id, as the hub's ModelInfo.sha gives it
HASHES = ".glm-hashes.json"  # digests of the files here, by size, mtime, inode: a staging again reads what changed
MAX_JSON = 64 << 20  # a manifest or progress document from another host larger than this is refused
REVISION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")  # the stack's own rule (config.py): a folder name
SHA256 = re.compile(r"[0-9a-f]{64}")
GIT_BLOB = re.compile(r"[0-9a-f]{40}")
HOST = os.uname().nodename


def log(msg: str) -> None:
    print(f"{HOST}: weights: {msg}", flush=True)


class StageError(Exception):
    pass


class NotThere(StageError):
    """The server has no such file (yet): a seed that is re-verifying withdraws what it re-checks."""


# --- files ---------------------------------------------------------------------------------------


def hashed(path: str, h: "hashlib._Hash") -> "hashlib._Hash":
    """``h`` updated with the bytes of the file, read CHUNK by CHUNK (never a whole file in memory)."""
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h


def sha256_file(path: str) -> str:
    return hashed(path, hashlib.sha256()).hexdigest()


def git_blob_sha1(path: str) -> str:
    return hashed(path, hashlib.sha1(f"blob {os.path.getsize(path)}\0".encode())).hexdigest()


HASHERS = {"sha256": sha256_file, "git-blob": git_blob_sha1}


def write_json(path: str, data: object) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def revisions_dir(path: str) -> str:
    return path.rstrip("/") + ".revisions"


def revision_dir(path: str, revision: str) -> str:
    return os.path.join(revisions_dir(path), revision)


def name_problem(name: object) -> str | None:
    """Why ``name`` cannot be a file of the revision directory, or None. Only a plain relative name in
    canonical form passes: nothing that reaches outside the directory, names one file two ways, or
    takes the name of glm-infra's own files or of a transfer in progress."""
    if not isinstance(name, str) or not name:
        return "not a file name"
    if "\0" in name:
        return "a NUL byte"
    if "\\" in name:
        return "a backslash"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "a control character"
    if name.startswith("/"):
        return "an absolute path"
    parts = name.split("/")
    if ".." in parts:
        return "a '..' component"
    if "" in parts or "." in parts:
        return "an empty or '.' component"
    if parts[0].startswith(".glm-"):
        return "glm-infra's own file"
    if name.endswith(".partial"):
        return "the name of a transfer in progress"
    try:
        longest = max(len(p.encode()) for p in parts)
    except UnicodeEncodeError:
        return "not UTF-8"
    if longest > 255:
        return "a component longer than 255 bytes"
    return None


def safe_name(name: object, origin: str = "the manifest") -> str:
    """A file name that came from another host (the mirror's or the hub's listing, a relay parent's
    manifest), or StageError naming where it came from."""
    problem = name_problem(name)
    if problem:
        raise StageError(f"refusing the manifest from {origin}: unsafe file name {name!r} ({problem})")
    return name  # type: ignore[return-value]


def inside(root: str, name: str, origin: str = "the manifest") -> str:
    """root/name, where the bytes of ``name`` land — refused when a symlink on the way (or the file, or
    its transfer file) leads outside root."""
    p = os.path.join(root, name)
    top = os.path.realpath(root)
    for q in (p, p + ".partial"):
        real = os.path.realpath(q)
        if os.path.commonpath([top, real]) != top:
            raise StageError(f"refusing the manifest from {origin}: {name!r} would land at {real}, outside "
                             f"{top} (through a symlink)")
    return p


def manifest_files(files: object, origin: str, blobs: bool = False) -> list[dict]:
    """The entries of a manifest from another host, each checked — a safe name (once), a byte count, a
    sha256 (or, ``blobs``: from the hub, a small file's git blob id instead) — sorted by path; a
    StageError naming ``origin`` and the entry otherwise. Nothing is written before this passed."""
    if not isinstance(files, list):
        raise StageError(f"refusing the manifest from {origin}: no list of files")
    out: dict[str, dict] = {}
    for e in files:
        if not isinstance(e, dict):
            raise StageError(f"refusing the manifest from {origin}: an entry is not an object: {e!r}")
        name = safe_name(e.get("path"), origin)
        size, sha = e.get("size"), e.get("sha256")
        if type(size) is not int or size < 0:
            raise StageError(f"refusing the manifest from {origin}: {name}: size {size!r} is not a byte count")
        entry = {"path": name, "size": size, "sha256": sha}
        if blobs and sha is None:
            entry["git_blob"] = blob = e.get("git_blob")
            if not (isinstance(blob, str) and GIT_BLOB.fullmatch(blob)):
                raise StageError(f"refusing the manifest from {origin}: {name}: neither a sha256 nor a git blob id")
        elif not (isinstance(sha, str) and SHA256.fullmatch(sha)):
            raise StageError(f"refusing the manifest from {origin}: {name}: sha256 {sha!r} is not a sha256")
        if name in out:
            raise StageError(f"refusing the manifest from {origin}: {name} is listed twice")
        out[name] = entry
    folders = {"/".join(n.split("/")[:i]) for n in out for i in range(1, n.count("/") + 1)}
    clash = sorted(folders & set(out))
    if clash:
        raise StageError(f"refusing the manifest from {origin}: {clash[0]} is a file and a folder of another")
    return [out[n] for n in sorted(out)]


def index_shards(root: str) -> set[str]:
    """Shards named by model.safetensors.index.json (the weight_map values)."""
    index = os.path.join(root, "model.safetensors.index.json")
    if not os.path.exists(index):
        return set()
    weight_map = read_json(index).get("weight_map", {})
    return {v for v in weight_map.values() if isinstance(v, str)} if isinstance(weight_map, dict) else set()


class Hashes:
    """The digests of the files under ``root``. With a ``cache`` file, a digest is remembered by what
    changes whenever a file is written or replaced — its size, mtime (ns), inode and device — so a
    staging again reads only what changed since; without one (``verify``) every file is read."""

    def __init__(self, root: str, cache: str | None = None) -> None:
        self.root, self.cache = root, cache
        self.lock = threading.Lock()
        self.known: dict[str, dict] = {}
        self.changed = False
        if cache:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                known = read_json(cache)  # only ever what this host hashed; unreadable: hash again
                self.known = {k: v for k, v in known.items() if isinstance(v, dict) and isinstance(v.get("digest"), str)}

    @staticmethod
    def stamp(st: os.stat_result) -> list[int]:
        return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev]

    def digest(self, name: str, algo: str = "sha256") -> str:
        p = os.path.join(self.root, name)
        key = f"{algo}:{name}"
        before = os.stat(p)
        hit = self.known.get(key)
        if self.cache and hit and hit.get("stat") == self.stamp(before):
            return hit["digest"]
        value = HASHERS[algo](p)
        if self.cache and self.stamp(os.stat(p)) == self.stamp(before):  # not written while it was read
            self.remember(name, value, algo)
        return value

    def remember(self, name: str, value: str, algo: str = "sha256") -> None:
        """The digest of a file this host just wrote (hashed on the way in)."""
        if self.cache:
            with self.lock:
                self.known[f"{algo}:{name}"] = {"stat": self.stamp(os.stat(os.path.join(self.root, name))),
                                                "digest": value}
                self.changed = True

    def save(self) -> None:
        with self.lock:
            if self.cache and self.changed:
                write_json(self.cache, self.known)
                self.changed = False

    def ok(self, e: dict, full: bool = True) -> bool:
        """The file is there with its size and (full) its sha256 — or, for a hub file kept in git whose
        sha256 is not known yet, its git blob id."""
        try:
            st = os.stat(os.path.join(self.root, e["path"]))
        except OSError:
            return False
        if not stat.S_ISREG(st.st_mode) or st.st_size != e["size"]:
            return False
        if not full:
            return True
        if e.get("git_blob"):
            return self.digest(e["path"], "git-blob") == e["git_blob"]
        return self.digest(e["path"]) == e["sha256"]


def check_files(root: str, manifest: dict, full: bool, hashes: Hashes | None = None) -> list[str]:
    """Names of files that are missing, of the wrong size or (full) of the wrong sha256."""
    hashes = hashes or Hashes(root)

    def one(entry: dict) -> str | None:
        return None if hashes.ok(entry, full) else entry["path"]

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 2)) as ex:
        bad = [b for b in ex.map(one, manifest["files"]) if b]
    unlisted = index_shards(root) - {e["path"] for e in manifest["files"]}
    return sorted(bad) + sorted(f"{s} (in the index, not in the manifest)" for s in unlisted)


# --- transfers -----------------------------------------------------------------------------------


class SourceFailed(StageError):
    """The host copied from failed: refused, reset, a short body, a stalled transfer."""


class _Redirects(urllib.request.HTTPRedirectHandler):
    """A mirror may redirect, to http(s) only; a relay host never does, so one that does is refused
    (its target would be another host's choice of where this host connects)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001 (urllib's API)
        if not req.follow:
            raise SourceFailed(f"{req.full_url}: HTTP {code} to {newurl!r} (a relay host never redirects)")
        if urllib.parse.urlsplit(newurl).scheme not in ("http", "https"):
            raise SourceFailed(f"{req.full_url}: HTTP {code} to {newurl!r} (not http or https)")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


OPENER = urllib.request.build_opener(_Redirects)


def open_url(url: str, timeout: float, headers: dict[str, str] | None = None, follow: bool = False):  # noqa: ANN201
    req = urllib.request.Request(url, headers=headers or {})
    req.follow = follow  # type: ignore[attr-defined]
    return OPENER.open(req, timeout=timeout)


def check_range(url: str, header: str | None, start: int, size: int | None) -> None:
    """A 206 must carry the bytes asked for: from ``start`` to the end of the file the manifest describes."""
    m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", str(header).strip(), re.ASCII)
    if not m or int(m[1]) != start or (size is not None and (int(m[2]) != size - 1 or m[3] != str(size))):
        raise SourceFailed(f"{url}: Content-Range {header!r} for bytes {start}-"
                           f"{'' if size is None else size - 1} (of {size if size is not None else '?'})")


def download(url: str, dest: str, size: int | None, timeout: float = 60, on_bytes=None, follow: bool = True) -> str:
    """One attempt at url → dest, resuming dest.partial with a Range request; streamed through a CHUNK
    buffer (never a whole file in memory) and hashed on the way. Returns the sha256 of dest. The
    headers that answer are checked against what was asked (status, Content-Range, Content-Length),
    and no more bytes are taken than the manifest's size (``size`` None: MAX_JSON)."""
    partial = dest + ".partial"
    if os.path.islink(partial):  # a transfer file is written here, never through a link
        os.remove(partial)
    have = os.path.getsize(partial) if os.path.exists(partial) else 0
    if size is not None and have > size:
        os.remove(partial)
        have = 0
    limit = MAX_JSON if size is None else size
    h = hashed(partial, hashlib.sha256()) if have else hashlib.sha256()
    too_long = False
    try:
        with open_url(url, timeout, {"Range": f"bytes={have}-"} if have else {}, follow) as resp:
            if resp.status == 206 and have:
                check_range(url, resp.headers.get("Content-Range"), have, size)
            elif resp.status == 200:  # the whole file (again): start over
                h, have = hashlib.sha256(), 0
            else:
                raise SourceFailed(f"{url}: HTTP {resp.status} for a request of bytes {have}-")
            length = resp.headers.get("Content-Length")
            if size is not None and length is not None and length.strip() != str(size - have):
                raise SourceFailed(f"{url}: Content-Length {length!r}, not the {size - have} bytes left of {size}")
            buf = memoryview(bytearray(CHUNK))  # one bounded buffer for the whole file
            flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if have else os.O_TRUNC)
            got = have
            with open(os.open(partial, flags, 0o644), "wb") as f:
                while n := resp.readinto(buf):
                    got += n
                    if got > limit:
                        too_long = True
                        break
                    f.write(buf[:n])
                    h.update(buf[:n])
                    if on_bytes:
                        on_bytes(n)
    except urllib.error.HTTPError as e:
        if e.code == 416 and size is not None and have == size:
            pass  # the partial file is already whole (interrupted before its rename)
        elif e.code == 416:
            os.remove(partial)
            raise SourceFailed(f"{url}: HTTP 416 for bytes {have}- (partial file dropped)") from None
        elif e.code == 404:
            raise NotThere(f"{url}: HTTP 404") from None
        elif e.code in (401, 403):
            raise StageError(f"{url}: HTTP {e.code}") from None
        else:
            raise SourceFailed(f"{url}: HTTP {e.code}") from None
    except (urllib.error.URLError, OSError, TimeoutError, http.client.HTTPException) as e:
        raise SourceFailed(f"{url}: {getattr(e, 'reason', None) or e}") from None
    if too_long:
        os.remove(partial)
        raise SourceFailed(f"{url}: more than {limit} bytes (partial file dropped)")
    got = os.path.getsize(partial)
    if size is not None and got != size:
        raise SourceFailed(f"{url}: short body ({got} of {size} bytes)")
    os.replace(partial, dest)
    return h.hexdigest()


def fetch(url: str, dest: str, size: int | None, tries: int = 5, on_bytes=None) -> str:
    """download() with retries against one source (the mirror): resumes where the last try stopped."""
    attempt = 1
    while True:
        try:
            return download(url, dest, size, on_bytes=on_bytes)
        except SourceFailed as e:
            if attempt >= tries:
                raise StageError(f"{e} (after {tries} tries)") from None
        time.sleep(min(2 * attempt, 10))
        attempt += 1


def fetch_verified(url: str, hashes: Hashes, entry: dict, on_bytes=None) -> None:
    p = inside(hashes.root, entry["path"])
    os.makedirs(os.path.dirname(p), exist_ok=True)
    for _ in range(2):
        sha = fetch(url, p, entry["size"], on_bytes=on_bytes)
        if sha == entry["sha256"]:
            hashes.remember(entry["path"], sha)
            return
        os.remove(p)
        log(f"{entry['path']}: sha256 mismatch after download, fetching again")
    raise StageError(f"{entry['path']}: sha256 mismatch twice from {url}")


# --- what a host serves while it stages: its verified files, to the hosts that copy from it ---------


MAC_HEADER = "X-Glm-Relay-Mac"


def sign(key: bytes, nonce: str, body: bytes) -> str:
    """HMAC-SHA256, with the stack's relay key, of a progress document and the nonce of the request it
    answers: a peer holding the key takes no manifest from a host without it, nor an old one replayed."""
    return hmac.new(key, nonce.encode() + b"\n" + body, hashlib.sha256).hexdigest()


def relay_key(path: str) -> bytes:
    """The stack's relay key from its 0600 file (GLM_RELAY_KEY=, like the HF token: never in argv)."""
    key = env_value(path, "GLM_RELAY_KEY")
    if key is None or len(key) < 32:
        raise StageError(f"{path}: no GLM_RELAY_KEY of at least 32 characters")
    return key.encode()


class Relay:
    """The published state of this host (shared by the staging and its server thread) and who copies
    from it. Only files this host verified are ever listed or served."""

    def __init__(self, revision: str, name: str) -> None:
        self.lock = threading.Lock()
        self.revision, self.name = revision, name
        self.commit: str | None = None  # what the revision resolved to at the source, where known
        self.files: list[dict] = []
        self.published: list[str] = []
        self.complete = False
        self.received = 0  # bytes written so far: a host that is still receiving is not stalled
        self.clients: dict[str, dict] = {}  # host → {"last": monotonic, "active": transfers, "done": bool}
        self.progress_path: str | None = None
        self.key: bytes | None = None  # the stack's relay key: the progress document goes out signed

    def adopt(self, files: list[dict]) -> list[str]:
        """List ``files`` (the manifest being staged) from now on: a published file whose entry they
        change or drop is withdrawn until verified again here. Returns the names withdrawn."""
        with self.lock:
            new = {e["path"]: e for e in files}
            old = {e["path"]: e for e in self.files}
            gone = [n for n in self.published if new.get(n) != old.get(n)]
            self.files = list(files)
            self.published = [n for n in self.published if n not in gone]
        self.publish()
        return gone

    def publish(self, name: str = "", complete: bool = False) -> None:
        with self.lock:
            if name and name not in self.published:
                self.published.append(name)
            self.complete = self.complete or complete
            doc = self.snapshot()
        if self.progress_path:
            write_json(self.progress_path, doc)

    def snapshot(self) -> dict:
        return {"revision": self.revision, **({"commit": self.commit} if self.commit else {}), "files": self.files,
                "published": list(self.published), "complete": self.complete, "received": self.received}

    def got(self, n: int) -> None:
        with self.lock:
            self.received += n

    def seen(self, client: str, active: int = 0, done: bool = False) -> None:
        with self.lock:
            c = self.clients.setdefault(client, {"active": 0, "done": False})
            c["last"] = time.monotonic()
            c["active"] += active
            c["done"] = c["done"] or done


class _Files(http.server.SimpleHTTPRequestHandler):
    """Static files with single-range requests (resumed transfers) and no directory listings.
    With ``published_only`` it serves just the progress file and the files listed there as published."""

    published_only = True
    relay: Relay | None = None  # the staging's own server: its state in memory, clients tracked

    def do_GET(self) -> None:  # noqa: N802 (http.server API)
        url = urllib.parse.urlparse(self.path)
        name = urllib.parse.unquote(url.path).lstrip("/")
        query = urllib.parse.parse_qs(url.query)
        client = query.get("host", [""])[0]
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,252}", client):
            client = self.client_address[0]  # a name this host logs and keeps: only a plain one
        relay = self.relay
        if relay is not None:
            relay.seen(client, done=name == DONE)
            if name == DONE:
                return self._send(b"ok\n", "text/plain")
            with relay.lock:
                doc, published = relay.snapshot(), set(relay.published)
            if name == PROGRESS:
                body = json.dumps(doc).encode()
                mac = {MAC_HEADER: sign(relay.key, query.get("nonce", [""])[0], body)} if relay.key else {}
                return self._send(body, "application/json", mac)
        elif self.published_only and name != PROGRESS:
            try:
                published = set(read_json(os.path.join(self.directory, PROGRESS))["published"])
            except (OSError, ValueError, KeyError):
                published = set()
        else:
            published = None
        if published is not None and name not in published:
            self.send_error(404, "not published")
            return
        path = self.translate_path(url.path)
        if not os.path.isfile(path):
            self.send_error(404)
            return
        size = os.path.getsize(path)
        start = 0
        if m := re.fullmatch(r"bytes=([0-9]+)-", self.headers.get("Range", "")):
            start = int(m[1])
            if start >= size:
                self.send_error(416)
                return
        if relay is not None:
            relay.seen(client, active=1)
        try:
            with open(path, "rb") as f:
                self.send_response(206 if start else 200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(size - start))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
                self.end_headers()
                # Zero-copy from the page cache to the socket: the CPU goes to hashing, not copying.
                self.connection.sendfile(f, start)
        finally:
            if relay is not None:
                relay.seen(client, active=-1)

    def _send(self, body: bytes, kind: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(200)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt: str, *a) -> None:
        if not self.published_only:  # the mirror stand-in logs what it served
            super().log_message(fmt, *a)


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class _Server6(_Server):
    address_family = socket.AF_INET6


def files_server(directory: str, bind: str, **handler: object) -> _Server:
    """A server of ``directory`` on ADDR:PORT ([v6]:PORT), its handler _Files with ``handler`` set."""
    host, _, port = bind.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    return (_Server6 if ":" in host else _Server)(
        (host, int(port)), functools.partial(type(_Files.__name__, (_Files,), handler), directory=directory))


def start_relay(relay: Relay, root: str, bind: str, stall: float) -> _Server:
    """Serve this host's verified files from a thread of the staging itself: nothing outlives the step.
    A client that sends nothing (or stops reading) for ``stall`` seconds is dropped."""
    try:
        server = files_server(root, bind, relay=relay, timeout=stall)
    except OSError as e:
        raise StageError(f"cannot serve the relay on {bind}: {e.strerror or e}") from None
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def wait_for_children(relay: Relay, children: list[str], stall: float) -> list[str]:
    """Keep serving until every host that copies from here has everything: each says so (/.glm-done,
    also when it moves to another host). One that made no request for ``stall`` seconds (or never
    came within ``stall`` seconds of this host finishing: not deployed with it) is left behind with a
    log line (one that comes back is served again). Returns those that came and stopped before they
    had every file."""
    since = time.monotonic()
    told = 0.0
    gone: set[str] = set()
    while True:
        now = time.monotonic()
        with relay.lock:
            clients = {k: dict(v) for k, v in relay.clients.items()}
        waiting = []
        for c in sorted(set(children) | set(clients)):
            info = clients.get(c)
            if info and info["done"]:
                continue
            if (info and info["active"] > 0) or now - max(info["last"] if info else since, since) < stall:
                waiting.append(c)
            elif c not in gone:
                gone.add(c)
                log(f"{c} {'made no request' if info else 'never came'} for {stall:g}s: not waiting for it any longer")
        if not waiting:
            return sorted(c for c in gone if c in clients and not clients[c]["done"])
        if now - told >= 30:
            log(f"serving {', '.join(waiting)} until they have every file")
            told = now
        time.sleep(0.2)


# --- the seed ------------------------------------------------------------------------------------


def mirror_url(args: argparse.Namespace, name: str) -> str:
    """A file of the revision at the mirror: URL/REVISION/NAME."""
    return f"{args.url.removesuffix('/')}/{args.revision}/{urllib.parse.quote(name)}"


def source_manifest(args: argparse.Namespace, root: str) -> dict:
    """Files of the checkpoint with sizes and sha256, from the source, checked like a relay parent's
    (the source is another host too). From the hub, a small file kept in git (not LFS) has no sha256
    yet, only its git blob id: the seed hashes it once downloaded."""
    if args.source == "mirror":
        url = mirror_url(args, "manifest.json")
        tmp = os.path.join(root, ".glm-source-manifest.json")
        fetch(url, tmp, None)
        try:
            m = read_json(tmp)
        except ValueError:
            raise StageError(f"{url}: not a JSON manifest") from None
        finally:
            os.remove(tmp)
        files = manifest_files(m.get("files") if isinstance(m, dict) else None, url)
        # A mirror serves a revision as it was staged there; its manifest may name the commit.
        commit = m.get("commit")
        if commit is not None and not (isinstance(commit, str) and COMMIT_ID.fullmatch(commit)):
            raise StageError(f"refusing the manifest from {url}: 'commit' {commit!r} is not a commit id")
        commit = commit or (args.revision if COMMIT_ID.fullmatch(args.revision) else None)
    else:  # huggingface: the hub knows every file's size and LFS sha256 (or git blob id)
        url = f"{args.repo}@{args.revision}"
        listed, commit = hf_manifest(args)
        files = manifest_files(listed, url, blobs=True)
    for e in files:
        inside(root, e["path"], url)
    return {"revision": args.revision, **({"commit": commit} if commit else {}), "files": files}


def hf_manifest(args: argparse.Namespace) -> tuple[list, str]:
    """The hub's files of REPO@REVISION and the commit the revision resolves to (ModelInfo.sha): the
    files are downloaded from that commit, so a branch that moves meanwhile changes nothing staged."""
    code = (
        "import json,sys;from huggingface_hub import HfApi;"
        "i=HfApi().model_info(sys.argv[1],revision=sys.argv[2],files_metadata=True);"
        "print(json.dumps({'commit':i.sha,'files':[{'path':s.rfilename,'size':s.size,'blob':s.blob_id,"
        "'sha256':(s.lfs.sha256 if s.lfs else None)} for s in i.siblings]}))"
    )
    out = subprocess.run([args.hf_python, "-c", code, args.repo, args.revision], capture_output=True, text=True,
                         env=hf_env(args))
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines() or ["(no output)"]
        # The exception line ("GatedRepoError: 401 Client Error.") and the hub's own last words.
        raised = [l for l in lines if re.match(r"^[\w.]+(Error|Exception): ", l)]
        error = re.sub(r"^[\w.]*\.", "", raised[-1]) if raised else ""
        said = "" if raised and lines[-1] == raised[-1] else lines[-1]
        raise StageError(f"cannot list {args.repo}@{args.revision}: {' '.join(filter(None, [error, said]))}")
    try:
        doc = json.loads(out.stdout)
    except ValueError:
        doc = None
    listed = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(listed, list):
        raise StageError(f"cannot list {args.repo}@{args.revision}: the hub client printed no list of files")
    commit = doc.get("commit")
    if not (isinstance(commit, str) and COMMIT_ID.fullmatch(commit)):
        raise StageError(f"cannot list {args.repo}@{args.revision}: the hub named no commit it resolves to "
                         f"(got {commit!r})")
    # Every file the hub lists, in the manifest's form: one without a size or a digest fails the check.
    return [{"path": f.get("path"), "size": f.get("size"), "sha256": f.get("sha256"), "git_blob": f.get("blob")}
            if isinstance(f, dict) else f for f in listed], commit


def env_value(path: str, var: str) -> str | None:
    """VAR's value in an EnvironmentFile of VAR=value lines (None when it sets none); StageError naming
    the file when it cannot be read: a secret file that is not there is a failure, never "no secret"."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise StageError(f"cannot read {path}: {e.strerror or e}") from None
    for line in lines:
        k, _, v = line.strip().partition("=")
        if k == var and v:
            return v
    return None


def hf_env(args: argparse.Namespace) -> dict[str, str]:
    """The hub client's environment: the token from its file (never on a command line)."""
    env = dict(os.environ)
    if args.token_file and (token := env_value(args.token_file, "HF_TOKEN")):
        env["HF_TOKEN"] = token
    return env


def _tree_bytes(root: str) -> int:
    total = 0
    for d, _, names in os.walk(root):
        for n in names:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(d, n))
    return total


HF_BATCH = 8  # files per `hf download`: its parallel workers, and how often the seed publishes


def hf_download(args: argparse.Namespace, root: str, entries: list[dict]) -> None:
    """`hf download` of these files into the revision directory (it resumes an interrupted file), then
    check each. A file that failed its check is deleted with the hub client's record of it first:
    otherwise the client trusts its record and keeps the bad bytes."""
    for e in entries:
        for stale in (os.path.join(root, e["path"]),
                      os.path.join(root, ".cache", "huggingface", "download", e["path"] + ".metadata")):
            with contextlib.suppress(FileNotFoundError):
                os.remove(stale)
    hf = os.path.join(os.path.dirname(args.hf_python), "hf")
    p = subprocess.Popen([hf, "download", args.repo, *[e["path"] for e in entries], "--revision", args.commit,
                          "--local-dir", root], env=hf_env(args), stdout=subprocess.DEVNULL)
    seen = _tree_bytes(root)
    while True:  # what the hub client wrote so far: the hosts copying from here see progress
        ended = p.poll() is not None
        now = _tree_bytes(root)
        if now > seen:
            args.relay.got(now - seen)
            seen = now
        if ended:
            break
        time.sleep(2)
    if p.returncode != 0:
        raise StageError(f"hf download of {len(entries)} files from {args.repo}@{args.revision} "
                         f"exited {p.returncode}")
    hashes: Hashes = args.hashes
    for e in entries:
        if not hashes.ok(e):
            raise StageError(f"{e['path']}: the hub delivered bytes that do not match its sha256/size")
        if e.get("git_blob"):  # from now on every host checks it like any other file
            e["sha256"] = hashes.digest(e["path"])
            del e["git_blob"]


def directory_files(args: argparse.Namespace) -> dict[str, tuple[str, int]]:
    """The regular files of the directory source: each name (its path under --from) → where it is and
    its size; all of --from, or what is under each --include. Anything else (a symlink, a socket …) or
    a name the manifest cannot hold is skipped with a line. No symlink is followed: a file reached
    through one could not be installed at its path (``install`` refuses it), and this staging's own
    folder is never read into itself."""
    top = args.from_dir
    real_top = os.path.realpath(top)
    own = os.path.realpath(revisions_dir(args.path))
    found: dict[str, tuple[str, int]] = {}

    def skip(name: str, why: str) -> None:
        log(f"{top}: {name!r} skipped ({why})")

    for rel in args.include or [""]:
        start = os.path.join(top, rel) if rel else top
        if not os.path.lexists(start):
            log(f"{start}: not there, skipped")
            continue
        if os.path.realpath(start) != os.path.normpath(os.path.join(real_top, rel)):
            skip(rel, "reached through a symlink, not followed")
            continue
        if os.path.isdir(start):
            walk = os.walk(start, onerror=lambda e: log(f"{e.filename}: cannot list it ({e.strerror}), skipped"))
        else:  # an include may name one file
            walk = iter([(os.path.dirname(start), [], [os.path.basename(start)])])
        for d, dirs, names in walk:
            for n in list(dirs):
                p = os.path.join(d, n)
                if os.path.islink(p) or os.path.realpath(p) == own:
                    dirs.remove(n)
                    if os.path.islink(p):
                        skip(os.path.relpath(p, top), "a symlink, not followed")
            dirs.sort()
            for n in sorted(names):
                p = os.path.join(d, n)
                name = os.path.relpath(p, top)
                try:
                    st = os.lstat(p)
                except OSError as e:
                    skip(name, e.strerror or str(e))
                    continue
                if not stat.S_ISREG(st.st_mode):
                    skip(name, "a symlink, not followed" if stat.S_ISLNK(st.st_mode) else "not a regular file")
                elif problem := name_problem(name):
                    skip(name, problem)
                else:
                    found[name] = (p, st.st_size)
    return found


def copy_hashed(src, dst, on_bytes=None) -> tuple[int, str]:  # noqa: ANN001 (open binary files)
    """The bytes of the open file ``src`` written to the open file ``dst``, CHUNK by CHUNK and hashed on
    the way: the size and sha256 of what was written. The source read again could give other bytes (a
    cache file may change while it is copied)."""
    h, size = hashlib.sha256(), 0
    while chunk := src.read(CHUNK):
        dst.write(chunk)
        h.update(chunk)
        size += len(chunk)
        if on_bytes:
            on_bytes(len(chunk))
    return size, h.hexdigest()


def copy_directory(args: argparse.Namespace, root: str) -> tuple[dict, set[str]]:
    """The directory source copied into the revision directory: the manifest of what is here now, made
    anew from the bytes copied (the source is a cache: it changes between runs), and the names copied.
    A file here that matches its source is kept: the source is read to compare only when the copy here
    has its size."""
    relay: Relay = args.relay
    hashes: Hashes = args.hashes
    found = directory_files(args)
    for name in found:
        inside(root, name, args.from_dir)
    need_disk(args, root, {"files": [{"path": n, "size": size} for n, (_, size) in found.items()]})
    files: list[dict] = []
    fresh: set[str] = set()
    for name, (src, size) in sorted(found.items()):
        dest = os.path.join(root, name)
        try:
            if os.path.isfile(dest) and os.path.getsize(dest) == size:
                e = {"path": name, "size": size, "sha256": sha256_file(src)}
                if hashes.ok(e):
                    files.append(e)
                    continue
            fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # never a link, never waiting on a fifo
        except OSError as err:  # gone since it was listed (a cache evicts), or unreadable: not staged
            log(f"{args.from_dir}: {name!r} skipped (cannot read it: {err.strerror or err})")
            continue
        partial = dest + ".partial"
        try:
            with open(fd, "rb") as f:
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                with contextlib.suppress(FileNotFoundError):
                    os.remove(partial)  # a cut copy, or a link planted there: never written through
                with open(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "wb") as out:
                    size, sha = copy_hashed(f, out, relay.got)
            os.replace(partial, dest)
        except OSError as err:
            raise StageError(f"{name}: cannot copy {src} into {root}: {err.strerror or err}") from None
        hashes.remember(name, sha)
        files.append({"path": name, "size": size, "sha256": sha})
        fresh.add(name)
    return {"revision": args.revision, "files": files}, fresh


def stage_seed(args: argparse.Namespace, root: str) -> None:
    relay: Relay = args.relay
    hashes: Hashes = args.hashes
    if args.source == "directory":  # copied first: a file's sha256 is known once its bytes are here
        manifest, fresh = copy_directory(args, root)
    else:
        manifest = source_manifest(args, root)
        need_disk(args, root, manifest)
        fresh = set()
    args.commit = relay.commit = manifest.get("commit")
    if args.source == "huggingface":
        # The small git-kept files first (config, tokenizer): then every file has a sha256 the peers
        # can check before anything is published.
        small = [e for e in manifest["files"] if e.get("git_blob")]
        good = [e for e in small if hashes.ok(e)]
        for e in good:
            e["sha256"] = hashes.digest(e["path"])
            del e["git_blob"]
        missing = [e for e in small if e.get("git_blob")]
        if missing:
            hf_download(args, root, missing)
        fresh = {e["path"] for e in missing}
    write_json(os.path.join(root, MANIFEST), manifest)
    relay.adopt(manifest["files"])
    kept = fetched = 0
    todo: list[dict] = []
    for e in manifest["files"]:
        p = inside(root, e["path"])
        if hashes.ok(e):
            if e["path"] in fresh:
                fetched += 1
            else:
                kept += 1
            relay.publish(e["path"])
        elif args.source == "mirror":
            if os.path.lexists(p):
                log(f"{e['path']}: does not match the manifest, fetching it again")
                os.remove(p)
            fetch_verified(mirror_url(args, e["path"]), hashes, e, on_bytes=relay.got)
            fetched += 1
            relay.publish(e["path"])
        elif args.source == "directory":  # copied and hashed just now: changed here since
            raise StageError(f"{e['path']}: changed in {root} while it was staged")
        else:  # huggingface
            if os.path.lexists(p):
                log(f"{e['path']}: does not match the hub's sha256, downloading it again")
            todo.append(e)
    for i in range(0, len(todo), HF_BATCH):
        batch = todo[i:i + HF_BATCH]
        hf_download(args, root, batch)
        fetched += len(batch)
        for e in batch:
            relay.publish(e["path"])
        log(f"{i + len(batch)}/{len(todo)} files downloaded from {args.repo}")
    relay.publish(complete=True)
    log(f"seed: {fetched} files from the {args.source} source, {kept} already here and verified")


# --- a peer: copies from its parent in the relay tree, from the next ancestor up when that fails ----


def get_json(url: str, timeout: float, key: bytes | None = None) -> object:
    """A JSON document from a relay host: at most MAX_JSON bytes, never redirected. With the stack's
    relay key, it must come signed with it, together with the nonce this request sent (not replayed)."""
    nonce = secrets.token_hex(16)
    if key is not None:
        url += f"&nonce={nonce}"
    try:
        with open_url(url, timeout) as r:
            body = r.read(MAX_JSON + 1)
            mac = r.headers.get(MAC_HEADER, "")
    except urllib.error.HTTPError as e:
        raise SourceFailed(f"{url}: HTTP {e.code}") from None
    except (urllib.error.URLError, OSError, TimeoutError, http.client.HTTPException) as e:
        raise SourceFailed(f"{url}: {getattr(e, 'reason', None) or e}") from None
    if len(body) > MAX_JSON:
        raise SourceFailed(f"{url}: more than {MAX_JSON} bytes")
    if key is not None and not hmac.compare_digest(mac.encode("latin-1"), sign(key, nonce, body).encode()):
        raise StageError(f"refusing the manifest from {url}: {'a wrong signature' if mac else 'not signed'} "
                         f"(it is not signed with this stack's relay key: a host of another stack, or forged)")
    try:
        return json.loads(body)
    except ValueError as e:
        raise SourceFailed(f"{url}: not JSON ({e})") from None


def parent_doc(doc: object, origin: str) -> dict:
    """A relay host's progress document, checked whole (every name, size, sha256) before anything is
    written from it: a StageError naming the host and the entry otherwise."""
    if not isinstance(doc, dict):
        raise StageError(f"refusing the manifest from {origin}: not a progress document")
    for key, kind in (("revision", str), ("files", list), ("published", list), ("complete", bool)):
        if not isinstance(doc.get(key), kind):
            raise StageError(f"refusing the manifest from {origin}: {key!r} is missing or not a {kind.__name__}")
    if type(doc.get("received")) is not int or doc["received"] < 0:
        raise StageError(f"refusing the manifest from {origin}: 'received' is missing or not a byte count")
    commit = doc.get("commit")  # absent from a relay host of an older glm-infra
    if commit is not None and not (isinstance(commit, str) and COMMIT_ID.fullmatch(commit)):
        raise StageError(f"refusing the manifest from {origin}: 'commit' {commit!r} is not a commit id")
    files = manifest_files(doc["files"], origin)
    names = {e["path"] for e in files}
    for n in doc["published"]:
        if not isinstance(n, str) or n not in names:
            raise StageError(f"refusing the manifest from {origin}: it publishes {n!r}, which it does not list")
    return {**doc, "files": files}


def earlier_files(root: str, revision: str) -> list[dict] | None:
    """The manifest an earlier staging of this revision wrote here, or None: none, another revision's,
    or one that does not pass the checks (then nothing here is kept without a source's manifest)."""
    try:
        m = read_json(os.path.join(root, MANIFEST))
        if isinstance(m, dict) and m.get("revision") == revision:
            return manifest_files(m.get("files"), f"the earlier staging ({root})")
    except FileNotFoundError:
        pass  # the first staging of this revision here
    except (OSError, ValueError) as e:
        log(f"no earlier manifest kept: {e}")
    except StageError as e:
        log(f"{e}: keeping nothing from it")
    return None


def stage_peer(args: argparse.Namespace, root: str) -> None:
    """Copy every file as soon as the host copied from has verified it (pipelined), verify it here,
    publish it. The sources are the parent first, then each ancestor up to the seed: a source that
    fails (refused or reset after it answered, a short body, bad bytes, no progress for ``--stall``
    seconds) is left for the next one; after the seed, the parent again. What is staged is the
    manifest the source serves: a file verified against an earlier one is kept only if its entry is
    the same (its sha256 checked through the hash cache)."""
    relay: Relay = args.relay
    hashes: Hashes = args.hashes
    sources = [u.removesuffix("/") for u in args.peer]
    me = urllib.parse.urlencode({"host": args.name})
    deadline = time.monotonic() + args.timeout
    at = 0
    answered = False  # the current source answered at least once
    since = time.monotonic()  # when the current source last showed progress (or we came to it)
    last_sig: tuple | None = None
    files: dict[str, dict] = {}  # the manifest being staged, by path
    have: set[str] = set()  # files here verified against ``files``
    kept: set[str] = set()  # of those, the ones that were here before this staging
    copied: dict[str, int] = {}
    known = False  # a source served its manifest
    started = time.monotonic()
    told = 0.0  # when it last said it is waiting: at once, then every minute

    def adopt(new: list[dict], origin: str, commit: str | None = None) -> None:
        """Stage the manifest ``new`` from now on (every destination checked before anything is
        written); a file verified against an entry it changes or drops is verified again."""
        nonlocal files
        for e in new:
            inside(root, e["path"], origin)
        need_disk(args, root, {"files": new})
        by_path = {e["path"]: e for e in new}
        stale = sorted(n for n in have if by_path.get(n) != files.get(n))
        have.difference_update(stale)
        kept.difference_update(stale)
        files = by_path
        relay.commit = commit or relay.commit
        write_json(os.path.join(root, MANIFEST), {"revision": args.revision,
                                                  **({"commit": relay.commit} if relay.commit else {}), "files": new})
        relay.adopt(new)
        if stale:
            log(f"{origin}: its manifest differs for {len(stale)} files verified here before "
                f"({', '.join(stale[:5])}{' ...' if len(stale) > 5 else ''}): checking them again")

    # What an earlier staging of this revision verified here is published at once (its children start
    # on it), and a complete copy needs no parent at all: one whose staging is over serves nobody.
    local: set[str] = set()
    if prior := earlier_files(root, args.revision):
        adopt(prior, "the earlier staging")
        local = set(files)
        for e in prior:
            if hashes.ok(e):
                have.add(e["path"])
                kept.add(e["path"])
                relay.publish(e["path"])

    def move(why: str, to: int | None = None) -> None:
        nonlocal at, answered, since, last_sig
        nxt = (at + 1) % len(sources) if to is None else to
        role = "the seed" if nxt == len(sources) - 1 else ("its parent" if nxt == 0 else "an ancestor")
        log(f"{sources[at]}: {why}; copying from {sources[nxt]} ({role}) now")
        if nxt != at:  # it need not wait for this host any longer
            say_done(f"{sources[at]}/{DONE}?{me}&moved=1", timeout=3)
        at, answered, since, last_sig = nxt, False, time.monotonic(), None

    while True:
        if time.monotonic() > deadline:
            if not known:
                raise StageError(f"{', '.join(sources)} did not answer within {args.timeout}s")
            raise StageError(f"timed out after {args.timeout}s with {len(have)} files "
                             f"(sources: {', '.join(sources)})")
        base = sources[at]
        try:
            raw = get_json(f"{base}/{PROGRESS}?{me}", args.stall, args.relay_key)
        except SourceFailed as e:
            if answered:
                move(f"failed ({e})")
            elif time.monotonic() - since > args.stall and (up := first_answering(sources, at, me)) is not None:
                # Not started yet, or gone: a parent starts no later than its ancestors, so one that
                # still does not answer while an ancestor does has failed.
                move(f"did not answer within {args.stall:g}s", to=up)
            elif local and have >= local and time.monotonic() - started > args.stall:
                log(f"every file already here and verified; none of {', '.join(sources)} answered "
                    f"within {args.stall:g}s, none needed")
                break
            else:
                if time.monotonic() - since > args.stall:
                    since = time.monotonic()  # nobody answers yet: keep waiting for the parent
                if time.monotonic() - told > 60:
                    log(f"waiting for {base} to serve (nothing answers: not started yet, or its staging is over)")
                    told = time.monotonic()
                time.sleep(1)
            continue
        progress = parent_doc(raw, base)
        if progress["revision"] != args.revision:
            if time.monotonic() - since > args.stall:
                move(f"serves revision {progress['revision']!r}, not {args.revision}")
            else:
                time.sleep(1)
            continue
        answered = True
        # A manifest once it lists files, or once the source is complete without any (an empty cache of
        # the directory source): that one is adopted too, or this host would wait for files forever.
        if progress["files"] or progress["complete"]:
            listed = {e["path"]: e for e in progress["files"]}
            if not known or listed != files or progress.get("commit") != relay.commit:
                adopt(progress["files"], base, progress.get("commit"))
            known = True
        sig = (len(progress["published"]), progress["received"], progress["complete"])
        if sig != last_sig:
            last_sig, since = sig, time.monotonic()
        failed = None
        for name in progress["published"]:
            if name in have:
                continue
            e = files[name]
            p = inside(root, name)
            if hashes.ok(e):
                kept.add(name)
            else:
                if os.path.lexists(p):
                    log(f"{name}: does not match its sha256, copying it again")
                    os.remove(p)
                os.makedirs(os.path.dirname(p), exist_ok=True)
                try:
                    sha = download(f"{base}/{urllib.parse.quote(name)}?{me}", p, e["size"], timeout=args.stall,
                                   on_bytes=relay.got, follow=False)
                except NotThere:
                    break  # listed in a progress file the source has since rewritten: next round
                except SourceFailed as err:
                    failed = f"failed ({err})"
                    break
                if sha != e["sha256"]:
                    os.remove(p)
                    failed = f"{name}: sha256 mismatch (bytes rejected)"
                    break
                hashes.remember(name, sha)
                copied[base] = copied.get(base, 0) + 1
            have.add(name)
            relay.publish(name)
            since = time.monotonic()
        if failed:
            move(failed)
            continue
        if progress["complete"] and known and have >= set(files):
            break
        if time.monotonic() - since > args.stall:
            move(f"no progress for {args.stall:g}s")
            continue
        time.sleep(0.5)
    relay.publish(complete=True)
    for base in sources:  # every host copied from may be waiting for this one
        say_done(f"{base}/{DONE}?{me}")
    where = ", ".join(f"{n} from {b}" for b, n in copied.items()) or "none"
    log(f"peer: {sum(copied.values())} files copied ({where}), {len(kept)} already here and verified")


def first_answering(sources: list[str], at: int, me: str) -> int | None:
    """The index of the first source after ``at`` (in failover order) that answers, if any."""
    for i in list(range(at + 1, len(sources))) + list(range(at)):
        with contextlib.suppress(SourceFailed):
            get_json(f"{sources[i]}/{PROGRESS}?{me}", timeout=5)
            return i
    return None


def say_done(url: str, timeout: float = 5) -> None:
    """Tell a host copied from that this one needs nothing more from it (if it still listens)."""
    with contextlib.suppress(OSError, http.client.HTTPException), open_url(url, timeout) as r:  # (URLError too)
        r.read(1024)


# --- shared steps --------------------------------------------------------------------------------


def need_disk(args: argparse.Namespace, root: str, manifest: dict) -> None:
    missing = 0
    for e in manifest["files"]:
        p = os.path.join(root, e["path"])
        have = os.path.getsize(p) if os.path.isfile(p) else 0
        partial = p + ".partial"
        have += os.path.getsize(partial) if os.path.isfile(partial) else 0
        missing += max(e["size"] - have, 0)
    st = os.statvfs(root)
    free = st.f_bavail * st.f_frsize
    margin = args.margin_gb * 1e9
    if free < missing + margin:
        raise StageError(
            f"{free / 1e9:.1f} GB free at {root}, the checkpoint needs {missing / 1e9:.1f} GB more "
            f"+ {args.margin_gb:g} GB margin"
        )


def switch(path: str, revision: str) -> None:
    """Point P at the revision atomically (rename of a new symlink over the old one)."""
    target = os.path.relpath(revision_dir(path, revision), os.path.dirname(path))
    if os.path.islink(path) and os.readlink(path) == target:
        return
    if os.path.exists(path) and not os.path.islink(path):
        raise StageError(f"{path} exists and is not a glm-infra symlink; move it away first")
    tmp = f"{path}.tmp-link"
    with contextlib.suppress(FileNotFoundError):
        os.remove(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, path)
    log(f"{path} -> {target}")


@contextlib.contextmanager
def locked(path: str):
    os.makedirs(revisions_dir(path), exist_ok=True)
    with open(os.path.join(revisions_dir(path), ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # a second staging waits for the first (interrupted runs resume)
        yield


def verify_in_place(path: str) -> int:
    """Source local: the checkpoint is already at P on every host; check it, change nothing."""
    if not os.path.isdir(path):
        raise StageError(f"{path} is not a directory (model.source local: the checkpoint must be there)")
    manifest_path = os.path.join(path, MANIFEST)
    if os.path.exists(manifest_path):
        bad = check_files(path, {"files": read_manifest(manifest_path)["files"]}, full=True)
    else:
        bad = sorted(s for s in index_shards(path) if not os.path.isfile(os.path.join(path, s)))
        if not os.path.exists(os.path.join(path, "model.safetensors.index.json")):
            bad.append("model.safetensors.index.json")
    if bad:
        raise StageError(f"{path}: missing or corrupt: {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}")
    log(f"{path}: checkpoint present and verified in place")
    return 0


def cmd_stage(args: argparse.Namespace) -> int:
    if args.source == "local":
        return verify_in_place(args.path)
    if args.source == "directory":
        if args.role == "peer":
            raise StageError("--source directory is the seed's (--role seed): a peer copies from its --peer hosts")
        if not args.from_dir:
            raise StageError("--source directory needs --from DIR: the folder whose files it stages")
        if not os.path.isdir(args.from_dir):
            raise StageError(f"--from {args.from_dir}: not a directory")
        for rel in args.include:
            if problem := name_problem(rel):
                raise StageError(f"--include {rel!r}: {problem} (it names a path under --from)")
    if args.role == "peer" and not args.peer:
        raise StageError("--role peer needs at least one --peer URL (its parent, then its ancestors)")
    children = [c for c in (args.children or "").split(",") if c]
    with locked(args.path):
        root = revision_dir(args.path, args.revision)
        os.makedirs(root, exist_ok=True)
        args.relay = relay = Relay(args.revision, args.name)
        relay.progress_path = os.path.join(root, PROGRESS)
        relay.key = args.relay_key = relay_key(args.relay_key_file) if args.relay_key_file else None
        args.hashes = hashes = Hashes(root, os.path.join(root, HASHES))
        server = start_relay(relay, root, args.serve, args.stall) if args.serve else None
        try:
            complete = os.path.join(root, COMPLETE)
            with contextlib.suppress(FileNotFoundError):
                os.remove(complete)
            if args.role == "seed":
                stage_seed(args, root)
            else:
                stage_peer(args, root)
            # The gate of .glm-complete: every file of the manifest written here, with its sha256 (read
            # once: what this staging hashed or downloaded is in the cache).
            manifest = read_json(os.path.join(root, MANIFEST))
            bad = check_files(root, manifest, full=True, hashes=hashes)
            if bad:
                raise StageError(f"after staging, missing or corrupt: {', '.join(bad[:5])}")
            commit = manifest.get("commit")
            with open(complete, "w") as f:
                f.write(f"{len(manifest['files'])} files, {sum(e['size'] for e in manifest['files'])} bytes"
                        + (f", commit {commit}" if commit else "") + "\n")
            switch(args.path, args.revision)
            total = sum(e["size"] for e in manifest["files"])
            log(f"{args.revision}{f' (commit {commit})' if commit and commit != args.revision else ''}: "
                f"{len(manifest['files'])} files, {total / 1e9:.2f} GB verified at {args.path}")
            if server is not None:
                left = wait_for_children(relay, children, args.stall)
                log(f"relay on {args.serve} stopped: every host copying from here is done or left")
                if left:  # failed, so that the next `up` stages here again and serves them
                    raise StageError(f"staged here, but {', '.join(left)} stopped copying from this host before "
                                     f"they had every file; the next `pulumi up` stages both again")
        finally:
            hashes.save()
            if server is not None:
                server.shutdown()
                server.server_close()
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Read-only: the revision is staged, the model path serves it, and every file is there with its
    size and (unless --quick) its sha256."""
    root = revision_dir(args.path, args.revision)
    try:
        manifest = {"files": manifest_files(read_json(os.path.join(root, MANIFEST)).get("files"), root)}
    except OSError:
        print(f"{HOST}: weights: {args.revision} is not staged at {args.path}", file=sys.stderr)
        return 1
    except (ValueError, AttributeError, StageError) as e:
        print(f"{HOST}: weights: {args.revision} at {args.path}: unreadable manifest ({e})", file=sys.stderr)
        return 1
    problems = []
    if os.path.realpath(args.path) != os.path.realpath(root):
        serving = os.path.basename(os.path.realpath(args.path)) if os.path.islink(args.path) else "nothing glm-infra staged"
        problems.append(f"{args.path} serves {serving}, not {args.revision}")
    bad = check_files(root, manifest, full=not args.quick)
    problems += [f"{b}: missing or {'of the wrong size' if args.quick else 'corrupt'}" for b in bad]
    for p in problems:
        print(f"{HOST}: weights: {p}", file=sys.stderr)
    if not problems:
        what = "size" if args.quick else "sha256"
        log(f"{args.revision}: all {len(manifest['files'])} files match their {what}")
    return 1 if problems else 0


def cmd_prune(args: argparse.Namespace) -> int:
    top = revisions_dir(args.path)
    if not os.path.isdir(top):
        return 0
    for name in sorted(os.listdir(top)):
        if name != args.revision and os.path.isdir(os.path.join(top, name)):  # (.lock is a file)
            shutil.rmtree(os.path.join(top, name))
            log(f"removed the old revision {name}")
    return 0


def cmd_remove(args: argparse.Namespace) -> int:
    if os.path.islink(args.path):
        os.remove(args.path)
    shutil.rmtree(revisions_dir(args.path), ignore_errors=True)
    log(f"removed {args.path} and its revisions")
    return 0


def read_manifest(path: str) -> dict:
    """A manifest on disk, its files checked as a parent's are; unreadable or malformed: StageError naming it."""
    try:
        manifest = read_json(path)
        return {**manifest, "files": manifest_files(manifest.get("files"), path)}
    except (OSError, ValueError, AttributeError, TypeError) as e:  # (not an object: no .get, no **)
        raise StageError(f"{path}: unreadable ({e})") from None


def staged_whole(args: argparse.Namespace, otherwise: str) -> tuple[str, dict]:
    """The folder and manifest of --revision at --path, staged and verified whole (.glm-complete); else
    StageError ending in ``otherwise`` (what is then not done)."""
    root = revision_dir(args.path, args.revision)
    if not os.path.isfile(os.path.join(root, COMPLETE)):
        raise StageError(f"{args.revision} is not staged at {args.path} (no {COMPLETE}): {otherwise}")
    return root, read_manifest(os.path.join(root, MANIFEST))


def cmd_install(args: argparse.Namespace) -> int:
    """The files of a staged revision (a warm-start cache) at their paths under --into, where nothing is
    there: a file the host has is left as it is (vLLM keys its caches itself, what it built wins).
    Each is copied to a temporary name beside it, checked against the manifest on the way, and renamed
    into place. A manifest path that would land outside --into ('..', a symlink on the way) is refused
    before anything is written. Running it again installs nothing more."""
    root, manifest = staged_whole(args, "nothing installed")
    files = manifest["files"]
    dests = {e["path"]: inside(args.into, e["path"], os.path.join(root, MANIFEST)) for e in files}
    installed = kept = total = 0
    for e in files:
        dest = dests[e["path"]]
        if os.path.lexists(dest):
            kept += 1
            continue
        src = os.path.join(root, e["path"])
        try:
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".glm-install-", dir=os.path.dirname(dest))
            try:
                with open(fd, "wb") as out, open(src, "rb") as f:
                    got = copy_hashed(f, out)
                    os.fchmod(out.fileno(), 0o644)
                if got != (e["size"], e["sha256"]):
                    raise StageError(f"{src}: not the bytes its manifest lists (changed since it was staged)")
                os.replace(tmp, dest)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(tmp)  # (gone once renamed)
        except OSError as err:
            raise StageError(f"cannot install {e['path']} into {args.into}: {err.strerror or err}") from None
        installed += 1
        total += e["size"]
    log(f"installed {installed} files ({total} bytes) into {args.into}, {kept} already there")
    return 0


def cmd_relay(args: argparse.Namespace) -> int:
    """A staged revision served as a relay parent serves it (every file published, complete) until each child
    said it has every file or went silent for --stall seconds: the pool's first host runs it as a transient
    unit, so the steps of the hosts that copy from it can follow its own. Exit 1 naming a child that left
    before it had every file."""
    root, manifest = staged_whole(args, "nothing to serve")
    relay = Relay(args.revision, args.name)
    relay.key = relay_key(args.relay_key_file) if args.relay_key_file else None
    relay.commit = manifest.get("commit")
    relay.adopt(manifest["files"])
    for e in relay.files:
        relay.publish(e["path"])
    relay.publish(complete=True)
    children = [c for c in args.children.split(",") if c]
    server = start_relay(relay, root, args.bind, args.stall)
    try:
        log(f"{args.revision}: serving {len(relay.files)} files on {args.bind} to {', '.join(children)}")
        left = wait_for_children(relay, children, args.stall)
    finally:
        server.shutdown()
        server.server_close()
    if left:
        raise StageError(f"{', '.join(left)} stopped copying from this host before they had every file")
    log(f"relay on {args.bind} stopped: every host copying from here is done or left")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Every file of a folder (--all: the mirror stand-in) or only what its progress file published."""
    with files_server(args.dir, args.bind, published_only=not args.all) as httpd:
        httpd.serve_forever()
    return 0


def parser() -> argparse.ArgumentParser:
    """The command line (the module's docstring says what each option means)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stage")
    s.add_argument("--role", choices=["seed", "peer"], default="seed")
    s.add_argument("--source", choices=["huggingface", "mirror", "directory", "local"], default="mirror")
    s.add_argument("--url")
    s.add_argument("--from", dest="from_dir")
    s.add_argument("--include", action="append", default=[])
    s.add_argument("--repo")
    s.add_argument("--hf-python", default="/opt/glm-infra/hf/bin/python")
    s.add_argument("--token-file")
    s.add_argument("--relay-key-file")
    s.add_argument("--peer", action="append", default=[])
    s.add_argument("--serve")
    s.add_argument("--children", default="")
    s.add_argument("--name", default=os.uname().nodename)
    s.add_argument("--stall", type=float, default=120)
    s.add_argument("--revision", default="")
    s.add_argument("--path", required=True)
    s.add_argument("--margin-gb", type=float, default=10)
    s.add_argument("--timeout", type=int, default=86400)
    for name in ("verify", "prune"):
        p = sub.add_parser(name)
        p.add_argument("--revision", required=True)
        p.add_argument("--path", required=True)
    sub.choices["verify"].add_argument("--quick", action="store_true")
    sub.add_parser("remove").add_argument("--path", required=True)
    i = sub.add_parser("install")
    i.add_argument("--revision", required=True)
    i.add_argument("--path", required=True)
    i.add_argument("--into", required=True)
    r = sub.add_parser("relay")
    r.add_argument("--revision", required=True)
    r.add_argument("--path", required=True)
    r.add_argument("--bind", required=True)
    r.add_argument("--children", required=True)
    r.add_argument("--name", default=os.uname().nodename)
    r.add_argument("--stall", type=float, default=120)
    r.add_argument("--relay-key-file")
    v = sub.add_parser("serve")
    v.add_argument("--dir", required=True)
    v.add_argument("--bind", required=True)
    v.add_argument("--all", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    global HOST
    args = parser().parse_args(argv)
    HOST = getattr(args, "name", None) or HOST
    if args.cmd in ("verify", "prune", "install", "relay") or (args.cmd == "stage" and args.source != "local"):
        if not REVISION.fullmatch(args.revision):  # a folder name under PATH.revisions, as the stack's rule
            print(f"{HOST}: weights: {args.revision!r} is not a revision", file=sys.stderr)
            return 1
    handlers = {"stage": cmd_stage, "verify": cmd_verify, "prune": cmd_prune, "remove": cmd_remove,
                "install": cmd_install, "relay": cmd_relay, "serve": cmd_serve}
    try:
        return handlers[args.cmd](args)
    except StageError as e:
        print(f"{HOST}: weights: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
