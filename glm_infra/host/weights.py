#!/usr/bin/env python3
"""Stage a model checkpoint on a host: read once from the source on a seed host, relayed host to host
down a tree, verified everywhere, resumed after interruption, revisions switched atomically. Runs on
the hosts (stdlib only).

Layout under the model path P (what vLLM serves):
    P                          symlink → P.revisions/<revision>
    P.revisions/<revision>/    the checkpoint; ``.glm-manifest.json`` lists every file with size
                               and sha256; ``.glm-complete`` exists once every file is verified
    P.revisions/.lock          held while a staging runs

    weights.py stage --role seed --source mirror --url URL --revision R --path P [RELAY]
    weights.py stage --role seed --source huggingface --repo ORG/NAME --revision R --path P [RELAY]
    weights.py stage --role peer --peer URL [--peer URL ...] --revision R --path P [RELAY]
        RELAY: --name HOST [--serve ADDR:PORT --children HOST,HOST] [--stall SECONDS]
    weights.py stage --source local --path P       (already on every host: verify only)
    weights.py serve --dir D --bind ADDR:PORT [--all]   (a static mirror: the simulated model source)
    weights.py verify --revision R --path P        (full sha256 check; exit 1 naming bad files)
    weights.py prune --revision R --path P         (remove every other revision)
    weights.py remove --path P                     (remove the checkpoint and its revisions)

Every host publishes each file in ``.glm-progress.json`` only after verifying it; with ``--serve`` a
thread of the staging serves the published files (never a partial one) to the hosts that copy from
this one (``--children``) and the staging ends once each has said it has every file (``/.glm-done``)
or went silent for ``--stall`` seconds. A peer copies each file as soon as the first of its
``--peer`` hosts (its parent; then each ancestor up to the seed) has published it, verifies it
against the sha256 there, and moves to the next one when its source fails: refused or reset after
it answered, a short body, bad bytes, no progress for ``--stall`` seconds.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import fcntl
import hashlib
import http.client
import http.server
import json
import os
import re
import shutil
import socketserver
import subprocess
import sys
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
HOST = os.uname().nodename


def log(msg: str) -> None:
    print(f"{HOST}: weights: {msg}", flush=True)


class StageError(Exception):
    pass


class NotThere(StageError):
    """The server has no such file (yet): a seed that is re-verifying withdraws what it re-checks."""


# --- files ---------------------------------------------------------------------------------------


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


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


def safe_name(name: str) -> str:
    """A manifest entry must stay inside the revision directory."""
    norm = os.path.normpath(name)
    if norm.startswith(("/", "..")) or norm.startswith(".glm-") or norm in (".", ""):
        raise StageError(f"refusing unsafe file name {name!r} in the manifest")
    return norm


def index_shards(root: str) -> set[str]:
    """Shards named by model.safetensors.index.json (the weight_map values)."""
    index = os.path.join(root, "model.safetensors.index.json")
    if not os.path.exists(index):
        return set()
    return set(read_json(index).get("weight_map", {}).values())


def file_ok(root: str, e: dict, full: bool = True) -> bool:
    """The file is there with its size and (full) its sha256 — or, for a hub file kept in git whose
    sha256 is not known yet, its git blob id."""
    p = os.path.join(root, e["path"])
    if not os.path.isfile(p) or os.path.getsize(p) != e["size"]:
        return False
    if not full:
        return True
    if e.get("git_blob"):
        return git_blob_sha1(p) == e["git_blob"]
    return sha256_file(p) == e["sha256"]


def git_blob_sha1(path: str) -> str:
    h = hashlib.sha1(f"blob {os.path.getsize(path)}\0".encode())
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def check_files(root: str, manifest: dict, full: bool) -> list[str]:
    """Names of files that are missing, of the wrong size or (full) of the wrong sha256."""
    bad = []

    def one(entry: dict) -> str | None:
        return None if file_ok(root, entry, full) else entry["path"]

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 2)) as ex:
        bad = [b for b in ex.map(one, manifest["files"]) if b]
    unlisted = index_shards(root) - {e["path"] for e in manifest["files"]}
    return sorted(bad) + sorted(f"{s} (in the index, not in the manifest)" for s in unlisted)


# --- transfers -----------------------------------------------------------------------------------


class SourceFailed(StageError):
    """The host copied from failed: refused, reset, a short body, a stalled transfer."""


class BadBytes(StageError):
    """What arrived does not match the manifest's sha256."""


