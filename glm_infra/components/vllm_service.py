"""One vLLM instance: its systemd unit, started and gated on ``/health``, restarted one instance of a
pool at a time, stopped in order on destroy. The steps come from the per-host plan
(vllm.instance_steps)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pulumi
import pulumi_command.remote as remote

from glm_infra.steps import Step

from .remote_step import inherited, run_step


@dataclass
class VllmServiceArgs:
    instance: str
    """Instance name (prefill-0)."""
    connection: remote.ConnectionArgs
    """SSH connection to its host."""
    steps: Mapping[str, Step]
    """Its steps: <instance>-unit, -service (start and gate on /health), -rollout (restart on change),
    -stop (on destroy)."""
    health_url: pulumi.Input[str]
    """URL that answers 200 once the instance serves (a stack output)."""
    restart_triggers: Sequence[pulumi.Input[str]] = field(default_factory=list)
    """Values besides the plan's whose change restarts the instance (its secrets file)."""
    stop_after: Sequence[pulumi.Resource] = field(default_factory=list)
    """On destroy, stop this instance before these (their ``stopper``): decode before prefill."""
    rollout_after: Sequence[pulumi.Resource] = field(default_factory=list)
    """Restart only after these have (the previous instance's ``rollout``): one at a time."""
    live: Mapping[str, pulumi.Output[Step]] = field(default_factory=dict)
    """The steps as resolved at deploy time (the unit names the instance's address)."""


class VllmService(pulumi.ComponentResource):
    def __init__(self, name: str, args: VllmServiceArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("glm-infra:index:VllmService", name, None, opts)
        i, s, live = args.instance, args.steps, args.live
        self.unit_file = run_step(f"{name}-unit", s[f"{i}-unit"], args.connection, self, live=live.get(f"{i}-unit"),
                                  depends_on=inherited(opts))
        # Two steps, so a first deploy starts every instance at once while a change restarts them
        # one at a time: "service" only starts the unit; "rollout" restarts it when the unit or
        # what it reads changes, after the previous instance's rollout.
        self.service = run_step(f"{name}-service", s[f"{i}-service"], args.connection, self,
                                live=live.get(f"{i}-service"), depends_on=[self.unit_file, *inherited(opts)])
        self.rollout = run_step(f"{name}-rollout", s[f"{i}-rollout"], args.connection, self,
                                live=live.get(f"{i}-rollout"), triggers=list(args.restart_triggers),
                                depends_on=[self.service, *args.rollout_after])
        # Stopping is its own resource, so destroy can order it (router, then decode, then prefill)
        # without making the instances start one after another. Not on the rollout: its chain through
        # the whole pool would make every dependency check on a stopper walk that chain.
        self.stopper = run_step(f"{name}-stop", s[f"{i}-stop"], args.connection, self, live=live.get(f"{i}-stop"),
                                depends_on=[self.service, *args.stop_after])
        self.health_url = pulumi.Output.from_input(args.health_url)
        self.register_outputs({"healthUrl": self.health_url})
