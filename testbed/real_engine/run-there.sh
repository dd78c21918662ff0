#!/usr/bin/env bash
# The real-engine check, on the GPU machine (no network), from this checkout: the payload's pieces in STASH
# (with MANIFEST.json), the lines in .real-engine/check (scripts/real-engine-payload wrote both). Joins and
# checks the pieces, installs the wheels into a venv that also sees the machine's own torch, puts the
# cutlass-dsl shim over vLLM's one module that needs it, makes the tiny checkpoints (the served one and the
# planted wrong one) and runs testbed/real_engine/check.py; its transcript lands in OUT.
#   testbed/real_engine/run-there.sh STASH [OUT]     (OUT default: /root/transcript)
# GLM_CHECK_ARCH=deepseek_v3: the first fallback where GlmMoeDsa cannot run (MLA, MoE and MTP without the DSA
# indexer: the same lines apply); llama, the second, also needs lines without -ep and MTP (not generated yet).
# versions.txt in OUT says which architecture ran.
set -euo pipefail
cd "$(dirname "$0")/../.."
stash=${1:?usage: run-there.sh STASH [OUT]}
out=${2:-/root/transcript}
work=${GLM_CHECK_WORK:-/root/glm-check}
python=${GLM_CHECK_PYTHON:-python3}  # the machine's Python with torch
arch=${GLM_CHECK_ARCH:-glm}
mkdir -p "$work"
"$python" testbed/real_engine/payload.py join --pieces "$stash" --out "$work/wheelhouse"
if [ ! -x "$work/venv/bin/python" ]; then
  "$python" -m venv "$work/venv"
  # The machine's python3 may itself be a venv, which --system-site-packages does not reach: name its
  # site-packages (torch's) in a .pth instead.
  "$python" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))' \
    > "$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/machine-torch.pth"
fi
"$work/venv/bin/pip" install -q --no-index --no-deps "$work"/wheelhouse/*.whl
vllm_dir=$("$work/venv/bin/python" -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("vllm").origin))')
cp testbed/real_engine/shim_fused_q_cutedsl.py "$vllm_dir/models/deepseek_v32/nvidia/ops/fused_q_cutedsl.py"
"$work/venv/bin/python" -c 'import vllm, vllm_router, nixl._api, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
for model in tiny:0 other:1; do
  dir="$work/$arch-${model%%:*}"
  [ -f "$dir/config.json" ] || "$work/venv/bin/python" testbed/real_engine/make_tiny_glm.py "$dir" --arch "$arch" \
    --visible --seed "${model##*:}"
done
rm -rf "$out"
mkdir -p "$out"
{
  "$work/venv/bin/pip" list 2>/dev/null | grep -iE '^(vllm|vllm-router|nixl|nixl-cu13|torch|transformers) '
  "$work/venv/bin/python" -c 'import json, sys; print("architecture", *json.load(open(sys.argv[1]))["architectures"])' \
    "$work/$arch-tiny/config.json"
} > "$out/versions.txt"
# FlashInfer is not carried (its sampler falls back); NVLink multicast stays off on these shared machines.
PYTHONUNBUFFERED=1 "$work/venv/bin/python" testbed/real_engine/check.py --lines .real-engine/check \
  --model "$work/$arch-tiny" --wrong-model "$work/$arch-other" --out "$out" --bin "$work/venv/bin" --timeout 900 \
  --env VLLM_USE_FLASHINFER_SAMPLER=0 --env NCCL_NVLS_ENABLE=0 --env TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  --env NVSHMEM_DISABLE_NVLS=1
