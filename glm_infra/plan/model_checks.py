"""The model against the stack: the checkpoint's weight format against the hosts' GPUs, the KV-cache room
of each pool against the longest request it promises (``capacity.py``'s arithmetic), the promised
contexts against the model's positions, and a model revision that is not a commit. Part of
``validate.check``; the warnings are ``stack.py``'s."""

from __future__ import annotations

import re

from glm_infra.spec.config import StackConfig

from . import capacity
from .capacity import Capacity
from .problem import Problem, key_path

# --- the checkpoint against the GPUs ---------------------------------------------------------------

# Compute capability of the GPU models a stack may name (hosts[].gpuModel), and the least each weight
# format needs: NVFP4 runs on Blackwell (10.0 and up), FP8 from Ada/Hopper (8.9).
GPU_COMPUTE_CAPABILITY = {"B300": 10.3, "GB300": 10.3, "B200": 10.0, "GB200": 10.0, "H200": 9.0, "GH200": 9.0,
                          "H100": 9.0, "H800": 9.0, "H20": 9.0, "L40S": 8.9, "L40": 8.9, "A100": 8.0, "A800": 8.0}
WEIGHT_FORMAT_NEEDS = {"nvfp4": 10.0, "fp8": 8.9, "bf16": 8.0}


def gpu_family(gpu_model: str) -> str:
    """``NVIDIA B300 SXM6 AC`` or ``B300`` → ``B300``: the name the tables here are keyed by."""
    return gpu_model.removeprefix("NVIDIA ").split()[0].upper()


def weight_format_problems(stack: StackConfig) -> list[Problem]:
    fmt = stack.model.weight_format
    out = []
    if fmt is None:
        return out
    need = WEIGHT_FORMAT_NEEDS[fmt]
    serving = {h for _, pool in stack.pools() for h in pool.hosts} or {h.name for h in stack.hosts}
    for i, h in enumerate(stack.hosts):
        cc = GPU_COMPUTE_CAPABILITY.get(gpu_family(h.gpu_model))
        if h.name in serving and cc is not None and cc < need:
            out.append(Problem(key_path("hosts", f"[{i}].gpuModel"),
                               f"{h.name}'s {h.gpu_model} (compute capability {cc:g}) cannot run {stack.model.repo}'s "
                               f"{fmt.upper()} weights, which need {need:g} or later (model.weightFormat)"))
    return out


# --- KV-cache room ---------------------------------------------------------------------------------


def capacity_problems(stack: StackConfig) -> list[Problem]:
    """A pool whose rank cannot hold one request of the maximum context is refused (capacity.py)."""
    try:
        cap = capacity.compute(stack)
    except capacity.CapacityError as e:
        return [Problem(e.key, e.message)]
    out = promise_problems(stack, cap)
    sla = stack.sla
    longest = max(sla.contexts) + sla.output_tokens
    for p in cap.pools:
        if p.requests_per_rank(p.max_model_len) >= 1:
            if p.tokens_per_rank < longest:
                out.append(Problem(key_path(p.role), f"a {p.role} rank (tp{p.tp} dp{p.dp}) has no KV-cache room for the "
                                                 f"SLA's longest request, {max(sla.contexts):,} + {sla.output_tokens} = "
                                                 f"{longest:,} tokens (sla.contexts, sla.outputTokens): its KV room of "
                                                 f"{p.room / capacity.GB:.1f} GB holds {p.tokens_per_rank:,} tokens at "
                                                 f"{p.kv_bytes_per_token} bytes/token. Promise less in sla.contexts, or "
                                                 "give the rank more room (glm-infra plan shows the arithmetic)"))
            continue
        what = (f"the weights alone ({p.weights_per_rank / capacity.GB:.1f} GB per rank) and the reserve "
                f"({p.reserve_bytes / capacity.GB:.1f} GB) exceed {p.gpu_bytes / capacity.GB:.1f} GB × {p.utilization:g}"
                if p.room <= 0 else
                f"its KV room of {p.room / capacity.GB:.1f} GB holds {p.tokens_per_rank:,} tokens at "
                f"{p.kv_bytes_per_token} bytes/token")
        out.append(Problem(key_path(p.role), f"a {p.role} rank (tp{p.tp} dp{p.dp}) cannot hold one request of the maximum "
                                         f"context, {p.max_model_len:,} tokens ({p.max_model_len_source}): {what}. "
                                         "Use more GPUs per instance (dp), a smaller model.maxModelLen, a denser "
                                         "model.kvCacheDtype or a higher gpuMemoryUtilization (glm-infra plan shows "
                                         "the arithmetic)"))
    return out


