"""The pinned versions of what runs on the hosts, and the choices each pinned version accepts for the
settings glm-infra passes it, in one place. ``validate`` checks the stack's values against the
choices of the versions it runs; a version this table does not know is not checked (and says so).

Every closed set is what the pinned release's own command line takes, read from the released
packages (``tests/test_pins.py`` rebuilds each from them and fails when they differ): vLLM 0.33.0's
wheel for ``vllm serve`` (the file and symbol of each set beside it) and vllm-router 0.1.17's
``router_args.py`` (``RouterArgs.add_cli_args``, ``--policy``'s ``choices``). A value in vLLM's
internal lists that its command line refuses is not a choice.
"""

from __future__ import annotations

VLLM = "0.33.0"
NIXL = "1.5.1"
VLLM_ROUTER = "0.1.17"
# vllm-router 0.1.17's worker health checking (`vllm-router --help`; glm-infra sets only the interval,
# router.healthCheckInterval): a worker is down after this many failed checks in a row and up again after
# this many good ones, each check waiting this long. The roll's drain and return wait from them.
ROUTER_HEALTH_FAILURE_THRESHOLD = 3
ROUTER_HEALTH_SUCCESS_THRESHOLD = 2
ROUTER_HEALTH_CHECK_TIMEOUT_S = 5
UV = "0.13.8"
HF_HUB = "2.4.0"

# vllm/config/speculative.py MTPModelTypes (part of SpeculativeMethod below).
_MTP = (
    "deepseek_mtp", "dots3_note_mtp", "mimo_mtp", "mimo_v2_mtp", "glm4_moe_mtp", "glm4_moe_lite_mtp", "glm_ocr_mtp",
    "ernie_mtp", "nemotron_h_mtp", "exaone_moe_mtp", "exaone4_5_mtp", "qwen3_next_mtp", "qwen4_exp_mtp",
    "qwen3_5_mtp", "longcat_flash_mtp", "bailing_hybrid_v3_mtp", "minimax_m3_mtp", "bailing_hybrid_mtp", "mtp",
    "kimi_k3_mtp", "pangu_ultra_moe_mtp", "step3p5_mtp", "step5_mtp", "hy_v3_mtp", "hy_v4_mtp", "gemma4_mtp",
    "inkling_mtp", "glm5_next_mtp",
)

# vLLM version → setting (the stack's key under model / a pool) → what that version accepts.
VLLM_CHOICES: dict[str, dict[str, tuple[str, ...]]] = {
    "0.33.0": {
        # vllm/tool_parsers/__init__.py _TOOL_PARSERS_TO_REGISTER (ToolParserManager.list_registered(), which
        # vllm/entrypoints/common/cli_args.py's --tool-call-parser is checked against after parsing).
        "toolCallParser": (
            "apertus", "beam", "cohere_command3", "cohere_command4", "deepseek_v3", "deepseek_v31", "deepseek_v32",
            "deepseek_v4", "deepseek_v41", "dots", "ernie45", "functiongemma", "gemma4", "gigachat3", "glm45",
            "glm47", "granite", "granite-20b-fc", "granite4", "hermes", "hf", "hunyuan_a13b", "hy_v3", "hy_v4",
            "inkling", "internlm", "jamba", "k2_horizon", "kimi_k2", "kimi_k3", "lfm2", "ling3", "llama3_json",
            "llama4_json", "llama4_pythonic", "longcat", "mimo", "minicpm5", "minimax_m2", "minimax_m3", "mistral",
            "muse", "muse_glimmer", "musespark1x", "olmo3", "openai", "phi4_mini_json", "plamo3", "poolside_v1",
            "pythonic", "qwen3_coder", "qwen3_json", "qwen3_xml", "seed_oss", "step3", "step3p5", "step5", "xlam",
        ),
        # vllm/reasoning/__init__.py _REASONING_PARSERS_TO_REGISTER (--reasoning-parser, checked after
        # parsing; it also takes "none", the same as leaving it out).
        "reasoningParser": (
            "beam", "cohere_command3", "cohere_command4", "deepseek_r1", "deepseek_v3", "deepseek_v4",
            "deepseek_v41", "ernie45", "gemma4", "glm45", "glm47", "granite", "granite_thinking_parser", "hf",
            "holo2", "hunyuan_a13b", "hy_v3", "hy_v4", "inkling", "k2_horizon", "kimi_k2", "kimi_k3", "ling3",
            "mimo", "minicpmv", "minimax_m2", "minimax_m2_append_think", "minimax_m3", "mistral", "muse",
            "muse_glimmer", "musespark1x", "nemotron_v3", "olmo3", "openai_gptoss", "plamo3", "poolside_v1", "qwen3",
            "seed_oss", "step3", "step3p5", "step5",
        ),
        # vllm/config/parallel.py All2AllBackend (ParallelConfig.all2all_backend) less what
        # vllm/engine/arg_utils.py EngineArgs.add_cli_args removes from --all2all-backend's choices:
        # "passthrough" (vllm/config/kernel.py PASSTHROUGH_ALL2ALL_BACKEND, set through --moe-backend).
        "all2allBackend": (
            "naive", "pplx", "deepep_high_throughput", "deepep_low_latency", "deepep_v2", "mori_high_throughput",
            "mori_low_latency", "moonep", "nixl_ep", "allgather_reducescatter", "flashinfer_all2allv",
            "flashinfer_nvlink_two_sided", "flashinfer_nvlink_one_sided",
        ),
        # vllm/config/speculative.py SpeculativeMethod (SpeculativeConfig.method: --speculative-config's JSON).
        "speculativeMethod": ("ngram", "draft_model", "suffix", "custom_class", "eagle", "eagle3",
                              "extract_hidden_states", *_MTP, "dflash", "ngram_gpu", "dspark"),
        # vllm/entrypoints/common/cli_args.py BaseFrontendArgs.fingerprint_mode (--fingerprint-mode's choices).
        "fingerprintMode": ("full", "hash", "custom", "none"),
        # vllm/renderers/chat_utils/types.py ChatTemplateContentFormatOption
        # (BaseFrontendArgs.chat_template_content_format: --chat-template-content-format's choices).
        "chatTemplateContentFormat": ("auto", "string", "openai"),
        # vllm/config/compilation.py CUDAGraphMode's names (--compilation-config's cudagraph_mode).
        "cudagraphMode": ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"),
        # vllm/config/cache.py CacheDType (--kv-cache-dtype takes any string, CacheConfig refuses the rest;
        # no register_kv_cache_dtype in the wheel adds one).
        "kvCacheDtype": ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla",
                         "nvfp4_ds_mla", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
                         "turboquant_3bit_nc", "octave_k3v4", "octave_k3v3", "octave_k3v3_compact", "ultraquant_4bit",
                         "int4_per_token_head", "int8_per_token_head", "fp8_per_token_head", "nvfp4", "nvfp4_4over6"),
    },
}

