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
    weights.py stage --role seed --source directory --from DIR [--include REL ...] [--kind GLOB ...]
                     --revision R --path P [RELAY] [COMMON]
    weights.py stage --role peer --peer URL [--peer URL ...] --relay-key-file F --revision R --path P [RELAY]
                     [COMMON]
        RELAY: --name HOST [--serve ADDR:PORT --children HOST,HOST --relay-key-file F] [--stall SECONDS]
        COMMON: [--margin-gb GB] [--timeout SECONDS]
    weights.py stage --source local --path P       (already on every host: verify only)
    weights.py serve --dir D --bind ADDR:PORT          (a static mirror of every file: the simulated model source)
    weights.py verify --revision R --path P [--quick]   (sha256 of every file, or --quick sizes only;
                                                         exit 1 naming bad files)
    weights.py prune --revision R --path P         (remove every other revision)
    weights.py remove --path P                     (remove the checkpoint and its revisions)
    weights.py install --revision R --path P --into DIR [--owner USER] [--include REL ...] [--kind GLOB ...]
                       (copy each file of the staged revision that DIR lacks to DIR/<its path>; exit 1 if
                        not staged, or if the manifest names a file outside the includes and kinds)
    weights.py relay --revision R --path P --bind ADDR:PORT --children HOST,HOST --relay-key-file F
                     [--name HOST] [--stall SECONDS]   (serve a staged revision to the relay children until
                     each has every file or went silent; a process of its own, not a staging; it tells
                     systemd it is ready once it listens: a transient unit of Type=notify)

    --url            the mirror: files under URL/REVISION/, with URL/REVISION/manifest.json
    --hf-python      python of the venv with the hf CLI (default /opt/glm-infra/hf/bin/python)
    --token-file     EnvironmentFile with HF_TOKEN= (read by this program: never on a command line)
    --from           (directory) the folder whose regular files are staged, each at its path under it
    --include        (directory) a path under --from to stage, repeated (default: all of --from); one
                     that is not there is skipped
    --kind           (directory) a pattern of the file names staged (fnmatch of the last component),
                     repeated (default: every regular file); the others are skipped and counted
    --into           (install) the folder the files go to, each at its path in the manifest
    --owner          (install) the user the files and folders it makes are given to (the folder's owner)
    --peer           a host to copy from, repeated: the parent first, then each ancestor up to the seed
    --name           this host's name in the relay (default: its hostname)
    --serve          serve the verified files here while staging (hosts with --children, comma-separated)
    --stall          seconds without progress before a peer leaves the host it copies from (default 120)
    --relay-key-file EnvironmentFile with GLM_RELAY_KEY=, the stack's relay key (needed by a peer and by a
                     host that serves): each request a peer makes is signed with it under its --name, time
                     and a nonce (a relay serves and counts no one else: 401), each progress document goes
                     out signed with it and the request's nonce, and a peer takes only documents so signed
                     (else exit 3: forged, or another process on the port), then every file only with the
                     sha256 that signed document lists
    --margin-gb      free disk to leave beside the checkpoint (default 10)
    --timeout        seconds a peer may take in all (default 86400)

Every host publishes each file in ``.glm-progress.json`` only after verifying it; with ``--serve`` a
thread of the staging serves the published files (never a partial one) to the hosts that copy from
this one (``--children``) and the staging ends once each has said it has every file (``/.glm-done``)
or went silent for ``--stall`` seconds. A peer copies each file as soon as the first of its
``--peer`` hosts (its parent; then each ancestor up to the seed) has published it, verifies it
against the sha256 there, and moves to the next one when its source fails: refused or reset after
it answered, a short body, bad bytes, no progress for ``--stall`` seconds.

