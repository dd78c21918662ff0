"""Capacity planning: the checkpoint's facts (config.json + safetensors headers, read by range requests
from the stand-in hub), the KV bytes per token of vLLM's layouts, the room per rank, and the refusal
of a pool that cannot hold one request of the maximum context."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, bundled, free_port, stack_config, wait_port

from glm_infra.plan import capacity, topology
from glm_infra.roles import vllm
from glm_infra.spec import checkpoint
from glm_infra.stack import StackError, load_file
from glm_infra.tools import cli
from testbed import glm5_checkpoint

REPO = "nvidia/GLM-5.2-NVFP4"
COMMIT = "5a1e9b7d2c4a6e8f0b1d3c5e7a9b2d4f6a8c3f0c"
ONE_M = 1 << 20  # the BRIEF's "1M-token context"


@pytest.fixture(scope="module")
def glm5(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("glm5")
    glm5_checkpoint.write(out)
    return out


def test_headers_split_the_checkpoint_into_routed_experts_and_what_every_rank_holds(glm5):
    snap = checkpoint.read_snapshot(checkpoint.LocalSource(glm5), REPO, COMMIT)
    assert len(snap["files"]) == 80  # embeddings + 78 layers + 1 MTP layer
    b = checkpoint.class_bytes(snap)
    # 76 MoE layers (75 + the MTP layer) × 256 experts × 3 NVFP4 matrices of 6144 × 2048: 0.5 byte per
    # value + one e4m3 scale per 16 + two float32 scales.
    assert b["routed"] == 76 * 256 * 3 * (6144 * 2048 // 2 + 6144 * 2048 // 16 + 8)
    assert b["embeddings"] == 2 * 154880 * 6144 * 2
    total = sum(b.values())
    assert 430e9 < total < 470e9, total  # BRIEF.md: "about 465 GB on disk"
    assert b["mtp"] > 0 and b["attention"] > 20e9 and b["shared_experts"] > 0 and b["dense_mlp"] > 0


@pytest.mark.parametrize("name, cls", [
    ("model.layers.5.mlp.experts.17.down_proj.weight_scale", "routed"),
    ("model.layers.78.mlp.experts.0.up_proj.weight", "routed"),  # MTP experts: EP divides them too
    ("model.layers.78.self_attn.o_proj.weight", "mtp"),
    ("model.layers.78.eh_proj.weight", "mtp"),
    ("model.layers.5.mlp.shared_experts.gate_proj.weight", "shared_experts"),
    ("model.layers.0.self_attn.indexer.wk.weight", "attention"),
    ("model.layers.1.mlp.down_proj.weight", "dense_mlp"),
    ("model.layers.9.mlp.gate.weight", "other"),
    ("model.embed_tokens.weight", "embeddings"), ("lm_head.weight", "embeddings"),
    ("model.norm.weight", "other"),
])
def test_tensor_names_of_the_deepseek_v3_layout_are_classified(name, cls):
    assert checkpoint.classify(name, 78) == cls


def test_a_file_that_is_not_safetensors_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(checkpoint.CheckpointError, match="is not a safetensors header"):
        checkpoint.read_snapshot(checkpoint.LocalSource(tmp_path), "o/m", "x")


@pytest.fixture
def hub(glm5, tmp_path):
    """The stand-in hub serving the synthetic checkpoint at COMMIT, behind a token."""
    src = tmp_path / "hub" / COMMIT
    src.mkdir(parents=True)
    files = []
    for f in sorted(glm5.iterdir()):
        (src / f.name).write_bytes(f.read_bytes())
        files.append({"path": f.name, "size": f.stat().st_size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()})
    (src / "manifest.json").write_text(json.dumps({"files": files}))
    port = free_port()
    log = tmp_path / "hub.log"
    p = subprocess.Popen([sys.executable, str(ROOT / "testbed" / "hub_standin.py"), "--dir", str(src.parent), "--repo",
                          REPO, "--bind", f"127.0.0.1:{port}", "--token", "hf_secret_123"],
                         stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        wait_port(port)
        yield f"http://127.0.0.1:{port}", log
    finally:
        p.terminate()
        p.wait()


def test_capacity_fetch_reads_only_the_headers_by_range_requests(hub, glm5, tmp_path, write_stack, monkeypatch, capsys):
    endpoint, log = hub
    cfg = stack_config("prod-b300")
    cfg["glm-infra:model"]["revision"] = COMMIT
    out = tmp_path / "facts.json"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert cli.main(["capacity", "fetch", str(write_stack(cfg)), "--out", str(out)]) == cli.EXIT_INVALID
    assert "HTTP 401" in capsys.readouterr().err  # a gated repository: the token is needed
    monkeypatch.setenv("HF_TOKEN", "hf_secret_123")
    assert cli.main(["capacity", "fetch", str(write_stack(cfg)), "--out", str(out)]) == cli.EXIT_OK
    assert "80 safetensors files, 446.9 GB" in capsys.readouterr().out
    snap = checkpoint.load_snapshot(out)
    assert snap["files"] == checkpoint.read_snapshot(checkpoint.LocalSource(glm5), REPO, COMMIT)["files"]
    assert snap["revision"] == COMMIT and snap["source"] == f"{endpoint}/{REPO}/resolve/{COMMIT}"
    shards = [l for l in log.read_text().splitlines() if '.safetensors"' in l and "/resolve/" in l]
    # Two ranged GETs per shard (the length, then the header), each answered 206: no weights downloaded.
    assert len(shards) == 2 * 80 and all(l.endswith(" 206") for l in shards), shards[:3]


def test_a_mirror_that_ignores_bounded_ranges_is_read_only_up_to_each_header(glm5, tmp_path, write_stack, capsys):
    """glm-infra's own file server (weights.py serve, the relay and a possible mirror) honours only
    'bytes=A-': fetch reads the 200 answer up to the header's end and closes the connection."""
    (tmp_path / "mirror").mkdir()
    shutil.copytree(glm5, tmp_path / "mirror" / COMMIT)
    port = free_port()
    p = subprocess.Popen([sys.executable, str(bundled("weights")), "serve", "--dir",
                          str(tmp_path / "mirror"), "--bind", f"127.0.0.1:{port}"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port)
        cfg = stack_config("prod-b300")
        cfg["glm-infra:model"].update(revision=COMMIT, source="mirror", mirrorUrl=f"http://127.0.0.1:{port}")
        out = tmp_path / "facts.json"
        assert cli.main(["capacity", "fetch", str(write_stack(cfg)), "--out", str(out)]) == cli.EXIT_OK, \
            capsys.readouterr().err
    finally:
        p.terminate()
        p.wait()
    assert checkpoint.load_snapshot(out)["source"] == f"http://127.0.0.1:{port}/{COMMIT}"
    assert checkpoint.load_snapshot(out)["files"] == checkpoint.read_snapshot(
        checkpoint.LocalSource(glm5), REPO, COMMIT)["files"]


def test_the_committed_snapshot_is_what_fetch_reads_from_the_synthetic_checkpoint(glm5):
    committed = checkpoint.load_snapshot(checkpoint.SNAPSHOT_DIR / checkpoint.snapshot_name(REPO))
    fresh = checkpoint.read_snapshot(checkpoint.LocalSource(glm5), REPO, "x")
    assert committed["files"] == fresh["files"] and committed["config"] == fresh["config"]
    assert committed["source"].startswith("SYNTHETIC")  # until someone fetches the real one from the hub


@pytest.mark.parametrize("dtype, sparse, expected", [
    ("auto", True, 656), ("fp8", True, 656), ("fp8_ds_mla", True, 656), ("bfloat16", True, 1152),
    ("nvfp4_ds_mla", True, 352), ("auto", False, 1152), ("fp8", False, 576),
])
def test_mla_bytes_per_token_follow_vllms_layouts(dtype, sparse, expected):
    assert capacity.mla_bytes_per_token(dtype, 512, 64, sparse) == expected


def test_indexer_key_cache_is_fp8_plus_a_float32_scale_per_128():
    assert capacity.indexer_bytes_per_token(128) == 132 and capacity.indexer_bytes_per_token(0) == 0


def _pool(stack, role: str, **kw) -> capacity.PoolCapacity:
    return next(p for p in capacity.compute(stack, **kw).pools if p.role == role)


def _stack(write_stack, name: str, **model) -> object:
    cfg = stack_config(name)
    cfg["glm-infra:model"].update(model)
    return load_file(write_stack(cfg)).config


def test_the_dp4_versus_dp2_trade_of_the_brief(write_stack):
    """BRIEF.md: TP1 DP2 EP prefill has 8 % more throughput per GPU, TP1 DP4 EP was kept 'so that the
    1M-token context has enough KV-cache room'. The arithmetic agrees: a DP2 rank holds half the routed
    experts more (103 GB), which leaves it ~9 GB of KV room, not one 1M (nor one 256K) request.
    KV bytes per token with GLM-5.2's real config: 78 layers + 1 MTP of fp8_ds_mla (656 bytes), the
    indexer's keys (132 bytes) on the 21 'full' layers of indexer_types and the MTP layer."""
    dp4 = _pool(_stack(write_stack, "prod-b300"), "prefill")
    dp2 = _pool(load_file(ROOT / "stacks/Pulumi.b300-prefill-dp2.yaml").config, "prefill")
    assert dp4.kv_bytes_per_token == dp2.kv_bytes_per_token == 79 * 656 + 22 * 132 == 54728
    assert round(dp4.routed_per_rank / 1e9, 1) == 103.3 and round(dp2.routed_per_rank / 1e9, 1) == 206.6
    assert round(dp4.room / 1e9, 1) == 111.9 and round(dp2.room / 1e9, 1) == 8.6
    assert dp4.tokens_per_rank == dp4.room // 54728 == 2_045_216 and dp2.tokens_per_rank == 158_053
    assert dp4.requests_per_rank(ONE_M) == 1 and dp2.requests_per_rank(ONE_M) == 0
    assert dp4.requests_per_instance(262144) == 28 and dp2.requests_per_instance(262144) == 0
    # What the DP2 stack promises instead: 128K of input + the SLA gate's 256 output tokens (model.maxModelLen).
    assert dp2.max_model_len == 131072 + 256 and dp2.requests_per_instance(dp2.max_model_len) == 2
    # Per GPU the DP4 layout holds ~13× the tokens: 2.05M vs 0.16M per GPU.
    assert dp4.tokens_per_rank // dp2.tokens_per_rank == 12
    # At the BRIEF's 1M context validate takes DP4 and refuses DP2, naming the pool and the numbers.
    load_file(write_stack({**stack_config("prod-b300"), "glm-infra:model": {
        **stack_config("prod-b300")["glm-infra:model"], "maxModelLen": ONE_M}}))
    cfg = stack_config("b300-prefill-dp2")
    cfg["glm-infra:model"]["maxModelLen"] = ONE_M
    with pytest.raises(StackError) as e:
        load_file(write_stack(cfg))
    assert ("glm-infra:prefill: a prefill rank (tp1 dp2) cannot hold one request of the maximum context, "
            "1,048,576 tokens (model.maxModelLen): its KV room of 8.6 GB holds 158,053 tokens at 54728 "
            "bytes/token") in str(e.value)


def test_a_decode_that_cannot_hold_one_max_request_is_refused_and_a_tight_one_warned(write_stack):
    cfg = stack_config("prod-b300")
    cfg["glm-infra:decode"].update(dp=2, instancesPerHost=4)
    with pytest.raises(StackError) as e:
        load_file(write_stack(cfg))
    msg = str(e.value)
    assert ("glm-infra:decode: a decode rank (tp1 dp2) cannot hold one request of the maximum context, 1,048,576 "
            "tokens (max_position_embeddings, real: config.json#max_position_embeddings)") in msg
    assert "its KV room of 2.9 GB holds 52,806 tokens at 54728 bytes/token" in msg
    cfg["glm-infra:decode"].update(dp=1, instancesPerHost=8)
    with pytest.raises(StackError) as e:
        load_file(write_stack(cfg))
    assert "the weights alone (446.9 GB per rank) and the reserve (16.0 GB) exceed 288.0 GB × 0.9" in str(e.value)
    cfg = stack_config("prod-b300")  # the model's 1M context: prefill ranks hold 1 request, decode ranks 2
    cfg["glm-infra:capacity"] = {"warnBelow": 3}
    loaded = load_file(write_stack(cfg))
    assert [w for w in loaded.warnings if "capacity.warnBelow" in w] == [
        f"glm-infra:{r}: a {r} rank holds {n} request(s) of the maximum context (1,048,576 tokens), fewer than "
        "capacity.warnBelow 3" for r, n in (("prefill", 1), ("decode", 2))]
    cfg["glm-infra:capacity"] = {"warnBelow": 1}
    assert not [w for w in load_file(write_stack(cfg)).warnings if "capacity.warnBelow" in w]


def test_max_model_len_and_kv_cache_dtype_reach_both_pools_serve_lines(write_stack):
    cfg = stack_config("prod-b300")
    cfg["glm-infra:model"].update(maxModelLen=131072, kvCacheDtype="bfloat16")
    cfg["glm-infra:sla"] = {"contexts": [16384, 65536]}  # what a 128K stack can promise
    loaded = load_file(write_stack(cfg))
    stack = loaded.config
    # The checkpoint's KV cache is FP8 (hf_quant_config.json): another dtype is served as asked, and said.
    assert ("glm-infra:model.kvCacheDtype: bfloat16 is not the checkpoint's FP8 KV-cache quantisation (real: "
            "hf_quant_config.json#quantization.kv_cache_quant_algo); vLLM serves bfloat16 as asked and capacity "
            "counts it") in loaded.warnings
    for inst in topology.plan(stack).instances:
        a = vllm.vllm_args(stack, inst)
        assert a[a.index("--max-model-len") + 1] == "131072" and a[a.index("--kv-cache-dtype") + 1] == "bfloat16"
    p = _pool(stack, "decode")
    assert p.mla_bytes_per_layer == 1152 and p.max_model_len == 131072
    prod = load_file(ROOT / "stacks/Pulumi.prod-b300.yaml").config  # unset: left out, vLLM's defaults
    assert not any("--max-model-len" in vllm.vllm_args(prod, i) or "--kv-cache-dtype" in vllm.vllm_args(prod, i)
                   for i in topology.plan(prod).instances)
    cfg["glm-infra:model"]["kvCacheDtype"] = "fp9"
    with pytest.raises(StackError, match=r"glm-infra:model.kvCacheDtype: 'fp9' is not a KV cache dtype of vLLM 0.33.0"):
        load_file(write_stack(cfg))
    cfg["glm-infra:model"]["kvCacheDtype"] = "auto"
    cfg["glm-infra:prefill"]["extraArgs"] = ["--max-model-len=4096"]
    with pytest.raises(StackError, match=r"--max-model-len is set by glm-infra from model.maxModelLen"):
        load_file(write_stack(cfg))


def test_preflight_memory_wins_over_the_gpu_table_and_the_stack_over_the_snapshot(write_stack):
    stack = load_file(ROOT / "stacks/Pulumi.prod-b300.yaml").config
    p = _pool(stack, "decode", host_facts={"b300-3": {"gpus": {"count": 8, "memory_total_mib": 275040}}})
    assert p.gpu_bytes == 275040 * 2**20 and p.gpu_source == "preflight memory.total of b300-3 (275040 MiB)"
    assert _pool(stack, "decode").gpu_source == "B300 288 GB (GPU table)"
    cfg = stack_config("prod-b300")
    cfg["glm-infra:capacity"] = {"gpuMemoryGb": 141, "modelFacts": {"max_position_embeddings": 65536},
                                 "routedBytes": 200 * 10**9, "reserveGb": 10}
    cfg["glm-infra:sla"] = {"contexts": [16384, 65280]}  # 65,280 + 256 output tokens: the 65,536 positions
    stack = load_file(write_stack(cfg)).config
    p = _pool(stack, "decode")
    assert p.gpu_source == "capacity.gpuMemoryGb 141 GB" and p.max_model_len == 65536
    assert p.routed_per_rank == 25 * 10**9 and p.reserve_bytes == 10**10
    facts = capacity.model_facts(stack)
    assert facts.sources["max_position_embeddings"] == "stack: capacity.modelFacts"
    assert facts.sources["kv_lora_rank"] == "real: config.json#kv_lora_rank"
    assert facts.sources["weights"] == ("stack: capacity.routedBytes; the rest synthetic: the generated headers of the "
                                        "facts snapshot; the config files give no byte sizes")


def test_a_model_without_facts_is_refused_naming_the_key_to_give(write_stack):
    cfg = stack_config("prod-b300")
    cfg["glm-infra:model"]["repo"] = "acme/unknown-model"
    with pytest.raises(StackError) as e:
        load_file(write_stack(cfg))
    assert "glm-infra:capacity.modelFacts.num_hidden_layers: the checkpoint's num_hidden_layers is not known: " \
           "no facts snapshot" in str(e.value)
    assert "glm-infra capacity fetch STACK" in str(e.value)
    cfg["glm-infra:capacity"] = {"modelFacts": {"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                                                "max_position_embeddings": 163840}}
    with pytest.raises(StackError, match="glm-infra:capacity.routedBytes: the checkpoint's weight bytes are not known"):
        load_file(write_stack(cfg))
    cfg["glm-infra:hosts"][2]["gpuModel"] = "Z9000"
    cfg["glm-infra:capacity"].update(routedBytes=300 * 10**9, residentBytes=30 * 10**9)
    with pytest.raises(StackError, match=r"glm-infra:capacity.gpuMemoryGb: hosts\[2\].gpuModel 'Z9000' is not in"):
        load_file(write_stack(cfg))


def test_plan_prints_the_room_of_each_pool_with_the_source_of_each_fact(capsys):
    assert cli.main(["plan", "prod-b300"]) == 0
    out = capsys.readouterr().out
    lines = [line.strip() for line in out.splitlines()]
    # The real config files, their origin; the weight bytes synthetic, and why.
    assert ("config: glm_infra/spec/checkpoints/nvidia--GLM-5.2-NVFP4/ (config.json, hf_quant_config.json), from "
            "aiconfigurator-core 0.12.0 (aiconfigurator_core-0.12.0-cp311-abi3-manylinux_2_28_x86_64.whl, sha256 "
            "aadc4aad0a00…), sha256 checked (SOURCE.json)") in lines
    assert "facts snapshot: glm_infra/spec/checkpoints/nvidia--GLM-5.2-NVFP4.json, read from SYNTHETIC" in out
    assert ("[synthetic: the generated headers of the facts snapshot; the config files give no byte sizes]" in lines)
    assert any(line.startswith("hf_quant_config.json#quantization.exclude_modules keeps 156 module patterns in BF16")
               and line.endswith("the real checkpoint is larger than this") for line in lines)
    # Each fact with where it came from.
    for fact in ("num_hidden_layers 78 (layers)", "num_nextn_predict_layers 1 (MTP layers)",
                 "kv_lora_rank 512 (MLA latent)", "qk_rope_head_dim 64 (MLA RoPE part)",
                 "index_head_dim 128 (DSA indexer key)", "max_position_embeddings 1,048,576 (positions)"):
        key = fact.split()[0]
        assert f"{fact}  [real: config.json#{key}]" in lines, fact
    assert "indexer_layers 21 (layers keeping indexer keys)  [real: config.json#indexer_types: 21 'full' of 78]" in lines
    assert "+ 1 MTP layer(s) keeping indexer keys of their own (with MTP on)  [assumed]" in lines
    assert ("KV cache: auto, counted as fp8_ds_mla: agrees with the checkpoint's FP8 KV cache [real: "
            "hf_quant_config.json#quantization.kv_cache_quant_algo]") in lines
    assert "prefill (tp1 dp4 ep), per rank:" in out and "decode (tp1 dp8 ep), per rank:" in out
    assert "weights 85.4 GB = routed 51.6 GB (÷8 EP) + resident 33.7 GB (÷tp1)" in out
    assert "[B300 288 GB (GPU table)]" in out and "[capacity.reserveGb]" in out
    assert "KV room 157.8 GB; KV 54728 bytes/token = 79 layers × 656 (MLA, auto) + 22 × 132 (indexer keys)" in lines
    assert ("tokens per rank 2,883,550; requests per instance (8 ranks): 16K: 1400, 256K: 80, max 1,048,576: 16  "
            "[max: max_position_embeddings, real: config.json#max_position_embeddings]") in lines


def test_compare_prints_the_readme_table(capsys):
    assert cli.main(["capacity", "compare", "prod-b300", "b300-prefill-dp2"]) == 0
    out = capsys.readouterr().out
    assert ("| prod-b300 | prefill tp1 dp4 | 4 | 137.0 GB | 111.9 GB | 2,045,216 | 32,723,456 (16 ranks) | 496 | 28 | "
            "4 of 1,048,576 | 1.00 |") in out
    assert ("| b300-prefill-dp2 | prefill tp1 dp2 | 2 | 240.3 GB | 8.6 GB | 158,053 | 2,528,848 (16 ranks) | 18 | 0 | "
            "2 of 131,328 | 1.00 |") in out


def test_a_snapshot_named_by_the_stack_and_shared_indexer_layers(glm5, tmp_path, write_stack):
    """capacity.facts names a snapshot of one's own, read from a checkpoint: its config.json wins over
    the one shipped with the library; layers whose indexer is 'shared' (indexer_types: they reuse the
    previous layer's top-k) keep no indexer key cache."""
    snap = checkpoint.read_snapshot(checkpoint.LocalSource(glm5), REPO, COMMIT)
    snap["config"]["indexer_types"] = ["full", "shared"] * 39
    checkpoint.write_snapshot(tmp_path / "mine.json", snap)
    cfg = stack_config("prod-b300")
    cfg["glm-infra:capacity"] = {"facts": str(tmp_path / "mine.json")}
    # This checkpoint's 202,752 positions (GLM-5's) hold no 256K bucket of the SLA.
    with pytest.raises(StackError) as e:
        load_file(write_stack(cfg))
    assert ("glm-infra:sla.contexts: the SLA promises 262,144 input tokens + 256 output (sla.outputTokens), more than "
            "the 202,752 tokens the stack serves (max_position_embeddings, real: config.json#max_position_embeddings "
            f"in {tmp_path / 'mine.json'})") in str(e.value)
    cfg["glm-infra:sla"] = {"contexts": [16384, 131072]}
    p = _pool(load_file(write_stack(cfg)).config, "decode")
    assert p.indexer_layers == 39 + 1 and p.kv_bytes_per_token == 79 * 656 + 40 * 132
    cfg["glm-infra:capacity"] = {"facts": str(tmp_path / "missing.json")}
    with pytest.raises(StackError, match=r"glm-infra:capacity.facts: .*missing.json: no such file"):
        load_file(write_stack(cfg))


# --- GLM-5.2's own config files (aiconfigurator-core 0.12.0) -----------------------------------------

REAL = ROOT / "glm_infra" / "spec" / "checkpoints" / "nvidia--GLM-5.2-NVFP4"


def test_the_real_config_files_are_the_published_ones_and_give_the_facts():
    """The sha256 of each file as research found it in the wheel (RECORD agrees), not as SOURCE.json says."""
    assert hashlib.sha256((REAL / "config.json").read_bytes()).hexdigest() == \
        "d3783a603e5aa9cb58eff7a5d8ac9c42d83156b229efe185c72e9e2dc8444923"
    assert hashlib.sha256((REAL / "hf_quant_config.json").read_bytes()).hexdigest() == \
        "212394aabaa6a4e7823668e7a03d6295422aa2ca2cbdbfbfc519eab602ad20e6"
    source = json.loads((REAL / "SOURCE.json").read_text())
    assert (source["package"], source["version"], source["license"]) == ("aiconfigurator-core", "0.12.0", "Apache-2.0")
    assert "no LICENSE file" in source["license_evidence"]
    assert (REAL.parent / "LICENSES" / "Apache-2.0.txt").read_text().lstrip().startswith("Apache License")
    real = checkpoint.load_real_config(REAL)
    assert real.config["max_position_embeddings"] == ONE_M
    assert real.config["indexer_types"].count("full") == 21 and len(real.config["indexer_types"]) == 78
    assert real.quant["quantization"]["kv_cache_quant_algo"] == "FP8"
    facts = capacity.model_facts(load_file(ROOT / "stacks/Pulumi.prod-b300.yaml").config)
    assert (facts.max_position_embeddings, facts.indexer_layers, facts.kv_cache_quant) == (ONE_M, 21, "FP8")


def _copy_real(tmp_path: Path, monkeypatch) -> Path:
    """The library's checkpoints folder copied, and the library pointed at the copy."""
    folder = tmp_path / "checkpoints"
    shutil.copytree(REAL.parent, folder)
    monkeypatch.setattr(checkpoint, "SNAPSHOT_DIR", folder)
    return folder / REAL.name


def test_a_changed_config_file_is_refused_naming_it(tmp_path, monkeypatch, write_stack):
    copy = _copy_real(tmp_path, monkeypatch)
    config = copy / "config.json"
    config.write_text(config.read_text().replace('"max_position_embeddings": 1048576', '"max_position_embeddings": 2097152'))
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.load_real_config(copy)
    assert str(e.value).startswith(f"{config}: sha256 ")
    assert ("is not the d3783a603e5aa9cb58eff7a5d8ac9c42d83156b229efe185c72e9e2dc8444923 that SOURCE.json records for "
            "aiconfigurator_core/model_configs/nvidia--GLM-5.2-NVFP4_config.json of aiconfigurator-core 0.12.0") in str(e.value)
    # validate (and so plan, preview, up) refuses the stack rather than plan with an unknown file.
    with pytest.raises(StackError) as e:
        load_file(write_stack(stack_config("prod-b300")))
    assert f"glm-infra:capacity.facts: {config}: sha256 " in str(e.value)
    (copy / "hf_quant_config.json").unlink()
    config.write_bytes((REAL / "config.json").read_bytes())
    with pytest.raises(checkpoint.CheckpointError, match=r"hf_quant_config.json: No such file"):
        checkpoint.load_real_config(copy)


def test_a_kv_cache_quantisation_capacity_cannot_map_to_auto_is_refused(tmp_path, monkeypatch, write_stack):
    """auto is counted as fp8_ds_mla for a DSA model: right for this checkpoint's FP8 KV cache; for
    another quantisation glm-infra cannot tell what vLLM picks, so it asks for model.kvCacheDtype."""
    copy = _copy_real(tmp_path, monkeypatch)
    quant = copy / "hf_quant_config.json"
    quant.write_text(quant.read_text().replace('"kv_cache_quant_algo": "FP8"', '"kv_cache_quant_algo": "NVFP4"'))
    source = json.loads((copy / "SOURCE.json").read_text())  # recorded as if it were published so
    source["files"]["hf_quant_config.json"]["sha256"] = hashlib.sha256(quant.read_bytes()).hexdigest()
    (copy / "SOURCE.json").write_text(json.dumps(source))
    cfg = stack_config("prod-b300")
    with pytest.raises(StackError) as e:
        load_file(write_stack(cfg))
    assert ("glm-infra:model.kvCacheDtype: the checkpoint's KV cache is quantised NVFP4 [real: "
            "hf_quant_config.json#quantization.kv_cache_quant_algo], and glm-infra cannot tell what vLLM's auto makes "
            "of that (it counts auto as fp8_ds_mla here): set model.kvCacheDtype") in str(e.value)
    cfg["glm-infra:model"]["kvCacheDtype"] = "nvfp4_ds_mla"
    loaded = load_file(write_stack(cfg))
    assert _pool(loaded.config, "decode").mla_bytes_per_layer == 352
    assert not [w for w in loaded.warnings if "kvCacheDtype" in w], "the dtype the checkpoint has: no warning"
