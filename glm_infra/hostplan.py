"""The per-host plan: every step that reaches each host, with its commands and the files it writes.

Pure and computed once. ``glm-infra render`` writes it out for review (``write_tree``) and the
components register exactly these steps, so what is reviewed is what deploys (a test checks that,
byte for byte, for every stack). Secret files hold placeholders here; the components fill in the
real values inside Pulumi (``Step.secret_render``).

Step keys per host, in the order the steps run:

    preflight, <host files>, turn-acquire (local), host-drain, drivers-install, drivers-reboot,
    drivers-wait (local), drivers-back, firewall, health-gate, rdma, ucx-env, host-return, turn-release (local),
    facts, runtime,
    weights-hf-cli (the seed, from the hub), weights-stage (serving the host's relay children while it runs),
    <instance>-unit, <instance>-service, <instance>-rollout, <instance>-stop, prune-weights,
    router-secrets, router-unit, router-service, router-front-conf, router-front-keys,
    router-front-tls-given (when the stack gives a certificate), router-front-tls, router-front,
    node-exporter, dcgm-exporter, prometheus, alertmanager-webhook, alertmanager  (monitoring)
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from . import render
from .agent import hostcheck
from .plan import topology
from .plan.topology import HostPlan, Instance, Plan, rolling, seed_host
from .roles import firewall, monitoring
from .spec import paths, pins
from .spec.config import StackConfig
from .steps import TRIGGERS_TOKEN, RenderedFile, ScriptStep, Step, command, digest, file_step, seconds

HOST_FILES = ("vllm-secrets", "hf-secrets")


@dataclass(frozen=True)
class HostSteps:
    """Everything glm-infra runs on one host, in order."""

    host: HostPlan
    steps: dict[str, Step]

    def files(self) -> dict[str, RenderedFile]:
        """Every file the steps write on the host, by absolute path."""
        out: dict[str, RenderedFile] = {}
        for step in self.steps.values():
            for f in step.files:
                out[f.path] = f
        return out

    def only(self, *prefixes: str) -> dict[str, Step]:
        return {k: s for k, s in self.steps.items() if k.startswith(prefixes)}


def host_file_slug(path: str) -> str:
    return path.strip("/").replace("/", "-").replace(".", "-")


def preflight_step(stack: StackConfig, h: HostPlan) -> Step:
    """Install hostcheck.py and run its preflight: facts on stdout, what rules the host out on stderr."""
    hc = stack.host(h.name)
    source = render.hostcheck_source()
    argv = [paths.HOSTCHECK, "preflight", "--host", h.name, "--min-kernel", stack.preflight.min_kernel,
            "--gpus", str(hc.gpus), "--gpu-model", hc.gpu_model]
    for os_id in stack.preflight.allowed_os:
        argv += ["--allowed-os", os_id]
    if stack.drivers.mode == "verify":
        argv.append("--require-driver")
    if h.provisioned:
        argv += ["--model-path", stack.model.path]
        if stack.preflight.min_free_disk_gb is not None:
            argv += ["--min-free-gb", f"{stack.preflight.min_free_disk_gb:g}"]
    create = f"install -D -m 0755 /dev/stdin {paths.HOSTCHECK} && {command(*argv)}"
    return Step("preflight", create, f"rm -f {paths.HOSTCHECK}", source, (digest(source),),
                files=(RenderedFile(paths.HOSTCHECK, source, 0o755),), check=f"{command(*argv)} >/dev/null")


def facts_step(stack: StackConfig, h: HostPlan) -> Step:
    argv = [paths.HOSTCHECK, "facts"] + (["--model-path", stack.model.path] if h.provisioned else [])
    return Step("facts", command(*argv))


def host_file_steps(stack: StackConfig, plan: Plan, h: HostPlan, secrets: Mapping[str, str]) -> list[Step]:
    out = []
    if h.instances:
        out.append(file_step("vllm-secrets", paths.VLLM_SECRETS, render.vllm_secrets_env(secrets), 0o600, True,
                             "vllm_secrets_env"))
    if h.name == seed_host(stack, plan.serve) and stack.model.source == "huggingface" and h.provisioned:
        out.append(file_step("hf-secrets", paths.HF_SECRETS, render.hf_secrets_env(secrets), 0o600, True,
                             "hf_secrets_env"))
    return out


def driver_steps(stack: StackConfig, h: HostPlan) -> list[Step]:
    d = stack.drivers
    wait_timeout = f"{d.reboot_timeout + 180}s"
    return [
        ScriptStep("drivers", render.drivers_script(stack, h.name)).step("drivers-install", timeout="30m"),
        Step("drivers-reboot", "bash -s", None, render.reboot_script(h.name)),
        Step("drivers-wait", "bash -s", None, render.waitboot_script(stack, h.name), local=True, timeout=wait_timeout),
        Step("drivers-back", "bash -s", None, render.back_script(h.name)),
    ]


# The steps that take a host down or change what its instances run on: they roll, one turn at a time.
DISRUPTIVE = ("drivers-install", "drivers-reboot", "rdma")
ROLL_FORCE = "GLM_INFRA_ROLL_FORCE"  # =1: the roll goes on without the router's view (docs/OPERATIONS.md)
UNTIMED_STEP_S = 600  # what a step without a timeout is assumed to take at most, for the roll's bounds


def roll_steps(stack: StackConfig, plan: Plan, h: HostPlan, stack_name: str,
               around: list[Step]) -> tuple[list[Step], list[Step]]:
    """The steps before and after ``around`` (drivers … ucx-env) on a serving host: its turn in its pools
    (turn-acquire, on the machine running pulumi), the drain of its instances (host-drain), and after
    them their return (host-return) and the turn given back (turn-release). They run when the disruptive
    steps change (their digest is in every command) and do nothing on a first deploy; hosts without
    instances have none."""
    groups = [g for g in rolling(stack, plan) if h.name in g.hosts]
    if not groups or not plan.serve:
        return [], []
    by_name = {x.name: x for x in around}
    roll = digest(*(part for k in DISRUPTIVE if k in by_name
                    for part in (by_name[k].create, by_name[k].stdin or "", *by_name[k].triggers)))
    pools = [(g.pool, g.max_unavailable) for g in groups]
    r = stack.router
    interval = r.health_check_interval if r is not None else 0
    check = interval + pins.ROUTER_HEALTH_CHECK_TIMEOUT_S
    stop_s = max(pool.shutdown_timeout + 30 for role, pool in stack.pools() if role in dict(pools))
    # Down after the failure threshold's checks, up after the success threshold's, each with one more
    # check and half a minute of margin (a loaded or restarting router is late).
    down_s = (pins.ROUTER_HEALTH_FAILURE_THRESHOLD + 1) * check + 30
    up_s = (pins.ROUTER_HEALTH_SUCCESS_THRESHOLD + 1) * check + 30
    start_s = render.SERVICE_START_TIMEOUT_S
    turn_s = stop_s + down_s + sum(seconds(x.timeout, UNTIMED_STEP_S) for x in around) + start_s + up_s
    wait_s = turn_s + 300  # another host's whole turn, from the timeouts of its steps
    bounds = {"guard_s": wait_s, "down_s": down_s, "up_s": up_s, "start_s": start_s}
    script = render.roll_script(stack, plan, h.name, pools, bounds)
    folder = f"{stack_name}-{digest(stack_name, *sorted(x.name for x in stack.hosts))}"
    lease = render.lease_script(h.name, folder, pools, wait_s)
    path = paths.script("roll")
    install = f"install -D -m 0755 /dev/stdin {path}"
    # roll.sh refuses to go on blind (the router unreadable) unless the operator sets this for one up;
    # SSH does not carry the environment, so the command does (and that up re-runs drain and return:
    # no-ops for a roll already done).
    run = f"{ROLL_FORCE}=1 {path}" if os.environ.get(ROLL_FORCE) == "1" else path
    first = f"echo {shlex.quote(f'{h.name}: turn: roll {roll} recorded (first deploy: nothing serves yet)')}"
    before = [
        Step("turn-acquire", first, stdin=lease, update=f"bash -s acquire {roll}", local=True,
             timeout=f"{wait_s + 120}s"),
        # Destroy leaves no trace of the rolls (the instances themselves are removed by their own steps).
        Step("host-drain", f"{install} && {path} record {roll}",
             f"rm -f {path} {paths.DRAINED} {paths.ROLLED} {paths.ROLL_LOG}", script,
             update=f"{install} && {run} drain {roll}", timeout=f"{wait_s + stop_s + down_s + 120}s",
             files=(RenderedFile(path, script, 0o755),), check=f"{path} check"),
    ]
    after = [
        Step("host-return", f"{run} return {roll}", timeout=f"{start_s + up_s + 120}s"),
        Step("turn-release", first, stdin=lease, update=f"bash -s release {roll}", local=True),
    ]
    return before, after


def health_gate_step(stack: StackConfig, h: HostPlan) -> Step:
    # The gate's wait, its looks and dcgmi diag, each limited; a minute more for SSH and bash.
    d = stack.drivers
    gate_s = hostcheck.gate_timeout_s(d.fabric_timeout, d.fabric_manager, d.dcgm_diag_level)
    return ScriptStep("health-gate", render.health_script(stack, h.name), removable=False).step(
        "health-gate", timeout=f"{gate_s + 60}s")


def weights_steps(stack: StackConfig, plan: Plan, h: HostPlan) -> list[Step]:
    """Staging of the checkpoint on one host (see ModelWeights): the seed reads the source, every other
    host copies from its parent in the relay tree (``topology.weights_relay``; failing over to its
    ancestors), every host verifies every file and serves what it verified to its children while it
    stages; the old revision goes once the instances moved on."""
    m = stack.model
    seed = seed_host(stack, plan.serve)
    source = render.weights_source()
    install = f"install -D -m 0755 /dev/stdin {paths.WEIGHTS}"
    base = [paths.WEIGHTS, "stage", "--revision", m.revision, "--path", m.path, "--margin-gb", f"{m.disk_margin_gb:g}"]
    relay = topology.weights_relay(stack, plan.serve).get(h.name)
    if m.source == "local":
        argv = [paths.WEIGHTS, "stage", "--source", "local", "--path", m.path]
    else:
        assert relay is not None, f"{h.name} stages the weights but is not in the relay tree"
        if h.name == seed:
            argv = base + ["--role", "seed", "--source", m.source]
            argv += ["--url", m.mirror_url or ""] if m.source == "mirror" else ["--repo", m.repo, "--token-file", paths.HF_SECRETS]
        else:
            argv = base + ["--role", "peer"]
            for up in relay.ancestors:  # the parent first, the seed last: the failover order
                argv += ["--peer", f"http://{paths.url_host(stack.host(up).address)}:{m.fanout_port}"]
        argv += ["--name", h.name]
        if m.relay_stall_seconds is not None:  # (left out otherwise: a deployed stack's command stays as it was)
            argv += ["--stall", str(m.relay_stall_seconds)]
        if relay.children:
            argv += ["--serve", f"{stack.host(h.name).address}:{m.fanout_port}", "--children", ",".join(relay.children)]
    # Re-staged when the checkpoint, its source or the set of hosts changes, or on request (verify).
    staged_on = sorted(x.name for x in plan.hosts if x.provisioned)
    triggers = (m.repo, m.revision, m.source, m.mirror_url or "", m.path, m.verify, digest(*staged_on), digest(source))
    remove = None if not m.remove_on_destroy else command(paths.WEIGHTS, "remove", "--path", m.path)
    out = []
    if h.name == seed and m.source == "huggingface":
        out.append(hf_cli_step(stack))
    verify = (command(*argv) if m.source == "local" else
              command(paths.WEIGHTS, "verify", "--revision", m.revision, "--path", m.path) + "${GLM_DOCTOR_QUICK:+ --quick}")
    out.append(Step("weights-stage", f"{install} && {command(*argv)}", remove, source, triggers, timeout="24h",
                    retain=not m.remove_on_destroy, files=(RenderedFile(paths.WEIGHTS, source, 0o755),),
                    check=verify))
    return out


def hf_cli_step(stack: StackConfig) -> Step:
    """The ``hf`` CLI the seed downloads with (huggingface source): a venv with the pinned
    huggingface_hub, installed with the runtime's uv, reinstalled when the pin changes, removed on destroy."""
    m, rt = stack.model, stack.runtime
    uv = f"{paths.uv_dir(rt.uv_version)}/uv"
    index = (f"--find-links {shlex.quote(rt.find_links)} --no-index" if rt.find_links
             else f"--index-url {shlex.quote(rt.index_url)}")
    pin = shlex.quote(m.hf_hub_version)
    env = paths.HF_ENV
    have = f"{env}/bin/python -c 'import importlib.metadata as m; print(m.version(\"huggingface_hub\"))' 2>/dev/null || true"
    create = (
        f"have=$({have}); if [ \"$have\" = {pin} ]; then echo \"hf CLI: huggingface_hub $have\"; else "
        f"{{ [ -x {env}/bin/python ] || {uv} venv --quiet --python /usr/bin/python3 {env}; }} && "
        f"{uv} pip install --quiet --python {env}/bin/python {index} "
        f"{shlex.quote('huggingface_hub[hf_xet]==' + m.hf_hub_version)} && "
        f"echo \"hf CLI: installed huggingface_hub {m.hf_hub_version} into {env}\"; fi"
    )
    delete = f"rm -rf {env} && {{ rmdir {paths.OPT} 2>/dev/null || true; }}"
    return Step("weights-hf-cli", create, delete)


