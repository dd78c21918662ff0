"""Pydantic models of one stack: hosts, SSH, model, pools, router, runtime.

Every model forbids unknown keys, so a misspelt key is an error rather than a silently ignored
setting. Keys are camelCase in the stack file (``instancesPerHost``) and snake_case in Python.
Cross-field rules (host references, GPU budgets, port collisions) live in ``validate.py``.
"""

from __future__ import annotations

import ipaddress
import json
import posixpath
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from . import packages, pins
from .checkpoint import FACT_KEYS

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
    "capacity",
)
# The keys of what serves (the pools and the router): Hosts, which provisions without serving, leaves them out.
SERVING_KEYS = ("prefill", "decode", "colocated", "router")

# The values that must be Pulumi secrets, in one place: the name templates and components know each
# by → (top key, nested key) in the stack file.
SECRETS = {
    "private_key": ("ssh", "privateKey"),
    "hf_token": ("model", "hfToken"),
    "router_api_key": ("router", "apiKey"),
    "router_tls_certificate": ("router", "tlsCertificate"),
    "router_tls_key": ("router", "tlsKey"),
    "webhook_url": ("monitoring", "webhookUrl"),
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
}


def snake(key: str) -> str:
    """A camelCase stack key as its Python field name."""
    return re.sub(r"(?<!^)([A-Z])", lambda m: "_" + m[1].lower(), key)

_HOST_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
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


def _url(v: str) -> str:
    if not re.fullmatch(URL_PATTERN, v):
        raise ValueError(f"{v!r} is not an http(s) URL (letters, digits and ._~%/+=,@:- only)")
    return v


Url = Annotated[str, AfterValidator(_url)]


def _cidr(v: str) -> str:
    try:
        return str(ipaddress.ip_network(v, strict=False))
    except ValueError:
        raise ValueError(f"{v!r} is not an address or network (10.0.0.0/8, 2001:db8::/32, 192.0.2.7)") from None


Cidr = Annotated[str, AfterValidator(_cidr)]


def _is_dns_name(v: str) -> bool:
    """A DNS name, and not something that only looks like a mistyped IPv4 address (10.0.0.300)."""
    return bool(_DNS_NAME.match(v)) and not re.fullmatch(r"[0-9.]+", v)


def _server_name(v: str) -> str:
    try:
        ip = ipaddress.ip_address(v)
    except ValueError:
        if _is_dns_name(v):
            return v.lower()
        raise ValueError(f"{v!r} is not a DNS name or IP address") from None
    return str(ip)


ServerName = Annotated[str, AfterValidator(_server_name)]


class HostConfig(StrictModel):
    """One bare-metal server."""

    name: str = Field(description="Short host name, used in resource names and unit paths.")
    address: str = Field(description="Routable address (IPv4, IPv6 or DNS name) used for SSH, NIXL and the router.")
    gpus: int = Field(8, ge=1, le=16, description="GPUs on the host.")
    gpu_model: str = Field("B300", description="GPU model name as nvidia-smi reports it, without 'NVIDIA '.")
    compute_nics: list[str] = Field(
        default_factory=list,
        description="RDMA devices carrying KV traffic (e.g. mlx5_0). Never the NVSwitch-management ConnectX.",
    )
    ssh_port: int = Field(22, ge=1, le=65535, description="SSH port.")
    nvlinks: int = Field(18, ge=1, le=72, description="NVLink links per GPU the health gate expects up (18 on HGX B300).")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _HOST_NAME.match(v):
            raise ValueError(f"{v!r} is not a valid host name (lowercase letters, digits and '-', at most 63)")
        return v

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        try:
            ip = ipaddress.ip_address(v)
        except ValueError:
            if _is_dns_name(v):
                return v
            raise ValueError(f"{v!r} is not an IP address or DNS name") from None
        if ip.is_unspecified or ip.is_multicast:
            raise ValueError(f"{v!r} cannot address a host")
        return v

    @field_validator("compute_nics")
    @classmethod
    def _nics(cls, v: list[str]) -> list[str]:
        for nic in v:
            if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.:-]*", nic):
                raise ValueError(f"{nic!r} is not an RDMA device name")
        if len(set(v)) != len(v):
            raise ValueError("duplicate NIC")
        return v


class SshConfig(StrictModel):
    """How glm-infra logs in to every host."""

    user: str = Field("root", pattern=r"^[a-z_][a-z0-9_-]*$", description="User glm-infra logs in as (root, or one with sudo-less root).")
    private_key: Secret | None = Field(None, description="Private key, a Pulumi secret.")
    private_key_path: str | None = Field(
        None, description="Path of a private key file on the machine running pulumi (read at run time, kept secret)."
    )
    dial_attempts: int = Field(10, ge=1, le=100, description="Connection attempts to a host before a step fails: a "
                               "host that does not answer fails `up` after about dialAttempts × (dialTimeout + 5) s.")
    dial_timeout: int = Field(10, ge=1, le=300, description="Seconds one connection attempt may take.")

    @model_validator(mode="after")
    def _one_key(self) -> SshConfig:
        if (self.private_key is None) == (self.private_key_path is None):
            raise ValueError("set exactly one of privateKey (a secret) or privateKeyPath")
        return self


