"""The commands on the staged checkout (stage, verify, prune, remove), the disk it needs and the atomic
switch from one revision to the next."""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import sys

from . import base
from .base import (
    COMPLETE, HASHES, Hashes, MANIFEST, PROGRESS, StageError, check_files, index_shards, log, manifest_files,
    name_problem, read_json, revision_dir, revisions_dir,
)
from .signing import Auth, CLIENT_NAME, relay_key
from .relay import Relay, start_relay, wait_for_children
from .seed import stage_seed
from .peer import stage_peer


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
        print(f"{base.HOST}: weights: {args.revision} is not staged at {args.path}", file=sys.stderr)
        return 1
    except (ValueError, AttributeError, StageError) as e:
        print(f"{base.HOST}: weights: {args.revision} at {args.path}: unreadable manifest ({e})", file=sys.stderr)
        return 1
    problems = []
    if os.path.realpath(args.path) != os.path.realpath(root):
        serving = os.path.basename(os.path.realpath(args.path)) if os.path.islink(args.path) else "nothing glm-infra staged"
        problems.append(f"{args.path} serves {serving}, not {args.revision}")
    bad = check_files(root, manifest, full=not args.quick)
    problems += [f"{b}: missing or {'of the wrong size' if args.quick else 'corrupt'}" for b in bad]
    for p in problems:
        print(f"{base.HOST}: weights: {p}", file=sys.stderr)
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
