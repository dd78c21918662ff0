"""Stack validation: every bad stack is refused with the file, the key path and the reason."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT, STACKS

from glm_infra.spec.config import SECRET_PATHS
from glm_infra.stack import StackError, load_file
from glm_infra.tools.cli import main


def _set(cfg: dict, path: str, value) -> dict:
    """Set a path such as 'glm-infra:prefill.tp' or 'glm-infra:hosts[0].name' (``_DELETE`` removes it)."""
    top = re.match(r"[^.\[]+", path).group(0)
    parts: list = [top] + [int(i) if i else k for k, i in re.findall(r"\.([^.\[]+)|\[(\d+)\]", path[len(top) :])]
    node = cfg
    for p in parts[:-1]:
        node = node[p]
    if value is _DELETE:
        del node[parts[-1]]
    else:
        node[parts[-1]] = value
    return cfg


_DELETE = object()

# (id, [(path, value), ...], key path the message must name, fragment of the reason)
BAD = [
    ("unknown-top-key", [("glm-infra:prefil", {"hosts": ["b300-1"]})], "glm-infra:prefil", "did you mean glm-infra:prefill"),
    ("misspelt-pool-key", [("glm-infra:prefill.instancePerHost", 2)], "glm-infra:prefill.instancePerHost", "unknown key"),
    ("misspelt-host-key", [("glm-infra:hosts[0].adress", "10.0.0.1")], "glm-infra:hosts[0].adress", "unknown key"),
    ("wrong-type-tp", [("glm-infra:prefill.tp", "one")], "glm-infra:prefill.tp", "integer"),
    ("wrong-type-hosts", [("glm-infra:prefill.hosts", "b300-1")], "glm-infra:prefill.hosts", "list"),
    ("tp-zero", [("glm-infra:prefill.tp", 0)], "glm-infra:prefill.tp", "greater than or equal to 1"),
    ("dp-zero", [("glm-infra:decode.dp", 0)], "glm-infra:decode.dp", "greater than or equal to 1"),
    ("instances-zero", [("glm-infra:prefill.instancesPerHost", 0)], "glm-infra:prefill.instancesPerHost", "greater than or equal to 1"),
    ("util-zero", [("glm-infra:decode.gpuMemoryUtilization", 0)], "glm-infra:decode.gpuMemoryUtilization", "greater than 0"),
    ("util-above-one", [("glm-infra:prefill.gpuMemoryUtilization", 1.2)], "glm-infra:prefill.gpuMemoryUtilization", "less than or equal to 1"),
    ("negative-mtp", [("glm-infra:decode.speculativeTokens", -1)], "glm-infra:decode.speculativeTokens", "greater than or equal to 0"),
    ("duplicate-host-name", [("glm-infra:hosts[1].name", "b300-1")], "glm-infra:hosts[1].name", "duplicate host name 'b300-1'"),
    ("duplicate-address", [("glm-infra:hosts[2].address", "10.0.0.11")], "glm-infra:hosts[2].address", "duplicate address"),
    ("invalid-address", [("glm-infra:hosts[0].address", "10.0.0.300")], "glm-infra:hosts[0].address", "not an IP address or DNS name"),
    ("unspecified-address", [("glm-infra:hosts[0].address", "0.0.0.0")], "glm-infra:hosts[0].address", "cannot address a host"),
    ("invalid-host-name", [("glm-infra:hosts[0].name", "B300_1")], "glm-infra:hosts[0].name", "not a valid host name"),
    ("relative-model-path", [("glm-infra:model.path", "mnt/model/glm")], "glm-infra:model.path", "relative"),
    ("unnormalised-model-path", [("glm-infra:model.path", "/mnt/../etc")], "glm-infra:model.path", "normalised"),
    ("unknown-pool-host", [("glm-infra:decode.hosts", ["b300-9"])], "glm-infra:decode.hosts[0]", "unknown host 'b300-9'"),
    ("unknown-router-host", [("glm-infra:router.host", "edge-1")], "glm-infra:router.host", "unknown host 'edge-1'"),
    ("gpu-oversubscribed-shared", [("glm-infra:decode.hosts", ["b300-1"])], "glm-infra:hosts[0].gpus", "over-subscribed: prefill 2×4 + decode 1×8 = 16 GPUs"),
    ("gpu-oversubscribed-pool", [("glm-infra:prefill.instancesPerHost", 3)], "glm-infra:hosts[0].gpus", "12 GPUs, the host has 8"),
    ("http-port-collision", [("glm-infra:hosts[2].gpus", 16), ("glm-infra:prefill.hosts", ["b300-1", "b300-2", "b300-3"]), ("glm-infra:decode.httpPort", 8101)], "glm-infra:decode.httpPort", "port 8101 on b300-3 used twice: prefill-5 http and decode-0 http"),
    ("nixl-port-collision", [("glm-infra:hosts[2].gpus", 16), ("glm-infra:prefill.hosts", ["b300-1", "b300-2", "b300-3"]), ("glm-infra:decode.nixlSideChannelPort", 5606)], "glm-infra:decode.nixlSideChannelPort", "ports 5606-5607 on b300-3 used twice: prefill-5 nixl and decode-0 nixl"),
    ("dp-rpc-port-collision", [("glm-infra:decode.dpRpcPort", 8000)], "glm-infra:router.port", "port 8000 on b300-3 used twice: decode-0 dp-rpc and router http"),
    ("router-port-collision", [("glm-infra:router.port", 8200)], "glm-infra:router.port", "port 8200 on b300-3 used twice"),
    ("router-metrics-collision", [("glm-infra:router.metricsPort", 8200)], "glm-infra:router.metricsPort", "port 8200 on b300-3 used twice: decode-0 http and router metrics"),
    ("privileged-port", [("glm-infra:router.port", 80)], "glm-infra:router.port", "greater than or equal to 1024"),
    ("empty-host-list", [("glm-infra:hosts", [])], "glm-infra:hosts", "at least 1 item"),
    ("empty-pool-hosts", [("glm-infra:prefill.hosts", [])], "glm-infra:prefill.hosts", "at least 1 item"),
    ("pool-host-twice", [("glm-infra:prefill.hosts", ["b300-1", "b300-1"])], "glm-infra:prefill.hosts", "listed twice"),
    ("decode-without-prefill", [("glm-infra:prefill", _DELETE)], "glm-infra:prefill", "P/D needs both pools"),
    ("pd-without-router", [("glm-infra:router", _DELETE)], "glm-infra:router", "P/D needs a router"),
    ("missing-required", [("glm-infra:model.repo", _DELETE)], "glm-infra:model.repo", "required key is missing"),
    ("bad-cudagraph-mode", [("glm-infra:decode.cudagraphMode", "FULL_DECODE")], "glm-infra:decode.cudagraphMode", "FULL_DECODE_ONLY"),
    ("ssh-no-key", [("glm-infra:ssh.privateKeyPath", _DELETE)], "glm-infra:ssh", "exactly one of privateKey"),
    ("plaintext-secret", [("glm-infra:router.apiKey", "hunter2")], "glm-infra:router.apiKey", "plaintext in the stack file"),
    ("mtp-mismatch", [("glm-infra:prefill.speculativeTokens", 0)], "glm-infra:decode.speculativeTokens", "both use MTP"),
    ("bad-extra-arg", [("glm-infra:decode.extraArgs", ["--x=$HOME"])], "glm-infra:decode.extraArgs", "cannot go in a unit"),
    ("colocated-with-pd", [("glm-infra:colocated", {"hosts": ["b300-1"]})], "glm-infra:colocated", "cannot be combined"),
    ("tp-dp-beyond-a-host", [("glm-infra:decode.tp", 4)], "glm-infra:decode.dp", "tp×dp = 32 GPUs, more than one host has"),
    ("seed-not-serving", [("glm-infra:model.seedHost", "b300-9")], "glm-infra:model.seedHost", "runs no vLLM instance"),
    ("port-above-65535", [("glm-infra:prefill.httpPort", 65535)], "glm-infra:prefill.httpPort", "above 65535"),
    ("router-internal-collision", [("glm-infra:router.internalPort", 8200)], "glm-infra:router.internalPort", "router internal"),
    ("fanout-collision", [("glm-infra:model.fanoutPort", 8100)], "glm-infra:model.fanoutPort", "weights relay"),
    ("kv-host-without-nics", [("glm-infra:hosts[2].computeNics", [])], "glm-infra:hosts[2].computeNics", "KV cache over RDMA"),
    ("unknown-seed-of-nothing", [("glm-infra:model.seedHost", "nope")], "glm-infra:model.seedHost", "'nope' runs no vLLM instance"),
    # Closed sets, against the choices of the pinned versions (glm_infra/spec/pins.py).
    ("unknown-tool-parser", [("glm-infra:model.toolCallParser", "glm48")], "glm-infra:model.toolCallParser", "'glm48' is not a tool call parser of vLLM 0.33.0 (did you mean 'glm47'?"),
    ("unknown-reasoning-parser", [("glm-infra:model.reasoningParser", "glm5")], "glm-infra:model.reasoningParser", "is not a reasoning parser of vLLM 0.33.0"),
    ("unknown-all2all", [("glm-infra:decode.all2allBackend", "flashinfer_nvlink_three_sided")], "glm-infra:decode.all2allBackend", "is not a all2all backend of vLLM 0.33.0 (did you mean 'flashinfer_nvlink_two_sided'?"),
    ("unknown-spec-method", [("glm-infra:model.speculativeMethod", "medusa")], "glm-infra:model.speculativeMethod", "is not a speculative decoding method of vLLM 0.33.0"),
    ("unknown-fingerprint-mode", [("glm-infra:model.fingerprintMode", "off")], "glm-infra:model.fingerprintMode", "(full, hash, custom, none)"),
    ("unknown-content-format", [("glm-infra:model.chatTemplateContentFormat", "text")], "glm-infra:model.chatTemplateContentFormat", "is not a chat template content format of vLLM 0.33.0"),
    ("unknown-router-policy", [("glm-infra:router.policy", "least_loaded")], "glm-infra:router.policy", "is not a routing policy of vllm-router 0.1.17"),
    # One setting, one place.
    ("extra-arg-sets-util", [("glm-infra:decode.extraArgs", ["--gpu-memory-utilization=0.8"])], "glm-infra:decode.extraArgs[0]", "--gpu-memory-utilization is set by glm-infra from decode.gpuMemoryUtilization"),
    ("extra-arg-sets-tp", [("glm-infra:prefill.extraArgs", ["-tp", "2"])], "glm-infra:prefill.extraArgs[0]", "-tp is set by glm-infra from prefill.tp"),
    ("extra-arg-sets-port", [("glm-infra:prefill.extraArgs", ["--port", "9000"])], "glm-infra:prefill.extraArgs[0]", "--port is set by glm-infra from prefill.httpPort"),
    ("env-sets-gpus", [("glm-infra:decode.env", {"CUDA_VISIBLE_DEVICES": "0"})], "glm-infra:decode.env.CUDA_VISIBLE_DEVICES", "set by glm-infra from the plan"),
    ("env-sets-model-runner", [("glm-infra:prefill.env", {"VLLM_USE_V2_MODEL_RUNNER": "0"})], "glm-infra:prefill.env.VLLM_USE_V2_MODEL_RUNNER", "from prefill.modelRunnerV2"),
    ("env-sets-ucx", [("glm-infra:decode.env", {"UCX_TLS": "tcp"})], "glm-infra:decode.env.UCX_TLS", "from nixl.ucxTls"),
    ("env-sets-api-key", [("glm-infra:decode.env", {"VLLM_API_KEY": "x"})], "glm-infra:decode.env.VLLM_API_KEY", "from router.apiKey"),
    # The checkpoint against the GPUs.
    ("nvfp4-on-hopper", [("glm-infra:hosts[1].gpuModel", "H200")], "glm-infra:hosts[1].gpuModel", "b300-2's H200 (compute capability 9) cannot run nvidia/GLM-5.2-NVFP4's NVFP4 weights, which need 10 or later"),
    ("fp8-on-ampere", [("glm-infra:model.weightFormat", "fp8"), ("glm-infra:hosts[0].gpuModel", "A100")], "glm-infra:hosts[0].gpuModel", "FP8 weights, which need 8.9"),
    ("unknown-weight-format", [("glm-infra:model.weightFormat", "int3")], "glm-infra:model.weightFormat", "'nvfp4', 'fp8' or 'bf16'"),
    # What reaches a script, a unit or a path.
    ("revision-dot-dot", [("glm-infra:model.revision", "..")], "glm-infra:model.revision", "is not a revision"),
    ("revision-option", [("glm-infra:model.revision", "-rf")], "glm-infra:model.revision", "is not a revision"),
    ("nic-option", [("glm-infra:hosts[0].computeNics", ["-mlx5_0"])], "glm-infra:hosts[0].computeNics", "not an RDMA device name"),
    ("nic-shell", [("glm-infra:hosts[0].computeNics", ["mlx5_0;reboot"])], "glm-infra:hosts[0].computeNics", "not an RDMA device name"),
    ("served-name-option", [("glm-infra:model.servedModelName", "--help")], "glm-infra:model.servedModelName", "should match pattern"),
    ("venv-is-system", [("glm-infra:runtime", {"venv": "/usr"})], "glm-infra:runtime.venv", "'/usr' is a system folder or inside one"),
    ("venv-in-etc", [("glm-infra:runtime", {"venv": "/etc/glm"})], "glm-infra:runtime.venv", "is a system folder or inside one"),
    ("state-dir-var-lib", [("glm-infra:runtime", {"stateDir": "/var/lib"})], "glm-infra:runtime.stateDir", "'/var/lib' is a system folder"),
    ("model-path-root-folder", [("glm-infra:model.path", "/mnt")], "glm-infra:model.path", "'/mnt' is a system folder"),
    ("index-url-shell", [("glm-infra:runtime", {"indexUrl": "https://pypi.org/simple;curl evil"})], "glm-infra:runtime.indexUrl", "is not an http(s) URL"),
    ("apt-repo-not-url", [("glm-infra:drivers.aptRepository", "file:///etc")], "glm-infra:drivers.aptRepository", "'file:///etc' is not an http(s) URL"),
    ("mirror-url-backtick", [("glm-infra:model.source", "mirror"), ("glm-infra:model.mirrorUrl", "http://m/`id`")], "glm-infra:model.mirrorUrl", "is not an http(s) URL"),
    ("monitoring-port-collision", [("glm-infra:monitoring", {"nodeExporterPort": 8100})], "glm-infra:monitoring.nodeExporterPort", "port 8100 on b300-1 used twice"),
    ("unknown-monitoring-host", [("glm-infra:monitoring", {"host": "edge-1"})], "glm-infra:monitoring.host", "unknown host 'edge-1'"),
    ("sla-context-twice", [("glm-infra:sla", {"contexts": [16384, 16384]})], "glm-infra:sla.contexts", "listed twice"),
    # TLS at the router's front.
    ("tls-certificate-without-key", [("glm-infra:router.tlsCertificate", {"secure": "v1:c"})], "glm-infra:router.tlsKey", "router.tlsCertificate is set but router.tlsKey is not"),
    ("tls-key-without-certificate", [("glm-infra:router.tlsKey", {"secure": "v1:k"})], "glm-infra:router.tlsCertificate", "router.tlsKey is set but router.tlsCertificate is not"),
    ("tls-key-in-plaintext", [("glm-infra:router.tlsCertificate", {"secure": "v1:c"}), ("glm-infra:router.tlsKey", "-----BEGIN PRIVATE KEY-----")], "glm-infra:router.tlsKey", "is plaintext in the stack file; it must be a secret"),
    ("tls-names-with-given-certificate", [("glm-infra:router.tlsCertificate", {"secure": "v1:c"}), ("glm-infra:router.tlsKey", {"secure": "v1:k"}), ("glm-infra:router.tlsNames", ["llm.example.com"])], "glm-infra:router.tlsNames", "names the generated certificate"),
    ("tls-name-shell", [("glm-infra:router.tlsNames", ["llm.example.com;id"])], "glm-infra:router.tlsNames[0]", "is not a DNS name or IP address"),
    ("plain-http-unknown", [("glm-infra:router.plainHttp", "allow")], "glm-infra:router.plainHttp", "'refuse' or 'redirect'"),
    # The other side of a rule, each found by a mutant that survived (scripts/mutation core).
    ("prefill-without-decode", [("glm-infra:decode", _DELETE)], "glm-infra:decode", "P/D needs both pools: prefill is set but decode is missing"),
    ("colocated-with-prefill-only", [("glm-infra:decode", _DELETE), ("glm-infra:colocated", {"hosts": ["b300-3"]})], "glm-infra:colocated", "cannot be combined"),
    ("nixl-port-range-collision", [("glm-infra:hosts[2].gpus", 16), ("glm-infra:prefill.hosts", ["b300-1", "b300-2", "b300-3"]), ("glm-infra:decode.nixlSideChannelPort", 5604)], "glm-infra:decode.nixlSideChannelPort", "ports 5604-5607 on b300-3 used twice: prefill-5 nixl and decode-0 nixl"),
    ("dns-name-with-the-firewall", [("glm-infra:hosts[0].address", "b300-1.example.com")], "glm-infra:hosts[0].address", "'b300-1.example.com' is a DNS name; with the firewall on"),
    ("colon-for-a-dot", [("glm-infra:prefill:tp", 2)], "glm-infra:prefill:tp", "unknown key"),
    ("extra-arg-value-with-equals", [("glm-infra:decode.extraArgs", ["--model=/mnt/model/glm=v2"])], "glm-infra:decode.extraArgs[0]", "--model is set by glm-infra from model.path"),
    ("nvfp4-on-nvidia-h200", [("glm-infra:hosts[1].gpuModel", "NVIDIA H200 SXM")], "glm-infra:hosts[1].gpuModel", "b300-2's NVIDIA H200 SXM (compute capability 9) cannot run"),
    # The KV-cache room (capacity.py), as validate words it.
    ("gpu-memory-unknown", [("glm-infra:hosts[0].gpuModel", "Z9000")], "glm-infra:capacity.gpuMemoryGb", "hosts[0].gpuModel 'Z9000' is not in glm-infra's GPU memory table"),
    ("decode-rank-below-one-request", [("glm-infra:decode.dp", 2), ("glm-infra:decode.instancesPerHost", 4)], "glm-infra:decode", "a decode rank (tp1 dp2) cannot hold one request of the maximum context, 1,048,576 tokens"),
    # The stack's promises against GLM-5.2's real config (1,048,576 positions) and the KV room.
    ("sla-bucket-over-max-model-len", [("glm-infra:model.maxModelLen", 131072)], "glm-infra:sla.contexts",
     "the SLA promises 131,072, 262,144 input tokens + 256 output (sla.outputTokens), more than the 131,072 tokens the stack serves (model.maxModelLen)"),
    ("max-model-len-over-positions", [("glm-infra:model.maxModelLen", 2_000_000)], "glm-infra:model.maxModelLen",
     "2,000,000 tokens is more than the model's 1,048,576 positions (max_position_embeddings, real: config.json#max_position_embeddings)"),
    ("no-kv-room-for-the-longest-bucket", [("glm-infra:prefill.dp", 2), ("glm-infra:prefill.instancesPerHost", 4), ("glm-infra:model.maxModelLen", 131328)],
     "glm-infra:prefill", "a prefill rank (tp1 dp2) has no KV-cache room for the SLA's longest request, 262,144 + 256 = 262,400 tokens"),
    ("decode-weights-exceed-the-gpu", [("glm-infra:decode.dp", 1), ("glm-infra:decode.instancesPerHost", 8)], "glm-infra:decode", "the weights alone (446.9 GB per rank) and the reserve (16.0 GB) exceed 288.0 GB × 0.9"),
    # Secure by default: who may log in over SSH and who may reach the router's public port, said by the stack.
    ("admin-cidrs-missing", [("glm-infra:firewall", _DELETE)], "glm-infra:firewall.adminCidrs",
     "not set: list who besides the stack's hosts may reach SSH on every host: the networks you and the machine running pulumi connect from"),
    ("admin-cidrs-null", [("glm-infra:firewall.adminCidrs", None)], "glm-infra:firewall.adminCidrs", "not set"),
    ("admin-cidrs-empty", [("glm-infra:firewall.adminCidrs", [])], "glm-infra:firewall.adminCidrs", "at least 1 item"),
    ("host-key-not-a-key", [("glm-infra:hosts[1].hostKey", "-----BEGIN OPENSSH PRIVATE KEY-----")],
     "glm-infra:hosts[1].hostKey", "not an SSH public key line"),
    ("host-key-unknown-type", [("glm-infra:hosts[0].hostKey", "ssh-dss AAAAB3NzaC1kc3MAAACBAP")],
     "glm-infra:hosts[0].hostKey", "not an SSH public key line"),
    ("router-allowed-cidrs-missing", [("glm-infra:router.allowedCidrs", _DELETE)], "glm-infra:router.allowedCidrs",
     "not set: list who besides the stack's hosts may reach the router's public port (8000 on b300-3): the networks your clients"),
    ("router-allowed-cidrs-empty", [("glm-infra:router.allowedCidrs", [])], "glm-infra:router.allowedCidrs", "at least 1 item"),
    ("both-allowlists-missing", [("glm-infra:firewall", {"enabled": True}), ("glm-infra:router.allowedCidrs", _DELETE)],
     "glm-infra:router.allowedCidrs", "or 0.0.0.0/0 and ::/0 to open it to every address on purpose"),
]


GOLDEN = ROOT / "tests" / "golden" / "bad-stacks.json"  # every problem of every case, word for word
_golden: dict = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_stack_is_refused_naming_the_key(case, prod_config, write_stack, capsys):
    name, edits, key, reason = case
    for path, value in edits:
        _set(prod_config, path, value)
    path = write_stack(prod_config)
    with pytest.raises(StackError) as err:
        load_file(path)
    msg = str(err.value)
    assert str(path) in msg
    assert f"{key}:" in msg, msg
    assert reason in msg, msg
    # The whole message, as users read it (regenerate with GLM_INFRA_REGEN_GOLDEN=1, then review the diff).
    lines = [line.split(": ", 1)[1] for line in msg.splitlines()[1:]]
    if os.environ.get("GLM_INFRA_REGEN_GOLDEN"):
        _golden[name] = lines
        GOLDEN.write_text(json.dumps(_golden, indent=1, sort_keys=True) + "\n")
    assert msg.splitlines()[0] == f"{path}: invalid stack ({len(lines)} problem{'s' if len(lines) > 1 else ''})"
    assert lines == _golden[name]
    # The CLI prints the same message and exits non-zero, without a traceback.
    assert main(["validate", str(path)]) == 1
    out = capsys.readouterr()
    assert key in out.err and reason in out.err and "Traceback" not in out.err


def test_secret_values_never_echoed(prod_config, write_stack):
    _set(prod_config, "glm-infra:router.apiKey", {"secure": "v1:abc"})
    _set(prod_config, "glm-infra:router.port", "not-a-port")
    msg = str(pytest.raises(StackError, load_file, write_stack(prod_config)).value)
    assert "glm-infra:router.port" in msg and "v1:abc" not in msg


@pytest.mark.parametrize("top,sub", SECRET_PATHS, ids=[f"{t}.{k}" for t, k in SECRET_PATHS])
def test_a_mistyped_secret_is_never_echoed(top, sub, prod_config, write_stack):
    """Every secret key, given as something else than a secret string: named, its value not shown
    (a number or a plaintext mistake may well be the real secret)."""
    prod_config.setdefault(f"glm-infra:{top}", {})[sub] = 98765432123
    msg = str(pytest.raises(StackError, load_file, write_stack(prod_config)).value)
    assert f"glm-infra:{top}.{sub}:" in msg and "98765432123" not in msg, msg
    _set(prod_config, "glm-infra:router.port", "not-a-port")  # others are still quoted
    assert "(got 'not-a-port')" in str(pytest.raises(StackError, load_file, write_stack(prod_config)).value)


def test_problem_lines_point_into_the_file(prod_config, write_stack):
    _set(prod_config, "glm-infra:decode.tp", 0)
    path = write_stack(prod_config)
    msg = str(pytest.raises(StackError, load_file, path).value)
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if text.strip().startswith("tp: 0"))
    assert f"{path}:{line}: glm-infra:decode.tp" in msg


def test_yaml_syntax_error_names_the_line(write_stack):
    path = write_stack("config:\n  glm-infra:hosts:\n    - name: a\n      address: [10.0.0.1\n  glm-infra:ssh: {}\n")
    msg = str(pytest.raises(StackError, load_file, path).value)
    assert "YAML syntax error at line 5" in msg, msg


def test_every_problem_is_reported_at_once(prod_config, write_stack):
    _set(prod_config, "glm-infra:prefill.tp", 0)
    _set(prod_config, "glm-infra:decode.gpuMemoryUtilization", 2)
    _set(prod_config, "glm-infra:model.path", "relative")
    err = pytest.raises(StackError, load_file, write_stack(prod_config)).value
    assert {p.path for p in err.problems} >= {
        "glm-infra:prefill.tp",
        "glm-infra:decode.gpuMemoryUtilization",
        "glm-infra:model.path",
    }


def test_a_plaintext_secret_is_refused_whatever_it_says(prod_config, write_stack):
    _set(prod_config, "glm-infra:router.apiKey", "a-not-so-secure-key")
    msg = str(pytest.raises(StackError, load_file, write_stack(prod_config)).value)
    assert "glm-infra:router.apiKey: is plaintext in the stack file" in msg


def test_keys_after_another_namespace_are_still_judged(prod_config, write_stack):
    config = {"pulumi:tags": {"team": "inference"}, **prod_config, "glm-infra:prefil": {}}
    msg = str(pytest.raises(StackError, load_file, write_stack(config)).value)
    assert "glm-infra:prefil: unknown key (did you mean glm-infra:prefill?)" in msg


def test_hosts_without_pools_still_check_the_seed_host():
    """Hosts (serve=False): pools and the router are not judged, a seed host that is no host is."""
    from glm_infra.stack import load_dict

    base = {"hosts": [{"name": "a", "address": "10.0.0.1"}, {"name": "b", "address": "10.0.0.2"}],
            "ssh": {"privateKeyPath": "k"}, "model": {"repo": "r/m", "revision": "0" * 40, "path": "/mnt/m"},
            "firewall": {"adminCidrs": ["10.20.0.0/24"]}}
    assert load_dict({**base, "model": {**base["model"], "seedHost": "b"}}, "Hosts 'h'", serve=False).config
    with pytest.raises(StackError) as e:
        load_dict({**base, "model": {**base["model"], "seedHost": "c"}}, "Hosts 'h'", serve=False)
    assert str(e.value).splitlines()[1:] == ["  Hosts 'h': glm-infra:model.seedHost: unknown host 'c' (hosts are: a, b)"]


def test_other_namespaces_are_left_alone(prod_config, write_stack):
    prod_config["command:someSetting"] = "x"
    prod_config["pulumi:tags"] = {"team": "inference"}
    assert load_file(write_stack(prod_config)).config.prefill is not None


def test_encrypted_secret_accepted(prod_config, write_stack):
    _set(prod_config, "glm-infra:router.apiKey", {"secure": "v1:Zm9v"})
    loaded = load_file(write_stack(prod_config))
    assert loaded.config.router.api_key is not None
    assert "Zm9v" not in repr(loaded.config)


@pytest.mark.parametrize("stack", STACKS)
def test_committed_stacks_validate(stack):
    assert main(["validate", stack]) == 0


def test_validate_exit_codes_via_console_script(write_stack, prod_config):
    bad = write_stack({**prod_config, "glm-infra:prefill": {"hosts": ["b300-1"], "tp": "x"}})
    ok = subprocess.run([sys.executable, "-m", "glm_infra.tools.cli", "validate", "prod-b300"], cwd=ROOT, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    res = subprocess.run([sys.executable, "-m", "glm_infra.tools.cli", "validate", str(bad)], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 1
    assert "glm-infra:prefill.tp" in res.stderr and "Traceback" not in res.stderr


def test_missing_stack_file_is_a_clear_error(capsys):
    assert main(["validate", "no-such-stack"]) == 1
    assert "Pulumi.no-such-stack.yaml: invalid stack" in capsys.readouterr().err


def test_a_version_without_known_choices_is_not_checked_and_says_so(prod_config, write_stack):
    _set(prod_config, "glm-infra:runtime", {"vllmVersion": "0.34.0", "routerVersion": "0.2.0"})
    _set(prod_config, "glm-infra:model.toolCallParser", "glm50")
    loaded = load_file(write_stack(prod_config))
    assert loaded.config.model.tool_call_parser == "glm50"
    warned = " ".join(loaded.warnings)
    assert "glm-infra:runtime.vllmVersion: glm-infra knows the choices of 0.33.0 only" in warned
    assert "not checked against 0.34.0" in warned and "glm-infra:runtime.routerVersion" in warned


def test_the_weight_format_comes_from_the_repository_unless_given(prod_config, write_stack):
    assert load_file(write_stack(prod_config)).config.model.weight_format == "nvfp4"
    _set(prod_config, "glm-infra:model.weightFormat", None)
    # The memory of the GPUs is not what this is about (an H200 could not hold the prefill rank's weights).
    prod_config["glm-infra:capacity"] = {"gpuMemoryGb": 288}
    _set(prod_config, "glm-infra:hosts[1].gpuModel", "H200")
    assert load_file(write_stack(prod_config)).config.model.weight_format is None  # not checked, on purpose
    _set(prod_config, "glm-infra:model.weightFormat", "bf16")
    _set(prod_config, "glm-infra:hosts[1].gpuModel", "Z9000")
    loaded = load_file(write_stack(prod_config))
    assert any("glm-infra:hosts[1].gpuModel: 'Z9000' is not a GPU glm-infra knows" in w for w in loaded.warnings)


# Stacks at the edge of a rule, accepted: (id, [(path, value), ...]).
EDGE = [
    ("mtp-token-counts-differ", [("glm-infra:prefill.speculativeTokens", 2), ("glm-infra:decode.speculativeTokens", 1)]),
    ("tp-dp-16-on-a-16-gpu-host", [("glm-infra:hosts[2].gpus", 16), ("glm-infra:decode.tp", 2)]),
    ("nvfp4-on-b200", [*((f"glm-infra:hosts[{i}].gpuModel", "B200") for i in range(3)),
                       ("glm-infra:capacity", {"gpuMemoryGb": 288})]),  # compute capability 10.0: just enough
]


@pytest.mark.parametrize("case", EDGE, ids=[c[0] for c in EDGE])
def test_a_stack_at_the_edge_of_a_rule_is_accepted(case, prod_config, write_stack):
    for path, value in case[1]:
        _set(prod_config, path, value)
    assert load_file(write_stack(prod_config)).config.prefill is not None


def test_a_host_that_serves_nothing_is_not_held_to_the_weight_format(prod_config, write_stack):
    prod_config["glm-infra:hosts"].append({"name": "spare", "address": "10.0.0.99", "gpuModel": "A100"})
    assert load_file(write_stack(prod_config)).config.hosts[3].gpu_model == "A100"
    prod_config["glm-infra:prefill"]["hosts"] = ["b300-1", "spare"]
    msg = str(pytest.raises(StackError, load_file, write_stack(prod_config)).value)
    assert "glm-infra:hosts[3].gpuModel: spare's A100 (compute capability 8) cannot run" in msg, msg


def test_hosts_without_pools_do_not_reserve_the_pools_ports():
    """Hosts (serve=False) runs no vLLM: a port only the pools would use is free for node exporter; a
    Cluster of the same hosts refuses it."""
    from glm_infra.stack import load_dict

    nics = ["mlx5_0"]
    raw = {"hosts": [{"name": "a", "address": "10.0.0.1", "computeNics": nics},
                     {"name": "b", "address": "10.0.0.2", "computeNics": nics}],
           "ssh": {"privateKeyPath": "k"}, "model": {"repo": "r/m", "revision": "0" * 40, "path": "/mnt/m"},
           "monitoring": {"nodeExporterPort": 8100}, "firewall": {"adminCidrs": ["10.20.0.0/24"]},
           "router": {"host": "b", "allowedCidrs": ["10.30.0.0/16"]}}
    assert load_dict(raw, "Hosts 'h'", serve=False).config.monitoring.node_exporter_port == 8100
    with pytest.raises(StackError) as e:
        load_dict(raw, "Cluster 'c'")
    assert str(e.value).splitlines()[1:] == [
        "  Cluster 'c': glm-infra:monitoring.nodeExporterPort: port 8100 on a used twice: prefill-0 http and node exporter"]


@pytest.mark.parametrize("name,value,problem", [
    ("router_api_key", "sk-0123456789abcdef", None),
    ("router_api_key", "sk-0123456789abcdef==", None),
    ("router_api_key", "sk-0123456789abcdef\nEXTRA=1", "glm-infra:router.apiKey: the secret's value is not 16 to 512 "
     "characters of a bearer token (letters, digits, - . _ ~ + /, then = padding)"),
    ("router_api_key", "sk-short", "glm-infra:router.apiKey: the secret's value is not 16 to 512 characters of a "
     "bearer token (letters, digits, - . _ ~ + /, then = padding)"),
    ("hf_token", "hf_0123456789", None),
    ("hf_token", "hf_0123 456789", "glm-infra:model.hfToken: the secret's value is not 8 to 512 letters, digits, _ . "
     "or - (a Hugging Face token)"),
    ("webhook_url", "https://hooks.example.com/T0/B1", None),
    ("webhook_url", "https://hooks.example.com/a'b", "glm-infra:monitoring.webhookUrl: the secret's value is not an "
     "http(s) URL without spaces, quotes or backslashes"),
    ("private_key", "any text\nat all \"'", None),  # no rule: it lands in a file of its own
])
def test_a_secret_value_that_breaks_its_file_is_named_never_shown(name, value, problem):
    """What the program checks once a secret's value is known (inputs.py): the key and the rule."""
    from glm_infra.plan.validate import secret_value_problem

    got = secret_value_problem(name, value)
    assert (got and f"{got.path}: {got.message}") == problem
    assert got is None or value not in got.message


