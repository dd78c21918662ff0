"""The model weights on every serving host: read once from the source by a seed host and relayed down
a tree of hosts (``topology.weights_relay``: each host copies from its parent as files are verified
there and serves its own children while it stages, failing over to its ancestors), verified
everywhere, switched atomically per revision, kept on destroy unless the stack says otherwise. Each
host's weights-stage step is the whole of it on that host: its relay server lives inside the step and
stops once its children have every file. The steps come from the per-host plan (weights.weights_steps)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pulumi
import pulumi_command.remote as remote

from glm_infra.plan import topology
from glm_infra.steps import Step

from .remote_step import run_step


@dataclass
class WeightsHost:
    name: str
    """Host name."""
    connection: remote.ConnectionArgs
    """SSH connection."""
    steps: Mapping[str, Step]
    """This host's weights steps (weights-stage; on the seed from the hub also weights-hf-cli)."""
    after: Sequence[pulumi.Resource] = field(default_factory=list)
    """What must be in place on this host first (its runtime, the token file)."""
    live: Mapping[str, pulumi.Output[Step]] = field(default_factory=dict)
    """The steps as resolved at deploy time (the peers' commands name their parents' addresses)."""
    children: Sequence[str] = ()
    """The hosts that copy from this one (its relay children)."""


@dataclass
class ModelWeightsArgs:
    hosts: Sequence[WeightsHost]
    """Every host that gets the checkpoint."""


class ModelWeights(pulumi.ComponentResource):
    staged: dict[str, remote.Command]

    def __init__(self, name: str, args: ModelWeightsArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("glm-infra:index:ModelWeights", name, None, opts)
        by_name = {h.name: h for h in args.hosts}
        before_stage: dict[str, list[pulumi.Resource]] = {h.name: list(h.after) for h in args.hosts}
        for h in args.hosts:
            if "weights-hf-cli" in h.steps:
                before_stage[h.name].append(run_step(
                    f"{name}-{h.name}-hf-cli", h.steps["weights-hf-cli"], h.connection, self,
                    live=h.live.get("weights-hf-cli"), depends_on=list(h.after)))
        self.staged = {}
        for h in args.hosts:
            # A host stages once every host below it in the tree can stage too: it serves them from its
            # first file on, and none of them waits for a parent that has not started.
            below: list[pulumi.Resource] = []
            todo = list(h.children)
            while todo:
                c = by_name.get(todo.pop())
                if c is not None:
                    below += before_stage[c.name]
                    todo += c.children
            self.staged[h.name] = run_step(
                f"{name}-{h.name}-stage", h.steps["weights-stage"], h.connection, self,
                live=h.live.get("weights-stage"), depends_on=[*before_stage[h.name], *below])
        self.register_outputs({"hosts": sorted(self.staged)})


def stage_weights(deployment, name: str, chains: dict) -> ModelWeights | None:
    """The ModelWeights of a Cluster or Hosts (``deployment``) over its hosts that stage the checkpoint;
    each host's chain then waits for its staging."""
    d = deployment
    staging = [h for h in d.plan.hosts if "weights-stage" in d.steps[h.name].steps and d.mine(h.name)]
    if not staging:
        return None
    relay = topology.weights_relay(d.stack, d.plan.serve)
    weights = ModelWeights(
        f"{name}-weights",
        ModelWeightsArgs([
            WeightsHost(h.name, chains[h.name].host.connection, d.steps[h.name].only("weights-"),
                        chains[h.name].ready, d.lives(h.name, d.steps[h.name].only("weights-")),
                        relay[h.name].children if h.name in relay else ())
            for h in staging
        ]),
        pulumi.ResourceOptions(parent=d),
    )
    for h in staging:
        chains[h.name].ready = [*chains[h.name].ready, weights.staged[h.name]]
    return weights
