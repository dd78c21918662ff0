"""What hosts send each other, signed with the stack's relay key: a client's requests and a relay's answers."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import re
import secrets
import time
import urllib.request

from .base import StageError, env_value


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
