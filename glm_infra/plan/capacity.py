"""KV-cache room per rank of each pool, from the checkpoint's facts (glm_infra/spec/checkpoint.py: its
config.json and hf_quant_config.json, real where the library has them; the weight bytes from a facts
snapshot) and the stack's topology; every fact keeps where it came from. Pure arithmetic, no Pulumi:

    room = GPU memory × gpuMemoryUtilization − resident weights of the rank − capacity.reserveGb
    tokens per rank = room ÷ KV bytes per token

Weights per rank: routed experts ÷ EP size (tp × dp with ``ep``, else tp), everything else (MLA and the
DSA indexer, the dense MLP layers, shared experts, embeddings, lm_head, the MTP layers) ÷ tp. That
last division is an approximation: vLLM replicates the norms, the router gates and the indexer's
small projections on every TP rank, and splits the rest. At TP1 (every stack here) it is exact.

KV bytes per token per rank: MLA keeps one latent (kv_lora_rank + qk_rope_head_dim) per token and
layer, which TP does not split, plus the DSA indexer's key cache on every layer that runs the indexer;
the MTP draft layers have their own. With DP attention each DP rank holds only its own requests, so a
request of L tokens needs L tokens of room on one rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glm_infra.spec import checkpoint
from glm_infra.spec.config import PoolConfig, StackConfig

GB = 10**9
MIB = 2**20
# HBM per GPU as the vendor states it (GB = 10^9 bytes), for a stack whose hosts' facts are not known
# (plan and validate run offline); capacity.gpuMemoryGb overrides, preflight's memory.total wins when known.
GPU_MEMORY_GB = {"B300": 288, "GB300": 288, "B200": 180, "GB200": 186, "H200": 141, "GH200": 144, "H100": 80,
                 "H800": 80, "H20": 96, "L40S": 48, "L40": 48, "A100": 80, "A800": 80}
# Requests the plan counts per instance: the SLA's 16K and 256K and the stack's maximum context.
REQUEST_SIZES = (16384, 262144)

# vLLM's per-token layouts (cited from vLLM's source):
# - vllm/v1/attention/backends/mla/flashmla_sparse.py: the DSA (sparse MLA) cache accepts auto, bfloat16,
#   fp8_ds_mla, fp8 (an alias of fp8_ds_mla) and nvfp4_ds_mla. fp8_ds_mla is 656 bytes per token and layer
#   (512 fp8 NoPE values, 4 float32 scales, 64 bfloat16 RoPE values); nvfp4_ds_mla 352 (512 e2m1 packed
#   2/byte, 64 fp8 RoPE, 32 fp8 scales, one per 16).
# - vllm/config/cache.py: "auto" is the model's dtype, except that DeepSeek-V3.2-style (DSA) models default
#   to fp8.
# - vllm/model_executor/models/deepseek_v2.py (Indexer): the indexer's key cache is uint8,
#   index_head_dim fp8 values + one float32 scale per 128 (quant_block_size) = 132 bytes for head dim 128.
INDEXER_QUANT_BLOCK = 128
_FP8 = ("fp8", "fp8_e4m3", "fp8_e5m2")


class CapacityError(Exception):
    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"glm-infra:{key}: {message}")
        self.key = f"glm-infra:{key}"
        self.message = message


def mla_bytes_per_token(dtype: str, kv_lora_rank: int, rope_dim: int, sparse: bool) -> int:
    """Bytes of one token's MLA latent in one layer for a vLLM --kv-cache-dtype."""
    if sparse and (dtype == "auto" or dtype in _FP8):
        dtype = "fp8_ds_mla"
    if dtype in ("auto", "bfloat16", "float16"):
        return (kv_lora_rank + rope_dim) * 2
    if dtype in _FP8:
        return kv_lora_rank + rope_dim
    if dtype == "fp8_ds_mla":
        return kv_lora_rank + kv_lora_rank // 128 * 4 + rope_dim * 2
    if dtype == "nvfp4_ds_mla":
        return kv_lora_rank // 2 + rope_dim + kv_lora_rank // 16
    raise CapacityError("model.kvCacheDtype", f"{dtype!r}: glm-infra knows no MLA cache layout for it "
                                              "(auto, bfloat16, float16, fp8, fp8_ds_mla, nvfp4_ds_mla)")