class ModelConfig(StrictModel):
    """The checkpoint to serve and where it lives on each host."""

    repo: str = Field(description="Hugging Face repository, e.g. nvidia/GLM-5.2-NVFP4.")
    revision: str = Field(description="Pinned revision (a commit SHA) of the repository.")
    path: str = Field(description="Absolute path of the checkpoint on every host.")
    served_model_name: str = Field("glm-5.2", pattern=r"^[A-Za-z0-9_.][A-Za-z0-9_.:/-]*$", description="--served-model-name: the model name clients ask for.")
    hf_token: Secret | None = Field(None, description="Hugging Face token, a Pulumi secret.")
    weight_format: Literal["nvfp4", "fp8", "bf16"] | None = Field(
        None, description="The checkpoint's weight format, checked against the hosts' GPUs (NVFP4 needs Blackwell). "
                          "Default: what the repository's name says (…-NVFP4, …-FP8); null: not checked.")
    # Model-wide serving flags of the BRIEF recipe; prefill and decode must agree on them.
    trust_remote_code: bool = Field(True, description="--trust-remote-code (the GLM-5 checkpoint ships its own code).")
    chat_template_content_format: str | None = Field(
        "string", pattern=r"^[a-z]+$", json_schema_extra=pins.schema_enum("chatTemplateContentFormat"),
        description="--chat-template-content-format (None: leave vLLM's default).")
    tool_call_parser: str | None = Field("glm47", pattern=r"^[a-z0-9_-]+$", json_schema_extra=pins.schema_enum("toolCallParser"),
                                         description="--tool-call-parser (None: none).")
    enable_auto_tool_choice: bool = Field(True, description="--enable-auto-tool-choice.")
    reasoning_parser: str | None = Field("glm45", pattern=r"^[a-z0-9_]+$", json_schema_extra=pins.schema_enum("reasoningParser"),
                                         description="--reasoning-parser (None: none).")
    enable_prompt_tokens_details: bool = Field(True, description="--enable-prompt-tokens-details.")
    fingerprint_mode: str | None = Field("none", pattern=r"^[a-z0-9_]+$", json_schema_extra=pins.schema_enum("fingerprintMode"),
                                         description="--fingerprint-mode (None: leave it out).")
    kv_cache_dtype: str | None = Field(
        None, pattern=r"^[a-z0-9_]+$", json_schema_extra=pins.schema_enum("kvCacheDtype"),
        description="--kv-cache-dtype of both pools (None: leave it out, vLLM's auto: fp8_ds_mla for a DSA "
                    "model such as GLM-5). Capacity planning counts the KV bytes per token of this layout.")
    max_model_len: int | None = Field(
        None, ge=1, le=16_777_216,
        description="--max-model-len of both pools: the longest request (prompt + output) the stack promises. "
                    "None: leave it out (vLLM and capacity planning use the model's max_position_embeddings).")
    speculative_method: str = Field("mtp", pattern=r"^[a-z0-9_]+$", json_schema_extra=pins.schema_enum("speculativeMethod"),
                                    description="MTP method (P and D must match).")
    # Staging of the weights (ModelWeights).
    source: Literal["huggingface", "mirror", "local"] = Field(
        "huggingface", description="huggingface (repo@revision via the hf CLI), mirror (HTTP(S) with manifest), "
        "local (already at path on every host: verify only)."
    )
    mirror_url: str | None = Field(None, description="Mirror base URL: files and manifest.json under URL/REVISION/.")
    seed_host: str | None = Field(None, description="Host that downloads from the source (default: first serving host).")
    fanout_port: Port = Field(8090, description="Port a host serves its verified files on to the hosts that copy from it (weights relay).")
    relay_stall_seconds: int | None = Field(
        None, ge=5, le=3600,
        description="Seconds without progress before a relay peer leaves the host it copies from, and before a host "
                    "stops waiting for a child that went silent (weights.py --stall). None: weights.py's own, 120.")
    disk_margin_gb: float = Field(20, ge=0, description="Free space required beyond the checkpoint.")
    hf_hub_version: str = Field(pins.HF_HUB, pattern=r"^[0-9][A-Za-z0-9.+_-]*$", description="huggingface_hub pin (hf CLI).")
    verify: str = Field("", description="Change to re-verify (and repair) the checkpoint on every host.")
    remove_on_destroy: bool = Field(False, description="Delete the weights on pulumi destroy (default: keep).")

    @field_validator("repo")
    @classmethod
    def _repo(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+", v):
            raise ValueError(f"{v!r} is not an 'owner/name' repository id")
        return v

    @field_validator("revision")
    @classmethod
    def _revision(cls, v: str) -> str:
        # A folder name under PATH.revisions (prune deletes its siblings): no '.', '..' or leading '-'.
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}", v) or set(v) <= {"."}:
            raise ValueError(f"{v!r} is not a revision (a commit SHA, a tag or a branch name)")
        return v

    @field_validator("mirror_url")
    @classmethod
    def _mirror_url(cls, v: str | None) -> str | None:
        return None if v is None else _url(v)

    @model_validator(mode="before")
    @classmethod
    def _weight_format_of_the_repo(cls, data: Any) -> Any:
        """No weightFormat given: the one the repository's name says (GLM-5.2-NVFP4 → nvfp4)."""
        if isinstance(data, dict) and not ({"weightFormat", "weight_format"} & set(data)):
            name = str(data.get("repo", "")).upper()
            fmt = "nvfp4" if "NVFP4" in name else "fp8" if "FP8" in name else None
            return {**data, "weight_format": fmt}
        return data

    @model_validator(mode="after")
    def _source_settings(self) -> ModelConfig:
        if self.source == "mirror" and not self.mirror_url:
            raise ValueError("source mirror needs mirrorUrl")
        return self

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"{v!r} is relative; the model path must be absolute")
        if posixpath.normpath(v) != v or v == "/":
            raise ValueError(f"{v!r} is not a normalised absolute path")
        if not re.fullmatch(r"[A-Za-z0-9_./+-]+", v):
            raise ValueError(f"{v!r} has characters that cannot appear in a unit file path")
        return v