# --- who may reach the hosts: said by every stack, open to all only on purpose -----------------------

_OPEN_TO_ALL = {
    "glm-infra:firewall.adminCidrs": "SSH on every host; list the networks you and the machine running pulumi "
                                     "connect from (a bastion, a VPN) unless that is what you mean",
    "glm-infra:router.allowedCidrs": "the router's public port (8000 on b300-3); list the networks your clients "
                                     "(or their load balancer) connect from unless that is what you mean",
    "glm-infra:monitoring.allowedCidrs": "Prometheus and Alertmanager on b300-1 (they ask no credential); list the "
                                         "networks the SLA gate and your dashboards connect from unless that is "
                                         "what you mean",
}


@pytest.mark.parametrize("key", sorted(_OPEN_TO_ALL))
@pytest.mark.parametrize("given,family", [
    (["0.0.0.0/0"], "IPv4"), (["::/0"], "IPv6"), (["0.0.0.0/0", "::/0"], "IPv4 and IPv6"),
    (["0.0.0.0/1", "128.0.0.0/1"], "IPv4"),  # halves that add up to every address
    (["0.0.0.0/0", "10.0.0.0/8"], "IPv4"),
], ids=["v4", "v6", "both", "halves", "with-more"])
def test_open_to_every_address_is_accepted_with_a_warning(key, given, family, prod_config, write_stack, capsys):
    """An explicit 0.0.0.0/0 (or ::/0) remains possible: validate accepts it and warns, naming the key."""
    prod_config.setdefault("glm-infra:monitoring", {})
    _set(prod_config, key, given)
    path = write_stack(prod_config)
    loaded = load_file(path)
    assert [w for w in loaded.warnings if "address reach" in w] == [
        f"{key}: {', '.join(given)} lets every {family} address reach {_OPEN_TO_ALL[key]}"]
    assert main(["validate", "--no-predict", str(path)]) == 0
    assert f"  warning: {key}: {', '.join(given)} lets every {family} address reach" in capsys.readouterr().err