def indexer_bytes_per_token(index_head_dim: int) -> int:
    return index_head_dim + index_head_dim // INDEXER_QUANT_BLOCK * 4 if index_head_dim else 0


# --- the model's facts -------------------------------------------------------------------------------



@dataclass(frozen=True)
class ModelFacts:
    num_hidden_layers: int
    mtp_layers: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    index_head_dim: int  # 0: no DSA indexer
    indexer_layers: int  # layers (of the main model) that run the indexer and keep its key cache
    max_position_embeddings: int
    class_bytes: dict[str, int]
    # Per fact, what it is and where it came from: "real: config.json#key", "stack: capacity.modelFacts",
    # "synthetic: …", "assumed: …" (plan prints them).
    sources: dict[str, str] = field(default_factory=dict)
    snapshot: str = "none"  # the facts snapshot the weight bytes (and a config without a real one) came from
    real: str = ""  # the checkpoint's own config files, when the library has them (checkpoint.RealConfig)
    kv_cache_quant: str | None = None  # hf_quant_config.json's kv_cache_quant_algo (None: not known / none)
    bf16_excluded: int = 0  # module globs hf_quant_config.json keeps out of the weight quantisation

    @property
    def routed_bytes(self) -> int:
        return self.class_bytes.get("routed", 0)

    @property
    def resident_bytes(self) -> int:
        """What every rank holds (split by TP): everything but the routed experts."""
        return sum(v for k, v in self.class_bytes.items() if k != "routed")

    @property
    def total_bytes(self) -> int:
        return sum(self.class_bytes.values())


def snapshot_path(stack: StackConfig, base: Path | None = None) -> Path:
    c = stack.capacity
    if c.facts:
        p = Path(c.facts)
        return p if p.is_absolute() else (base or Path.cwd()) / p
    return checkpoint.SNAPSHOT_DIR / checkpoint.snapshot_name(stack.model.repo)