CudagraphMode = Annotated[str, Field(pattern=r"^[A-Z_]+$", json_schema_extra=pins.schema_enum("cudagraphMode"))]


class PoolConfig(StrictModel):
    """Settings shared by every pool of vLLM instances."""

    hosts: list[str] = Field(min_length=1, description="Names of the hosts that run this pool.")
    instances_per_host: int = Field(1, ge=1, le=16, description="vLLM instances of this pool on each of its hosts.")
    tp: int = Field(1, ge=1, le=16, description="Tensor parallel size (-tp).")
    dp: int = Field(1, ge=1, le=16, description="Data parallel size (-dp).")
    ep: bool = Field(True, description="Expert parallelism (-ep).")
    speculative_tokens: int = Field(ge=0, le=16, description="MTP num_speculative_tokens; 0 disables MTP.")
    gpu_memory_utilization: float = Field(gt=0, le=1, description="--gpu-memory-utilization.")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="--max-num-batched-tokens (None: vLLM's default).")
    cudagraph_mode: CudagraphMode | None = Field(None, description="cudagraph_mode of --compilation-config.")
    all2all_backend: str | None = Field(None, alias="all2allBackend", pattern=r"^[a-z0-9_]+$",
                                        json_schema_extra=pins.schema_enum("all2allBackend"),
                                        description="--all2all-backend of expert parallelism.")
    shutdown_timeout: int = Field(300, ge=0, le=3600, description="--shutdown-timeout seconds (drain).")
    max_unavailable: int = Field(
        1, ge=1, le=1024,
        description="Hosts of this pool a disruptive host change (a driver upgrade with reboot, an RDMA change) "
                    "takes down at once; the others serve meanwhile. A host serving several pools rolls with the "
                    "strictest. As many as the pool's hosts (or one host): the change interrupts the pool.")
    http_port: Port = Field(description="HTTP port of the first instance on a host; further instances add 1.")
    dp_rpc_port: Port = Field(description="--data-parallel-rpc-port of the first instance on a host; +1 each.")
    nixl_side_channel_port: Port = Field(
        description="VLLM_NIXL_SIDE_CHANNEL_PORT base of the first instance on a host; each DP rank uses base+rank."
    )
    model_runner_v2: bool = Field(True, description="VLLM_USE_V2_MODEL_RUNNER=1 (Model Runner V2).")
    extra_args: list[str] = Field(default_factory=list, description="Further vllm serve arguments, verbatim.")
    env: dict[str, str] = Field(default_factory=dict, description="Further non-secret environment variables.")

    @field_validator("hosts")
    @classmethod
    def _unique_hosts(cls, v: list[str]) -> list[str]:
        seen = set()
        for h in v:
            if h in seen:
                raise ValueError(f"host {h!r} is listed twice")
            seen.add(h)
        return v

    @field_validator("env", mode="before")
    @classmethod
    def _env_scalars(cls, v: Any) -> Any:
        """A number or boolean in YAML (``FOO: 5``) is the string the environment gets."""
        if isinstance(v, dict):
            return {k: (str(x).lower() if isinstance(x, bool) else str(x)) if isinstance(x, (int, float)) else x
                    for k, x in v.items()}
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for k, val in v.items():
            if not re.fullmatch(r"[A-Z_][A-Z0-9_]*", k):
                raise ValueError(f"{k!r} is not an environment variable name")
            if "\n" in val or '"' in val or "\\" in val:
                raise ValueError(f"value of {k} may not contain newlines, quotes or backslashes")
        return v

    @field_validator("extra_args")
    @classmethod
    def _extra_args(cls, v: list[str]) -> list[str]:
        for a in v:
            if any(c in a for c in "\n%$'\\"):
                raise ValueError(f"{a!r}: newlines, single quotes, backslashes, '%' and '$' cannot go in a unit")
        return v

    @property
    def gpus_per_instance(self) -> int:
        return self.tp * self.dp


