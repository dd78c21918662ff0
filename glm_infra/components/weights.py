"""The model weights on every serving host: downloaded once by a seed host, fanned out to the
others while it downloads, verified everywhere, switched atomically per revision, kept on destroy
unless the stack says otherwise. The steps come from the per-host plan (hostplan.weights_steps)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pulumi
import pulumi_command.remote as remote

from ..steps import Step
from .remote_step import run_step


@dataclass
class WeightsHost:
    name: str
    """Host name."""
    connection: remote.ConnectionArgs
    """SSH connection."""
    steps: Mapping[str, Step]
    """This host's weights steps (weights-stage; on the seed also weights-hf-cli, weights-fanout,
    weights-fanout-stop)."""
    after: Sequence[pulumi.Resource] = field(default_factory=list)
    """What must be in place on this host first (its runtime, the token file)."""
    live: Mapping[str, pulumi.Output[Step]] = field(default_factory=dict)
    """The steps as resolved at deploy time (the peers' commands name the seed's address)."""


@dataclass
class ModelWeightsArgs:
    hosts: Sequence[WeightsHost]
    """Every host that gets the checkpoint; the one with weights-fanout is the seed."""


class ModelWeights(pulumi.ComponentResource):
    staged: dict[str, remote.Command]

    def __init__(self, name: str, args: ModelWeightsArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("glm-infra:index:ModelWeights", name, None, opts)
        seeds = [h for h in args.hosts if "weights-fanout" in h.steps or "weights-hf-cli" in h.steps]
        before_stage: dict[str, list[pulumi.Resource]] = {h.name: list(h.after) for h in args.hosts}
        fanout: list[pulumi.Resource] = []
        for seed in seeds:
            if "weights-hf-cli" in seed.steps:
                before_stage[seed.name].append(run_step(
                    f"{name}-{seed.name}-hf-cli", seed.steps["weights-hf-cli"], seed.connection, self,
                    live=seed.live.get("weights-hf-cli"), depends_on=list(seed.after)))
            if "weights-fanout" in seed.steps:
                fanout.append(run_step(f"{name}-{seed.name}-fanout", seed.steps["weights-fanout"], seed.connection,
                                       self, live=seed.live.get("weights-fanout"), depends_on=list(seed.after)))
        self.staged = {}
        for h in args.hosts:
            self.staged[h.name] = run_step(
                f"{name}-{h.name}-stage", h.steps["weights-stage"], h.connection, self,
                live=h.live.get("weights-stage"), depends_on=[*before_stage[h.name], *fanout])
        for seed in seeds:
            if "weights-fanout-stop" in seed.steps:
                run_step(f"{name}-{seed.name}-fanout-stop", seed.steps["weights-fanout-stop"], seed.connection, self,
                         live=seed.live.get("weights-fanout-stop"), depends_on=list(self.staged.values()))
        self.register_outputs({"hosts": sorted(self.staged)})
