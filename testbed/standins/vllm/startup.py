"""An engine's start, phase by phase, as vLLM 0.33.0 logs it for GLM-5.2 (docs/research/vllm-0.33-compile-cache.md):
weights, then per DP engine the kernel warmup (FlashInfer autotune, its results cached on disk), then CUDA-graph
capture (never cached), then the engine-init total.

GLM-5.2 (GlmMoeDsaForCausalLM) is not torch.compiled by vLLM 0.33.0 on CUDA (breakable CUDA graphs, compile
mode NONE; config/vllm.py:76-108, 842-870), so there is no torch.compile phase and no torch_compile_cache here:
what a warm start saves is the autotune (and, on the real engine, DeepGEMM/Triton/FlashInfer JIT) caches.

The autotune cache is laid out and keyed as vLLM 0.33.0 does (model_executor/warmup/flashinfer_autotune_cache.py):
    $VLLM_CACHE_ROOT/flashinfer_autotune_cache/<flashinfer version>/<arch>/<sha256(config hash)>/
        autotune_configs_dp<D>_rank<R>.json
with the config hash taken over what VllmConfig.compute_hash(include_version=False) covers (the model path
string, its config.json, and the flags that reach the model, cache, parallel, scheduler, compilation and
speculative configs; not the API server's host, ports, served name, memory share or shutdown timeout). A
file that is there and reads as FlashInfer's JSON is a hit: that engine's tuning is skipped.

Time per phase comes from the environment (GLM_SIM_STARTUP_SECONDS for the weights, GLM_SIM_KERNEL_WARMUP_SECONDS
for a cold autotune, GLM_SIM_KERNEL_WARMUP_WARM_SECONDS for a warm one, GLM_SIM_GRAPH_CAPTURE_SECONDS).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import importlib.metadata
import json
import os
import subprocess
import time
from pathlib import Path

# `vllm serve` flags that do not reach VllmConfig.compute_hash (the research's §2.3: ModelConfig ignores
# served_model_name; CacheConfig gpu_memory_utilization; ParallelConfig the DP RPC port; KVTransferConfig
# hashes to a constant; host, port and the shutdown timeout are the API server's).
NOT_HASHED = frozenset({"host", "port", "data_parallel_rpc_port", "served_model_name", "gpu_memory_utilization",
                        "kv_transfer_config", "shutdown_timeout", "command"})
# Compute capability by product name (NVIDIA's CUDA GPUs table): FlashInfer names its workspace by it.
COMPUTE_CAPABILITY = {"B300": "103", "B200": "100", "GB200": "100", "GB300": "103", "H200": "90", "H100": "90"}
GIB_PER_GRAPH_CAPTURE = 0.42  # what "took %.2f GiB" prints: a constant of the stand-in


def cache_root() -> Path:
    """VLLM_CACHE_ROOT, as vllm/envs.py:712-719 resolves it."""
    default = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm")
    return Path(os.path.expanduser(os.environ.get("VLLM_CACHE_ROOT", default)))


def config_hash(args: argparse.Namespace) -> str:
    """compute_hash(include_version=False)'s stand-in: what it covers, hashed (10 hex, as vLLM truncates)."""
    flags = {k: v for k, v in sorted(vars(args).items()) if k not in NOT_HASHED}
    config = (Path(args.model) / "config.json").read_text()
    text = json.dumps({"flags": flags, "hf_config": json.loads(config)}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def gpu_arch() -> str:
    """The workspace's arch part: the GPUs' compute capability, "noarch" when nvidia-smi cannot say
    (FlashInfer's own fallback)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except OSError:
        return "noarch"
    names = out.stdout.split("\n")[0] if out.returncode == 0 else ""
    for model, cc in COMPUTE_CAPABILITY.items():
        if model in names.split():
            return cc
    return "noarch"


def autotune_dir(args: argparse.Namespace) -> Path:
    try:
        flashinfer = importlib.metadata.version("flashinfer-python").split("+", 1)[0]
    except importlib.metadata.PackageNotFoundError:
        flashinfer = "0"
    digest = hashlib.sha256(config_hash(args).encode()).hexdigest()
    return cache_root() / "flashinfer_autotune_cache" / flashinfer / gpu_arch() / digest


def autotune_file(folder: Path, dp_rank: int, rank: int = 0) -> Path:
    return folder / f"autotune_configs_dp{dp_rank}_rank{rank}.json"


def readable(path: Path) -> bool:
    """vLLM's fingerprint check (kernel_warmup.py:388): JSON with FlashInfer's metadata."""
    try:
        return "_metadata" in json.loads(path.read_text())
    except (OSError, ValueError, TypeError):
        return False


def write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def start_engine(args: argparse.Namespace, dp_rank: int, folder: Path, cold_s: float, warm_s: float,
                 capture_s: float, log) -> None:
    """One DP engine after the weights: its autotune (a hit skips the tuning runs), then graph capture."""
    prefix = f"(EngineCore_DP{dp_rank} pid={os.getpid()}) INFO"
    began = time.monotonic()
    # One file per rank of the engine's tuning group (its TP ranks); a hit needs every one of them.
    paths = [autotune_file(folder, dp_rank, r) for r in range(args.tensor_parallel_size)]
    log(f"{prefix} Using FlashInfer autotune cache file: {paths[0]}. Pass --disable-flashinfer-autotune to skip "
        "autotuning.")
    if all(readable(p) for p in paths):
        time.sleep(warm_s)
    else:
        tokens = args.max_num_batched_tokens or 8192
        buckets = [1 << i for i in range(tokens.bit_length()) if 1 << i <= tokens]
        log(f"{prefix} Running FlashInfer autotune with {tokens} tokens and token buckets {buckets}.")
        time.sleep(cold_s)
        for p in paths:
            write_atomically(p, json.dumps({"_metadata": {"tuned_for": folder.name}, "fp4_gemm": buckets}))
    captured = time.monotonic()
    time.sleep(capture_s)
    log(f"{prefix} Graph capturing finished in {time.monotonic() - captured:.0f} secs, "
        f"took {GIB_PER_GRAPH_CAPTURE:.2f} GiB")
    log(f"{prefix} init engine (profile, create kv cache, warmup model) took {time.monotonic() - began:.2f} s")


def run(args: argparse.Namespace, weights_s: float, cold_s: float, warm_s: float, capture_s: float, log,
        stopping=lambda: False) -> None:
    """Every phase, the DP engines side by side as vLLM starts them; returns once all are up, raises
    OSError when one could not start (its cache unwritable): the process then exits, as vLLM's does."""
    config = json.loads((Path(args.model) / "config.json").read_text())
    if "GlmMoeDsaForCausalLM" in config.get("architectures", []) and "VLLM_USE_BREAKABLE_CUDAGRAPH" not in os.environ:
        log("Auto-enabling VLLM_USE_BREAKABLE_CUDAGRAPH=1. Set VLLM_USE_BREAKABLE_CUDAGRAPH=0 to opt out.")
    began = time.monotonic()
    while time.monotonic() - began < weights_s and not stopping():
        time.sleep(min(0.1, weights_s))
    log(f"Loading weights took {time.monotonic() - began:.2f} seconds")
    # As vLLM 0.33.0 logs it next (seen on a GPU, tests/fixtures/real-engine/): the weights' size on the GPU.
    size = sum(f.stat().st_size for f in Path(args.model).glob("*.safetensors"))
    log(f"Model loading took {size / 2**30:.2f} GiB memory and {time.monotonic() - began:.6f} seconds")
    folder = autotune_dir(args)
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.data_parallel_size) as pool:
        engines = [pool.submit(start_engine, args, d, folder, cold_s, warm_s, capture_s, log)
                   for d in range(args.data_parallel_size)]
    for e in engines:
        e.result()  # an engine's error, raised here
