"""The directory source: the regular files of a folder (vLLM's warm-start caches), each opened beneath it
without following a link and hashed as it is copied."""

from __future__ import annotations

import argparse
import contextlib
import errno
import fnmatch
import hashlib
import os
import stat

from .base import CHUNK, Hashes, StageError, inside, log, name_problem, need_disk, read_hashed, revisions_dir
from .relay import Relay


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