# Defaults of the pools are the BRIEF recipe's, so a stack (or a Cluster) needs only hosts, SSH and model.
class PrefillConfig(PoolConfig):
    """Prefill instances (KV producers). Default: TP1 DP4 EP, two per host, MTP 1, 92 % of GPU memory."""

    instances_per_host: int = Field(2, ge=1, le=16, description="vLLM instances of this pool on each of its hosts.")
    dp: int = Field(4, ge=1, le=16, description="Data parallel size (-dp).")
    speculative_tokens: int = Field(1, ge=0, le=16, description="MTP num_speculative_tokens; 0 disables MTP.")
    gpu_memory_utilization: float = Field(0.92, gt=0, le=1, description="--gpu-memory-utilization.")
    http_port: Port = Field(8100, description="HTTP port of the first instance on a host; further instances add 1.")
    dp_rpc_port: Port = Field(29550, description="--data-parallel-rpc-port of the first instance on a host; +1 each.")
    nixl_side_channel_port: Port = Field(5600, description="VLLM_NIXL_SIDE_CHANNEL_PORT base of the first instance on a host; each DP rank uses base+rank.")


class DecodeConfig(PoolConfig):
    """Decode instances (KV consumers). Default: TP1 DP8 EP, one per host, MTP 3, 90 % of GPU memory,
    1024 batched tokens, FULL_DECODE_ONLY CUDA graphs, flashinfer_nvlink_two_sided all2all."""

    dp: int = Field(8, ge=1, le=16, description="Data parallel size (-dp).")
    speculative_tokens: int = Field(3, ge=0, le=16, description="MTP num_speculative_tokens; 0 disables MTP.")
    gpu_memory_utilization: float = Field(0.90, gt=0, le=1, description="--gpu-memory-utilization.")
    max_num_batched_tokens: int = Field(1024, ge=1, description="--max-num-batched-tokens.")
    cudagraph_mode: CudagraphMode = Field("FULL_DECODE_ONLY", description="cudagraph_mode of --compilation-config.")
    all2all_backend: str = Field("flashinfer_nvlink_two_sided", alias="all2allBackend", pattern=r"^[a-z0-9_]+$",
                                 json_schema_extra=pins.schema_enum("all2allBackend"),
                                 description="--all2all-backend of expert parallelism.")
    http_port: Port = Field(8200, description="HTTP port of the first instance on a host; further instances add 1.")
    dp_rpc_port: Port = Field(29650, description="--data-parallel-rpc-port of the first instance on a host; +1 each.")
    nixl_side_channel_port: Port = Field(5700, description="VLLM_NIXL_SIDE_CHANNEL_PORT base of the first instance on a host; each DP rank uses base+rank.")


class ColocatedConfig(PoolConfig):
    """One pool serving prefill and decode together (no P/D): a development box. Default: TP1 DP8 EP,
    MTP 3, 90 % of GPU memory."""

    dp: int = Field(8, ge=1, le=16, description="Data parallel size (-dp).")
    speculative_tokens: int = Field(3, ge=0, le=16, description="MTP num_speculative_tokens; 0 disables MTP.")
    gpu_memory_utilization: float = Field(0.90, gt=0, le=1, description="--gpu-memory-utilization.")
    http_port: Port = Field(8100, description="HTTP port of the first instance on a host; further instances add 1.")
    dp_rpc_port: Port = Field(29550, description="--data-parallel-rpc-port of the first instance on a host; +1 each.")
    nixl_side_channel_port: Port = Field(5600, description="VLLM_NIXL_SIDE_CHANNEL_PORT base of the first instance on a host; each DP rank uses base+rank.")


