"""A peer: copies from its parent in the relay tree, from the next ancestor up when that fails, each file
checked against the sha256 of a progress document signed with the stack's key."""

from __future__ import annotations

import argparse
import contextlib
import hmac
import http.server
import json
import os
import time
import urllib.request

from .base import (
    COMMIT_ID, DONE, Hashes, MANIFEST, MAX_JSON, NotThere, PROGRESS, StageError, inside, log, manifest_files,
    need_disk, read_json, write_json,
)
from .transfer import SourceFailed, download, open_url
from .signing import Auth, Forged, MAC_HEADER, sign
from .relay import Relay


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