def promise_problems(stack: StackConfig, cap: Capacity) -> list[Problem]:
    """What the stack promises against what the model has: model.maxModelLen within the model's
    positions, and every SLA bucket (its input and sla.outputTokens: vLLM's OpenAI server refuses a
    request whose prompt and max_tokens exceed --max-model-len) within the context the stack serves."""
    out = []
    m, sla, f = stack.model, stack.sla, cap.facts
    positions = f.max_position_embeddings
    if m.max_model_len is not None and m.max_model_len > positions:
        out.append(Problem(key_path("model", ".maxModelLen"), f"{m.max_model_len:,} tokens is more than the model's "
                                                          f"{positions:,} positions (max_position_embeddings, "
                                                          f"{f.sources['max_position_embeddings']}); vLLM refuses it"))
    served = m.max_model_len or positions
    where = "model.maxModelLen" if m.max_model_len else f"max_position_embeddings, {f.sources['max_position_embeddings']}"
    over = [c for c in sla.contexts if c + sla.output_tokens > served]
    if over:
        out.append(Problem(key_path("sla", ".contexts"), f"the SLA promises {', '.join(f'{c:,}' for c in over)} input tokens "
                                                     f"+ {sla.output_tokens} output "
                                                     f"(sla.outputTokens), more than the {served:,} tokens the stack "
                                                     f"serves ({where}): vLLM refuses such a request. Drop those "
                                                     "buckets, or raise model.maxModelLen where the KV room allows"))
    return out


def capacity_warnings(stack: StackConfig) -> list[str]:
    """Pools whose rank holds fewer than capacity.warnBelow requests of the maximum context; an explicit
    model.kvCacheDtype other than the checkpoint's KV-cache quantisation."""
    try:
        cap = capacity.compute(stack)
    except capacity.CapacityError:
        return []  # refused by check() already
    n = stack.capacity.warn_below
    out = [f"glm-infra:{p.role}: a {p.role} rank holds {p.requests_per_rank(p.max_model_len)} request(s) of the maximum "
           f"context ({p.max_model_len:,} tokens), fewer than capacity.warnBelow {n}"
           for p in cap.pools if 1 <= p.requests_per_rank(p.max_model_len) < n]
    dtype, q = stack.model.kv_cache_dtype, cap.facts.kv_cache_quant
    if dtype not in (None, "auto") and q is not None and capacity.kv_family(dtype) != q.upper():
        out.append(f"glm-infra:model.kvCacheDtype: {dtype} is not the checkpoint's {q} KV-cache quantisation "
                   f"({cap.facts.sources['kv_cache_quant']}); vLLM serves {dtype} as asked and capacity counts it")
    return out


def unpinned_revision(stack: StackConfig) -> Problem | None:
    """A model.revision that is not a commit: a branch or tag deploys whatever it points to that day
    (a warning; ``glm-infra validate --strict`` refuses it)."""
    rev = stack.model.revision
    if re.fullmatch(r"[0-9a-f]{40}", rev):
        return None
    return Problem(key_path("model", ".revision"), f"{rev!r} is not a commit SHA; pin a commit so every host serves the "
                                               "same bytes")
