"""The vLLM instances: the `vllm serve` command line of each (the recipe (docs/RECIPE.md)), its unit, environment and
secrets, and the steps that start it, roll it out when it changes and stop it on destroy."""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Mapping, Sequence

from glm_infra.plan import startup
from glm_infra.plan.topology import KV_ROLE, Instance, allocate, pool_of
from glm_infra.render import render_template, systemd_quote
from glm_infra.roles import nixl
from glm_infra.spec import paths
from glm_infra.spec.config import StackConfig, dump_json
from glm_infra.spec.paths import UCX_ENV, VLLM_SECRETS
from glm_infra.steps import TRIGGERS_TOKEN, ScriptStep, Step, command, digest, file_step

# How long a (re)started instance may take to answer /health: loading ~465 GB and compiling graphs.
SERVICE_START_TIMEOUT_S = 3600


def _fmt_float(v: float) -> str:
    return f"{v:.2f}" if round(v, 2) == v else repr(v)


def vllm_args(stack: StackConfig, inst: Instance) -> list[str]:
    """The complete ``vllm serve`` command of one instance, in the recipe's (docs/RECIPE.md) order."""
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
    env.append(("HOME", paths.home(stack.runtime.state_dir)))
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
    """Where an instance runs on its host: what another instance there must not hold when it starts. In
    the form templates/placement.sh.j2 reads back from the installed unit (its CUDA_VISIBLE_DEVICES,
    --port, --data-parallel-rpc-port, VLLM_NIXL_SIDE_CHANNEL_PORT and -dp): a colocated instance
    transfers no KV cache and has no NIXL side channel."""
    nixl = f"{inst.nixl_port_base}+{inst.nixl_port_count}" if inst.role in KV_ROLE else "-"
    return f"gpus:{inst.cuda_visible_devices};http:{inst.http_port};rpc:{inst.dp_rpc_port};nixl:{nixl}"


def placement_step(host: str, instances: Sequence[Instance]) -> Step:
    """Before any instance of the host starts: what the plan no longer puts here is stopped and removed,
    what its installed unit puts on other GPUs or ports than the plan is stopped (its rollout starts it
    there), so a re-laid-out pool finds its GPUs and ports free; a unit that does not say where it runs
    fails the step (templates/placement.sh.j2)."""
    script = render_template("placement.sh.j2", host=host, records_dir=paths.PLACEMENT_DIR, libexec=paths.LIBEXEC,
                             planned=[(i.unit, placement(i)) for i in instances])
    return ScriptStep("glm-vllm-placement", script).step("vllm-placement")


# `vllm serve` flags outside the config hash vLLM 0.33.0 keys its warm-start caches by (the API server's
# address and ports, the served name, the memory share, the shutdown timeout; KVTransferConfig hashes to a
# constant): docs/research/vllm-0.33-compile-cache.md §2.3. A change of these alone relays nothing.
CACHE_NEUTRAL_FLAGS = ("--host", "--port", "--data-parallel-rpc-port", "--served-model-name",
                       "--gpu-memory-utilization", "--shutdown-timeout", "--kv-transfer-config")


def warm_cache_key(stack: StackConfig, role: str) -> str:
    """What the pool's warm-start caches are built for: the vLLM pin, the model and its revision, the GPU of
    the pool's first host, and the pool's flags that reach vLLM's config hash. The relay moves a pool's
    caches under this name; vLLM itself decides, by its own keys, which of the files it uses."""
    pool = pool_of(stack, role)
    argv = vllm_args(stack, next(i for i in allocate(stack) if i.role == role))[2:]
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in CACHE_NEUTRAL_FLAGS:
            skip = True
        else:
            kept.append(a)
    return digest(stack.runtime.vllm_version, stack.model.repo, stack.model.revision,
                  stack.host(pool.hosts[0]).gpu_model, *kept)


