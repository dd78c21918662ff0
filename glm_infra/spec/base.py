"""The stack model's ground: its namespace and top-level keys, the secrets and what each may hold, the
strict base model (unknown keys are errors; camelCase in the file, snake_case in Python) and the value
types the sections share (ports, URLs, CIDRs, server names)."""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
)
from pydantic.alias_generators import to_camel

NAMESPACE = "glm-infra"

# Top-level stack keys this program reads; anything else in the namespace is a typo.
STACK_KEYS = (
    "hosts",
    "preflight",
    "ssh",
    "model",
    "prefill",
    "decode",
    "colocated",
    "router",
    "runtime",
    "drivers",
    "rdma",
    "nixl",
    "monitoring",
    "sla",
    "firewall",
    "prediction",
    "capacity",
    "startup",
    "stateInCheckout",
)
# The keys of what serves (the pools and the router): Hosts, which provisions without serving, leaves them out.
SERVING_KEYS = ("prefill", "decode", "colocated", "router")
# Keys only the program reads (glm_infra/program.py), not the components: no field of their Args.
PROGRAM_KEYS = ("state_in_checkout",)

# The values that must be Pulumi secrets, in one place: the name templates and components know each
# by → (top key, nested key) in the stack file.
SECRETS = {
    "private_key": ("ssh", "privateKey"),
    "hf_token": ("model", "hfToken"),
    "router_api_key": ("router", "apiKey"),
    "router_tls_certificate": ("router", "tlsCertificate"),
    "router_tls_key": ("router", "tlsKey"),
    "webhook_url": ("monitoring", "webhookUrl"),
    "dead_mans_switch_url": ("monitoring", "deadMansSwitchUrl"),
}
SECRET_PATHS = tuple(SECRETS.values())
# What a secret may hold, checked where its value is known (inside a Pulumi run, before any resource
# when it is given as a string): each lands in a file a service reads — an env file, nginx's map of
# keys — where a quote, a space or a newline would break the file or add to it.
API_KEY_MAX = 512
SECRET_VALUE_RULES: dict[str, tuple[str, str]] = {
    "router_api_key": (rf"[A-Za-z0-9._~+/-]{{16,{API_KEY_MAX}}}=*",
                       f"16 to {API_KEY_MAX} characters of a bearer token (letters, digits, - . _ ~ + /, then = padding)"),
    "hf_token": (r"[A-Za-z0-9_.-]{8,512}", "8 to 512 letters, digits, _ . or - (a Hugging Face token)"),
    "webhook_url": (r"https?://[^\s\"'\\]{1,2048}", "an http(s) URL without spaces, quotes or backslashes"),
    "dead_mans_switch_url": (r"https?://[^\s\"'\\]{1,2048}", "an http(s) URL without spaces, quotes or backslashes"),
}


def snake(key: str) -> str:
    """A camelCase stack key as its Python field name."""
    return re.sub(r"(?<!^)([A-Z])", lambda m: "_" + m[1].lower(), key)

HOST_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_DNS_NAME = re.compile(r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")


@dataclass(frozen=True)
class SecretValue:
    """A secret from the stack. ``plaintext`` is known only inside a Pulumi run (decrypted by the
    engine); in a stack file read offline it is ``None`` and only the ciphertext is present."""

    plaintext: str | None = None

    def __repr__(self) -> str:  # never print the value
        return "SecretValue(***)"

    __str__ = __repr__


def _to_secret(value: Any) -> Any:
    if isinstance(value, SecretValue):
        return value
    if isinstance(value, dict) and set(value) == {"secure"} and isinstance(value["secure"], str):
        return SecretValue(None)
    if isinstance(value, str):
        return SecretValue(value)
    raise ValueError("must be a secret string (pulumi config set --secret --path ...)")


Secret = Annotated[SecretValue, BeforeValidator(_to_secret)]


class StrictModel(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        frozen=True,
        arbitrary_types_allowed=True,
    )


Port = Annotated[int, Field(ge=1024, le=65535)]
# A URL that reaches a shell script, a unit or a command line: http(s), no spaces, quotes or shell
# characters (it is quoted as well).
URL_PATTERN = r"https?://[A-Za-z0-9.\[\]:-]+(/[A-Za-z0-9._~%/+=,@:-]*)?"


def check_url(v: str) -> str:
    if not re.fullmatch(URL_PATTERN, v):
        raise ValueError(f"{v!r} is not an http(s) URL (letters, digits and ._~%/+=,@:- only)")
    return v


Url = Annotated[str, AfterValidator(check_url)]


def check_cidr(v: str) -> str:
    try:
        return str(ipaddress.ip_network(v, strict=False))
    except ValueError:
        raise ValueError(f"{v!r} is not an address or network (10.0.0.0/8, 2001:db8::/32, 192.0.2.7)") from None


Cidr = Annotated[str, AfterValidator(check_cidr)]


def check_ipv4(v: str) -> str:
    try:
        return str(ipaddress.IPv4Address(v))
    except ValueError:
        raise ValueError(f"{v!r} is not an IPv4 address (192.0.2.7)") from None


IPv4 = Annotated[str, AfterValidator(check_ipv4)]


def is_dns_name(v: str) -> bool:
    """A DNS name, and not something that only looks like a mistyped IPv4 address (10.0.0.300)."""
    return bool(_DNS_NAME.match(v)) and not re.fullmatch(r"[0-9.]+", v)


def check_server_name(v: str) -> str:
    try:
        ip = ipaddress.ip_address(v)
    except ValueError:
        if is_dns_name(v):
            return v.lower()
        raise ValueError(f"{v!r} is not a DNS name or IP address") from None
    return str(ip)


ServerName = Annotated[str, AfterValidator(check_server_name)]



def dump_json(value: Any) -> str:
    """Compact JSON as vLLM's command line examples write it."""
    return json.dumps(value, separators=(",", ":"))
