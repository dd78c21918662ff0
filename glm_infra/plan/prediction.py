"""What to ask NVIDIA's aiconfigurator about a stack, and what its answers mean against the SLA.

Pure: one estimate request per SLA context bucket, built from the stack's own topology (TP, DP, EP,
instances, MTP draft lengths) and its ``prediction`` block; the answers judged against ``sla``.
``glm_infra/tools/planner.py`` runs the requests with aiconfigurator (the ``glm-infra[planner]``
extra); nothing here imports it, so the library and ``pulumi up`` never need it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from glm_infra.spec.config import PoolConfig, StackConfig

from .model_checks import gpu_family
from .problem import Problem, key_path

# aiconfigurator's system (its systems/*.yaml) for each GPU model as nvidia-smi names it (hosts[].gpuModel).
SYSTEMS = {"B300": "b300_sxm", "B200": "b200_sxm", "GB300": "gb300", "GB200": "gb200", "H200": "h200_sxm",
           "H100": "h100_sxm"}
# The checkpoints aiconfigurator carries a config of (aiconfigurator_core/model_configs/), by model.repo.
MODELS = {"nvidia/GLM-5.2-NVFP4"}
BACKEND = "vllm"


@dataclass(frozen=True)
class PoolShape:
    """One pool as aiconfigurator sees it: a worker is one vLLM instance of tp × dp ranks."""

    tp: int
    attention_dp: int
    moe_tp: int
    moe_ep: int
    workers: int
    batch_per_rank: int

    @property
    def gpus(self) -> int:
        return self.tp * self.attention_dp * self.workers


@dataclass(frozen=True)
class BucketRequest:
    """One SLA bucket's estimate: ``context`` input tokens, ``output_tokens`` out, at the gate's concurrency."""

    context: int
    output_tokens: int
    mode: Literal["disagg", "agg"]
    pools: dict[str, PoolShape]
    nextn: int
    nextn_accepted: float

    def estimate_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of aiconfigurator.cli.api.cli_estimate (besides model, system and backend)."""
        kw: dict[str, Any] = {"mode": self.mode, "isl": self.context, "osl": self.output_tokens,
                              "nextn": self.nextn, "nextn_accepted": self.nextn_accepted if self.nextn else None}
        if self.mode == "agg":
            p = self.pools["colocated"]
            kw.update(tp_size=p.tp, pp_size=1, attention_dp_size=p.attention_dp, moe_tp_size=p.moe_tp,
                      moe_ep_size=p.moe_ep, batch_size=p.batch_per_rank)
            return kw
        for role, pool in (("prefill", self.pools["prefill"]), ("decode", self.pools["decode"])):
            kw.update({f"{role}_tp_size": pool.tp, f"{role}_pp_size": 1, f"{role}_attention_dp_size": pool.attention_dp,
                       f"{role}_moe_tp_size": pool.moe_tp, f"{role}_moe_ep_size": pool.moe_ep,
                       f"{role}_batch_size": pool.batch_per_rank, f"{role}_num_workers": pool.workers})
        return kw


@dataclass(frozen=True)
class Target:
    """What aiconfigurator is asked with: its system, the model's config it carries, and its data."""

    system: str
    model: str
    backend: str
    backend_version: str | None
    database_mode: str
    concurrency: int
    mtp_acceptance_rate: float


def _shape(pool: PoolConfig, concurrency: int | None) -> PoolShape:
    """concurrency: the requests in flight that share the pool's ranks (None: one prompt at a time per rank,
    as a prefill rank takes them; a prompt spends a small part of its life there)."""
    ranks = pool.tp * pool.dp
    workers = len(pool.hosts) * pool.instances_per_host
    # With EP the experts are spread over every rank of an instance; without, vLLM shards each expert over them.
    moe_tp, moe_ep = (1, ranks) if pool.ep else (ranks, 1)
    return PoolShape(tp=pool.tp, attention_dp=pool.dp, moe_tp=moe_tp, moe_ep=moe_ep, workers=workers,
                     batch_per_rank=1 if concurrency is None else max(1, math.ceil(concurrency / (pool.dp * workers))))


