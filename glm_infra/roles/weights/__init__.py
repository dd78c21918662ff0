"""The checkpoint on the hosts: staged once from its source by the seed and relayed host to host
(agent/weights/), the hub's `hf` CLI and token, the old revision pruned once the instances moved on."""

from __future__ import annotations

import shlex
from collections.abc import Mapping

from glm_infra import render
from glm_infra.plan import startup, topology
from glm_infra.plan.topology import HostPlan, Plan, seed_host
from glm_infra.render import render_template
from glm_infra.spec import paths
from glm_infra.spec.config import StackConfig
from glm_infra.steps import RenderedFile, Step, command, digest


def hf_secrets_env(secrets: Mapping[str, str]) -> str:
    return render_template("hf-secrets.env.j2", secrets=secrets)


def relay_secrets_env(secrets: Mapping[str, str]) -> str:
    return render_template("relay-secrets.env.j2", secrets=secrets)


def relays_on(stack: StackConfig, plan: Plan, h: HostPlan) -> bool:
    """Whether ``h`` sends or takes anything from another host through a relay (the checkpoint's, a pool's
    warm-start caches'): then it holds the stack's relay key (paths.RELAY_KEY), and signs and checks with it."""
    staged = h.provisioned and stack.model.source != "local" and seed_host(stack, plan.serve) is not None
    tree = topology.weights_relay(stack, plan.serve) if staged else {}
    if len(tree) > 1 and h.name in tree:
        return True
    return bool(h.instances) and any(h.name in pool for pool in startup.warm_cache_relays(stack).values())


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
        if relay.children or relay.parent is not None:  # signed requests and answers, nothing taken unsigned
            argv += ["--relay-key-file", paths.RELAY_KEY]
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


def prune_step(stack: StackConfig) -> Step:
    m = stack.model
    return Step("prune-weights", command(paths.WEIGHTS, "prune", "--revision", m.revision, "--path", m.path),
                triggers=(m.revision,))
