"""The pools that serve (prefill, decode, or one colocated pool) and the P/D router in front of them."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    field_validator,
)

from . import pins
from .base import IPv4, Cidr, Port, Secret, ServerName, StrictModel

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


# Defaults of the pools are the recipe's (docs/RECIPE.md), so a stack (or a Cluster) needs only hosts, SSH and model.
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

    host: str = Field(description="Host the router (and its front) runs on; with standbyHosts, the first of "
                                  "the routers to roll (the others follow, one at a time).")
    standby_hosts: list[str] = Field(
        default_factory=list, max_length=3,
        description="Further hosts that run the router and its front too, hot, behind virtualAddress: keepalived "
                    "(VRRP) keeps the address on one router host whose front and router answer, and moves it "
                    "within seconds when that host dies. Each front passes a request its own router cannot "
                    "take to another router's front, so a change restarts the routers one at a time, each "
                    "drained first, and loses no request.")
    virtual_address: IPv4 | None = Field(
        None, description="The address clients use with standbyHosts (required with them): held by one router "
                          "host at a time, on the interface that carries the host's own address, in the same "
                          "network, and used by no host.")
    vrrp_router_id: int = Field(
        51, ge=1, le=255, description="keepalived's virtual_router_id: unique among the VRRP instances of the "
                                      "routers' network.")
    peer_port: Port = Field(
        8002, description="Loopback port of the front through which it passes requests to the other routers' "
                          "fronts (TLS, checked against the front's CA) while its own router is down or drained.")
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
    allowed_cidrs: list[Cidr] | None = Field(
        None, min_length=1,
        description="Who may reach the public port besides the stack's hosts (the firewall): the networks your "
                    "clients or their load balancer connect from. Required while the firewall is on: glm-infra "
                    "cannot guess them (open, every address could try the API; closed, no client could). "
                    "0.0.0.0/0 and ::/0 open it to every address, with a warning.")
    health_check_interval: int = Field(10, ge=1, le=600, description="Seconds between worker health checks.")
    gate_port: Port = Field(
        8010, description="First of the loopback ports (one per instance, in plan order) through which the router "
                          "reaches its workers: nginx passes everything to the instance and answers /health 503 "
                          "while the instance's canary fails, so the router's health checks take it out of rotation.")
    canary_interval: int = Field(60, ge=5, le=3600, description="Seconds between canary runs (a systemd timer on "
                                                                 "the router's host).")
    canary_timeout: int = Field(30, ge=1, le=600, description="Seconds a canary may take before it fails (a DP rank "
                                                              "that hangs).")