@pytest.mark.parametrize("given", [["0.0.0.0/1"], ["10.0.0.0/8", "::/1"], ["128.0.0.0/1", "2000::/3"]])
def test_a_wide_network_short_of_every_address_is_not_called_open_to_all(given, prod_config, write_stack):
    _set(prod_config, "glm-infra:firewall.adminCidrs", given)
    assert not [w for w in load_file(write_stack(prod_config)).warnings if "address reach" in w]


def test_with_the_firewall_off_no_network_is_required_and_validate_says_nothing_filters(prod_config, write_stack,
                                                                                         capsys):
    """firewall.enabled false: adminCidrs and router.allowedCidrs configure nothing, so they are not required;
    the warning says that nothing filters and that the lists given are not applied."""
    del prod_config["glm-infra:firewall"]
    _set(prod_config, "glm-infra:router.allowedCidrs", _DELETE)
    prod_config["glm-infra:firewall"] = {"enabled": False}
    path = write_stack(prod_config)
    loaded = load_file(path)
    warning = ("glm-infra:firewall.enabled is false: nothing filters who reaches the hosts; SSH, the router's public "
               "port and every port glm-infra opens (vLLM, its relays, the exporters, Prometheus, Alertmanager) "
               "answer every address that can route to them, and firewall.adminCidrs, router.allowedCidrs and "
               "monitoring.allowedCidrs are not applied")
    assert [w for w in loaded.warnings if "firewall" in w] == [warning]
    assert main(["validate", "--no-predict", str(path)]) == 0
    assert f"  warning: {warning}" in capsys.readouterr().err
    # Lists given with the firewall off: still accepted, still not applied, not called open to all.
    prod_config["glm-infra:firewall"]["adminCidrs"] = ["0.0.0.0/0"]
    assert [w for w in load_file(write_stack(prod_config)).warnings if "firewall" in w] == [warning]


