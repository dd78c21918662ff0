"""The model weights on every serving host: downloaded once by a seed host, fanned out to the
others while it downloads, verified everywhere, switched atomically per revision, kept on destroy
unless the stack says otherwise."""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pulumi
import pulumi_command.remote as remote

from ..config import ModelConfig, RuntimeConfig
from ..render import HF_SECRETS, WEIGHTS, weights_source
from ..steps import Step, digest
from .remote_step import run_step


@dataclass
class WeightsHost:
    name: str
    """Host name."""
    address: str
    """Address the other hosts reach it on."""
    connection: remote.ConnectionArgs
    """SSH connection."""
    after: Sequence[pulumi.Resource] = field(default_factory=list)
    """What must be in place on this host first (its runtime, the token file)."""


@dataclass
class ModelWeightsArgs:
    model: ModelConfig
    """The checkpoint, its source and where it goes."""
    runtime: RuntimeConfig
    """The runtime (its uv installs the hf CLI for the huggingface source)."""
    hosts: Sequence[WeightsHost]
    """Every host that serves the model."""
    seed: str
    """The host that downloads from the source."""


def _q(args: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in args)


def stage_commands(a: ModelWeightsArgs) -> Mapping[str, str]:
    """Host name → the command that stages the checkpoint there (installing weights.py from stdin)."""
    m = a.model
    install = f"install -D -m 0755 /dev/stdin {WEIGHTS}"
    seed = next(h for h in a.hosts if h.name == a.seed)
    base = [WEIGHTS, "stage", "--revision", m.revision, "--path", m.path, "--margin-gb", f"{m.disk_margin_gb:g}"]
    out = {}
    for h in a.hosts:
        if m.source == "local":
            cmd = [WEIGHTS, "stage", "--source", "local", "--path", m.path]
        elif h.name == a.seed:
            cmd = base + ["--role", "seed", "--source", m.source]
            if m.source == "mirror":
                assert m.mirror_url is not None
                cmd += ["--url", m.mirror_url]
            else:
                cmd += ["--repo", m.repo, "--token-file", HF_SECRETS]
        else:
            cmd = base + ["--role", "peer", "--peer", f"http://{_url_host(seed.address)}:{m.fanout_port}"]
        out[h.name] = f"{install} && {_q(cmd)}"
    return out


HF_ENV = "/opt/glm-infra/hf"


def hf_cli_step(model: ModelConfig, runtime: RuntimeConfig) -> Step:
    """The ``hf`` CLI the seed downloads with (huggingface source): a venv with the pinned
    huggingface_hub, installed with the runtime's uv, reinstalled when the pin changes, removed on destroy."""
    uv = f"/opt/glm-infra/uv-{runtime.uv_version}/uv"
    index = (f"--find-links {shlex.quote(runtime.find_links)} --no-index" if runtime.find_links
             else f"--index-url {shlex.quote(runtime.index_url)}")
    pin = shlex.quote(model.hf_hub_version)
    have = (f"{HF_ENV}/bin/python -c 'import importlib.metadata as m; print(m.version(\"huggingface_hub\"))' "
            "2>/dev/null || true")
    create = (
        f"have=$({have}); if [ \"$have\" = {pin} ]; then echo \"hf CLI: huggingface_hub $have\"; else "
        f"{{ [ -x {HF_ENV}/bin/python ] || {uv} venv --quiet --python /usr/bin/python3 {HF_ENV}; }} && "
        f"{uv} pip install --quiet --python {HF_ENV}/bin/python {index} "
        f"{shlex.quote('huggingface_hub[hf_xet]==' + model.hf_hub_version)} && "
        f"echo \"hf CLI: installed huggingface_hub {model.hf_hub_version} into {HF_ENV}\"; fi"
    )
    delete = f"rm -rf {HF_ENV} && {{ rmdir /opt/glm-infra 2>/dev/null || true; }}"
    return Step("hf-cli", create, delete)


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


class ModelWeights(pulumi.ComponentResource):
    staged: dict[str, remote.Command]

    def __init__(self, name: str, args: ModelWeightsArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("glm-infra:index:ModelWeights", name, None, opts)
        m = args.model
        source = weights_source()
        # Re-staged when the checkpoint, its source or the set of hosts changes, or on request (verify).
        triggers = [m.repo, m.revision, m.source, m.mirror_url or "", m.path, m.verify,
                    digest(*sorted(h.name for h in args.hosts))]
        seed = next(h for h in args.hosts if h.name == args.seed)
        fanout: list[pulumi.Resource] = []
        if m.source != "local":
            bind = f"{seed.address}:{m.fanout_port}"
            start = Step(
                "fanout",
                f"install -D -m 0755 /dev/stdin {WEIGHTS} && "
                + _q([WEIGHTS, "fanout-start", "--revision", m.revision, "--path", m.path, "--bind", bind]),
                None,
                source,
                (digest(source),),
            )
            fanout = [run_step(f"{name}-{seed.name}-fanout", start, seed.connection, self, triggers=triggers,
                               depends_on=list(seed.after))]
        hf_cli: list[pulumi.Resource] = []
        if m.source == "huggingface":
            hf_cli = [run_step(f"{name}-{seed.name}-hf-cli", hf_cli_step(m, args.runtime), seed.connection, self,
                               depends_on=list(seed.after))]
        remove = None if not m.remove_on_destroy else _q([WEIGHTS, "remove", "--path", m.path])
        self.staged = {}
        for host, cmd in stage_commands(args).items():
            h = next(x for x in args.hosts if x.name == host)
            step = Step("stage", cmd, remove, source, (digest(source),))
            self.staged[host] = run_step(
                f"{name}-{host}-stage", step, h.connection, self, triggers=triggers,
                depends_on=[*h.after, *fanout, *(hf_cli if host == seed.name else [])], timeout="24h",
                retain_on_delete=not m.remove_on_destroy,
            )
        if fanout:
            stop = Step("fanout-stop", _q([WEIGHTS, "fanout-stop"]), None, None)
            run_step(f"{name}-{seed.name}-fanout-stop", stop, seed.connection, self, triggers=triggers,
                     depends_on=list(self.staged.values()))
        self.revision = pulumi.Output.from_input(m.revision)
        self.register_outputs({"revision": self.revision, "path": m.path})
