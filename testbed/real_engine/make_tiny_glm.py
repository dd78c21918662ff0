"""A tiny, randomly initialised GLM-5.2 (GlmMoeDsaForCausalLM) checkpoint in BF16, made with no download.

    python3 make_tiny_glm.py OUT_DIR [--arch glm|deepseek_v3|llama] [--device cuda|cpu] [--layers 4] [--hidden 1024]
                             [--seed N] [--visible]

--arch deepseek_v3 and --arch llama are the fallbacks (README.md): the same MLA + MoE + MTP
layout without the DSA indexer (DeepseekV3ForCausalLM), or a plain tiny LlamaForCausalLM (no MLA, MoE, MTP).

Source of the architecture: nvidia/GLM-5.2-NVFP4's config.json as aiconfigurator-core 0.12.0 ships it
(glm52-nvfp4-config.aiconfigurator-core-0.12.0.json beside this file, sha256 d3783a60...). Kept as in the
real model: the MLA shape (kv_lora_rank 512, qk_rope 64, qk_nope 192, v_head 256: a 576-wide sparse-MLA
head), the DSA indexer (32 heads x 128, index_topk 2048, index_topk_freq 4, offset 3: 'full' and 'shared'
indexer layers), sigmoid/noaux_tc routing with 8 experts per token and 1 shared expert, first dense layers,
one MTP layer, the RoPE settings. Shrunk: layers, hidden size, expert count and sizes, q_lora_rank, vocab,
max_position_embeddings. Dropped: quantization_config (NVFP4 needs Blackwell; BF16 here).

Tensor names follow the DeepSeek-V3.2 / GLM-5 checkpoint layout (as glm-infra's
testbed/glm5_checkpoint.py lays it out), per-expert gate/up/down, plus the MTP layer's enorm, hnorm, eh_proj,
shared_head.{norm,head}. A byte-level tokenizer (256 byte tokens + GLM's special tokens) and a GLM-style
chat template are written with it, so the glm45 reasoning parser and glm47 tool parser find their tokens.

--visible: the output heads (lm_head and the MTP layer's shared head) can only name lowercase letters and the
space, so a greedy answer is visible text (a random head's detokenizes mostly to nothing, and glm-infra's
canary fails closed on that). Each of those tokens gets a random row or its negation in pairs, every other
row is zero: whatever the last hidden state, some visible token's logit is above the others' 0. Another
--seed is another model (the real-engine check's planted wrong instance). First written for the one-GPU run
of 2026-12-06 (real vLLM 0.33.0); kept here with the check that runs it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
VISIBLE = "abcdefghijklmnopqrstuvwxyz "
SOURCE = HERE / "glm52-nvfp4-config.aiconfigurator-core-0.12.0.json"

SPECIALS = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
            "<|assistant|>", "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<think>", "</think>",
            "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<arg_key>", "</arg_key>",
            "<arg_value>", "</arg_value>", "/nothink"]

CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}<|system|>{{ m.content }}"
    "{%- elif m.role == 'user' -%}<|user|>{{ m.content }}"
    "{%- elif m.role == 'assistant' -%}<|assistant|></think>{{ m.content }}"
    "{%- elif m.role == 'tool' -%}<|observation|><tool_response>{{ m.content }}</tool_response>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|><think>{%- endif -%}"
)


def tiny_config(layers: int, hidden: int, heads: int, vocab: int, special_ids: dict[str, int]) -> dict:
    c = json.loads(SOURCE.read_text())
    c.pop("quantization_config", None)
    n = layers
    c.update(
        num_hidden_layers=n, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=256,
        num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=1024,
        n_routed_experts=32, num_experts=32, first_k_dense_replace=1,
        vocab_size=vocab, max_position_embeddings=16384, dtype="bfloat16", torch_dtype="bfloat16",
        bos_token_id=special_ids["[gMASK]"], pad_token_id=special_ids["<|endoftext|>"],
        eos_token_id=[special_ids["<|endoftext|>"], special_ids["<|user|>"], special_ids["<|observation|>"]],
    )
    for key in ("layer_types", "mlp_layer_types", "indexer_types"):
        if isinstance(c.get(key), list):
            c[key] = c[key][:n]
    c["mlp_layer_types"] = ["dense" if i < c["first_k_dense_replace"] else "sparse" for i in range(n)]
    return c


def deepseek_v3_config(glm: dict) -> dict:
    """The fallback: GLM-5.2's shape without DeepSeek Sparse Attention (DeepSeek-V3 MLA + MoE + MTP)."""
    keep = ("attention_bias", "attention_dropout", "bos_token_id", "eos_token_id", "pad_token_id", "first_k_dense_replace",
            "hidden_act", "hidden_size", "initializer_range", "intermediate_size", "kv_lora_rank", "max_position_embeddings",
            "moe_intermediate_size", "moe_layer_freq", "n_group", "n_routed_experts", "n_shared_experts", "norm_topk_prob",
            "num_attention_heads", "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads",
            "num_nextn_predict_layers", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "rms_norm_eps",
            "rope_interleave", "rope_parameters", "routed_scaling_factor", "scoring_func", "tie_word_embeddings",
            "topk_group", "topk_method", "v_head_dim", "vocab_size", "dtype", "torch_dtype")
    c = {k: glm[k] for k in keep if k in glm}
    c.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    return c


