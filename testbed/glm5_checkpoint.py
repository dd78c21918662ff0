"""A synthetic GLM-5-NVFP4 checkpoint for capacity planning: tests/fixtures/glm5/config.json and one
safetensors file per layer holding only its header (8-byte length + JSON): the tensor names, dtypes,
shapes and byte offsets of the real layout, without the tensor data (tests/fixtures/glm5/README.md).

    python testbed/glm5_checkpoint.py OUT        # OUT/config.json, OUT/*.safetensors, the index
"""

from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "glm5" / "config.json"
SIZE = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "U8": 1}


def _bf16(name: str, *shape: int) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(name, "BF16", shape)]


def _nvfp4(prefix: str, out_f: int, in_f: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """An NVFP4 linear as ModelOpt stores it: e2m1 packed 2 per byte, an e4m3 scale per 16 inputs,
    a float32 global scale of the weights and one of the input."""
    return [(f"{prefix}.weight", "U8", (out_f, in_f // 2)), (f"{prefix}.weight_scale", "F8_E4M3", (out_f, in_f // 16)),
            (f"{prefix}.weight_scale_2", "F32", ()), (f"{prefix}.input_scale", "F32", ())]


def _mlp(prefix: str, hidden: int, inter: int) -> list:
    return [*_nvfp4(f"{prefix}.gate_proj", inter, hidden), *_nvfp4(f"{prefix}.up_proj", inter, hidden),
            *_nvfp4(f"{prefix}.down_proj", hidden, inter)]


def layer_tensors(c: dict, i: int) -> list:
    h, p = c["hidden_size"], f"model.layers.{i}"
    heads, qk = c["num_attention_heads"], c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    t = [*_bf16(f"{p}.input_layernorm.weight", h), *_bf16(f"{p}.post_attention_layernorm.weight", h)]
    a = f"{p}.self_attn"
    t += [*_bf16(f"{a}.q_a_proj.weight", c["q_lora_rank"], h), *_bf16(f"{a}.q_a_layernorm.weight", c["q_lora_rank"]),
          *_bf16(f"{a}.q_b_proj.weight", heads * qk, c["q_lora_rank"]),
          *_bf16(f"{a}.kv_a_proj_with_mqa.weight", c["kv_lora_rank"] + c["qk_rope_head_dim"], h),
          *_bf16(f"{a}.kv_a_layernorm.weight", c["kv_lora_rank"]),
          *_bf16(f"{a}.kv_b_proj.weight", heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"]),
          *_bf16(f"{a}.o_proj.weight", h, heads * c["v_head_dim"]),
          # The DSA indexer (lightning indexer) of DeepSeek-V3.2.
          *_bf16(f"{a}.indexer.wq_b.weight", c["index_n_heads"] * c["index_head_dim"], c["q_lora_rank"]),
          *_bf16(f"{a}.indexer.wk.weight", c["index_head_dim"], h),
          *_bf16(f"{a}.indexer.k_norm.weight", c["index_head_dim"]), *_bf16(f"{a}.indexer.k_norm.bias", c["index_head_dim"]),
          *_bf16(f"{a}.indexer.weights_proj.weight", c["index_n_heads"], h)]
    if i < c["first_k_dense_replace"]:
        return t + _mlp(f"{p}.mlp", h, c["intermediate_size"])
    t += [*_bf16(f"{p}.mlp.gate.weight", c["n_routed_experts"], h),
          (f"{p}.mlp.gate.e_score_correction_bias", "F32", (c["n_routed_experts"],)),
          *_mlp(f"{p}.mlp.shared_experts", h, c["moe_intermediate_size"] * c["n_shared_experts"])]
    for e in range(c["n_routed_experts"]):
        t += _mlp(f"{p}.mlp.experts.{e}", h, c["moe_intermediate_size"])
    if i >= c["num_hidden_layers"]:  # the MTP layer: embedding/hidden norms and their projection
        t += [*_bf16(f"{p}.enorm.weight", h), *_bf16(f"{p}.hnorm.weight", h), *_bf16(f"{p}.eh_proj.weight", h, 2 * h),
              *_bf16(f"{p}.shared_head.norm.weight", h)]
    return t


def header(tensors: list) -> bytes:
    meta: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in tensors:
        n = SIZE[dtype]
        for d in shape:
            n *= d
        meta[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write(out: Path, config: Path = CONFIG) -> dict[str, int]:
    """The checkpoint under ``out``; returns each file's claimed size (header + tensor bytes)."""
    out.mkdir(parents=True, exist_ok=True)
    c = json.loads(config.read_text())
    shutil.copy(config, out / "config.json")
    layers = c["num_hidden_layers"] + c.get("num_nextn_predict_layers", 0)
    shards = [[*_bf16("model.embed_tokens.weight", c["vocab_size"], c["hidden_size"]),
               *_bf16("model.norm.weight", c["hidden_size"]), *_bf16("lm_head.weight", c["vocab_size"], c["hidden_size"])]]
    shards += [layer_tensors(c, i) for i in range(layers)]
    weight_map, sizes = {}, {}
    for k, tensors in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        (out / name).write_bytes(header(tensors))
        sizes[name] = sum(SIZE[d] * _prod(s) for _, d, s in tensors)
        weight_map.update({t[0]: name for t in tensors})
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}))
    return sizes


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    print(sum(write(Path(sys.argv[1])).values()))