def target(stack: StackConfig) -> Target | Problem:
    """aiconfigurator's system and model for the stack, or the key that has none."""
    models = {gpu_family(h.gpu_model) for h in stack.hosts}
    for i, h in enumerate(stack.hosts):
        if gpu_family(h.gpu_model) not in SYSTEMS:
            return Problem(key_path("hosts", f"[{i}].gpuModel"),
                           f"{h.gpu_model!r}: aiconfigurator has no system for it (known: {', '.join(sorted(SYSTEMS))})")
    if len(models) > 1:
        return Problem(key_path("hosts", ""), f"hosts of several GPU models ({', '.join(sorted(models))}); "
                                               "predict takes one system")
    if stack.model.repo not in MODELS:
        return Problem(key_path("model", ".repo"), f"{stack.model.repo!r}: aiconfigurator carries no config of it "
                                                   f"(known: {', '.join(sorted(MODELS))})")
    p = stack.prediction
    return Target(system=SYSTEMS[models.pop()], model=stack.model.repo, backend=BACKEND,
                  backend_version=p.backend_version, database_mode=p.database_mode,
                  concurrency=stack.sla.concurrency, mtp_acceptance_rate=p.mtp_acceptance_rate)


def requests(stack: StackConfig) -> list[BucketRequest]:
    """One request per SLA context bucket, the load the SLA gate puts on the stack (sla.concurrency
    requests in flight, sla.outputTokens each), spread over the decode (or colocated) ranks."""
    conc = stack.sla.concurrency
    if stack.colocated is not None:
        pools = {"colocated": _shape(stack.colocated, conc)}
        mtp = stack.colocated.speculative_tokens
        mode: Literal["disagg", "agg"] = "agg"
    else:
        assert stack.prefill is not None and stack.decode is not None
        pools = {"prefill": _shape(stack.prefill, None), "decode": _shape(stack.decode, conc)}
        # aiconfigurator takes one draft length for both phases: decode's, the one TPOT depends on.
        mtp = stack.decode.speculative_tokens
        mode = "disagg"
    accepted = round(stack.prediction.mtp_acceptance_rate * mtp, 4)
    return [BucketRequest(context=c, output_tokens=stack.sla.output_tokens, mode=mode, pools=pools, nextn=mtp,
                          nextn_accepted=accepted) for c in stack.sla.contexts]


@dataclass
class PoolPrediction:
    workers: int
    gpus: int
    memory_gb_per_rank: float
    requests_per_s: float


@dataclass
class BucketPrediction:
    """aiconfigurator's answer for one bucket; ``error`` when it gave none (its reason, verbatim)."""

    context: int
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    tokens_per_s_per_gpu: float | None = None
    requests_per_s: float | None = None
    concurrency: float | None = None
    pools: dict[str, PoolPrediction] = field(default_factory=dict)
    error: str | None = None


def from_estimate(req: BucketRequest, raw: dict[str, Any]) -> BucketPrediction:
    """A prediction from cli_estimate's result row (EstimateResult.raw)."""
    pools: dict[str, PoolPrediction] = {}
    for role, pool in req.pools.items():
        if req.mode == "agg":
            memory, rate = raw["memory"], raw["seq/s"]
        else:
            tag = "(p)" if role == "prefill" else "(d)"
            memory, rate = raw[f"{tag}memory"], raw[f"{tag}seq/s/worker"] * pool.workers
        pools[role] = PoolPrediction(workers=pool.workers, gpus=pool.gpus, memory_gb_per_rank=round(memory, 3),
                                     requests_per_s=round(rate, 3))
    return BucketPrediction(context=req.context, ttft_ms=round(raw["ttft"], 3), tpot_ms=round(raw["tpot"], 3),
                            tokens_per_s_per_gpu=round(raw["tokens/s/gpu"], 3), requests_per_s=round(raw["seq/s"], 3),
                            concurrency=raw["concurrency"], pools=pools)