def _sha_of_prefix(path: str) -> "hashlib._Hash":
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h


def download(url: str, dest: str, size: int | None, headers: dict[str, str] | None = None, timeout: float = 60,
             on_bytes=None) -> str:
    """One attempt at url → dest, resuming dest.partial with a Range request; streamed through a CHUNK
    buffer (never a whole file in memory) and hashed on the way. Returns the sha256 of dest."""
    partial = dest + ".partial"
    have = os.path.getsize(partial) if os.path.exists(partial) else 0
    if size is not None and have > size:
        os.remove(partial)
        have = 0
    req = urllib.request.Request(url, headers=dict(headers or {}))
    if have:
        req.add_header("Range", f"bytes={have}-")
    h = _sha_of_prefix(partial) if have else hashlib.sha256()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            if have and resp.status != 206:  # the server sends it all again: start over
                h, have = hashlib.sha256(), 0
            buf = memoryview(bytearray(CHUNK))  # one bounded buffer for the whole file
            with open(partial, "ab" if have else "wb") as f:
                while n := resp.readinto(buf):
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
        raise SourceFailed(f"{url}: {getattr(e, 'reason', None) or e!r}") from None
    got = os.path.getsize(partial)
    if size is not None and got != size:
        raise SourceFailed(f"{url}: short body ({got} of {size} bytes)")
    os.replace(partial, dest)
    return h.hexdigest()


def fetch(url: str, dest: str, size: int | None, headers: dict[str, str] | None = None, tries: int = 5,
          on_bytes=None) -> str:
    """download() with retries against one source (the mirror): resumes where the last try stopped."""
    for attempt in range(1, tries + 1):
        try:
            return download(url, dest, size, headers, on_bytes=on_bytes)
        except SourceFailed as e:
            if attempt == tries:
                raise StageError(f"{e} (after {tries} tries)") from None
        time.sleep(min(2 * attempt, 10))
    raise AssertionError("unreachable")


def fetch_verified(url: str, root: str, entry: dict, headers: dict[str, str] | None = None, on_bytes=None) -> None:
    dest = os.path.join(root, entry["path"])
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    for _ in range(2):
        if fetch(url, dest, entry["size"], headers, on_bytes=on_bytes) == entry["sha256"]:
            return
        os.remove(dest)
        log(f"{entry['path']}: sha256 mismatch after download, fetching again")
    raise StageError(f"{entry['path']}: sha256 mismatch twice from {url}")


# --- what a host serves while it stages: its verified files, to the hosts that copy from it ---------


