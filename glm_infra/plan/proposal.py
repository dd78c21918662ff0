"""From aiconfigurator's ranked P/D configurations to a stack file glm-infra deploys (``glm-infra propose``).

Pure: what its search may try (``search_space``), which of its answers are whole predictions
(``Candidate.from_row``) and meet the SLA asked (``sla_misses``), which glm-infra can deploy and why
not the others (``why_not_candidate``), and the stack file of the best one (``stack_document``): the
base stack's hosts, SSH, model and platform, with the prefill and decode pools, the router and the SLA
of the proposal. glm_infra/tools/propose.py runs the search.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from glm_infra.spec.config import NAMESPACE, StackConfig


@dataclass(frozen=True)
class Shape:
    """One pool of a configuration: a worker (vLLM instance) of tp × dp ranks, and how many."""

    tp: int
    pp: int
    dp: int
    moe_tp: int
    moe_ep: int
    workers: int

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def label(self) -> str:
        return f"tp{self.tp} pp{self.pp} dp{self.dp} moe tp{self.moe_tp}/ep{self.moe_ep}"


class BadRow(ValueError):
    """A row of aiconfigurator's ranking that is not a whole prediction: the message names the column."""


def _number(row: dict[str, Any], key: str) -> float:
    """The row's ``key``: present, a number (not a string, not a bool), finite and above 0. A prediction of
    0 is no prediction: nothing is served in no time."""
    if key not in row:
        raise BadRow(f"no {key!r}")
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRow(f"{key!r} is {value!r}, not a number")
    if not math.isfinite(value) or value <= 0:
        raise BadRow(f"{key!r} is {value!r}, not a finite number above 0")
    return float(value)


def _whole(row: dict[str, Any], key: str) -> int:
    value = _number(row, key)
    if not value.is_integer():
        raise BadRow(f"{key!r} is {row[key]!r}, not a whole number")
    return int(value)


