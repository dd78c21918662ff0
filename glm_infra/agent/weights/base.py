"""Names, limits and errors the weights program shares; the manifest's rules; hashing, the digest cache
and the disk a staging needs."""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import hashlib
import json
import os
import re
import stat
import threading


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
