"""RDMA networking for NIXL: DOCA-OFED or inbox rdma-core, GPUDirect mode, MTU, memlock, and a
check that every compute NIC is active with the right link layer, MTU and RoCE GID."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_command.remote as remote

from ..config import RdmaConfig
from ..render import render_template
from ..steps import ScriptStep
from .host import HOSTCHECK
from .remote_step import inherited, run_step


@dataclass
class RdmaArgs:
    host: str
    """Host name."""
    connection: remote.ConnectionArgs
    """SSH connection."""
    nics: list[str]
    """Compute NICs (never the NVSwitch-management ConnectX devices)."""
    rdma: RdmaConfig
    """RDMA settings of the stack."""


class Rdma(pulumi.ComponentResource):
    setup: remote.Command

    def __init__(self, name: str, args: RdmaArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("glm-infra:index:Rdma", name, None, opts)
        script = render_template("rdma.sh.j2", host=args.host, r=args.rdma, nics=args.nics, hostcheck=HOSTCHECK)
        self.setup = run_step(f"{name}-setup", ScriptStep("rdma", script).step(), args.connection, self,
                              depends_on=inherited(opts), timeout="20m")
        self.register_outputs({"rdma": self.setup.stdout})
