"""The Python runtime of the services: a system user, uv, and a venv with the pinned vllm, nixl and
vllm-router, reinstalled only when a pin changes."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_command.remote as remote

from ..steps import ScriptStep
from .remote_step import inherited, run_step


@dataclass
class RuntimeArgs:
    connection: remote.ConnectionArgs
    """SSH connection."""
    script: str
    """Rendered runtime.sh (user, uv, venv with the pins)."""


class Runtime(pulumi.ComponentResource):
    venv: remote.Command

    def __init__(self, name: str, args: RuntimeArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("glm-infra:index:Runtime", name, None, opts)
        self.venv = run_step(f"{name}-venv", ScriptStep("runtime", args.script).step(), args.connection, self,
                             depends_on=inherited(opts), timeout="60m")
        self.register_outputs({"runtime": self.venv.stdout})
