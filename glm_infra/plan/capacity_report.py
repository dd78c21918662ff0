"""What ``glm-infra plan`` prints of the KV-cache capacity (``capacity.compute``): the per-rank report
with where each fact came from, and the markdown table of one pool across stacks (docs/CAPACITY.md)."""

from __future__ import annotations

from pathlib import Path

from glm_infra.spec.config import StackConfig

from .capacity import GB, REQUEST_SIZES, Capacity, compute


def _gb(n: int) -> str:
    return f"{n / GB:.1f} GB"


_FACT_LINES = (("num_hidden_layers", "layers"), ("num_nextn_predict_layers", "MTP layers"),
               ("kv_lora_rank", "MLA latent"), ("qk_rope_head_dim", "MLA RoPE part"),
               ("index_head_dim", "DSA indexer key"), ("indexer_layers", "layers keeping indexer keys"),
               ("max_position_embeddings", "positions"))


def format_report(stack: StackConfig, cap: Capacity) -> str:
    f = cap.facts
    cb = f.class_bytes
    out = ["KV-cache capacity per rank (glm_infra/plan/capacity.py):"]
    if f.real:
        out.append(f"  config: {f.real}")
    out += [f"  facts snapshot: {f.snapshot}",
            f"  checkpoint: {_gb(f.total_bytes)}: routed experts {_gb(f.routed_bytes)}, on every rank "
            f"{_gb(f.resident_bytes)} ({', '.join(f'{k} {_gb(v)}' for k, v in cb.items() if k != 'routed' and v)})",
            f"    [{f.sources['weights']}]"]
    if f.bf16_excluded and f.sources["weights"].startswith("synthetic"):
        out.append(f"    hf_quant_config.json#quantization.exclude_modules keeps {f.bf16_excluded} module patterns in "
                   "BF16, among them the dense MLP of layers 0-2, the shared experts and the MTP layer, which the "
                   "synthetic headers store as NVFP4: the real checkpoint is larger than this")
    out.append("  model facts:")
    for key, what in _FACT_LINES:
        if key in f.sources:
            value = getattr(f, "mtp_layers" if key == "num_nextn_predict_layers" else key)
            out.append(f"    {key} {value:,} ({what})  [{f.sources[key]}]")
    if f.index_head_dim and f.mtp_layers:
        out.append(f"    + {f.mtp_layers} MTP layer(s) keeping indexer keys of their own (with MTP on)  [assumed]")
    out.append(f"    KV cache: {cap.kv_note}")
    for p in cap.pools:
        share = f"÷{p.ep_size} EP" if p.ep_size > 1 else "not divided"
        req = ", ".join(f"{n // 1024}K: {p.requests_per_instance(n)}" for n in REQUEST_SIZES)
        out += [
            f"  {p.role} (tp{p.tp} dp{p.dp}{' ep' if p.ep_size > p.tp else ''}), per rank:",
            f"    GPU memory {_gb(p.gpu_bytes)} × {p.utilization:g} = {_gb(int(p.gpu_bytes * p.utilization))}  "
            f"[{p.gpu_source}]",
            f"    weights {_gb(p.weights_per_rank)} = routed {_gb(p.routed_per_rank)} ({share}) + "
            f"resident {_gb(p.resident_per_rank)} (÷tp{p.tp})",
            f"    reserve {_gb(p.reserve_bytes)} (activations, CUDA graphs, MTP draft)  [capacity.reserveGb]",
            f"    KV room {_gb(p.room)}; KV {p.kv_bytes_per_token} bytes/token = {p.kv_layers} layers × "
            f"{p.mla_bytes_per_layer} (MLA, {p.kv_cache_dtype})"
            + (f" + {p.indexer_layers} × {p.indexer_bytes_per_layer} (indexer keys)" if p.indexer_layers else ""),
            f"    tokens per rank {p.tokens_per_rank:,}; requests per instance ({p.dp} ranks): {req}, "
            f"max {p.max_model_len:,}: {p.requests_per_instance(p.max_model_len)}  [max: {p.max_model_len_source}]",
        ]
    return "\n".join(out)


def trade_table(rows: list[tuple[str, StackConfig]], role: str = "prefill", base: Path | None = None) -> str:
    """A markdown table of one pool across stacks (docs/CAPACITY.md's DP4-vs-DP2 table)."""
    head = ("stack", "pool", "GPUs/instance", "weights/rank", "KV room/rank", "tokens/rank", "tokens in the pool",
            "16K req/inst", "256K req/inst", "max req/inst", "max req/GPU")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, stack in rows:
        p = next(x for x in compute(stack, base=base).pools if x.role == role)
        gpus = p.tp * p.dp
        pool = getattr(stack, role)
        ranks = len(pool.hosts) * pool.instances_per_host * p.dp
        lines.append("| " + " | ".join((
            name, f"{role} tp{p.tp} dp{p.dp}", str(gpus), _gb(p.weights_per_rank), _gb(p.room),
            f"{p.tokens_per_rank:,}", f"{p.tokens_per_rank * ranks:,} ({ranks} ranks)",
            str(p.requests_per_instance(REQUEST_SIZES[0])),
            str(p.requests_per_instance(REQUEST_SIZES[1])),
            f"{p.requests_per_instance(p.max_model_len)} of {p.max_model_len:,}",
            f"{p.requests_per_instance(p.max_model_len) / gpus:.2f}")) + " |")
    return "\n".join(lines)
