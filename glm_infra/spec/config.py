"""Pydantic models of one stack: the whole (StackConfig) here, its sections in hosts, model, pools,
platform and operations, their ground in base (all of it importable from here).

Every model forbids unknown keys, so a misspelt key is an error rather than a silently ignored
setting. Keys are camelCase in the stack file (``instancesPerHost``) and snake_case in Python.
Cross-field rules (host references, GPU budgets, port collisions) live in ``plan/validate.py``.
"""

from __future__ import annotations

from typing import Any

from pydantic import (
    Field,
    model_validator,
)

from .base import (  # noqa: F401  (the stack model in one import: what its callers take from here)
    API_KEY_MAX,
    NAMESPACE,
    PROGRAM_KEYS,
    SECRET_PATHS,
    SECRET_VALUE_RULES,
    SECRETS,
    SERVING_KEYS,
    STACK_KEYS,
    URL_PATTERN,
    Cidr,
    Port,
    Secret,
    SecretValue,
    ServerName,
    StrictModel,
    Url,
    dump_json,
    snake,
)
from .hosts import HostConfig, SshConfig
from .model import ModelConfig
from .operations import (
    CapacityConfig,
    Duration,  # noqa: F401
    FirewallConfig,
    MonitoringConfig,
    PredictionConfig,
    SlaConfig,
    StartupConfig,
)
from .platform import DriversConfig, NixlConfig, PreflightConfig, RdmaConfig, RuntimeConfig
from .pools import (
    ColocatedConfig,
    CudagraphMode,  # noqa: F401
    DecodeConfig,
    PoolConfig,
    PrefillConfig,
    RouterConfig,
)


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
    prediction: PredictionConfig = Field(default_factory=PredictionConfig,
                                         description="What `glm-infra predict` assumes beyond the topology.")
    capacity: CapacityConfig = Field(default_factory=CapacityConfig, description="KV-cache capacity planning: the "
                                                                                 "checkpoint's facts and the reserve.")
    startup: StartupConfig = Field(default_factory=StartupConfig, description="An instance's start: warm-start caches "
                                                                              "staged between hosts, the expected time to ready.")
    state_in_checkout: bool = Field(False, description="The stack's hosts are disposable (the simulated cluster): its "
                                    "Pulumi state may live in a file backend inside the repository checkout, where "
                                    "scripts/lib/pulumi-env.sh puts it unless PULUMI_BACKEND_URL is set. Otherwise "
                                    "`up` refuses such a backend (a re-clone or `git clean -xfd` would delete the "
                                    "state) and a preview warns.")

    @model_validator(mode="before")
    @classmethod
    def _brief_layout(cls, data: Any) -> Any:
        """No pool given: the recipe's layout (docs/RECIPE.md). Prefill on every host but the last, decode
        and the router on the last; one host: a colocated instance."""
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