def has_indexer(c: dict, i: int) -> bool:
    """vllm/models/deepseek_v32/attention.py: a layer keeps its own indexer unless index_topk_freq skips it;
    the MTP layer always has one. Same rule as the checkpoint's indexer_types ('full' vs 'shared')."""
    if "index_topk" not in c:
        return False
    if i >= c["num_hidden_layers"]:
        return True
    freq, off = c.get("index_topk_freq", 1), c.get("index_skip_topk_offset", 2)
    return max(i - off + 1, 0) % freq == 0


def tensors(c: dict) -> list[tuple[str, tuple[int, ...], str]]:
    h, heads = c["hidden_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    out = [("model.embed_tokens.weight", (c["vocab_size"], h), "w"), ("model.norm.weight", (h,), "one"),
           ("lm_head.weight", (c["vocab_size"], h), "w")]

    def mlp(p: str, inter: int) -> None:
        out.extend([(f"{p}.gate_proj.weight", (inter, h), "w"), (f"{p}.up_proj.weight", (inter, h), "w"),
                    (f"{p}.down_proj.weight", (h, inter), "w")])

    total = c["num_hidden_layers"] + c.get("num_nextn_predict_layers", 0)
    for i in range(total):
        p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
        out += [(f"{p}.input_layernorm.weight", (h,), "one"), (f"{p}.post_attention_layernorm.weight", (h,), "one"),
                (f"{a}.q_a_proj.weight", (c["q_lora_rank"], h), "w"),
                (f"{a}.q_a_layernorm.weight", (c["q_lora_rank"],), "one"),
                (f"{a}.q_b_proj.weight", (heads * qk, c["q_lora_rank"]), "w"),
                (f"{a}.kv_a_proj_with_mqa.weight", (c["kv_lora_rank"] + c["qk_rope_head_dim"], h), "w"),
                (f"{a}.kv_a_layernorm.weight", (c["kv_lora_rank"],), "one"),
                (f"{a}.kv_b_proj.weight", (heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"]), "w"),
                (f"{a}.o_proj.weight", (h, heads * c["v_head_dim"]), "w")]
        if has_indexer(c, i):
            ih, idim = c["index_n_heads"], c["index_head_dim"]
            out += [(f"{a}.indexer.wq_b.weight", (ih * idim, c["q_lora_rank"]), "w"),
                    (f"{a}.indexer.wk.weight", (idim, h), "w"),
                    (f"{a}.indexer.k_norm.weight", (idim,), "one"), (f"{a}.indexer.k_norm.bias", (idim,), "zero"),
                    (f"{a}.indexer.weights_proj.weight", (ih, h), "w")]
        if i < c["first_k_dense_replace"]:
            mlp(f"{p}.mlp", c["intermediate_size"])
        else:
            out += [(f"{p}.mlp.gate.weight", (c["n_routed_experts"], h), "w"),
                    (f"{p}.mlp.gate.e_score_correction_bias", (c["n_routed_experts"],), "zero32")]
            mlp(f"{p}.mlp.shared_experts", c["moe_intermediate_size"] * c["n_shared_experts"])
            for e in range(c["n_routed_experts"]):
                mlp(f"{p}.mlp.experts.{e}", c["moe_intermediate_size"])
        if i >= c["num_hidden_layers"]:  # the MTP layer
            out += [(f"{p}.enorm.weight", (h,), "one"), (f"{p}.hnorm.weight", (h,), "one"),
                    (f"{p}.eh_proj.weight", (h, 2 * h), "w"), (f"{p}.shared_head.norm.weight", (h,), "one"),
                    (f"{p}.shared_head.head.weight", (c["vocab_size"], h), "w")]
    return out


def write_tokenizer(out: Path) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for s in SPECIALS:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIALS[1:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return {s: vocab[s] for s in SPECIALS}


def visible_head(head, out: Path):
    """The head with a row only for VISIBLE's tokens, in +/- pairs (module docstring)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = [tok.token_to_id("\u0120" if ch == " " else ch) for ch in VISIBLE]  # ByteLevel spells a space as \u0120
    kept = head.clone().zero_()
    for k, i in enumerate(ids):
        kept[i] = head[ids[k - k % 2]] * (1 if k % 2 == 0 else -1)
    return kept


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--arch", default="glm", choices=("glm", "deepseek_v3", "llama"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--visible", action="store_true", help="greedy answers are visible text (lowercase, space)")
    args = ap.parse_args()

    import torch
    from safetensors.torch import save_file

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(out)
    c = tiny_config(args.layers, args.hidden, args.heads, args.vocab, ids)
    if args.arch == "deepseek_v3":
        c = deepseek_v3_config(c)
    elif args.arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(args.seed)
        lc = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=8,
                         head_dim=args.hidden // 16, max_position_embeddings=16384, bos_token_id=c["bos_token_id"],
                         eos_token_id=c["eos_token_id"], pad_token_id=c["pad_token_id"], torch_dtype="bfloat16")
        model = LlamaForCausalLM(lc).to(torch.bfloat16)
        if args.visible:
            model.lm_head.weight.data = visible_head(model.lm_head.weight.data, out)
        model.save_pretrained(str(out))
        print(f"wrote {out}: tiny LlamaForCausalLM, vocab_size {args.vocab}")
        return
    (out / "config.json").write_text(json.dumps(c, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": c["bos_token_id"], "eos_token_id": c["eos_token_id"], "pad_token_id": c["pad_token_id"],
         "do_sample": False}))

    dev = args.device if (args.device != "cuda" or torch.cuda.is_available()) else "cpu"
    g = torch.Generator(device=dev).manual_seed(args.seed)
    weight_map, shard, shards, nbytes = {}, {}, [], 0
    specs = tensors(c)
    for name, shape, kind in specs:
        if kind == "w":
            t = torch.randn(shape, generator=g, device=dev, dtype=torch.float32).mul_(0.02).to(torch.bfloat16)
        elif kind == "one":
            t = torch.ones(shape, device=dev, dtype=torch.bfloat16)
        elif kind == "zero32":
            t = torch.zeros(shape, device=dev, dtype=torch.float32)
        else:
            t = torch.zeros(shape, device=dev, dtype=torch.bfloat16)
        if args.visible and name.endswith(("lm_head.weight", "shared_head.head.weight")):
            t = visible_head(t, out)
        shard[name] = t.cpu().contiguous()
        nbytes += shard[name].numel() * shard[name].element_size()
        if nbytes > 512 * 2**20:
            shards.append(shard)
            shard, nbytes = {}, 0
    shards.append(shard)
    total = 0
    for k, s in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(s, str(out / fname), metadata={"format": "pt"})
        for n, t in s.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    print(f"wrote {out}: {len(specs)} tensors, {total / 2**30:.2f} GiB in {len(shards)} shards; "
          f"special ids {ids['<|endoftext|>']}..{ids['/nothink']}; vocab_size {c['vocab_size']}")


if __name__ == "__main__":
    main()
