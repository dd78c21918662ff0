"""RDMA networking for NIXL: DOCA-OFED or inbox rdma-core, GPUDirect mode, MTU, memlock, and a
check that every compute NIC is active with the right link layer, MTU and RoCE GID."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_command.remote as remote

from ..steps import ScriptStep
from .remote_step import inherited, run_step


@dataclass
class RdmaArgs:
    connection: remote.ConnectionArgs
    """SSH connection."""
    script: str
    """Rendered rdma.sh (install, GPUDirect, MTU, memlock, then check the compute NICs)."""


class Rdma(pulumi.ComponentResource):
    setup: remote.Command

    def __init__(self, name: str, args: RdmaArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("glm-infra:index:Rdma", name, None, opts)
        self.setup = run_step(f"{name}-setup", ScriptStep("rdma", args.script).step(), args.connection, self,
                              depends_on=inherited(opts), timeout="20m")
        self.register_outputs({"rdma": self.setup.stdout})
