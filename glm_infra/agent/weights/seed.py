"""The seed: a checkpoint read once from its source (a mirror or the Hugging Face hub; a folder is
directory.py's) and published file by file as it is verified."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import time
import urllib.request

from .base import (
    COMMIT_ID, Hashes, MANIFEST, StageError, env_value, inside, log, manifest_files, need_disk, read_json,
    write_json,
)
from .transfer import fetch, fetch_verified
from .relay import Relay
from .directory import copy_directory


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