def warm_cache_steps(stack: StackConfig, host: str) -> list[Step]:
    """``<pool>-warm-cache`` on each host of a pool that spans hosts (plan/startup.py). On the pool's first host,
    once its instances there serve: the files of the expected kinds (paths.WARM_CACHE_KINDS: tuning results
    and GPU code, never host code) of its warm-start caches (paths.WARM_CACHES under the services' home) are
    copied into a revision named by warm_cache_key, and a transient unit serves them, signed with the stack's
    relay key, to its relay children until each has every file (or goes silent); a relay that cannot listen
    (its port taken) fails the step, naming who holds the port. Every other host then copies them from its
    parent (failing over to its ancestors), taking only a manifest signed with the key and each file with the
    sha256 it lists, adds to its own caches the files it lacks (never replacing one of its own; as the
    services' user's, without following a link the user could plant), and only then are its instances
    restarted; a copy that fails is reported and they start cold, but one refused as forged fails the step.
    Runs again when the key changes; older keys' copies go."""
    out = []
    rt = stack.runtime
    home = paths.home(rt.state_dir)
    stall = ["--stall", str(stack.model.relay_stall_seconds)] if stack.model.relay_stall_seconds is not None else []
    kinds = [x for cache in paths.WARM_CACHES for x in ("--include", cache)]
    kinds += [x for kind in paths.WARM_CACHE_KINDS for x in ("--kind", kind)]
    for role, relays in startup.warm_cache_relays(stack).items():
        me = relays.get(host)
        if me is None:
            continue
        key, folder = warm_cache_key(stack, role), paths.warm_cache(rt.state_dir, role)
        port, unit = startup.relay_port(stack, role), paths.warm_cache_relay_unit(role)
        signed = ["--relay-key-file", paths.RELAY_KEY]
        serve = ["--serve" if me.parent else "--bind", f"{stack.host(host).address}:{port}",
                 "--children", ",".join(me.children)] if me.children else []
        stage = [paths.WEIGHTS, "stage", "--revision", key, "--path", folder, "--name", host,
                 "--margin-gb", f"{stack.model.disk_margin_gb:g}", *stall]
        prune = command(paths.WEIGHTS, "prune", "--revision", key, "--path", folder)
        stop_relay = f"{{ systemctl stop {unit}.service 2>/dev/null || true; }}"
        # The pools' caches folder goes with the last of them.
        remove = (f"{command(paths.WEIGHTS, 'remove', '--path', folder)} && "
                  f"{{ rmdir {posixpath.dirname(folder)} 2>/dev/null || true; }}")
        if me.parent is None:
            stage += ["--role", "seed", "--source", "directory", "--from", home, *kinds]
            # Served by a transient unit, so the other hosts' steps can follow this one (and are not run
            # at all when it fails); it stops once each child has every file or went silent. Type=notify:
            # systemd-run returns once the relay listens (weights.py tells it), or fails when it cannot.
            relay = ["systemd-run", "--unit", unit, "--collect", "--quiet", "-p", "Type=notify", "-p",
                     f"RuntimeMaxSec={SERVICE_START_TIMEOUT_S}", paths.WEIGHTS, "relay", "--revision", key,
                     "--path", folder, *serve, *stall, *signed]
            failed = (f"{{ journalctl --no-pager -o cat -n 5 -u {unit}.service >&2; echo "
                      f"{shlex.quote(f'{host}: warm-cache: the relay of the {role} pool caches did not start (above)')}"
                      " >&2; exit 1; }")
            create = [command(*stage), prune, stop_relay, f"{{ {command(*relay)} || {failed}; }}"]
            delete = f"{stop_relay} && {remove}"
        else:
            stage += ["--role", "peer", "--timeout", str(SERVICE_START_TIMEOUT_S), *signed]
            for up in me.ancestors:  # the parent first, the pool's first host last
                stage += ["--peer", f"http://{paths.url_host(stack.host(up).address)}:{port}"]
            # Root copies them into the services' home, as theirs, never through a link they could plant.
            install = command(paths.WEIGHTS, "install", "--revision", key, "--path", folder, "--into", home,
                              "--owner", rt.user, *kinds)
            # The caches only save time: a copy that fails leaves this host's instances to start cold (and
            # doctor shows the step drifted) rather than holding back their restart. Forged is not a failed
            # copy: it fails the step (exit 3 of weights.py).
            cold = (f"{host}: warm-cache: no verified copy of the {role} pool's caches from {me.parent}; "
                    "its instances here start cold")
            forged = (f"{host}: warm-cache: refused what answered for the {role} pool's caches as forged (above): "
                      "nothing installed")
            create = [f"if {command(*stage, *serve)}; then {install}; else rc=$?; "
                      f"if [ \"$rc\" = 3 ]; then echo {shlex.quote(forged)} >&2; exit 3; fi; "
                      f"echo {shlex.quote(cold)} >&2; fi", prune]
            delete = remove
        out.append(Step(f"{role}-warm-cache", " && ".join(create), delete, triggers=(key, digest(*relays)),
                        timeout=f"{SERVICE_START_TIMEOUT_S + 600}s",
                        check=command(paths.WEIGHTS, "verify", "--quick", "--revision", key, "--path", folder)))
    return out
