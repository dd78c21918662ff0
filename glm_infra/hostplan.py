"""The per-host plan: every step that reaches each host, with its commands and the files it writes.

Pure and computed once. ``glm-infra render`` writes it out for review (``write_tree``) and the
components register exactly these steps, so what is reviewed is what deploys (a test checks that,
byte for byte, for every stack). Secret files hold placeholders here; the components fill in the
real values inside Pulumi (``Step.secret_render``).

Step keys per host, in the order the steps run:

    preflight, <host files: vllm-secrets, hf-secrets, relay-key>, turn-acquire (local), host-drain, drivers-install, drivers-reboot,
    drivers-wait (local), drivers-back, firewall, health-gate, rdma, nic-affinity, ucx-env, host-return, turn-release (local),
    facts, runtime, vllm-placement (what a re-laid-out pool moves off the host, before its instances start),
    canary-transition (the router's host: a change of identity marked before any instance restarts),
    weights-hf-cli (the seed, from the hub), weights-stage (serving the host's relay children while it runs),
    <instance>-unit, <instance>-service, <instance>-rollout, <instance>-stop,
    <pool>-warm-cache (a pool's warm-start caches, relayed from its first host), prune-weights,
    router-secrets, router-unit, router-service, router-front-conf, router-front-keys,
    router-front-tls-given (when the stack gives a certificate), router-front-tls, router-front,
    node-exporter, unit-memory, dcgm-exporter, prometheus, alertmanager-webhook, alertmanager  (monitoring)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from . import render
from .plan.topology import HostPlan, Plan, seed_host
from .roles import drivers, firewall, health_gate, monitoring, nixl, preflight, rdma, roll, router, runtime, vllm, weights
from .spec import paths
from .spec.config import StackConfig
from .steps import RenderedFile, Step, file_step

HOST_FILES = ("vllm-secrets", "hf-secrets", "relay-key")


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


def host_file_steps(stack: StackConfig, plan: Plan, h: HostPlan, secrets: Mapping[str, str]) -> list[Step]:
    out = []
    if h.instances:
        out.append(file_step("vllm-secrets", paths.VLLM_SECRETS, vllm.vllm_secrets_env(secrets), 0o600, True,
                             vllm.vllm_secrets_env))
    if h.name == seed_host(stack, plan.serve) and stack.model.source == "huggingface" and h.provisioned:
        out.append(file_step("hf-secrets", paths.HF_SECRETS, weights.hf_secrets_env(secrets), 0o600, True,
                             weights.hf_secrets_env))
    if weights.relays_on(stack, plan, h):
        out.append(file_step("relay-key", paths.RELAY_KEY, weights.relay_secrets_env(secrets), 0o600, True,
                             weights.relay_secrets_env))
    return out


def host_steps(stack: StackConfig, plan: Plan, h: HostPlan, secrets: Mapping[str, str] | None = None, *,
               stack_name: str) -> HostSteps:
    """Every step of one host. ``stack_name`` labels its metrics (unless the stack sets monitoring.stackLabel)."""
    if secrets is None:
        secrets = render.placeholders(stack)
    elif "relay_key" not in secrets:  # made by the stack, never given: shown by its placeholder
        secrets = {**secrets, "relay_key": render.placeholders(stack)["relay_key"]}
    steps: list[Step] = [preflight.preflight_step(stack, h), *host_file_steps(stack, plan, h, secrets)]
    wall = firewall.step(stack, plan, h)
    if h.provisioned:
        around = drivers.driver_steps(stack, h)
        around += [wall] if wall else []  # after the driver step: it adds the repository nftables may come from
        around.append(health_gate.health_gate_step(stack, h))
        around.append(rdma.rdma_step(stack, h))
        affinity = nixl.nic_affinity_step(stack, h)
        around += [affinity] if affinity else []
        around.append(nixl.ucx_env_step(stack, h))
        before, after = roll.roll_steps(stack, plan, h, stack_name, around)
        steps += [*before, *around, *after]
        steps.append(preflight.facts_step(stack, h))
    elif wall:
        steps.append(wall)
    if h.instances or h.runs_router or h.runtime:
        steps.append(runtime.runtime_step(stack, h))
    if h.provisioned and seed_host(stack, plan.serve) is not None:
        steps += weights.weights_steps(stack, plan, h)
    if h.instances or h.runs_router:
        steps.append(vllm.placement_step(h.name, h.instances))
    if h.runs_router:  # before any instance of the stack restarts (Cluster orders every rollout after it)
        steps.append(router.canary_transition_step(stack, plan, h.name))
    for inst in h.instances:
        steps += vllm.instance_steps(stack, inst)
    if h.instances:
        steps += vllm.warm_cache_steps(stack, h.name)
    if h.instances and stack.model.source != "local":
        steps.append(weights.prune_step(stack))
    if h.runs_router:
        steps += router.router_steps(stack, plan, secrets, h.name)
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