class RouterConfig(StrictModel):
    """vllm-router in P/D mode behind an nginx front on the public port: the front checks the API
    key and retries a request the router failed before answering (a prefill restarting)."""

    host: str = Field(description="Host the router (and its front) runs on.")
    port: Port = Field(8000, description="Public port (the nginx front).")
    internal_port: Port = Field(8001, description="vllm-router's own port, on loopback behind the front.")
    metrics_port: Port = Field(29000, description="Prometheus exporter of the router (--prometheus-port).")
    retries: int = Field(3, ge=1, le=10, description="Attempts the front makes per request.")
    policy: str = Field("round_robin", pattern=r"^[a-z0-9_]+$",
                        json_schema_extra={"enum": list(pins.ROUTER_CHOICES[pins.VLLM_ROUTER]["policy"])},
                        description="vllm-router --policy (the choices of runtime.routerVersion).")
    api_key: Secret | None = Field(None, description="API key the router and workers share, a Pulumi secret.")
    tls_certificate: Secret | None = Field(
        None, description="PEM certificate (chain) the public port serves, a Pulumi secret, with tlsKey. Unset: "
                          "glm-infra generates one on the router's host once, signed by a CA of its own that stays "
                          "across ups (stack output routerCaCertificate).")
    tls_key: Secret | None = Field(None, description="PEM private key of tlsCertificate, a Pulumi secret.")
    tls_names: list[ServerName] = Field(
        default_factory=list, description="DNS names and addresses clients use besides the router host's address: "
                                          "the generated certificate carries them all.")
    plain_http: Literal["refuse", "redirect"] = Field(
        "refuse", description="A plain-HTTP request to the public port: refused (400) or redirected to https (301).")
    allowed_cidrs: list[Cidr] = Field(
        default_factory=list, description="Who may reach the public port besides the stack's hosts (the firewall); "
                                          "empty: nobody else, so it is opened on purpose.")
    health_check_interval: int = Field(10, ge=1, le=600, description="Seconds between worker health checks.")


class RuntimeConfig(StrictModel):
    """The Python runtime that runs vLLM and the router on every host."""

    user: str = Field("vllm", pattern=r"^[a-z_][a-z0-9_-]*$", description="System user the services run as.")
    venv: str = Field("/opt/glm-infra/venv", description="Virtualenv of vLLM, NIXL and vllm-router on every host.")
    vllm_version: str = Field(pins.VLLM, pattern=r"^[0-9][A-Za-z0-9.+_-]*$", description="vllm pin.")
    nixl_version: str = Field(pins.NIXL, pattern=r"^[0-9][A-Za-z0-9.+_-]*$", description="nixl pin.")
    router_version: str = Field(pins.VLLM_ROUTER, pattern=r"^[0-9][A-Za-z0-9.+_-]*$", description="vllm-router pin.")
    uv_version: str = Field(pins.UV, pattern=r"^[0-9][A-Za-z0-9.+_-]*$", description="uv pin (installs the venv).")
    index_url: Url = Field("https://pypi.org/simple", description="Python package index (PEP 503) for the hosts.")
    find_links: Url | None = Field(None, description="Wheel folder URL; with it the hosts use no index at all.")
    state_dir: str = Field("/var/lib/glm-infra", description="State of the services (their home).")

    @field_validator("venv", "state_dir")
    @classmethod
    def _abs(cls, v: str) -> str:
        if not v.startswith("/") or posixpath.normpath(v) != v or v == "/":
            raise ValueError(f"{v!r} must be a normalised absolute path")
        return v


class PreflightConfig(StrictModel):
    """What a host must already be before glm-infra installs anything."""

    allowed_os: list[str] = Field(
        default_factory=lambda: ["ubuntu 24.04"], description="'ID VERSION_ID' pairs from /etc/os-release."
    )
    min_kernel: str = Field("5.12", pattern=r"^[0-9]+\.[0-9]+$", description="DMA-BUF GPUDirect needs 5.12+.")
    min_free_disk_gb: float | None = Field(
        None, ge=0, description="Free space (or checkpoint already staged) needed at model.path before anything is "
        "installed; the weights step checks the exact size later.",
    )


class DriversConfig(StrictModel):
    """NVIDIA driver, fabric manager and tools: installed and held (install) or only checked (verify)."""

    mode: Literal["install", "verify"] = Field(
        "install", description="install (and hold) the driver, or verify a pre-installed image and change nothing.")
    version: str = Field("580.159.04", pattern=r"^[0-9]+\.[0-9]+(\.[0-9]+)?$",
                         description="NVIDIA driver version (fabric manager and NSCQ at exactly this one).")
    apt_repository: Url = Field(
        "https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2404/x86_64/",
        description="NVIDIA apt repository (deb line URL).",
    )
    apt_keyring_url: Url | None = Field(
        "https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2404/x86_64/3bf863cc.pub",
        description="Signing key of the repository; None means the repository is trusted as is.",
    )
    fabric_manager: bool = Field(True, description="Run nvidia-fabricmanager (NVLink 5 / NVSwitch systems).")
    dcgm_diag_level: int = Field(0, ge=0, le=3, description="Run `dcgmi diag -r N` in the health gate (0: skip).")
    reboot_timeout: int = Field(1800, ge=60, le=7200, description="Seconds to wait for a host to come back.")
    fabric_timeout: int = Field(600, ge=0, le=3600, description="Seconds the health gate waits for the fabric.")
    remove_on_destroy: bool = Field(False, description="Unhold and purge the driver on pulumi destroy.")

    @field_validator("version")
    @classmethod
    def _known_branch(cls, v: str) -> str:
        packages.rule(packages.branch_of(v))  # package names differ per branch: refuse one with no rule
        return v

    @property
    def branch(self) -> str:
        return packages.branch_of(self.version)

    def package_set(self, dcgm_exporter: bool = False) -> packages.DriverSet:
        """The packages and units of glm_infra/spec/packages.py for this version (the exporter's unit needs
        DCGM's host engine, as the health gate's dcgmi diag does)."""
        return packages.driver_set(self.version, self.fabric_manager, self.dcgm_diag_level > 0 or dcgm_exporter)

    @property
    def branch_pin_package(self) -> str:
        """NVIDIA's pinning package of the branch, versioned by branch (580-N), not by driver version."""
        return self.package_set().branch_pin.name

    @property
    def locked_packages(self) -> list[str]:
        """Packages whose version must be exactly the driver's (a mismatch breaks the fabric)."""
        return [p.name for p in self.package_set().locked]

    @property
    def tool_packages(self) -> list[str]:
        """Packages installed and held at whatever version the repository has."""
        return [p.name for p in self.package_set().tools]


