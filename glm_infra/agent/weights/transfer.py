"""Downloads: one URL to a file, resumed with a Range request, bounded by the manifest's size, verified."""

from __future__ import annotations

import hashlib
import http.server
import os
import re
import time
import urllib.request

from .base import CHUNK, Hashes, MAX_JSON, NotThere, StageError, hashed, inside, log
from .signing import Auth, Forged


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