def instance_steps(stack: StackConfig, inst: Instance) -> list[Step]:
    """A vLLM instance: its unit; "service" starts it (and only starts it) so a first deploy starts
    every instance at once; "rollout" is a no-op when created and restarts the unit when the unit or
    what it reads changes, one instance of a pool at a time; "stop" stops it on destroy (its own
    step, so destroy can order router → decode → prefill)."""
    unit = render.vllm_unit(stack, inst)
    stem = inst.unit.removesuffix(".service")
    timeout = f"{render.SERVICE_START_TIMEOUT_S + 120}s"
    service = ScriptStep(stem, render.vllm_service_script(stack, inst), action="start").step(
        f"{inst.name}-service", timeout=timeout)
    script = paths.script(stem)
    return [
        file_step(f"{inst.name}-unit", paths.unit(inst.unit), unit),
        service,
        # Restarts only when its triggers changed since the instance last (re)started: a step re-run
        # for another reason (a new SSH key changes every step's connection) leaves it running.
        Step(f"{inst.name}-rollout", f"{script} record {TRIGGERS_TOKEN}", update=f"{script} rollout {TRIGGERS_TOKEN}",
             triggers=(digest(unit), digest(render.ucx_env(stack, inst.host)), stack.model.revision,
                       digest(stack.runtime.vllm_version, stack.runtime.nixl_version, stack.runtime.venv)),
             timeout=timeout),
        Step(f"{inst.name}-stop", f"echo {stem} stops on destroy",
             delete=f"if [ -x {script} ]; then {script} remove; fi"),
    ]


