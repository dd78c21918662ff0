"""The vLLM instances: the `vllm serve` command line of each (the BRIEF recipe), its unit, environment and
secrets, and the steps that start it, roll it out when it changes and stop it on destroy."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from glm_infra.plan.topology import KV_ROLE, Instance, pool_of
from glm_infra.render import render_template, systemd_quote
from glm_infra.roles import nixl
from glm_infra.spec import paths
from glm_infra.spec.config import StackConfig, dump_json
from glm_infra.spec.paths import UCX_ENV, VLLM_SECRETS
from glm_infra.steps import TRIGGERS_TOKEN, ScriptStep, Step, digest, file_step

# How long a (re)started instance may take to answer /health: loading ~465 GB and compiling graphs.
SERVICE_START_TIMEOUT_S = 3600


def _fmt_float(v: float) -> str:
    return f"{v:.2f}" if round(v, 2) == v else repr(v)


def vllm_args(stack: StackConfig, inst: Instance) -> list[str]:
    """The complete ``vllm serve`` command of one instance, in the BRIEF recipe's order."""
    m = stack.model
    pool = pool_of(stack, inst.role)
    a = [f"{stack.runtime.venv}/bin/vllm", "serve", m.path]
    if m.trust_remote_code:
        a.append("--trust-remote-code")
    if inst.role in KV_ROLE:
        a += ["--kv-transfer-config", dump_json({"kv_connector": "NixlConnector", "kv_role": KV_ROLE[inst.role]})]
    if m.chat_template_content_format:
        a.append(f"--chat-template-content-format={m.chat_template_content_format}")
    if pool.cudagraph_mode:
        a += ["--compilation-config", dump_json({"cudagraph_mode": pool.cudagraph_mode})]
    if pool.max_num_batched_tokens:
        a += ["--max-num-batched-tokens", str(pool.max_num_batched_tokens)]
    if pool.ep:
        a.append("-ep")
    a += ["-tp", str(pool.tp), "-dp", str(pool.dp)]
    if m.tool_call_parser:
        a += ["--tool-call-parser", m.tool_call_parser]
    if m.enable_auto_tool_choice:
        a.append("--enable-auto-tool-choice")
    if m.reasoning_parser:
        a += ["--reasoning-parser", m.reasoning_parser]
    a += ["--gpu-memory-utilization", _fmt_float(pool.gpu_memory_utilization)]
    if m.kv_cache_dtype:
        a += ["--kv-cache-dtype", m.kv_cache_dtype]
    if m.max_model_len:
        a += ["--max-model-len", str(m.max_model_len)]
    if m.enable_prompt_tokens_details:
        a.append("--enable-prompt-tokens-details")
    if pool.all2all_backend:
        a.append(f"--all2all-backend={pool.all2all_backend}")
    if pool.speculative_tokens > 0:
        spec = {"method": m.speculative_method, "num_speculative_tokens": pool.speculative_tokens}
        a += ["--speculative-config", dump_json(spec)]
    a += ["--shutdown-timeout", str(pool.shutdown_timeout)]
    if m.fingerprint_mode:
        a.append(f"--fingerprint-mode={m.fingerprint_mode}")
    # What a multi-host, multi-instance deployment adds to the recipe.
    a += ["--served-model-name", m.served_model_name]
    a += ["--host", inst.address, "--port", str(inst.http_port)]
    a += ["--data-parallel-rpc-port", str(inst.dp_rpc_port)]
    a += list(pool.extra_args)
    return a


def vllm_environment(stack: StackConfig, inst: Instance) -> list[tuple[str, str]]:
    """Non-secret environment of one instance, as ``Environment=`` lines."""
    pool = pool_of(stack, inst.role)
    env: list[tuple[str, str]] = []
    if pool.model_runner_v2:
        env.append(("VLLM_USE_V2_MODEL_RUNNER", "1"))
    env.append(("CUDA_VISIBLE_DEVICES", inst.cuda_visible_devices))
    if inst.role in KV_ROLE:
        env.append(("VLLM_NIXL_SIDE_CHANNEL_HOST", inst.nixl_host))
        env.append(("VLLM_NIXL_SIDE_CHANNEL_PORT", str(inst.nixl_port_base)))
    env.append(("HOME", f"{stack.runtime.state_dir}/home"))
    env.append(("HF_HUB_OFFLINE", "1"))  # weights are staged by glm-infra; never download at start
    env += sorted(pool.env.items())
    return env


