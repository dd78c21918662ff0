"""The health gate of a host: every GPU visible, NVLink fabric Completed, links up, no pending row
remap. Nothing is served from a host that fails it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pulumi
import pulumi_command.remote as remote

from ..render import render_template
from ..steps import ScriptStep
from .host import HOSTCHECK
from .remote_step import inherited, run_step


@dataclass
class FabricArgs:
    host: str
    """Host name."""
    connection: remote.ConnectionArgs
    """SSH connection."""
    gpus: int
    """GPUs the host must show."""
    gpu_model: str
    """GPU model the host must show."""
    driver_version: str
    """Driver version every GPU must run."""
    fabric: bool = True
    """Require fabric state Completed and NVLink up (NVSwitch systems)."""
    dcgm_diag_level: int = 0
    """Also run `dcgmi diag -r N` (0: skip)."""
    timeout_s: int = 600
    """How long the fabric may take to reach Completed."""
    triggers: Sequence[pulumi.Input[str]] = field(default_factory=list)
    """Values whose change re-runs the gate (the driver step's result)."""


class Fabric(pulumi.ComponentResource):
    gate: remote.Command

    def __init__(self, name: str, args: FabricArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("glm-infra:index:Fabric", name, None, opts)
        script = render_template(
            "fabric.sh.j2",
            host=args.host,
            hostcheck=HOSTCHECK,
            gpus=args.gpus,
            gpu_model=args.gpu_model,
            driver=args.driver_version,
            fabric=args.fabric,
            dcgm_level=args.dcgm_diag_level,
            timeout_s=args.timeout_s,
        )
        self.gate = run_step(
            f"{name}-gate",
            ScriptStep("health-gate", script, removable=False).step(),
            args.connection,
            self,
            triggers=list(args.triggers),
            depends_on=inherited(opts),
            timeout=f"{args.timeout_s + 120}s",
        )
        self.register_outputs({"health": self.gate.stdout})