def prune_step(stack: StackConfig) -> Step:
    m = stack.model
    return Step("prune-weights", command(paths.WEIGHTS, "prune", "--revision", m.revision, "--path", m.path),
                triggers=(m.revision,))


def router_steps(stack: StackConfig, plan: Plan, secrets: Mapping[str, str]) -> list[Step]:
    assert plan.router is not None and stack.router is not None
    r, rt = plan.router, stack.runtime
    unit = render.router_unit(stack, plan)
    front_conf = render.router_front_conf(stack, plan)
    stem = r.unit.removesuffix(".service")
    service = ScriptStep(stem, render.router_service_script(stack, plan), action=f"rollout {TRIGGERS_TOKEN}").step(
        "router-service")
    # vllm-router is its own wheel in the shared venv: a new vllm pin leaves its files alone.
    service = Step(**{**service.__dict__, "triggers": (digest(unit), digest(rt.router_version, rt.venv))})
    tls = ScriptStep("router-front-tls", render.router_front_tls_script(stack, plan)).step("router-front-tls")
    front = ScriptStep("router-front", render.router_front_script(stack, plan)).step("router-front")
    # nginx reads the certificate when it (re)loads: a new one (other names, the stack's own) reloads it.
    front = Step(**{**front.__dict__, "triggers": (digest(front_conf), digest(tls.stdin or ""))})
    given = [file_step("router-front-tls-given", paths.FRONT_TLS_GIVEN, render.router_front_tls_given(secrets),
                       0o600, True, "router_front_tls_given")] if not render.tls_generated(stack) else []
    return [
        file_step("router-secrets", paths.ROUTER_SECRETS, render.router_secrets_env(secrets), 0o600, True,
                  "router_secrets_env"),
        file_step("router-unit", paths.unit(r.unit), unit),
        service,
        file_step("router-front-conf", paths.FRONT_CONF, front_conf),
        file_step("router-front-keys", paths.FRONT_KEYS, render.router_front_keys(secrets), 0o600, True,
                  "router_front_keys"),
        *given,
        tls,
        front,
    ]