The directory source moves what one host built to the others (vLLM's warm-start caches under its
HOME: JIT and autotune caches). The seed copies each regular file of the kinds asked under the includes
into the revision directory, each opened beneath --from without following a symlink (the folder is the
services' own: they could swap a folder for a link meanwhile), hashing the bytes it copies (a cache file
may change while it is read), and writes the manifest anew on every run (paths relative to --from, no
commit); the relay carries it like a checkpoint. ``install`` then puts each file at DIR/<path> on every
host where DIR has none there, the same way beneath DIR, given to --owner: a file the host has is left as
it is (vLLM keys its caches itself).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import errno
import fcntl
import fnmatch
import functools
import hashlib
import hmac
import http.client
import http.server
import json
import os
import pwd
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


def read_hashed(f, h: "hashlib._Hash") -> "hashlib._Hash":  # noqa: ANN001 (an open binary file)
    """``h`` updated with what is left to read of the open file ``f``, CHUNK by CHUNK (never a whole file in
    memory)."""
    while chunk := f.read(CHUNK):
        h.update(chunk)
    return h


def hashed(path: str, h: "hashlib._Hash") -> "hashlib._Hash":
    """``h`` updated with the bytes of the file at ``path``."""
    with open(path, "rb") as f:
        return read_hashed(f, h)


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


def download(url: str, dest: str, size: int | None, timeout: float = 60, on_bytes=None, follow: bool = True,
             auth: Auth | None = None) -> str:
    """One attempt at url → dest, resuming dest.partial with a Range request; streamed through a CHUNK
    buffer (never a whole file in memory) and hashed on the way. Returns the sha256 of dest. The
    headers that answer are checked against what was asked (status, Content-Range, Content-Length),
    and no more bytes are taken than the manifest's size (``size`` None: MAX_JSON). ``auth``: a relay
    host's file, asked for signed (its bytes are checked against the signed manifest by the caller)."""
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
        headers = auth.headers(url)[0] if auth else {}
        if have:
            headers["Range"] = f"bytes={have}-"
        with open_url(url, timeout, headers, follow) as resp:
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
        elif e.code == 401 and auth is not None:
            raise Forged(f"{url}: HTTP 401: {e.read(300).decode(errors='replace').strip()} (this host's relay key "
                         "is not the one its source holds)") from None
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


MAC_HEADER = "X-Glm-Relay-Mac"  # a relay's answer: HMAC of the document and the nonce of the request
AUTH_HEADER = "X-Glm-Relay-Client"  # a relay client's request: "NAME TIME NONCE MAC"
AUTH_WINDOW_S = 300  # a request signed further from the relay's clock than this is refused (hosts run NTP)
CLIENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,252}")
NONCE = re.compile(r"[0-9a-f]{32}")
EXIT_FORGED = 3  # what came from another host was refused as not signed with the stack's key (not a failed copy)


class Forged(StageError):
    """An answer or a request not signed with the stack's relay key: another process on the port, a host
    of another stack, or a forgery. Never used, never retried elsewhere quietly: the step fails naming it."""


def sign(key: bytes, nonce: str, body: bytes) -> str:
    """HMAC-SHA256, with the stack's relay key, of a relay's answer (its progress document) and the nonce of
    the request it answers: a peer takes no manifest from a host without the key, nor an old one replayed."""
    return hmac.new(key, b"server\n" + nonce.encode() + b"\n" + body, hashlib.sha256).hexdigest()


def client_mac(key: bytes, name: str, at: str, nonce: str, target: str) -> str:
    """HMAC-SHA256 of a relay client's request (GET of ``target``, its path and query) under its name, time and
    nonce: a relay counts and serves only clients holding the stack's key, by the name they signed."""
    return hmac.new(key, f"client\n{name}\n{at}\n{nonce}\nGET {target}".encode(), hashlib.sha256).hexdigest()


