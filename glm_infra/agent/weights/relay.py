"""The relay between hosts: requests and answers signed with the stack's key, the server of the verified
files, and the wait for the hosts that copy from this one."""

from __future__ import annotations

import contextlib
import errno
import functools
import hmac
import http.server
import json
import os
import pwd
import re
import socket
import socketserver
import threading
import time
import urllib.request

from .base import DONE, PROGRESS, StageError, log, write_json
from .signing import AUTH_HEADER, AUTH_WINDOW_S, CLIENT_NAME, MAC_HEADER, NONCE, client_mac, sign


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