class RdmaConfig(StrictModel):
    """RDMA networking for NIXL's KV transfer."""

    stack: Literal["doca-ofed", "inbox"] = Field("doca-ofed", description="DOCA-OFED or the distribution's rdma-core.")
    gpudirect: Literal["dmabuf", "peermem"] = Field(
        "dmabuf", description="GPUDirect RDMA through DMA-BUF (open driver, kernel 5.12+) or nvidia-peermem.")
    link_layer: Literal["Ethernet", "InfiniBand"] = Field(
        "Ethernet", description="Ethernet (RoCE v2) or InfiniBand on the compute NICs.")
    mtu: int = Field(9000, ge=1500, le=9216, description="Netdev MTU of the compute NICs (RoCE active_mtu 4096 at 9000).")
    gid_index: int = Field(3, ge=0, le=255, description="RoCE v2 GID index with the IPv4 address (show_gids).")
    doca_version: str = Field(
        packages.DOCA_VERSION, pattern=r"^[0-9]+\.[0-9]+\.[0-9]+$",
        description="DOCA release of doca-ofed (stack doca-ofed): installed and checked at <docaVersion>-N.")
    doca_repository: Url | None = Field(
        None, description="DOCA apt repository (deb line URL). None: NVIDIA's for the DOCA release, "
                          "https://linux.mellanox.com/public/repo/doca/<docaVersion>/ubuntu24.04/x86_64/.")
    doca_keyring_url: Url | None = Field(
        packages.DOCA_REPOSITORY.keyring_url,
        description="Signing key of the DOCA repository; None means the repository is trusted as is.")
    remove_on_destroy: bool = Field(True, description="Remove the RDMA packages glm-infra installed on destroy.")

    @property
    def packages(self) -> list[str]:
        return [p.name for p in packages.rdma_packages(self.stack)]

    @property
    def doca_repository_url(self) -> str:
        return self.doca_repository or packages.doca_repository_url(self.doca_version)

    @property
    def active_mtu(self) -> int:
        """The RDMA MTU the ports report for this netdev MTU (RoCE: 4096 for 9000)."""
        return max(m for m in (256, 512, 1024, 2048, 4096) if m <= self.mtu - 100) if self.link_layer == "Ethernet" else 4096


class NixlConfig(StrictModel):
    """NIXL's transport (UCX) settings on every serving host."""

    ucx_tls: str = Field("rc,cuda_copy,cuda_ipc", pattern=r"^[a-z0-9_,]+$", description="UCX_TLS for NIXL.")


Duration = Annotated[str, Field(pattern=r"^[1-9][0-9]*(ms|s|m|h|d|w|y)$")]