def misses(stack: StackConfig, b: BucketPrediction) -> list[str]:
    """How a bucket's prediction misses the SLA: a mean above a target, or no prediction at all."""
    name = bucket_label(b.context)
    if b.error is not None:
        return [f"{name}: no prediction ({b.error})"]
    # A latency aiconfigurator gave without a number (absent, NaN, infinite, not above 0) predicts nothing:
    # a miss, never a pass.
    unknown = [f"{name}: no predicted {what} (aiconfigurator gave {value!r})"
               for what, value in (("TTFT", b.ttft_ms), ("TPOT", b.tpot_ms))
               if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0)]
    if unknown:
        return unknown
    ttft, tpot = float(b.ttft_ms or 0), float(b.tpot_ms or 0)
    out = []
    if ttft > stack.sla.ttft_seconds * 1000:
        out.append(f"{name}: predicted TTFT {ttft / 1000:.2f} s > {stack.sla.ttft_seconds:g} s (sla.ttftSeconds)")
    if tpot > stack.sla.tpot_seconds * 1000:
        out.append(f"{name}: predicted TPOT {tpot:.1f} ms > {stack.sla.tpot_seconds * 1000:g} ms (sla.tpotSeconds)")
    return out


def bucket_label(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


@dataclass
class Prediction:
    """Every bucket of a stack, labelled with the data that predicted it."""

    stack: str
    target: Target
    labels: dict[str, str]
    buckets: list[BucketPrediction]
    notes: list[str] = field(default_factory=list)

    def to_json(self, stack: StackConfig) -> dict[str, Any]:
        return {"stack": self.stack, "target": asdict(self.target), "labels": self.labels,
                "sla": {"ttft_seconds": stack.sla.ttft_seconds, "tpot_seconds": stack.sla.tpot_seconds},
                "buckets": [{**asdict(b), "misses": misses(stack, b)} for b in self.buckets],
                "notes": self.notes}


def format_table(stack: StackConfig, p: Prediction) -> str:
    """The prediction as ``glm-infra predict`` prints it: per bucket, per pool."""
    t = p.target
    lines = [f"predicted by {p.labels['predictor']}: {t.system}, {t.backend} {p.labels['backend_version']} data "
             f"({t.database_mode}), {t.model}",
             f"load: the SLA gate's {t.concurrency} requests in flight; MTP acceptance {t.mtp_acceptance_rate:g} "
             f"(prediction.mtpAcceptanceRate)",
             f"SLA: mean TTFT ≤ {stack.sla.ttft_seconds:g} s, mean TPOT ≤ {stack.sla.tpot_seconds * 1000:g} ms", ""]
    head = ("bucket", "pool", "TTFT s", "TPOT ms", "tok/s/GPU", "req/s", "GB/rank", "verdict")
    rows: list[tuple[str, ...]] = [head]
    for b in p.buckets:
        if b.error is not None:
            rows.append((bucket_label(b.context), "-", "-", "-", "-", "-", "-", f"no prediction: {b.error}"))
            continue
        verdict = "; ".join(m.split(": ", 1)[1] for m in misses(stack, b)) or "meets the SLA"
        first = True
        for role, pool in b.pools.items():
            ttft = f"{b.ttft_ms / 1000:.2f}" if role in ("prefill", "colocated") and b.ttft_ms is not None else ""
            tpot = f"{b.tpot_ms:.1f}" if role in ("decode", "colocated") and b.tpot_ms is not None else ""
            tps = f"{b.tokens_per_s_per_gpu:.1f}" if first else ""
            rows.append((bucket_label(b.context) if first else "", role, ttft, tpot, tps, f"{pool.requests_per_s:.2f}",
                         f"{pool.memory_gb_per_rank:.1f}", verdict if first else ""))
            first = False
    widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(line.rstrip() for line in lines)