def model_facts(stack: StackConfig, base: Path | None = None) -> ModelFacts:
    """The checkpoint's facts, each from the first of: the stack (capacity.modelFacts,
    capacity.routedBytes, capacity.residentBytes); a snapshot read from the checkpoint itself; the
    checkpoint's own config files shipped with the library (checkpoint.load_real_config, sha256
    checked); a synthetic snapshot (labelled so)."""
    c = stack.capacity
    path = snapshot_path(stack, base)
    snap: dict[str, Any] | None = None
    if path.is_file():
        try:
            snap = checkpoint.load_snapshot(path)
        except checkpoint.CheckpointError as e:
            raise CapacityError("capacity.facts", str(e)) from None
    elif c.facts:
        raise CapacityError("capacity.facts", f"{path}: no such file")
    synthetic = snap is not None and checkpoint.is_synthetic(snap)
    real: checkpoint.RealConfig | None = None
    real_dir = checkpoint.real_config_dir(stack.model.repo)
    if (snap is None or synthetic) and real_dir.is_dir():
        try:
            real = checkpoint.load_real_config(real_dir)
        except checkpoint.CheckpointError as e:
            raise CapacityError("capacity.facts", str(e)) from None
    snapshot = (f"{_short(path)}, read from {snap['source']} at revision {snap['revision']} "
                f"(the stack pins {stack.model.revision})") if snap else "none"
    if real is not None:
        cfg: dict[str, Any] = real.config
        where = "real: config.json#{}"
    else:
        cfg = snap["config"] if snap else {}
        where = f"synthetic: {_short(path)} config.{{}}" if synthetic else f"real: config.json#{{}} in {_short(path)}"
    given = dict(c.model_facts)
    sources: dict[str, str] = {}

    def fact(key: str, default: int | None = None) -> int:
        if key in given:
            sources[key] = "stack: capacity.modelFacts"
            return int(given[key])
        if key in cfg and cfg[key] is not None:
            sources[key] = where.format(key)
            return int(cfg[key])
        if default is not None:
            sources[key] = "default (not in config.json)"
            return default
        hint = f"{path} has none" if snap else f"no facts snapshot {path} (write it with: glm-infra capacity fetch STACK)"
        raise CapacityError(f"capacity.modelFacts.{key}", f"the checkpoint's {key} is not known: {hint}; "
                                                          "give it in capacity.modelFacts")

    layers = fact("num_hidden_layers")
    mtp = fact("num_nextn_predict_layers", 0)
    index_dim = fact("index_head_dim", 0)
    indexer_types = cfg.get("indexer_types") if "index_head_dim" not in given else None
    if not index_dim:
        indexer_layers = 0
    elif isinstance(indexer_types, list):
        # "shared" layers reuse the previous layer's top-k and keep no indexer key cache.
        indexer_layers = sum(1 for t in indexer_types if t == "full")
        sources["indexer_layers"] = f"{where.format('indexer_types')}: {indexer_layers} 'full' of {len(indexer_types)}"
    else:
        indexer_layers = layers
        sources["indexer_layers"] = ("assumed: every layer (capacity.modelFacts gives index_head_dim)"
                                     if "index_head_dim" in given else
                                     "assumed: every layer (no indexer_types in config.json)")
    facts = dict(num_hidden_layers=layers, mtp_layers=mtp, kv_lora_rank=fact("kv_lora_rank"),
                 qk_rope_head_dim=fact("qk_rope_head_dim"), index_head_dim=index_dim, indexer_layers=indexer_layers,
                 max_position_embeddings=fact("max_position_embeddings"))
    quant = ((real.quant or {}).get("quantization") if real is not None else None) or {}
    kv_quant = quant.get("kv_cache_quant_algo") if isinstance(quant.get("kv_cache_quant_algo"), str) else None
    sources["kv_cache_quant"] = ("real: hf_quant_config.json#quantization.kv_cache_quant_algo" if kv_quant else
                                 "not known (no hf_quant_config.json): vLLM's auto assumed")
    excluded = quant.get("exclude_modules")
    bf16_excluded = len(excluded) if isinstance(excluded, list) else 0
    weights_from = ("synthetic: the generated headers of the facts snapshot; the config files give no byte sizes"
                    if synthetic else
                    "safetensors headers") if snap is not None else ""
    if c.routed_bytes is not None and c.resident_bytes is not None:
        classes = {"routed": c.routed_bytes, "resident": c.resident_bytes}
        sources["weights"] = "stack: capacity.routedBytes, capacity.residentBytes"
    elif snap is not None:
        classes = checkpoint.class_bytes(snap)
        sources["weights"] = weights_from
        if c.routed_bytes is not None:
            resident = sum(v for k, v in classes.items() if k != "routed")
            classes, sources["weights"] = {"routed": c.routed_bytes, "resident": resident}, \
                f"stack: capacity.routedBytes; the rest {weights_from}"
        elif c.resident_bytes is not None:
            classes, sources["weights"] = {"routed": classes["routed"], "resident": c.resident_bytes}, \
                f"stack: capacity.residentBytes; routed experts {weights_from}"
    else:
        raise CapacityError("capacity.routedBytes", f"the checkpoint's weight bytes are not known: no facts "
                                                    f"snapshot {path} (glm-infra capacity fetch STACK writes it); "
                                                    "give capacity.routedBytes and capacity.residentBytes")
    real_text = (f"{_short(real.folder)}/ ({', '.join(checkpoint.REAL_FILES[:2 if real.quant else 1])}), "
                 f"from {real.origin}, sha256 checked (SOURCE.json)") if real else ""
    return ModelFacts(**facts, class_bytes=classes, sources=sources, snapshot=snapshot, real=real_text,
                      kv_cache_quant=kv_quant, bf16_excluded=bf16_excluded)


def _short(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path(__file__).resolve().parents[2]))
    except ValueError:
        return str(path)