@dataclasses.dataclass(frozen=True)
class Auth:
    """How this host signs what it asks a relay host: the stack's key and its own name in the relay."""

    key: bytes
    name: str

    def headers(self, url: str) -> tuple[dict[str, str], str]:
        """The request's authentication header and its nonce (the answer must be signed with it)."""
        parts = urllib.parse.urlsplit(url)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        nonce, at = secrets.token_hex(16), str(int(time.time()))
        return {AUTH_HEADER: f"{self.name} {at} {nonce} {client_mac(self.key, self.name, at, nonce, target)}"}, nonce


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
        self.key: bytes | None = None  # the stack's relay key: clients must sign with it, answers go out signed
        self.nonces: dict[str, float] = {}  # nonces of the requests taken, by their time: none is taken twice
        self.refused: dict[str, float] = {}  # client address → when a refusal of it was last logged

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

    def authenticate(self, header: str | None, target: str) -> tuple[str | None, str]:
        """The name a request signed with the stack's key (its AUTH_HEADER, for GET ``target``), or None and
        why not: no key here, no header, a malformed one, a time outside AUTH_WINDOW_S of this host's clock,
        a nonce already taken, a wrong MAC. The nonce is what this relay signs its answer with."""
        if self.key is None:
            return None, "this relay has no key"
        fields = (header or "").split(" ")
        if len(fields) != 4:
            return None, f"no {AUTH_HEADER} header of NAME TIME NONCE MAC"
        name, at, nonce, mac = fields
        if not CLIENT_NAME.fullmatch(name) or not at.isdigit() or not NONCE.fullmatch(nonce):
            return None, f"a malformed {AUTH_HEADER} header"
        now = time.time()
        if abs(now - int(at)) > AUTH_WINDOW_S:
            return None, (f"signed at {at}, {abs(now - int(at)):.0f} s from this host's clock (more than "
                          f"{AUTH_WINDOW_S} s: replayed, or the hosts' clocks differ)")
        if not hmac.compare_digest(mac.encode("latin-1"), client_mac(self.key, name, at, nonce, target).encode()):
            return None, "not signed with this stack's relay key"
        with self.lock:
            if nonce in self.nonces:
                return None, "a nonce already taken (replayed)"
            for old in [n for n, t in self.nonces.items() if now - t > 2 * AUTH_WINDOW_S]:
                del self.nonces[old]
            self.nonces[nonce] = now
        return name, nonce

    def seen(self, client: str, active: int = 0, done: bool = False) -> None:
        with self.lock:
            c = self.clients.setdefault(client, {"active": 0, "done": False})
            c["last"] = time.monotonic()
            c["active"] += active
            c["done"] = c["done"] or done


class _Files(http.server.SimpleHTTPRequestHandler):
    """Static files with single-range requests (resumed transfers) and no directory listings: with a
    ``relay``, only to clients signed with its key and only the files it published; without, every file
    (``serve``: the mirror stand-in, which logs what it served)."""

    relay: Relay | None = None  # the staging's own server: its state in memory, clients tracked

    def do_GET(self) -> None:  # noqa: N802 (http.server API)
        url = urllib.parse.urlparse(self.path)
        name = urllib.parse.unquote(url.path).lstrip("/")
        relay = self.relay
        client = ""
        if relay is not None:
            # Only a host holding the stack's key is served or counted, by the name it signed.
            client, nonce = relay.authenticate(self.headers.get(AUTH_HEADER), self.path)
            if client is None:
                return self._refuse(relay, nonce)
            relay.seen(client, done=name == DONE)
            if name == DONE:
                return self._send(b"ok\n", "text/plain")
            with relay.lock:
                doc, published = relay.snapshot(), set(relay.published)
            if name == PROGRESS:
                body = json.dumps(doc).encode()
                return self._send(body, "application/json", {MAC_HEADER: sign(relay.key, nonce, body)})
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

    def _refuse(self, relay: Relay, why: str) -> None:
        """401 for a request not signed with the stack's key; logged once a minute per address at most."""
        who, now = self.client_address[0], time.monotonic()
        with relay.lock:
            quiet = now - relay.refused.get(who, -60.0) < 60
            if not quiet:
                relay.refused[who] = now
        if not quiet:
            log(f"refused a request from {who}: {why}")
        body = f"unauthenticated relay client: {why}\n".encode()
        self.send_response(401)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _send(self, body: bytes, kind: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(200)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt: str, *a) -> None:
        if self.relay is None:  # the mirror stand-in logs what it served; a relay only what it refused
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


