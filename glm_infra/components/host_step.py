"""One provisioning step of a host as its own component: the health gate, RDMA, the NIXL/UCX
environment file, the Python runtime — each a script or file step of the per-host plan."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pulumi
import pulumi_command.remote as remote

from glm_infra.steps import Step

from .remote_step import inherited, run_step


@dataclass
class HostStepArgs:
    connection: remote.ConnectionArgs
    """SSH connection."""
    step: Step
    """The step (hostplan: health-gate, rdma, ucx-env, runtime, …)."""
    command_name: str = "run"
    """Suffix of the command resource's name."""
    triggers: Sequence[pulumi.Input[str]] = field(default_factory=list)
    """Values besides the step's own whose change re-runs it (another step's output)."""
    live: pulumi.Output[Step] | None = None
    """The step as resolved at deploy time, when it depends on values other resources produce."""


class HostStep(pulumi.ComponentResource):
    """``glm-infra:index:HostStep``: one step of the per-host plan; ``command.stdout`` is what it said."""

    command: remote.Command

    def __init__(self, name: str, args: HostStepArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("glm-infra:index:HostStep", name, None, opts)
        self.command = run_step(f"{name}-{args.command_name}", args.step, args.connection, self, live=args.live,
                                triggers=args.triggers, depends_on=inherited(opts))
        self.register_outputs({"output": self.command.stdout})
