"""NIXL / UCX settings of a host: the EnvironmentFile every vLLM instance reads (compute NICs,
transports, GID index). Per-instance side-channel host and port are in each unit."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_command.remote as remote

from ..render import UCX_ENV
from ..steps import file_step
from .remote_step import inherited, run_step


@dataclass
class NixlArgs:
    connection: remote.ConnectionArgs
    """SSH connection."""
    ucx_env: str
    """Rendered UCX EnvironmentFile."""


class Nixl(pulumi.ComponentResource):
    env_file: remote.Command

    def __init__(self, name: str, args: NixlArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("glm-infra:index:Nixl", name, None, opts)
        self.env_file = run_step(
            f"{name}-ucx-env", file_step("ucx-env", UCX_ENV, args.ucx_env), args.connection, self, depends_on=inherited(opts)
        )
        self.register_outputs({"path": UCX_ENV})