def host_steps(stack: StackConfig, plan: Plan, h: HostPlan, secrets: Mapping[str, str] | None = None, *,
               stack_name: str) -> HostSteps:
    """Every step of one host. ``stack_name`` labels its metrics (unless the stack sets monitoring.stackLabel)."""
    if secrets is None:
        secrets = render.placeholders(stack)
    steps: list[Step] = [preflight_step(stack, h), *host_file_steps(stack, plan, h, secrets)]
    wall = firewall.step(stack, plan, h)
    if h.provisioned:
        around = driver_steps(stack, h)
        around += [wall] if wall else []  # after the driver step: it adds the repository nftables may come from
        around.append(health_gate_step(stack, h))
        around.append(ScriptStep("rdma", render.rdma_script(stack, h.name)).step("rdma", timeout="20m"))
        around.append(file_step("ucx-env", paths.UCX_ENV, render.ucx_env(stack, h.name)))
        before, after = roll_steps(stack, plan, h, stack_name, around)
        steps += [*before, *around, *after]
        steps.append(facts_step(stack, h))
    elif wall:
        steps.append(wall)
    if h.instances or h.runs_router or h.runtime:
        steps.append(ScriptStep("runtime", render.runtime_script(stack, h.name)).step("runtime", timeout="60m"))
    if h.provisioned and seed_host(stack, plan.serve) is not None:
        steps += weights_steps(stack, plan, h)
    for inst in h.instances:
        steps += instance_steps(stack, inst)
    if h.instances and stack.model.source != "local":
        steps.append(prune_step(stack))
    if h.runs_router:
        steps += router_steps(stack, plan, secrets)
    steps += monitoring.host_steps(stack, plan, h, stack_name, secrets)
    return HostSteps(h, {s.name: s for s in steps})