ROUTER_CHOICES: dict[str, dict[str, tuple[str, ...]]] = {
    "0.1.17": {
        # vllm_router/router_args.py RouterArgs.add_cli_args: --policy's choices.
        "policy": ("random", "round_robin", "cache_aware", "kv_aware", "power_of_two", "consistent_hash",
                   "sticky_least_loaded"),
    },
}


# vllm-router version → every HTTP route its server defines, (method, path), axum's {name} a path segment:
# vllm-router 0.1.17's src/server.rs build_app_with_wasm_middleware (the sdist, sha256 6c37f9a8…d9d;
# docs/research/vllm-router-0.1.17-rotation.md §1). None asks for a credential when the vllm-router command
# starts it (§2.1): whoever reaches its port may take every worker out (POST /remove_worker).
ROUTER_ROUTES: dict[str, tuple[tuple[str, str], ...]] = {
    "0.1.17": (
        # inference ("protected_routes": behind the concurrency limit, not behind any key)
        ("POST", "/generate"), ("POST", "/inference/v1/generate"), ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"), ("POST", "/rerank"), ("POST", "/v1/rerank"), ("POST", "/v1/responses"),
        ("POST", "/v1/embeddings"), ("GET", "/v1/responses/{response_id}"),
        ("POST", "/v1/responses/{response_id}/cancel"), ("DELETE", "/v1/responses/{response_id}"),
        ("GET", "/v1/responses/{response_id}/input"),
        # probes and information ("public_routes")
        ("GET", "/liveness"), ("GET", "/readiness"), ("GET", "/health"), ("GET", "/health_generate"),
        ("GET", "/v1/models"), ("GET", "/get_model_info"), ("GET", "/get_server_info"),
        # administration ("admin_routes", "worker_routes")
        ("POST", "/add_worker"), ("POST", "/remove_worker"), ("GET", "/list_workers"), ("POST", "/flush_cache"),
        ("GET", "/get_loads"), ("GET", "/scheduling/diagnostics"), ("POST", "/finish_session"),
        ("POST", "/workers"), ("GET", "/workers"), ("GET", "/workers/{url}"), ("DELETE", "/workers/{url}"),
    ),
}
# What the router does with a request no route above takes: 0.1.17 turns its transparent proxy on in every
# mode (src/server.rs startup: enable_transparent_proxy = true), so a POST with a JSON body to any other path
# is sent to a prefill and a decode worker at that path (vLLM's own /reset_prefix_cache, /pause, …); any
# other method gets 405.
ROUTER_FALLBACK: dict[str, str] = {"0.1.17": "POST"}


def release(version: str) -> str:
    """A version without its local part: the stand-ins' ``0.33.0+glmsim`` is vLLM 0.33.0's interface."""
    return version.split("+", 1)[0]


def schema_enum(setting: str) -> dict[str, list[str]]:
    """The JSON Schema ``enum`` of a vLLM setting: the pinned version's choices (for editors)."""
    return {"enum": list(VLLM_CHOICES[VLLM][setting])}