# --- the room per pool -------------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolCapacity:
    role: str
    tp: int
    dp: int
    ep_size: int
    gpu_bytes: int
    gpu_source: str
    utilization: float
    routed_per_rank: int
    resident_per_rank: int
    reserve_bytes: int
    kv_cache_dtype: str
    kv_layers: int
    mla_bytes_per_layer: int
    indexer_layers: int
    indexer_bytes_per_layer: int
    max_model_len: int
    max_model_len_source: str

    @property
    def weights_per_rank(self) -> int:
        return self.routed_per_rank + self.resident_per_rank

    @property
    def room(self) -> int:
        return int(self.gpu_bytes * self.utilization) - self.weights_per_rank - self.reserve_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_layers * self.mla_bytes_per_layer + self.indexer_layers * self.indexer_bytes_per_layer

    @property
    def tokens_per_rank(self) -> int:
        return max(self.room, 0) // self.kv_bytes_per_token

    def requests_per_rank(self, length: int) -> int:
        return self.tokens_per_rank // length

    def requests_per_instance(self, length: int) -> int:
        """Each DP rank holds its own requests: a request is on one rank, never split."""
        return self.dp * self.requests_per_rank(length)

    def as_dict(self) -> dict[str, Any]:
        sizes = {str(n): self.requests_per_instance(n) for n in REQUEST_SIZES}
        return {
            "tp": self.tp, "dp": self.dp, "epSize": self.ep_size,
            "gpuMemoryBytes": self.gpu_bytes, "gpuMemorySource": self.gpu_source,
            "gpuMemoryUtilization": self.utilization,
            "weightsPerRankBytes": {"routed": self.routed_per_rank, "resident": self.resident_per_rank},
            "reserveBytes": self.reserve_bytes, "roomBytes": self.room,
            "kvCacheDtype": self.kv_cache_dtype, "kvBytesPerToken": self.kv_bytes_per_token,
            "tokensPerRank": self.tokens_per_rank, "maxModelLen": self.max_model_len,
            "requestsPerInstance": {**sizes, "max": self.requests_per_instance(self.max_model_len)},
        }


@dataclass(frozen=True)
class Capacity:
    facts: ModelFacts
    pools: tuple[PoolCapacity, ...]
    kv_note: str = ""  # the KV-cache layout counted, against the checkpoint's KV-cache quantisation


def kv_family(dtype: str) -> str | None:
    """The quantisation of a --kv-cache-dtype as hf_quant_config.json names it (None: unquantised)."""
    if dtype in _FP8 or dtype == "fp8_ds_mla":
        return "FP8"
    return "NVFP4" if dtype == "nvfp4_ds_mla" else None


def _kv_note(dtype: str, facts: ModelFacts, sparse: bool) -> str:
    """What capacity counts for the KV cache and whether the checkpoint agrees. With ``auto`` vLLM
    decides, and capacity's assumption (fp8_ds_mla for a DSA model) must match the checkpoint's KV-cache
    quantisation: one it cannot map is refused (counting the wrong layout would misstate the room)."""
    q = facts.kv_cache_quant
    src = facts.sources.get("kv_cache_quant", "")
    if dtype != "auto":
        if q is None or kv_family(dtype) == q.upper():
            return f"{dtype} (model.kvCacheDtype)" + (f"; the checkpoint's KV cache: {q} [{src}]" if q else "")
        return f"{dtype} (model.kvCacheDtype), not the checkpoint's {q} KV-cache quantisation [{src}]"
    counted = "fp8_ds_mla" if sparse else "bfloat16"
    if q is None:
        return f"auto, counted as {counted} (vLLM's default for {'a DSA' if sparse else 'this'} model) [{src}]"
    if sparse and q.upper() == "FP8":
        return f"auto, counted as fp8_ds_mla: agrees with the checkpoint's FP8 KV cache [{src}]"
    raise CapacityError("model.kvCacheDtype", f"the checkpoint's KV cache is quantised {q} [{src}], and glm-infra "
                                              f"cannot tell what vLLM's auto makes of that (it counts auto as "
                                              f"{counted} here): set model.kvCacheDtype")