class MonitoringConfig(StrictModel):
    """Prometheus and Alertmanager (the distribution's packages) on one host, the node exporter on
    every host, NVIDIA's DCGM exporter on every host whose driver step installs DCGM; scrape targets,
    rules and alert thresholds come from the plan and this block."""

    enabled: bool = Field(True, description="Deploy the monitoring (false: none of it).")
    host: str | None = Field(None, description="Host that runs Prometheus and Alertmanager (default: the router "
                                               "host, else the last host).")
    stack_label: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$",
                                    description="Value of the 'stack' label on every series (default: the stack name).")
    prometheus_port: Port = Field(9090, description="Prometheus web and API port.")
    alertmanager_port: Port = Field(9093, description="Alertmanager port.")
    node_exporter_port: Port = Field(9100, description="prometheus-node-exporter port on every host.")
    dcgm_exporter_port: Port = Field(9400, description="DCGM exporter port on every provisioned host.")
    dcgm_exporter_package: str | None = Field(
        "datacenter-gpu-manager-exporter", pattern=r"^[a-z0-9][a-z0-9.+-]*$",
        description="Package of NVIDIA's DCGM exporter in the driver repository (None: no DCGM exporter).")
    scrape_interval: Duration = Field("15s", description="How often every target is scraped.")
    evaluation_interval: Duration = Field("15s", description="How often the rules run.")
    retention: Duration = Field("15d", description="How long Prometheus keeps samples.")
    allowed_cidrs: list[Cidr] = Field(
        default_factory=list, description="Who may reach Prometheus and Alertmanager besides the stack's hosts "
                                          "(the firewall; the SLA gate asks Prometheus from where it runs).")
    webhook_url: Secret | None = Field(None, description="Alertmanager webhook receiver URL, a Pulumi secret "
                                                         "(it often carries a token). None: alerts stay in Alertmanager.")
    group_wait: Duration = Field("30s", description="How long Alertmanager waits to group a new alert before "
                                                    "sending it.")
    repeat_interval: Duration = Field("4h", description="How often a firing alert is sent again.")
    mtp_acceptance_min: float = Field(0.5, gt=0, lt=1, description="Alert when MTP draft acceptance falls below this.")
    kv_transfer_p99_seconds: float = Field(1.0, gt=0, description="Alert when NIXL's p99 KV transfer time exceeds this.")
    memory_growth_window: Duration = Field("6h", description="Window over which a vLLM process's resident memory "
                                                             "growing without pause is a leak.")
    memory_growth_bytes: float = Field(2e9, gt=0, description="Growth over that window that fires the leak alert.")


class SlaConfig(StrictModel):
    """The service level the deployment holds, checked by the alert rules (over ``window``) and by
    ``glm-infra sla`` (a benchmark client, NVIDIA AIPerf, through the router)."""

    ttft_seconds: float = Field(2.5, gt=0, description="Mean time to first token the SLA allows.")
    tpot_seconds: float = Field(0.020, gt=0, description="Mean time per output token (after the first) the SLA "
                                                         "allows.")
    window: Duration = Field("10m", description="Window of the SLA burn alerts' means.")
    contexts: list[Annotated[int, Field(ge=16, le=2_000_000)]] = Field(
        default_factory=lambda: [16384, 65536, 131072, 262144], min_length=1,
        description="Input lengths (tokens) the SLA gate measures, one bucket each.")
    output_tokens: int = Field(256, ge=2, le=65536, description="Output tokens per request in the SLA gate.")
    concurrency: int = Field(4, ge=1, le=1024, description="Requests in flight in the SLA gate.")
    requests_per_context: int = Field(16, ge=1, le=100000, description="Requests per bucket in the SLA gate.")
    tokenizer: str | None = Field(
        None, description="Tokenizer the gate builds prompts with: a Hugging Face repository or a folder on the "
                          "machine running the gate (default: the model's repository at its revision).")
    prometheus_tolerance: float = Field(
        0.15, ge=0, le=1, description="How far Prometheus's mean TTFT of a bucket may be from the client's "
                                      "(a share of the client's) before the gate says they disagree.")

    @field_validator("contexts")
    @classmethod
    def _distinct(cls, v: list[int]) -> list[int]:
        if len(set(v)) != len(v):
            raise ValueError("a context length is listed twice")
        return sorted(v)


class FirewallConfig(StrictModel):
    """nftables on every host, in a table of glm-infra's own (inet glm_infra): every port glm-infra opens
    is reachable from the stack's hosts only, the router's public port also from router.allowedCidrs,
    Prometheus and Alertmanager from monitoring.allowedCidrs; SSH from adminCidrs and the stack's hosts;
    loopback, replies, ICMP and DHCP pass; everything else is dropped. Host addresses must be IP
    addresses (nft would resolve a name at boot, before the network is up)."""

    enabled: bool = Field(True, description="Load the table: glm-infra's ports for the stack's hosts, SSH, "
                                            "and nothing else.")
    admin_cidrs: list[Cidr] | None = Field(
        None, min_length=1,
        description="Who may log in over SSH (each host's sshPort) besides the stack's hosts: the networks you and "
                    "the machine running pulumi connect from (a bastion, a VPN). Unset: SSH from anywhere, as "
                    "before the firewall; glm-infra cannot know where you log in from, and a guess that missed "
                    "would lock you out of the host.")