def vllm_unit(stack: StackConfig, inst: Instance) -> str:
    pool = pool_of(stack, inst.role)
    requires = []
    if stack.drivers.fabric_manager:
        requires.append("nvidia-fabricmanager.service")
    requires.append("nvidia-persistenced.service")
    per_rank = nixl.per_rank(stack, inst.host)  # its GPU's nearest NIC, read and checked on the host
    return render_template(
        "vllm.service.j2",
        inst=inst,
        pool=pool,
        stack=stack,
        exec_start=systemd_quote(vllm_args(stack, inst)),
        environment=vllm_environment(stack, inst),
        environment_files=[UCX_ENV, *([paths.NIC_AFFINITY_ENV] if per_rank else []), VLLM_SECRETS],
        nic_affinity=paths.script(nixl.NIC_AFFINITY) if per_rank else None,
        acs_unit=nixl.ACS_UNIT if per_rank and stack.rdma.disable_acs else None,
        requires=requires,
        timeout_stop=pool.shutdown_timeout + 30,
        gate=paths.script("health-gate"),
    )


def vllm_secrets_env(secrets: Mapping[str, str]) -> str:
    return render_template("vllm-secrets.env.j2", secrets=secrets)


def vllm_service_script(stack: StackConfig, inst: Instance) -> str:
    return render_template(
        "service.sh.j2",
        host=inst.host,
        unit=inst.unit,
        health_url=f"{inst.url}/health",
        timeout_s=SERVICE_START_TIMEOUT_S,
        drain_s=pool_of(stack, inst.role).shutdown_timeout,
    )


def instance_steps(stack: StackConfig, inst: Instance) -> list[Step]:
    """A vLLM instance: its unit; "service" starts it (and only starts it) so a first deploy starts
    every instance at once; "rollout" is a no-op when created and restarts the unit when the unit or
    what it reads changes, one instance of a pool at a time; "stop" stops it on destroy (its own
    step, so destroy can order router → decode → prefill)."""
    unit = vllm_unit(stack, inst)
    stem = inst.unit.removesuffix(".service")
    timeout = f"{SERVICE_START_TIMEOUT_S + 120}s"
    service = ScriptStep(stem, vllm_service_script(stack, inst), action="start").step(
        f"{inst.name}-service", timeout=timeout)
    script = paths.script(stem)
    return [
        file_step(f"{inst.name}-unit", paths.unit(inst.unit), unit),
        service,
        # Restarts only when its triggers changed since the instance last (re)started: a step re-run
        # for another reason (a new SSH key changes every step's connection) leaves it running.
        Step(f"{inst.name}-rollout", f"{script} record {TRIGGERS_TOKEN}", update=f"{script} rollout {TRIGGERS_TOKEN}",
             triggers=(digest(unit), digest(nixl.ucx_env(stack, inst.host)), stack.model.revision,
                       digest(stack.runtime.vllm_version, stack.runtime.nixl_version, stack.runtime.venv)),
             timeout=timeout),
        Step(f"{inst.name}-stop", f"echo {stem} stops on destroy",
             delete=f"if [ -x {script} ]; then {script} remove; fi"),
    ]


def placement(inst: Instance) -> str:
    """Where an instance runs on its host: what another instance there must not hold when it starts."""
    return (f"gpus:{inst.cuda_visible_devices};http:{inst.http_port};rpc:{inst.dp_rpc_port};"
            f"nixl:{inst.nixl_port_base}+{inst.nixl_port_count}")


def placement_step(host: str, instances: Sequence[Instance]) -> Step:
    """Before any instance of the host starts: what the plan no longer puts here is stopped and removed,
    what moves to other GPUs or ports is stopped (its rollout starts it there), so a re-laid-out pool
    finds its GPUs and ports free (templates/placement.sh.j2)."""
    script = render_template("placement.sh.j2", host=host, records_dir=paths.PLACEMENT_DIR, libexec=paths.LIBEXEC,
                             planned=[(i.unit, placement(i)) for i in instances])
    return ScriptStep("glm-vllm-placement", script).step("vllm-placement")