def gpu_memory(stack: StackConfig, pool: PoolConfig, host_facts: dict[str, Any] | None = None) -> tuple[int, str]:
    """The smallest GPU memory among the pool's hosts, and where the figure comes from: preflight's
    memory.total when the host's facts are known, else capacity.gpuMemoryGb, else the GPU model table."""
    best: tuple[int, str] | None = None
    for name in pool.hosts:
        i = next(k for k, h in enumerate(stack.hosts) if h.name == name)
        h = stack.hosts[i]
        got = _preflight_memory(name, (host_facts or {}).get(name))
        if got is None and stack.capacity.gpu_memory_gb is not None:
            got = (int(stack.capacity.gpu_memory_gb * GB), f"capacity.gpuMemoryGb {stack.capacity.gpu_memory_gb:g} GB")
        if got is None:
            model = h.gpu_model.removeprefix("NVIDIA ").split()[0].upper()
            if model not in GPU_MEMORY_GB:
                raise CapacityError("capacity.gpuMemoryGb", f"hosts[{i}].gpuModel {h.gpu_model!r} is not in "
                                                            "glm-infra's GPU memory table: give the GPU memory")
            got = (GPU_MEMORY_GB[model] * GB, f"{model} {GPU_MEMORY_GB[model]} GB (GPU table)")
        if best is None or got[0] < best[0]:
            best = got
    assert best is not None
    return best


def _preflight_memory(host: str, facts: Any) -> tuple[int, str] | None:
    """memory.total of the host's smallest GPU from its facts (hostcheck.py gpu_facts)."""
    gpus = facts.get("gpus") if isinstance(facts, dict) else None
    mib = gpus.get("memory_total_mib") if isinstance(gpus, dict) else None
    if not isinstance(mib, int) or mib <= 0:
        return None
    return mib * MIB, f"preflight memory.total of {host} ({mib} MiB)"


def compute(stack: StackConfig, host_facts: dict[str, Any] | None = None, base: Path | None = None) -> Capacity:
    facts = model_facts(stack, base)
    m = stack.model
    max_len = m.max_model_len or facts.max_position_embeddings
    max_src = "model.maxModelLen" if m.max_model_len else \
        f"max_position_embeddings, {facts.sources['max_position_embeddings']}"
    dtype = m.kv_cache_dtype or "auto"
    mla = mla_bytes_per_token(dtype, facts.kv_lora_rank, facts.qk_rope_head_dim, sparse=facts.index_head_dim > 0)
    kv_note = _kv_note(dtype, facts, sparse=facts.index_head_dim > 0)
    idx = indexer_bytes_per_token(facts.index_head_dim)
    pools = []
    for role, pool in stack.pools():
        ep_size = pool.tp * pool.dp if pool.ep else pool.tp
        mtp = facts.mtp_layers if pool.speculative_tokens > 0 else 0
        mem, src = gpu_memory(stack, pool, host_facts)
        pools.append(PoolCapacity(
            role=role, tp=pool.tp, dp=pool.dp, ep_size=ep_size, gpu_bytes=mem, gpu_source=src,
            utilization=pool.gpu_memory_utilization,
            routed_per_rank=-(-facts.routed_bytes // ep_size), resident_per_rank=-(-facts.resident_bytes // pool.tp),
            reserve_bytes=int(stack.capacity.reserve_gb * GB), kv_cache_dtype=dtype,
            kv_layers=facts.num_hidden_layers + mtp, mla_bytes_per_layer=mla,
            # The MTP layers are DSA layers too: each keeps an indexer key cache.
            indexer_layers=facts.indexer_layers + (mtp if idx else 0), indexer_bytes_per_layer=idx,
            max_model_len=max_len, max_model_len_source=max_src))
    return Capacity(facts, tuple(pools), kv_note)


def as_output(stack: StackConfig, host_facts: dict[str, Any] | None = None) -> dict[str, Any]:
    """The stack output ``capacity``: per pool the room and what it holds, from the hosts' preflight
    GPU memory where known (after ``up``), else as plan computes it."""
    cap = compute(stack, host_facts)
    f = cap.facts
    return {"facts": f.snapshot, "config": f.real, "factSources": dict(f.sources), "checkpointBytes": {"routed": f.routed_bytes, "resident": f.resident_bytes},
            "pools": {p.role: p.as_dict() for p in cap.pools}}