def plan_all(stack: StackConfig, plan: Plan, secrets: Mapping[str, str] | None = None, *,
             stack_name: str) -> dict[str, HostSteps]:
    return {h.name: host_steps(stack, plan, h, secrets, stack_name=stack_name) for h in plan.hosts}


# --- the review tree -----------------------------------------------------------------------------

STEPS_DIR = "_steps"  # beside the host's files in the review tree


def step_text(index: int, host: str, step: Step) -> str:
    """One step as the review tree shows it: where it runs, its commands, what triggers it."""
    where = "the machine running pulumi" if step.local else host
    lines = [f"# {host} step {index:02d}: {step.name} (runs on {where})"]
    if step.triggers:
        lines.append(f"# re-runs when any of these change: {', '.join(step.triggers)}")
    if step.timeout:
        lines.append(f"# timeout: {step.timeout}")
    if step.retain:
        lines.append("# kept on destroy")
    if step.stdin is not None:
        written = [f.path for f in step.files if f.content == step.stdin]
        lines.append(f"# stdin: {written[0] if written else f'{index:02d}-{step.name}.stdin'}")
    lines += ["# create:", step.create]
    if step.update is not None and step.update != step.create:
        lines += ["# update:", step.update]
    if step.delete_command is not None:
        lines += ["# delete:", step.delete_command]
    if step.check is not None:
        lines += ["# check:", step.check]
    return "\n".join(lines) + "\n"


def tree(all_steps: Mapping[str, HostSteps]) -> dict[str, RenderedFile]:
    """The review tree: ``<host>/<absolute path>`` for every file, ``<host>/_steps/NN-<step>.sh`` for
    every step (and ``.stdin`` for what a step reads that is no file on the host)."""
    out: dict[str, RenderedFile] = {}
    for host, hs in all_steps.items():
        for path, f in hs.files().items():
            out[f"{host}{path}"] = f
        for i, step in enumerate(hs.steps.values(), 1):
            out[f"{host}/{STEPS_DIR}/{i:02d}-{step.name}.sh"] = RenderedFile("", step_text(i, host, step))
            if step.stdin is not None and not any(f.content == step.stdin for f in step.files):
                out[f"{host}/{STEPS_DIR}/{i:02d}-{step.name}.stdin"] = RenderedFile("", step.stdin)
    return out


def write_tree(out_dir: Path, all_steps: Mapping[str, HostSteps]) -> list[Path]:
    written = []
    for rel, f in sorted(tree(all_steps).items()):
        target = out_dir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(f.content)
        target.chmod(f.mode if f.path else 0o644)
        written.append(target)
    return written
