"""The Python runtime of the services: a system user, uv, and a venv with the pinned vllm, nixl and
vllm-router, reinstalled only when a pin changes."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_command.remote as remote

from ..config import RuntimeConfig
from ..render import render_template
from ..steps import ScriptStep
from .remote_step import inherited, run_step


@dataclass
class RuntimeArgs:
    host: str
    """Host name."""
    connection: remote.ConnectionArgs
    """SSH connection."""
    runtime: RuntimeConfig
    """Runtime settings of the stack (user, venv, pins, package index)."""


class Runtime(pulumi.ComponentResource):
    venv: remote.Command

    def __init__(self, name: str, args: RuntimeArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("glm-infra:index:Runtime", name, None, opts)
        script = render_template("runtime.sh.j2", host=args.host, rt=args.runtime)
        self.venv = run_step(f"{name}-venv", ScriptStep("runtime", script).step(), args.connection, self,
                             depends_on=inherited(opts), timeout="60m")
        self.register_outputs({"venv": args.runtime.venv})
