"""One vLLM instance: its systemd unit, started and gated on ``/health``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pulumi
import pulumi_command.remote as remote

from ..render import render_template
from ..steps import ScriptStep, digest, file_step
from .remote_step import inherited, run_step


@dataclass
class VllmServiceArgs:
    host: str
    """Host name the instance runs on."""
    connection: remote.ConnectionArgs
    """SSH connection to that host."""
    unit_name: str
    """systemd unit name (glm-vllm-prefill-0.service)."""
    unit: str
    """Rendered unit file."""
    health_url: str
    """URL that answers 200 once the instance serves."""
    start_timeout_s: int = 3600
    """How long to wait for /health after a (re)start."""
    drain_s: int = 300
    """--shutdown-timeout of the instance (for messages)."""
    restart_triggers: Sequence[pulumi.Input[str]] = field(default_factory=list)
    """Values whose change restarts the instance (env files, weights revision, runtime pins)."""


class VllmService(pulumi.ComponentResource):
    def __init__(self, name: str, args: VllmServiceArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("glm-infra:index:VllmService", name, None, opts)
        unit_path = f"/etc/systemd/system/{args.unit_name}"
        unit_file = run_step(
            f"{name}-unit", file_step("unit", unit_path, args.unit), args.connection, self, depends_on=inherited(opts)
        )
        script = render_template(
            "service.sh.j2",
            host=args.host,
            unit=args.unit_name,
            health_url=args.health_url,
            timeout_s=args.start_timeout_s,
            drain_s=args.drain_s,
        )
        svc = ScriptStep(args.unit_name.removesuffix(".service"), script).step()
        self.service = run_step(
            f"{name}-service",
            svc,
            args.connection,
            self,
            triggers=[digest(args.unit), *args.restart_triggers],
            depends_on=[unit_file, *inherited(opts)],
            timeout=f"{args.start_timeout_s + 120}s",
        )
        self.unit_file = unit_file
        self.health_url = pulumi.Output.from_input(args.health_url)
        self.register_outputs({"healthUrl": self.health_url, "unit": args.unit_name})
