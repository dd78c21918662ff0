"""The P/D router (vllm-router) as a systemd unit in front of every instance."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pulumi
import pulumi_command.remote as remote

from ..render import unit_stem
from ..steps import ScriptStep, digest, file_step
from .remote_step import inherited, run_step


@dataclass
class RouterArgs:
    host: str
    """Host name the router runs on."""
    connection: remote.ConnectionArgs
    """SSH connection to that host."""
    unit_name: str
    """systemd unit name."""
    unit: str
    """Rendered unit file."""
    script: str
    """Rendered service.sh: (re)start the router and wait for /health."""
    url: str
    """Public URL of the router."""
    secrets_env: pulumi.Input[str]
    """Rendered secrets EnvironmentFile (a secret Output)."""
    secrets_path: str
    """Where the secrets file lives on the host."""
    restart_triggers: Sequence[pulumi.Input[str]] = field(default_factory=list)
    """Values whose change restarts the router."""


class Router(pulumi.ComponentResource):
    def __init__(self, name: str, args: RouterArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("glm-infra:index:Router", name, None, opts)
        secrets = run_step(
            f"{name}-secrets",
            file_step("secrets", args.secrets_path, "", mode=0o600, secret=True),
            args.connection,
            self,
            stdin=args.secrets_env,
            depends_on=inherited(opts),
        )
        unit_path = f"/etc/systemd/system/{args.unit_name}"
        unit_file = run_step(
            f"{name}-unit", file_step("unit", unit_path, args.unit), args.connection, self, depends_on=inherited(opts)
        )
        svc = ScriptStep(unit_stem(args.unit_name), args.script).step()
        self.service = run_step(
            f"{name}-service",
            svc,
            args.connection,
            self,
            triggers=[digest(args.unit), pulumi.Output.secret(args.secrets_env).apply(lambda s: digest(s)), *args.restart_triggers],
            depends_on=[unit_file, secrets, *inherited(opts)],
        )
        self.url = pulumi.Output.from_input(args.url)
        self.register_outputs({"url": self.url})
