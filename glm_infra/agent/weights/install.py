"""``install``: the files of a staged revision put where the folder has none, beneath it, given to its owner."""

from __future__ import annotations

import argparse
import contextlib
import os
import pwd
import secrets

from .base import MANIFEST, StageError, inside, log
from .directory import copy_hashed, wanted
from .revisions import staged_whole


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