@dataclass(frozen=True)
class Candidate:
    """One row of aiconfigurator's ranking: a replica (prefill and decode workers) and its prediction."""

    rank: int
    prefill: Shape
    decode: Shape
    replicas: int
    ttft_ms: float
    tpot_ms: float
    tokens_per_s_per_gpu: float  # over all the GPUs given, replicas counted (aiconfigurator's gpu_cluster)
    concurrency: float

    @classmethod
    def from_row(cls, rank: int, row: Any, total_gpus: int) -> Candidate:
        """A row as a candidate, or BadRow naming what is missing: every column glm-infra reads must be there
        as a number, so a row without a prediction is never mistaken for one that meets the SLA."""
        if not isinstance(row, dict):
            raise BadRow(f"a {type(row).__name__}, not a row of columns")

        def shape(tag: str) -> Shape:
            return Shape(*(_whole(row, f"({tag}){k}") for k in ("tp", "pp", "dp", "moe_tp", "moe_ep", "workers")))

        return cls(rank=rank, prefill=shape("p"), decode=shape("d"),
                   replicas=max(1, total_gpus // _whole(row, "num_total_gpus")), ttft_ms=_number(row, "ttft"),
                   tpot_ms=_number(row, "tpot"), tokens_per_s_per_gpu=_number(row, "tokens/s/gpu_cluster"),
                   concurrency=_number(row, "concurrency"))


def sla_misses(c: Candidate, ttft_ms: float, tpot_ms: float) -> list[str]:
    """What of the SLA asked (mean TTFT ≤ ``ttft_ms``, mean TPOT ≤ ``tpot_ms``) the candidate's prediction
    misses, by how much; empty when it meets both. glm-infra's own check: it does not rest on the search
    having filtered."""
    misses = []
    if not c.ttft_ms <= ttft_ms:
        misses.append(f"TTFT {c.ttft_ms / 1000:.2f} s > {ttft_ms / 1000:g} s "
                      f"({(c.ttft_ms - ttft_ms) / 1000:.2f} s over, {c.ttft_ms / ttft_ms:.2f}×)")
    if not c.tpot_ms <= tpot_ms:
        misses.append(f"TPOT {c.tpot_ms:.1f} ms > {tpot_ms:g} ms ({c.tpot_ms - tpot_ms:.1f} ms over, "
                      f"{c.tpot_ms / tpot_ms:.2f}×)")
    return misses


def shortfall(c: Candidate, ttft_ms: float, tpot_ms: float) -> float:
    """How far the prediction is from the SLA: its larger ratio to its target (≤ 1 meets both); the
    closest configuration is the one with the least."""
    return max(c.ttft_ms / ttft_ms, c.tpot_ms / tpot_ms)


def search_space(gpus_per_host: int) -> dict[str, Any]:
    """What the search may try: one stage (no pipeline parallel) of at most one host's GPUs per worker,
    as glm-infra runs an instance (aiconfigurator's disagg experiment keys)."""
    sizes = [n for n in (1, 2, 4, 8, 16) if n <= gpus_per_host]
    return {f"{role}_{k}": v for role in ("prefill", "decode")
            for k, v in (("pp_candidates", [1]), ("num_gpu_candidates", sizes))}


def why_not(shape: Shape, role: str, gpus_per_host: int) -> str | None:
    """Why glm-infra cannot run this pool's worker, or None."""
    ranks = shape.tp * shape.dp
    if shape.pp > 1:
        return f"{role} uses pipeline parallel (pp{shape.pp}), which glm-infra does not deploy"
    if shape.gpus > gpus_per_host:
        return f"a {role} worker spans {shape.gpus} GPUs, more than a host's {gpus_per_host}"
    if ranks > 1 and (shape.moe_tp, shape.moe_ep) not in ((1, ranks), (ranks, 1)):
        return (f"{role}'s experts are split tp{shape.moe_tp} × ep{shape.moe_ep}: vLLM either spreads them over "
                f"every rank (-ep) or shards each over every rank")
    return None


@dataclass(frozen=True)
class Layout:
    """Where a pool's workers go: ``instances_per_host`` on each of ``hosts`` hosts."""

    workers: int
    instances_per_host: int
    hosts: int


def layout(workers: int, gpus_per_worker: int, gpus_per_host: int) -> Layout:
    """As many workers on a host as fit, the same number on every host (a pool's instancesPerHost): the
    largest count that fits and divides the workers."""
    fit = max(1, gpus_per_host // gpus_per_worker)
    per_host = max(n for n in range(1, min(fit, workers) + 1) if workers % n == 0)
    return Layout(workers=workers, instances_per_host=per_host, hosts=math.ceil(workers / per_host))


def describe(c: Candidate) -> str:
    return (f"#{c.rank} ({c.tokens_per_s_per_gpu:.1f} tok/s/GPU, prefill {c.prefill.label}, decode "
            f"{c.decode.label})")


def why_not_candidate(c: Candidate, gpus_per_host: int, hosts: int) -> str | None:
    """Why glm-infra cannot deploy this configuration on ``hosts`` hosts (before validate sees it), or None."""
    reason = why_not(c.prefill, "prefill", gpus_per_host) or why_not(c.decode, "decode", gpus_per_host)
    if reason is None:
        p = layout(c.prefill.workers * c.replicas, c.prefill.gpus, gpus_per_host)
        d = layout(c.decode.workers * c.replicas, c.decode.gpus, gpus_per_host)
        if p.hosts + d.hosts > hosts:
            reason = (f"its {p.workers} prefill and {d.workers} decode workers take {p.hosts} + {d.hosts} hosts "
                      f"(a host serves one pool), more than the {hosts} given")
    return reason


def _pool(shape: Shape, lay: Layout, hosts: list[str], speculative_tokens: int) -> dict[str, Any]:
    ranks = shape.tp * shape.dp
    return {"hosts": hosts, "instancesPerHost": lay.instances_per_host, "tp": shape.tp, "dp": shape.dp,
            "ep": ranks > 1 and shape.moe_ep == ranks, "speculativeTokens": speculative_tokens}


def stack_document(base: dict[str, Any], config: StackConfig, c: Candidate, gpus_per_host: int,
                   sla: dict[str, Any], decode_mtp: int, prefill_mtp: int, max_model_len: int | None) -> dict[str, Any]:
    """The base stack file's document with the proposal's pools, router and SLA, on the hosts it needs
    (and ``model.maxModelLen`` when given)."""
    p = layout(c.prefill.workers * c.replicas, c.prefill.gpus, gpus_per_host)
    d = layout(c.decode.workers * c.replicas, c.decode.gpus, gpus_per_host)
    names = [h.name for h in config.hosts]
    prefill_hosts, decode_hosts = names[:p.hosts], names[p.hosts:p.hosts + d.hosts]
    used = set(prefill_hosts + decode_hosts)
    doc = {**base, "config": dict(base["config"])}
    cfg = doc["config"]
    cfg[f"{NAMESPACE}:hosts"] = [h for h in cfg[f"{NAMESPACE}:hosts"] if h["name"] in used]
    router = _routers(dict(cfg.get(f"{NAMESPACE}:router") or {}), prefill_hosts, decode_hosts)
    # The base's own settings of each pool (memory, batching, ports, env) stay; the topology is the proposal's.
    base_pools = {key: dict(cfg.get(f"{NAMESPACE}:{key}") or {}) for key in ("prefill", "decode")}
    for key in ("prefill", "decode", "colocated"):
        cfg.pop(f"{NAMESPACE}:{key}", None)
    cfg[f"{NAMESPACE}:prefill"] = {**base_pools["prefill"], **_pool(c.prefill, p, prefill_hosts, prefill_mtp)}
    cfg[f"{NAMESPACE}:decode"] = {**base_pools["decode"], **_pool(c.decode, d, decode_hosts, decode_mtp)}
    cfg[f"{NAMESPACE}:router"] = router
    cfg[f"{NAMESPACE}:sla"] = {**(cfg.get(f"{NAMESPACE}:sla") or {}), **sla}
    if max_model_len is not None:
        cfg[f"{NAMESPACE}:model"] = {**cfg[f"{NAMESPACE}:model"], "maxModelLen": max_model_len}
    monitoring = cfg.get(f"{NAMESPACE}:monitoring")
    if monitoring and monitoring.get("host") is not None:
        # The base's choice of a host that runs no router, kept where the proposal allows it.
        routers = {router["host"], *router.get("standbyHosts", [])}
        mon = monitoring["host"] if monitoring["host"] in used and monitoring["host"] not in routers else next(
            (h for h in prefill_hosts + decode_hosts if h not in routers), None)
        cfg[f"{NAMESPACE}:monitoring"] = {**{k: v for k, v in monitoring.items() if k != "host"},
                                          **({"host": mon} if mon else {})}
    return doc


def _routers(router: dict[str, Any], prefill_hosts: list[str], decode_hosts: list[str]) -> dict[str, Any]:
    """The router on the first decode host; as many standbys as the base had, on the other decode hosts, then the
    prefill hosts (none fit: a single router, and no virtual address)."""
    router["host"] = decode_hosts[0]
    wanted = len(router.get("standbyHosts") or [])
    standbys = [h for h in decode_hosts[1:] + prefill_hosts[::-1] if h != router["host"]][:wanted]
    if standbys:
        router["standbyHosts"] = standbys
    else:
        router = {k: v for k, v in router.items() if k not in ("standbyHosts", "virtualAddress")}
    return router


def experiment(model: str, system: str, backend: str, backend_version: str, database_mode: str, total_gpus: int,
               gpus_per_host: int, isl: int, osl: int, ttft_ms: float, tpot_ms: float, nextn: int,
               nextn_accepted: float) -> dict[str, Any]:
    """aiconfigurator's disaggregated experiment (the flat task keys of its ``cli exp``) within search_space."""
    exp: dict[str, Any] = {"serving_mode": "disagg", "total_gpus": total_gpus, "isl": isl, "osl": osl,
                           "ttft": ttft_ms, "tpot": tpot_ms, "nextn": nextn,
                           "nextn_accepted": nextn_accepted if nextn else None, "database_mode": database_mode}
    for role in ("prefill", "decode"):
        exp.update({f"{role}_model_path": model, f"{role}_system_name": system, f"{role}_backend_name": backend,
                    f"{role}_backend_version": backend_version})
    return {**exp, **search_space(gpus_per_host)}