class Relay:
    """The published state of this host (shared by the staging and its server thread) and who copies
    from it. Only files this host verified are ever listed or served."""

    def __init__(self, revision: str, name: str) -> None:
        self.lock = threading.Lock()
        self.revision, self.name = revision, name
        self.files: list[dict] = []
        self.published: list[str] = []
        self.complete = False
        self.received = 0  # bytes written so far: a host that is still receiving is not stalled
        self.clients: dict[str, dict] = {}  # host → {"last": monotonic, "active": transfers, "done": bool}
        self.progress_path: str | None = None

    def publish(self, name: str = "", complete: bool = False) -> None:
        with self.lock:
            if name and name not in self.published:
                self.published.append(name)
            self.complete = self.complete or complete
            doc = self.snapshot()
        if self.progress_path:
            write_json(self.progress_path, doc)

    def snapshot(self) -> dict:
        return {"revision": self.revision, "files": self.files, "published": list(self.published),
                "complete": self.complete, "received": self.received}

    def got(self, n: int) -> None:
        with self.lock:
            self.received += n

    def seen(self, client: str, active: int = 0, done: bool = False) -> None:
        with self.lock:
            c = self.clients.setdefault(client, {"last": 0.0, "active": 0, "done": False})
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
        client = urllib.parse.parse_qs(url.query).get("host", [self.client_address[0]])[0]
        relay = self.relay
        if relay is not None:
            relay.seen(client, done=name == DONE)
            if name == DONE:
                return self._send(b"ok\n", "text/plain")
            with relay.lock:
                doc, published = relay.snapshot(), set(relay.published)
            if name == PROGRESS:
                return self._send(json.dumps(doc).encode(), "application/json")
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
        rng = self.headers.get("Range", "")
        if rng.startswith("bytes=") and rng.endswith("-") and rng[6:-1].isdigit():
            start = int(rng[6:-1])
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
                self.connection.sendfile(f, start, size - start)
        finally:
            if relay is not None:
                relay.seen(client, active=-1)

    def _send(self, body: bytes, kind: str) -> None:
        self.send_response(200)
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


def start_relay(relay: Relay, root: str, bind: str, stall: float) -> _Server:
    """Serve this host's verified files from a thread of the staging itself: nothing outlives the step."""
    host, _, port = bind.rpartition(":")
    # A blocked write to a client that went away ends after ``stall`` seconds.
    handler_class = type("Handler", (_Files,), {"relay": relay, "published_only": True, "timeout": stall})
    handler = lambda *a, **kw: handler_class(*a, directory=root, **kw)  # noqa: E731
    try:
        server = _Server((host.strip("[]"), int(port)), handler)
    except OSError as e:
        raise StageError(f"cannot serve the relay on {bind}: {e.strerror or e}") from None
    threading.Thread(target=server.serve_forever, name="relay", daemon=True).start()
    return server


def info_came(clients: dict[str, dict], c: str) -> bool:
    return clients.get(c, {}).get("last", 0.0) > 0


def wait_for_children(relay: Relay, children: list[str], stall: float) -> list[str]:
    """Keep serving until every host that copies from here has everything: each says so (/.glm-done,
    also when it moves to another host). One that made no request for ``stall`` seconds (or never
    came within ``stall`` seconds of this host finishing: not deployed with it) is left behind with a
    log line. Returns those that came and stopped before they had every file."""
    since = time.monotonic()
    told = 0.0
    left: list[str] = []
    while True:
        now = time.monotonic()
        with relay.lock:
            clients = {k: dict(v) for k, v in relay.clients.items()}
        waiting, gone = [], []
        for c in sorted(set(children) | set(clients)):
            info = clients.get(c)
            if info and info["done"]:
                continue
            last = max(info["last"], since) if info else since
            if (info and info["active"] > 0) or now - last < stall:
                waiting.append(c)
            else:
                gone.append((c, "made no request" if info else "never came"))
        for c, why in gone:
            if c not in relay.clients or not relay.clients[c].get("left"):
                log(f"{c} {why} for {stall:g}s: not waiting for it any longer")
                with relay.lock:
                    relay.clients.setdefault(c, {"last": 0.0, "active": 0, "done": False})["left"] = True
                if info_came(clients, c):
                    left.append(c)
        if not waiting:
            return left
        if now - told >= 30:
            log(f"serving {', '.join(waiting)} until they have every file")
            told = now
        time.sleep(0.2)


# --- the seed ------------------------------------------------------------------------------------