def test_a_documentation_network_left_in_is_a_placeholder_warned_about(prod_config, write_stack):
    """The committed stacks carry documentation networks (RFC 5737, RFC 3849) as the operator's to replace."""
    warned = [w for w in load_file(write_stack(prod_config)).warnings if "placeholder" in w]
    assert warned == [
        "glm-infra:firewall.adminCidrs: 192.0.2.0/24 is a documentation network (RFC 5737, RFC 3849), a placeholder "
        "nobody connects from: replace it with the networks you and the machine running pulumi connect from (a "
        "bastion, a VPN)",
        "glm-infra:router.allowedCidrs: 203.0.113.0/24 is a documentation network (RFC 5737, RFC 3849), a "
        "placeholder nobody connects from: replace it with the networks your clients (or their load balancer) "
        "connect from"]
    _set(prod_config, "glm-infra:firewall.adminCidrs", ["10.20.0.0/24", "2001:db8:1::/48", "198.51.100.7"])
    _set(prod_config, "glm-infra:router.allowedCidrs", ["10.30.0.0/16"])
    prod_config["glm-infra:monitoring"] = {"allowedCidrs": ["192.0.2.0/25"]}
    assert [w.split(": replace")[0] for w in load_file(write_stack(prod_config)).warnings if "placeholder" in w] == [
        "glm-infra:firewall.adminCidrs: 2001:db8:1::/48, 198.51.100.7/32 are documentation networks (RFC 5737, "
        "RFC 3849), a placeholder nobody connects from",
        "glm-infra:monitoring.allowedCidrs: 192.0.2.0/25 is a documentation network (RFC 5737, RFC 3849), a "
        "placeholder nobody connects from"]


