"""Operating a stack: monitoring, the SLA it promises, the firewall and capacity planning."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    Field,
    field_validator,
)

from .base import Cidr, Port, Secret, StrictModel
from .checkpoint import FACT_KEYS

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
    dead_mans_switch_url: Secret | None = Field(
        None, description="A dead man's switch (a service outside the stack that pages when a heartbeat stops "
                          "arriving), a Pulumi secret: Alertmanager sends it the always-firing Watchdog alert every "
                          "deadMansSwitchInterval, so the monitoring host, Prometheus or Alertmanager going down "
                          "pages too. None: nothing pages when the monitoring itself is down (validate warns).")
    dead_mans_switch_interval: Duration = Field("1m", description="How often the Watchdog alert is sent to the dead "
                                                                  "man's switch (its expected period, shorter than the "
                                                                  "switch's grace time).")
    group_wait: Duration = Field("30s", description="How long Alertmanager waits to group a new alert before "
                                                    "sending it.")
    repeat_interval: Duration = Field("4h", description="How often a firing alert is sent again.")
    mtp_acceptance_min: float = Field(0.5, gt=0, lt=1, description="Alert when MTP draft acceptance falls below this.")
    kv_transfer_p99_seconds: float = Field(1.0, gt=0, description="Alert when NIXL's p99 KV transfer time exceeds this.")
    memory_growth_window: Duration = Field("6h", description="Window over which a vLLM instance's memory (its "
                                                             "unit's cgroup) growing without pause is a leak.")
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
                                      "(a share of the client's) before the gate says they disagree; a difference "
                                      "of 50 ms or less always agrees (the client's own TLS and router hop).")

    @field_validator("contexts")
    @classmethod
    def _distinct(cls, v: list[int]) -> list[int]:
        if len(set(v)) != len(v):
            raise ValueError("a context length is listed twice")
        return sorted(v)


class PredictionConfig(StrictModel):
    """What ``glm-infra predict`` assumes beyond the stack's topology when it asks NVIDIA's aiconfigurator
    (the ``glm-infra[planner]`` extra) for each SLA bucket's TTFT and TPOT."""

    mtp_acceptance_rate: float = Field(
        0.6, ge=0, le=1,
        description="Share of MTP draft tokens the model accepts, as vLLM counts it "
                    "(vllm:spec_decode_num_accepted_tokens_total / vllm:spec_decode_num_draft_tokens_total). The "
                    "default is an assumption, not a measurement: set your deployment's. Decode's accepted tokens "
                    "per step are this times decode's speculativeTokens.")
    backend_version: str | None = Field(
        None, pattern=r"^[0-9][0-9A-Za-z.+-]*$",
        description="vLLM version of aiconfigurator's measured data to predict with (default: the newest it has "
                    "for the GPU).")
    database_mode: Literal["SILICON", "HYBRID"] = Field(
        "SILICON", description="aiconfigurator's data mode: SILICON (measured kernels only) or HYBRID (measured, "
                               "and modelled where it has no measurement).")


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
                    "the machine running pulumi connect from (a bastion, a VPN). Required while the firewall is on: "
                    "glm-infra cannot guess them (open, every address could try SSH; a guess that missed would lock "
                    "you and pulumi out of the hosts). 0.0.0.0/0 and ::/0 open SSH to every address, with a "
                    "warning.")


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


class StartupConfig(StrictModel):
    """An instance's start: the warm-start caches staged from each pool's first host to its others, and
    what ``plan`` expects a start to take (docs/research/vllm-0.33-compile-cache.md: for GLM-5.2, vLLM
    0.33.0 loads the weights, tunes its kernels (cached on disk) and captures CUDA graphs (never cached))."""

    warm_cache: bool = Field(
        True, description="Stage each pool's warm-start caches (vLLM's FlashInfer autotune, DeepGEMM, Triton, "
                          "FlashInfer JIT and torch.compile caches under the services' home) from the pool's first "
                          "host to its others through a relay like the weights', verified like them, before their "
                          "instances restart on a change of vLLM, flags or model revision.")
    relay_port: Port = Field(7090, description="Port the warm-cache relay serves on (hosts with relay children): "
                                               "prefill's (or colocated's) here, decode's on the next port.")
    weight_load_seconds: float = Field(
        300, ge=0, description="Seconds an instance takes to load the checkpoint (vLLM's 'Loading weights took'). "
                               "An assumption (about 1.5 GB/s of the ~465 GB checkpoint), not a measurement: "
                               "set what your hosts take.")
    kernel_warmup_cold_seconds: float = Field(
        300, ge=0, description="Seconds of kernel warmup with nothing cached (FlashInfer autotune, DeepGEMM/Triton "
                               "JIT). An assumption from reports of minutes on other MoE models (vllm#43189, "
                               "vllm#44881), not a measurement: set yours.")
    kernel_warmup_warm_seconds: float = Field(
        30, ge=0, description="Seconds of kernel warmup with the caches warm (an assumption, as above).")
    graph_capture_seconds: float = Field(
        20, ge=0, description="Seconds of CUDA-graph capture, at every start (vLLM caches none; its code says "
                              "'This usually takes 5~20 seconds').")