def source_manifest(args: argparse.Namespace, root: str) -> dict:
    """Files of the checkpoint with sizes and sha256, from the source. From the hub, a small file kept
    in git (not LFS) has no sha256 yet, only its git blob id: the seed hashes it once downloaded."""
    if args.source == "mirror":
        url = f"{args.url.rstrip('/')}/{args.revision}/manifest.json"
        tmp = os.path.join(root, ".glm-source-manifest.json")
        fetch(url, tmp, None)
        m = read_json(tmp)
        os.remove(tmp)
    else:  # huggingface: the hub knows every file's size and LFS sha256 (or git blob id)
        m = hf_manifest(args)
    files = []
    for e in m["files"]:
        f = {"path": safe_name(e["path"]), "size": int(e["size"]), "sha256": e["sha256"]}
        if not e["sha256"]:
            f["git_blob"] = e["blob"]
        files.append(f)
    return {"revision": args.revision, "files": sorted(files, key=lambda e: e["path"])}


def hf_manifest(args: argparse.Namespace) -> dict:
    code = (
        "import json,sys;from huggingface_hub import HfApi;"
        "i=HfApi().model_info(sys.argv[1],revision=sys.argv[2],files_metadata=True);"
        "print(json.dumps([{'path':s.rfilename,'size':s.size,'blob':s.blob_id,"
        "'sha256':(s.lfs.sha256 if s.lfs else None)} for s in i.siblings]))"
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
    return {"files": [f for f in json.loads(out.stdout) if f["size"] is not None and (f["sha256"] or f["blob"])]}


def hf_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    if args.token_file and os.path.exists(args.token_file):
        with open(args.token_file) as f:
            for line in f:
                k, _, v = line.strip().partition("=")
                if k == "HF_TOKEN" and v:
                    env["HF_TOKEN"] = v
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
    p = subprocess.Popen([hf, "download", args.repo, *[e["path"] for e in entries], "--revision", args.revision,
                          "--local-dir", root], env=hf_env(args), stdout=subprocess.DEVNULL)
    seen = 0
    while p.poll() is None:  # what the hub client wrote so far: the hosts copying from here see progress
        time.sleep(2)
        now = _tree_bytes(root)
        if now > seen:
            args.relay.got(now - seen)
            seen = now
    if p.returncode != 0:
        raise subprocess.CalledProcessError(p.returncode, p.args)
    for e in entries:
        if not file_ok(root, e):
            raise StageError(f"{e['path']}: the hub delivered bytes that do not match its sha256/size")
        if e.get("git_blob"):  # from now on every host checks it like any other file
            e["sha256"] = sha256_file(os.path.join(root, e["path"]))
            del e["git_blob"]


def stage_seed(args: argparse.Namespace, root: str) -> None:
    relay: Relay = args.relay
    manifest = source_manifest(args, root)
    need_disk(args, root, manifest)
    if args.source == "huggingface":
        # The small git-kept files first (config, tokenizer): then every file has a sha256 the peers
        # can check before anything is published.
        small = [e for e in manifest["files"] if e.get("git_blob")]
        good = [e for e in small if file_ok(root, e)]
        for e in good:
            e["sha256"] = sha256_file(os.path.join(root, e["path"]))
            del e["git_blob"]
        missing = [e for e in small if e.get("git_blob")]
        if missing:
            hf_download(args, root, missing)
        fresh = {e["path"] for e in missing}
    else:
        fresh = set()
    write_json(os.path.join(root, MANIFEST), manifest)
    relay.files = manifest["files"]
    relay.publish()
    kept = fetched = 0
    todo: list[dict] = []
    for e in manifest["files"]:
        p = os.path.join(root, e["path"])
        if file_ok(root, e):
            if e["path"] in fresh:
                fetched += 1
            else:
                kept += 1
            relay.publish(e["path"])
        elif args.source == "mirror":
            if os.path.exists(p):
                log(f"{e['path']}: does not match the manifest, fetching it again")
                os.remove(p)
            fetch_verified(f"{args.url.rstrip('/')}/{args.revision}/{urllib.parse.quote(e['path'])}", root, e,
                           on_bytes=relay.got)
            fetched += 1
            relay.publish(e["path"])
        elif args.source == "huggingface":
            if os.path.exists(p):
                log(f"{e['path']}: does not match the hub's sha256, downloading it again")
            todo.append(e)
        else:
            raise StageError(f"{e['path']}: missing or does not match its sha256 at {p}")
    for i in range(0, len(todo), HF_BATCH):
        batch = todo[i:i + HF_BATCH]
        hf_download(args, root, batch)
        fetched += len(batch)
        for e in batch:
            relay.publish(e["path"])
        log(f"{fetched}/{len(todo)} files downloaded from {args.repo}")
    relay.publish(complete=True)
    log(f"seed: {fetched} files from the {args.source} source, {kept} already here and verified")


# --- a peer: copies from its parent in the relay tree, from the next ancestor up when that fails ----


def get_json(url: str, timeout: float) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.load(r)
    except (urllib.error.URLError, OSError, TimeoutError, http.client.HTTPException, ValueError) as e:
        raise SourceFailed(f"{url}: {getattr(e, 'reason', None) or e!r}") from None


def stage_peer(args: argparse.Namespace, root: str) -> None:
    """Copy every file as soon as the host copied from has verified it (pipelined), verify it here,
    publish it. The sources are the parent first, then each ancestor up to the seed: a source that
    fails (refused or reset after it answered, a short body, bad bytes, no progress for ``--stall``
    seconds) is left for the next one; after the seed, the parent again."""
    relay: Relay = args.relay
    sources = [u.rstrip("/") for u in args.peer]
    me = urllib.parse.urlencode({"host": args.name})
    deadline = time.monotonic() + args.timeout
    at = 0
    answered = False  # the current source answered at least once
    since = time.monotonic()  # when the current source last showed progress (or we came to it)
    last_sig: tuple | None = None
    have: set[str] = set()
    kept = 0
    copied: dict[str, int] = {}
    checked_disk = False
    started = time.monotonic()
    told = started
    # What an earlier staging of this revision verified here is published at once (its children start
    # on it), and a complete copy needs no parent at all: one whose staging is over serves nobody.
    local: set[str] = set()
    with contextlib.suppress(OSError, ValueError, KeyError):
        earlier = read_json(os.path.join(root, MANIFEST))
        if earlier["revision"] == args.revision:
            relay.files = earlier["files"]
            relay.publish()
            local = {e["path"] for e in earlier["files"]}
            for e in earlier["files"]:
                if file_ok(root, e):
                    have.add(e["path"])
                    kept += 1
                    relay.publish(e["path"])

    def move(why: str, to: int | None = None) -> None:
        nonlocal at, answered, since, last_sig
        nxt = (at + 1) % len(sources) if to is None else to
        role = "the seed" if nxt == len(sources) - 1 else ("its parent" if nxt == 0 else "an ancestor")
        log(f"{sources[at]}: {why}; copying from {sources[nxt]} ({role}) now")
        if nxt != at:  # it need not wait for this host any longer (if it still listens)
            with contextlib.suppress(SourceFailed):
                get_json_done(f"{sources[at]}/{DONE}?{me}&moved=1", timeout=3)
        at, answered, since, last_sig = nxt, False, time.monotonic(), None

    while True:
        if time.monotonic() > deadline:
            if not checked_disk:
                raise StageError(f"{', '.join(sources)} did not answer within {args.timeout}s")
            raise StageError(f"timed out after {args.timeout}s with {len(have)} files "
                             f"(sources: {', '.join(sources)})")
        base = sources[at]
        try:
            progress = get_json(f"{base}/{PROGRESS}?{me}", timeout=args.stall)
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
        if progress.get("revision") != args.revision:
            if time.monotonic() - since > args.stall:
                move(f"serves revision {progress.get('revision')}, not {args.revision}")
            else:
                time.sleep(1)
            continue
        answered = True
        entries = {e["path"]: e for e in progress["files"]}
        if not checked_disk and entries:
            write_json(os.path.join(root, MANIFEST), {"revision": args.revision, "files": progress["files"]})
            need_disk(args, root, {"files": progress["files"]})
            relay.files = progress["files"]
            relay.publish()
            checked_disk = True
        sig = (len(progress["published"]), progress.get("received"), progress["complete"])
        if sig != last_sig:
            last_sig, since = sig, time.monotonic()
        failed = None
        for name in progress["published"]:
            if name in have:
                continue
            e = entries[name]
            p = os.path.join(root, name)
            if file_ok(root, e):
                kept += 1
            else:
                if os.path.exists(p):
                    log(f"{name}: does not match its sha256, copying it again")
                    os.remove(p)
                os.makedirs(os.path.dirname(p), exist_ok=True)
                try:
                    sha = download(f"{base}/{urllib.parse.quote(name)}?{me}", p, e["size"], timeout=args.stall,
                                   on_bytes=relay.got)
                except NotThere:
                    break  # listed in a progress file the source has since rewritten: next round
                except SourceFailed as err:
                    failed = f"failed ({err})"
                    break
                if sha != e["sha256"]:
                    os.remove(p)
                    failed = f"{name}: sha256 mismatch (bytes rejected)"
                    break
                copied[base] = copied.get(base, 0) + 1
            have.add(name)
            relay.publish(name)
            since = time.monotonic()
        if failed:
            move(failed)
            continue
        if progress["complete"] and entries and have >= set(entries):
            break
        if time.monotonic() - since > args.stall:
            move(f"no progress for {args.stall:g}s")
            continue
        time.sleep(0.5)
    relay.publish(complete=True)
    for base in sources:  # every host copied from may be waiting for this one
        with contextlib.suppress(SourceFailed):
            get_json_done(f"{base}/{DONE}?{me}")
    where = ", ".join(f"{n} from {b}" for b, n in copied.items()) or "none"
    log(f"peer: {sum(copied.values())} files copied ({where}), {kept} already here and verified")


def first_answering(sources: list[str], at: int, me: str) -> int | None:
    """The index of the first source after ``at`` (in failover order) that answers, if any."""
    for i in list(range(at + 1, len(sources))) + list(range(0, at)):
        with contextlib.suppress(SourceFailed):
            get_json(f"{sources[i]}/{PROGRESS}?{me}", timeout=5)
            return i
    return None


def get_json_done(url: str, timeout: float = 5) -> None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            r.read()
    except (urllib.error.URLError, OSError, TimeoutError, http.client.HTTPException) as e:
        raise SourceFailed(str(e)) from None


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
        bad = check_files(path, read_json(manifest_path), full=True)
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
    if args.role == "peer" and not args.peer:
        raise StageError("--role peer needs at least one --peer URL (its parent, then its ancestors)")
    children = [c for c in (args.children or "").split(",") if c]
    with locked(args.path):
        root = revision_dir(args.path, args.revision)
        os.makedirs(root, exist_ok=True)
        args.relay = relay = Relay(args.revision, args.name)
        relay.progress_path = os.path.join(root, PROGRESS)
        server = start_relay(relay, root, args.serve, args.stall) if args.serve else None
        try:
            complete = os.path.join(root, COMPLETE)
            with contextlib.suppress(FileNotFoundError):
                os.remove(complete)
            if args.role == "seed":
                stage_seed(args, root)
            else:
                stage_peer(args, root)
            manifest = read_json(os.path.join(root, MANIFEST))
            bad = check_files(root, manifest, full=False)
            if bad:
                raise StageError(f"after staging, not in place: {', '.join(bad[:5])}")
            with open(complete, "w") as f:
                f.write(f"{len(manifest['files'])} files, {sum(e['size'] for e in manifest['files'])} bytes\n")
            switch(args.path, args.revision)
            total = sum(e["size"] for e in manifest["files"])
            log(f"{args.revision}: {len(manifest['files'])} files, {total / 1e9:.2f} GB verified at {args.path}")
            if server is not None:
                left = wait_for_children(relay, children, args.stall)
                log(f"relay on {args.serve} stopped: every host copying from here is done or left")
                if left:  # failed, so that the next `up` stages here again and serves them
                    raise StageError(f"staged here, but {', '.join(left)} stopped copying from this host before "
                                     f"they had every file; the next `pulumi up` stages both again")
        finally:
            if server is not None:
                server.shutdown()
                server.server_close()
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Read-only: the revision is staged, the model path serves it, and every file is there with its
    size and (unless --quick) its sha256."""
    root = revision_dir(args.path, args.revision)
    try:
        manifest = read_json(os.path.join(root, MANIFEST))
    except OSError:
        print(f"{HOST}: weights: {args.revision} is not staged at {args.path}", file=sys.stderr)
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
        if name not in (args.revision, ".lock") and os.path.isdir(os.path.join(top, name)):
            shutil.rmtree(os.path.join(top, name))
            log(f"removed the old revision {name}")
    return 0


def cmd_remove(args: argparse.Namespace) -> int:
    if os.path.islink(args.path):
        os.remove(args.path)
    shutil.rmtree(revisions_dir(args.path), ignore_errors=True)
    log(f"removed {args.path} and its revisions")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    host, _, port = args.bind.rpartition(":")
    handler_class = type("Handler", (_Files,), {"published_only": not args.all})
    handler = lambda *a, **kw: handler_class(*a, directory=args.dir, **kw)  # noqa: E731
    with _Server((host.strip("[]"), int(port)), handler) as httpd:
        httpd.serve_forever()
    return 0


def main(argv: list[str] | None = None) -> int:
    global HOST
    ap = argparse.ArgumentParser(prog="weights.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stage")
    s.add_argument("--role", choices=["seed", "peer"], default="seed")
    s.add_argument("--source", choices=["huggingface", "mirror", "local"], default="mirror")
    s.add_argument("--url", help="mirror base URL (files under URL/REVISION/)")
    s.add_argument("--repo", help="Hugging Face repository")
    s.add_argument("--hf-python", default="/opt/glm-infra/hf/bin/python", help="python of the venv with the hf CLI")
    s.add_argument("--token-file", help="EnvironmentFile with HF_TOKEN=")
    s.add_argument("--peer", action="append", default=[],
                   help="role peer: a host to copy from, repeated: the parent first, then each ancestor up to the seed")
    s.add_argument("--serve", metavar="ADDR:PORT", help="serve verified files here while staging (hosts with children)")
    s.add_argument("--children", default="", help="comma-separated names of the hosts that copy from this one")
    s.add_argument("--name", default=os.uname().nodename, help="this host's name in the relay (default: its hostname)")
    s.add_argument("--stall", type=float, default=120,
                   help="seconds without progress before a peer leaves the host it copies from")
    s.add_argument("--revision", default="")
    s.add_argument("--path", required=True)
    s.add_argument("--margin-gb", type=float, default=10)
    s.add_argument("--timeout", type=int, default=86400, help="seconds a peer may take in all")
    for name in ("verify", "prune"):
        p = sub.add_parser(name)
        p.add_argument("--revision", required=True)
        p.add_argument("--path", required=True)
        if name == "verify":
            p.add_argument("--quick", action="store_true", help="sizes only, no sha256")
    r = sub.add_parser("remove")
    r.add_argument("--path", required=True)
    v = sub.add_parser("serve")
    v.add_argument("--dir", required=True)
    v.add_argument("--bind", required=True)
    v.add_argument("--all", action="store_true", help="serve every file (a mirror), not only published ones")
    args = ap.parse_args(argv)
    HOST = getattr(args, "name", None) or HOST
    handlers = {"stage": cmd_stage, "verify": cmd_verify, "prune": cmd_prune, "remove": cmd_remove,
                "serve": cmd_serve}
    try:
        return handlers[args.cmd](args)
    except StageError as e:
        print(f"{HOST}: weights: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