def test_hosts_without_a_router_need_who_may_log_in_only():
    """Hosts (serve=False) runs no router: router.allowedCidrs is neither required nor judged; who may log in
    over SSH is, as for a Cluster."""
    from glm_infra.stack import load_dict

    raw = {"hosts": [{"name": n, "address": a, "computeNics": ["mlx5_0"]} for n, a in (("a", "10.0.0.1"), ("b", "10.0.0.2"))],
           "ssh": {"privateKeyPath": "k"}, "model": {"repo": "r/m", "revision": "0" * 40, "path": "/mnt/m"}}
    with pytest.raises(StackError) as e:
        load_dict(raw, "Hosts 'h'", serve=False)
    assert [p.path for p in e.value.problems] == ["glm-infra:firewall.adminCidrs"]
    loaded = load_dict({**raw, "firewall": {"adminCidrs": ["::/0"]}}, "Hosts 'h'", serve=False)
    assert [w.split(" address reach")[0] for w in loaded.warnings if "address reach" in w] == [
        "glm-infra:firewall.adminCidrs: ::/0 lets every IPv6"]
    with pytest.raises(StackError) as e:  # the same hosts as a Cluster: its router's clients too
        load_dict({**raw, "firewall": {"adminCidrs": ["::/0"]}}, "Cluster 'c'")
    assert [p.path for p in e.value.problems] == ["glm-infra:router.allowedCidrs"]