def port_holder(port: int, proc: str = "/proc") -> str | None:
    """Who listens on TCP ``port`` on this host, from /proc: "pid N (COMMAND, user U)", or what /proc shows of
    it; None when nothing visible listens there."""
    inodes = set()
    for table in (f"{proc}/net/tcp", f"{proc}/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in list(f)[1:]:
                fields = line.split()
                # local_address is ADDR:PORT in hex; state 0A is LISTEN; the inode is the 10th field.
                if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
    if not inodes:
        return None
    for pid in sorted((p for p in os.listdir(proc) if p.isdigit()), key=int):
        with contextlib.suppress(OSError):
            fds = os.listdir(f"{proc}/{pid}/fd")
            if any(os.readlink(f"{proc}/{pid}/fd/{fd}") in {f"socket:[{i}]" for i in inodes} for fd in fds):
                with open(f"{proc}/{pid}/comm") as f:
                    comm = f.read().strip()
                uid = os.stat(f"{proc}/{pid}").st_uid
                try:
                    user = pwd.getpwuid(uid).pw_name
                except KeyError:
                    user = str(uid)
                return f"pid {pid} ({comm}, user {user})"
    return "a socket of a process this host's /proc does not show"


def start_relay(relay: Relay, root: str, bind: str, stall: float) -> _Server:
    """Serve this host's verified files from a thread of the staging itself: nothing outlives the step.
    A client that sends nothing (or stops reading) for ``stall`` seconds is dropped. Never without the
    stack's key (clients must sign their requests with it, answers go out signed); a port already taken
    fails, naming who holds it (a relay whose port another process took is never trusted by it)."""
    if relay.key is None:
        raise StageError(f"no relay key: a relay is served only with the stack's key (--relay-key-file), never "
                         f"by its port {bind} alone")
    try:
        server = files_server(root, bind, relay=relay, timeout=stall)
    except OSError as e:
        port = bind.rpartition(":")[2]
        holder = port_holder(int(port)) if port.isdigit() and e.errno == errno.EADDRINUSE else None
        raise StageError(f"cannot serve the relay on {bind}: {e.strerror or e}"
                         + (f" (held by {holder})" if holder else "")) from None
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


MAX_DIRECTORY_FILE = 1 << 30  # a file of the directory source larger than this is not staged (a cache file never is)


def open_beneath(top: int, name: str, flags: int) -> int:
    """A descriptor of ``name`` (a plain relative name) under the directory ``top`` (a descriptor), each
    component opened without following a symlink: whatever the owner of the tree renames or links meanwhile,
    what is opened is inside it. OSError (ELOOP, ENOTDIR: a symlink on the way) otherwise."""
    *folders, last = name.split("/")
    fd = os.dup(top)
    try:
        for part in folders:
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return os.open(last, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    finally:
        os.close(fd)


def wanted(name: str, includes: list[str], kinds: list[str]) -> bool:
    """Whether a file of the directory source is one the staging takes: under one of ``includes`` (all, when
    none) and its name of one of ``kinds`` (fnmatch patterns of the last component; all, when none)."""
    under = not includes or any(name == rel or name.startswith(rel + "/") for rel in includes)
    return under and (not kinds or any(fnmatch.fnmatchcase(name.rsplit("/", 1)[-1], k) for k in kinds))


def directory_files(args: argparse.Namespace) -> dict[str, int]:
    """The regular files of the directory source: each name (its path under --from) → its size; all of
    --from, or what is under each --include, of the --kind patterns. Anything else (a symlink, a socket, a
    file of another kind, one larger than MAX_DIRECTORY_FILE) or a name the manifest cannot hold is skipped
    (with a line; other kinds counted in one). No symlink is followed anywhere on the way (each folder is
    opened from its parent's descriptor, an include's folders too): what the folder's owner changes meanwhile
    cannot lead this root process elsewhere; this staging's own folder is never read into itself."""
    top = args.from_dir
    found: dict[str, int] = {}
    other_kinds: list[str] = []
    try:
        st = os.stat(revisions_dir(args.path))
        own = (st.st_dev, st.st_ino)  # this staging's own folder, when it is under --from
    except OSError:
        own = None

    def skip(name: str, why: str) -> None:
        log(f"{top}: {name!r} skipped ({why})")

    def visit(folder: int, entry: str, name: str, include: bool = False) -> None:
        """``entry`` of the open ``folder``, known as ``name`` under --from (``include``: an --include): a folder
        is walked, a regular file of the kinds taken, anything else skipped."""
        try:
            st = os.stat(entry, dir_fd=folder, follow_symlinks=False)
        except OSError as e:
            if include and e.errno == errno.ENOENT:
                return log(f"{os.path.join(top, name)}: not there, skipped")
            return skip(name, e.strerror or str(e))
        if stat.S_ISDIR(st.st_mode):
            if (st.st_dev, st.st_ino) != own:
                walk(folder, entry, name)
        elif stat.S_ISLNK(st.st_mode):
            skip(name, "a symlink, not followed")
        elif not stat.S_ISREG(st.st_mode):
            skip(name, "not a regular file")
        elif problem := name_problem(name):
            skip(name, problem)
        elif not wanted(name, [], args.kind):
            other_kinds.append(name)
        elif st.st_size > MAX_DIRECTORY_FILE:
            skip(name, f"{st.st_size} bytes, more than {MAX_DIRECTORY_FILE}")
        else:
            found[name] = st.st_size

    def walk(folder: int, entry: str, name: str) -> None:
        try:  # (a folder swapped for a link since it was seen is not opened: ELOOP)
            fd = os.open(entry, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
        except OSError as e:
            return skip(name, f"cannot open it ({e.strerror})")
        try:
            for sub in sorted(os.listdir(fd)):
                visit(fd, sub, f"{name}/{sub}" if name else sub)
        finally:
            os.close(fd)

    top_fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for rel in args.include or [""]:
            if not rel:
                walk(top_fd, ".", "")
                continue
            head, _, last = rel.rpartition("/")
            try:  # the include's folders, each opened without following a link
                parent = open_beneath(top_fd, head, os.O_RDONLY | os.O_DIRECTORY) if head else os.dup(top_fd)
            except FileNotFoundError:
                log(f"{os.path.join(top, rel)}: not there, skipped")
                continue
            except OSError:
                skip(rel, "reached through a symlink, not followed")
                continue
            try:
                visit(parent, last, rel, include=True)
            finally:
                os.close(parent)
    finally:
        os.close(top_fd)
    if other_kinds:
        shown = ", ".join(repr(n) for n in other_kinds[:3])
        log(f"{top}: {len(other_kinds)} files of other kinds than {', '.join(args.kind)} skipped ({shown}"
            f"{' ...' if len(other_kinds) > 3 else ''})")
    return found


def copy_hashed(src, dst, on_bytes=None, limit: int | None = None) -> tuple[int, str]:  # noqa: ANN001 (open binary files)
    """The bytes of the open file ``src`` written to the open file ``dst``, CHUNK by CHUNK and hashed on
    the way: the size and sha256 of what was written (at most ``limit`` bytes, then StageError). The source
    read again could give other bytes (a cache file may change while it is copied)."""
    h, size = hashlib.sha256(), 0
    while chunk := src.read(CHUNK):
        size += len(chunk)
        if limit is not None and size > limit:
            raise StageError(f"more than {limit} bytes")
        dst.write(chunk)
        h.update(chunk)
        if on_bytes:
            on_bytes(len(chunk))
    return size, h.hexdigest()


def copy_directory(args: argparse.Namespace, root: str) -> tuple[dict, set[str]]:
    """The directory source copied into the revision directory: the manifest of what is here now, made
    anew from the bytes copied (the source is a cache: it changes between runs), and the names copied.
    A file here that matches its source is kept: the source is read to compare only when the copy here
    has its size. Each source file is opened beneath --from without following a symlink (open_beneath)
    and must still be a regular file once open."""
    relay: Relay = args.relay
    hashes: Hashes = args.hashes
    found = directory_files(args)
    for name in found:
        inside(root, name, args.from_dir)
    need_disk(args, root, {"files": [{"path": n, "size": size} for n, size in found.items()]})
    files: list[dict] = []
    fresh: set[str] = set()
    top = os.open(args.from_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name, size in sorted(found.items()):
            dest = os.path.join(root, name)
            try:
                # Never a link, never waiting on a fifo, and still a regular file once open.
                fd = open_beneath(top, name, os.O_RDONLY | os.O_NONBLOCK)
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    os.close(fd)
                    raise OSError(errno.EINVAL, "no longer a regular file")
            except OSError as err:  # gone since it was listed (a cache evicts), swapped, or unreadable: not staged
                log(f"{args.from_dir}: {name!r} skipped (cannot read it: {err.strerror or err})")
                continue
            partial = dest + ".partial"
            try:
                with open(fd, "rb") as f:
                    if os.path.isfile(dest) and os.path.getsize(dest) == os.fstat(f.fileno()).st_size:
                        e = {"path": name, "size": os.path.getsize(dest),
                             "sha256": read_hashed(f, hashlib.sha256()).hexdigest()}
                        if hashes.ok(e):
                            files.append(e)
                            continue
                        f.seek(0)
                    os.makedirs(os.path.dirname(dest), exist_ok=True)
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(partial)  # a cut copy, or a link planted there: never written through
                    with open(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "wb") as out:
                        size, sha = copy_hashed(f, out, relay.got, MAX_DIRECTORY_FILE)
                os.replace(partial, dest)
            except StageError as err:  # grew past the bound while it was copied
                with contextlib.suppress(FileNotFoundError):
                    os.remove(partial)
                log(f"{args.from_dir}: {name!r} skipped ({err})")
                continue
            except OSError as err:
                raise StageError(f"{name}: cannot copy it from {args.from_dir} into {root}: {err.strerror or err}") \
                    from None
            hashes.remember(name, sha)
            files.append({"path": name, "size": size, "sha256": sha})
            fresh.add(name)
    finally:
        os.close(top)
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


def get_json(url: str, timeout: float, auth: Auth | None = None) -> object:
    """A JSON document from a relay host: at most MAX_JSON bytes, never redirected. With ``auth`` (the stack's
    relay key) the request goes signed and the answer must come signed with the key, for this request's
    nonce (not replayed): else Forged, naming the host."""
    headers, nonce = auth.headers(url) if auth is not None else ({}, "")
    try:
        with open_url(url, timeout, headers) as r:
            body = r.read(MAX_JSON + 1)
            mac = r.headers.get(MAC_HEADER, "")
    except urllib.error.HTTPError as e:
        if e.code == 401 and auth is not None:
            raise Forged(f"refusing {url}: HTTP 401: {e.read(300).decode(errors='replace').strip()} (this host's "
                         "relay key is not the one its source holds)") from None
        raise SourceFailed(f"{url}: HTTP {e.code}") from None
    except (urllib.error.URLError, OSError, TimeoutError, http.client.HTTPException) as e:
        raise SourceFailed(f"{url}: {getattr(e, 'reason', None) or e}") from None
    if len(body) > MAX_JSON:
        raise SourceFailed(f"{url}: more than {MAX_JSON} bytes")
    if auth is not None and not hmac.compare_digest(mac.encode("latin-1"), sign(auth.key, nonce, body).encode()):
        raise Forged(f"refusing the manifest from {url}: {'a wrong signature' if mac else 'not signed'} "
                     f"(not signed with this stack's relay key: another process on that port, a host of another "
                     f"stack, or a forgery)")
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
    auth: Auth = args.auth
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
            say_done(f"{sources[at]}/{DONE}?moved=1", auth, timeout=3)
        at, answered, since, last_sig = nxt, False, time.monotonic(), None

    while True:
        if time.monotonic() > deadline:
            if not known:
                raise StageError(f"{', '.join(sources)} did not answer within {args.timeout}s")
            raise StageError(f"timed out after {args.timeout}s with {len(have)} files "
                             f"(sources: {', '.join(sources)})")
        base = sources[at]
        try:
            raw = get_json(f"{base}/{PROGRESS}", args.stall, auth)
        except SourceFailed as e:
            if answered:
                move(f"failed ({e})")
            elif time.monotonic() - since > args.stall and (up := first_answering(sources, at, auth)) is not None:
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
                    sha = download(f"{base}/{urllib.parse.quote(name)}", p, e["size"], timeout=args.stall,
                                   on_bytes=relay.got, follow=False, auth=auth)
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
        say_done(f"{base}/{DONE}", auth)
    where = ", ".join(f"{n} from {b}" for b, n in copied.items()) or "none"
    log(f"peer: {sum(copied.values())} files copied ({where}), {len(kept)} already here and verified")


def first_answering(sources: list[str], at: int, auth: Auth) -> int | None:
    """The index of the first source after ``at`` (in failover order) that answers, signed, if any (one that
    answers unsigned is Forged: never taken for a source that answers)."""
    for i in list(range(at + 1, len(sources))) + list(range(at)):
        with contextlib.suppress(SourceFailed):
            get_json(f"{sources[i]}/{PROGRESS}", 5, auth)
            return i
    return None


def say_done(url: str, auth: Auth, timeout: float = 5) -> None:
    """Tell a host copied from that this one needs nothing more from it (if it still listens), signed."""
    with contextlib.suppress(OSError, http.client.HTTPException), \
            open_url(url, timeout, auth.headers(url)[0]) as r:  # (URLError too)
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
    if (args.role == "peer" or args.serve) and not args.relay_key_file:
        raise StageError(f"{'--serve' if args.serve else '--role peer'} needs --relay-key-file F (the stack's relay key): "
                         "a relay host is never served, nor trusted, by its port alone")
    if not CLIENT_NAME.fullmatch(args.name):
        raise StageError(f"--name {args.name!r}: not a host name")
    key = relay_key(args.relay_key_file) if args.relay_key_file else None  # (read before anything is written)
    children = [c for c in (args.children or "").split(",") if c]
    with locked(args.path):
        root = revision_dir(args.path, args.revision)
        os.makedirs(root, exist_ok=True)
        args.relay = relay = Relay(args.revision, args.name)
        relay.progress_path = os.path.join(root, PROGRESS)
        relay.key = key
        args.auth = Auth(key, args.name) if key is not None else None
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
    Each is copied to a temporary name beside it, checked against the manifest on the way, and linked into
    place only if the name is still free. A manifest path that would land outside --into ('..', a symlink on
    the way) or that is not of the --include/--kind the staging takes is refused before anything is
    written; then every folder is opened from its parent without following a symlink, so the owner of
    --into (the services' user, whose tree it is) cannot lead this root process elsewhere meanwhile, and
    what is created is given to --owner. Running it again installs nothing more."""
    owner = None
    if args.owner:
        try:
            pw = pwd.getpwnam(args.owner)
        except KeyError:
            raise StageError(f"--owner {args.owner}: no such user") from None
        owner = (pw.pw_uid, pw.pw_gid)
    root, manifest = staged_whole(args, "nothing installed")
    files = manifest["files"]
    origin = os.path.join(root, MANIFEST)
    for e in files:
        inside(args.into, e["path"], origin)
        if not wanted(e["path"], args.include, args.kind):
            raise StageError(f"refusing the manifest from {origin}: {e['path']!r} is not under "
                             f"{', '.join(args.include) or '--into'} or not of the kinds "
                             f"{', '.join(args.kind) or '(any)'}")
    installed = kept = total = 0
    os.makedirs(args.into, exist_ok=True)
    try:
        top = os.open(args.into, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        raise StageError(f"cannot install into {args.into}: {err.strerror or err}") from None
    try:
        for e in files:
            try:
                if install_one(top, os.path.join(root, e["path"]), e, owner):
                    installed += 1
                    total += e["size"]
                else:
                    kept += 1
            except OSError as err:
                raise StageError(f"cannot install {e['path']} into {args.into}: {err.strerror or err}") from None
    finally:
        os.close(top)
    log(f"installed {installed} files ({total} bytes) into {args.into}, {kept} already there")
    return 0


def install_one(top: int, src: str, e: dict, owner: tuple[int, int] | None) -> bool:
    """Install the staged file ``src`` at e["path"] under the folder ``top`` (a descriptor) unless something is
    there; False when something was. Folders are made and opened one by one without following a symlink
    (one on the way fails with ELOOP or ENOTDIR), the file is written under a temporary name there, checked
    against ``e`` and linked to its name (which fails if the name was taken meanwhile: kept)."""
    *folders, last = e["path"].split("/")
    fd = os.dup(top)
    try:
        for part in folders:
            made = False
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o755, dir_fd=fd)
                made = True
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
            if made and owner:
                os.fchown(fd, *owner)
        with contextlib.suppress(FileNotFoundError):
            os.stat(last, dir_fd=fd, follow_symlinks=False)
            return False
        tmp = f".glm-install-{secrets.token_hex(8)}"
        out_fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=fd)
        try:
            with open(out_fd, "wb") as out, open(src, "rb") as f:
                got = copy_hashed(f, out)
                os.fchmod(out.fileno(), 0o644)
                if owner:
                    os.fchown(out.fileno(), *owner)
            if got != (e["size"], e["sha256"]):
                raise StageError(f"{src}: not the bytes its manifest lists (changed since it was staged)")
            try:
                os.link(tmp, last, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
            except FileExistsError:
                return False  # its owner made one meanwhile: what it built wins
            return True
        finally:
            os.unlink(tmp, dir_fd=fd)
    finally:
        os.close(fd)


def cmd_relay(args: argparse.Namespace) -> int:
    """A staged revision served as a relay parent serves it (every file published, complete) until each child
    said it has every file or went silent for --stall seconds: the pool's first host runs it as a transient
    unit, so the steps of the hosts that copy from it can follow its own. Exit 1 naming a child that left
    before it had every file."""
    if not args.relay_key_file:
        raise StageError("relay needs --relay-key-file F (the stack's relay key): a relay is never served by its "
                         "port alone")
    key = relay_key(args.relay_key_file)
    root, manifest = staged_whole(args, "nothing to serve")
    relay = Relay(args.revision, args.name)
    relay.key = key
    relay.commit = manifest.get("commit")
    relay.adopt(manifest["files"])
    for e in relay.files:
        relay.publish(e["path"])
    relay.publish(complete=True)
    children = [c for c in args.children.split(",") if c]
    server = start_relay(relay, root, args.bind, args.stall)
    try:
        notify_ready()  # (a transient unit of Type=notify: its start, and the step, wait for this)
        log(f"{args.revision}: serving {len(relay.files)} files on {args.bind} to {', '.join(children)}")
        left = wait_for_children(relay, children, args.stall)
    finally:
        server.shutdown()
        server.server_close()
    if left:
        raise StageError(f"{', '.join(left)} stopped copying from this host before they had every file")
    log(f"relay on {args.bind} stopped: every host copying from here is done or left")
    return 0


def notify_ready() -> None:
    """Tell systemd this service is ready (sd_notify READY=1), when it runs as a unit of Type=notify."""
    where = os.environ.get("NOTIFY_SOCKET")
    if not where:
        return
    address = "\0" + where[1:] if where.startswith("@") else where  # "@": an abstract socket
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(address)
        s.sendall(b"READY=1")


def cmd_serve(args: argparse.Namespace) -> int:
    """Every file of a folder: the mirror stand-in (a relay is ``relay`` or ``stage --serve``, signed)."""
    with files_server(args.dir, args.bind) as httpd:
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
    s.add_argument("--kind", action="append", default=[])
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
    i.add_argument("--owner")
    i.add_argument("--include", action="append", default=[])
    i.add_argument("--kind", action="append", default=[])
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
        return EXIT_FORGED if isinstance(e, Forged) else 1


if __name__ == "__main__":
    sys.exit(main())
