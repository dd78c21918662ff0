"""The health gate of a host: every GPU visible, NVLink fabric Completed, links up, no pending row
remap. Nothing is served from a host that fails it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pulumi
import pulumi_command.remote as remote

from ..steps import ScriptStep
from .remote_step import inherited, run_step


@dataclass
class FabricArgs:
    connection: remote.ConnectionArgs
    """SSH connection."""
    script: str
    """Rendered health-gate script (waits for the fabric, then checks GPUs, NVLink, row remaps)."""
    timeout_s: int = 600
    """How long the gate may wait for the fabric."""
    triggers: Sequence[pulumi.Input[str]] = field(default_factory=list)
    """Values whose change re-runs the gate (the driver step's result)."""


class Fabric(pulumi.ComponentResource):
    gate: remote.Command

    def __init__(self, name: str, args: FabricArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("glm-infra:index:Fabric", name, None, opts)
        self.gate = run_step(
            f"{name}-gate",
            ScriptStep("health-gate", args.script, removable=False).step(),
            args.connection,
            self,
            triggers=list(args.triggers),
            depends_on=inherited(opts),
            timeout=f"{args.timeout_s + 120}s",
        )
        self.register_outputs({"health": self.gate.stdout})