class CapacityConfig(StrictModel):
    """Capacity planning (glm_infra/plan/capacity.py): the KV-cache room per rank of every pool, from the
    checkpoint's facts (a snapshot written by `glm-infra capacity fetch`) and the topology. validate
    refuses a pool whose rank cannot hold one request of the maximum context."""

    facts: str | None = Field(
        None, description="Facts snapshot of the checkpoint (JSON, `glm-infra capacity fetch` writes it), relative "
                          "to the current directory. Default: glm_infra/spec/checkpoints/<owner>--<name>.json of model.repo.")
    model_facts: dict[str, int] = Field(
        default_factory=dict, description="config.json facts that override the snapshot's (or stand in for a "
                                          "missing one): num_hidden_layers, num_nextn_predict_layers, kv_lora_rank, "
                                          "qk_rope_head_dim, index_head_dim, max_position_embeddings.")
    routed_bytes: int | None = Field(None, ge=0, description="Bytes of the routed experts (overrides the snapshot).")
    resident_bytes: int | None = Field(None, ge=0, description="Bytes of everything else (attention, dense and "
                                                               "shared experts, embeddings, MTP; overrides the snapshot).")
    gpu_memory_gb: float | None = Field(None, gt=0, description="GPU memory per GPU in GB (10^9 bytes) for every "
                                                                "host, instead of the GPU table (glm_infra/plan/capacity.py).")
    reserve_gb: float = Field(
        16, ge=0, description="Memory per rank kept out of the KV room besides the weights: activations of the "
                              "profile run, CUDA graphs, all2all/NCCL buffers, the MTP draft's working memory.")
    warn_below: int = Field(2, ge=1, description="Warn when a rank holds fewer requests of the maximum context "
                                                 "than this (one is the least validate accepts).")

    @field_validator("model_facts")
    @classmethod
    def _facts(cls, v: dict[str, int]) -> dict[str, int]:
        for k in v:
            if k not in FACT_KEYS:
                raise ValueError(f"{k!r} is not a fact capacity reads ({', '.join(FACT_KEYS)})")
        return v


class StackConfig(StrictModel):
    """One stack file's ``glm-infra:*`` keys."""

    hosts: list[HostConfig] = Field(min_length=1, description="The servers.")
    preflight: PreflightConfig = Field(default_factory=PreflightConfig, description="What a host must be first.")
    ssh: SshConfig = Field(description="How glm-infra logs in.")
    model: ModelConfig = Field(description="The checkpoint and its staging.")
    prefill: PrefillConfig | None = Field(None, description="Prefill pool (P/D).")
    decode: DecodeConfig | None = Field(None, description="Decode pool (P/D).")
    colocated: ColocatedConfig | None = Field(None, description="One pool without P/D, instead of prefill and decode.")
    router: RouterConfig | None = Field(None, description="The P/D router and its front.")
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig, description="The Python runtime of the services.")
    drivers: DriversConfig = Field(default_factory=DriversConfig, description="NVIDIA driver and fabric.")
    rdma: RdmaConfig = Field(default_factory=RdmaConfig, description="RDMA for the KV transfer.")
    nixl: NixlConfig = Field(default_factory=NixlConfig, description="NIXL / UCX settings.")
    monitoring: MonitoringConfig = Field(default_factory=MonitoringConfig, description="Prometheus, exporters, alerts.")
    sla: SlaConfig = Field(default_factory=SlaConfig, description="The service level and its gate.")
    firewall: FirewallConfig = Field(default_factory=FirewallConfig, description="nftables: glm-infra's ports for "
                                                                                 "the stack's hosts, SSH, the rest dropped.")
    capacity: CapacityConfig = Field(default_factory=CapacityConfig, description="KV-cache capacity planning: the "
                                                                                 "checkpoint's facts and the reserve.")

    @model_validator(mode="before")
    @classmethod
    def _brief_layout(cls, data: Any) -> Any:
        """No pool given: the BRIEF layout. Prefill on every host but the last, decode and the router
        on the last; one host: a colocated instance."""
        if not isinstance(data, dict) or any(data.get(k) is not None for k in ("prefill", "decode", "colocated")):
            return data
        hosts = data.get("hosts")
        if not isinstance(hosts, list) or not hosts or not all(isinstance(h, dict) and "name" in h for h in hosts):
            return data
        names = [h["name"] for h in hosts]
        if len(names) == 1:
            return {**data, "colocated": {"hosts": names}}
        out = {**data, "prefill": {"hosts": names[:-1]}, "decode": {"hosts": names[-1:]}}
        if data.get("router") is None:
            out["router"] = {"host": names[-1]}
        return out

    def host(self, name: str) -> HostConfig:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    def pools(self) -> list[tuple[str, PoolConfig]]:
        """(role, pool) in a fixed order: prefill, decode, colocated."""
        out: list[tuple[str, PoolConfig]] = []
        for role in ("prefill", "decode", "colocated"):
            pool = getattr(self, role)
            if pool is not None:
                out.append((role, pool))
        return out

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None and self.decode is not None

    @property
    def monitoring_host(self) -> str | None:
        """Where Prometheus runs: the stack's choice, else the router host, else the last host."""
        m = self.monitoring
        if not m.enabled:
            return None
        return m.host or (self.router.host if self.router is not None else self.hosts[-1].name)


def dump_json(value: Any) -> str:
    """Compact JSON as vLLM's command line examples write it."""
    return json.dumps(value, separators=(",", ":"))
