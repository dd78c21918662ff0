"""One vLLM instance: its systemd unit, started and gated on ``/health``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pulumi
import pulumi_command.remote as remote

from ..render import unit_stem
from ..steps import LIBEXEC, ScriptStep, Step, digest, file_step
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
    script: str
    """Rendered service.sh: (re)start the unit and wait for /health."""
    health_url: str
    """URL that answers 200 once the instance serves (a stack output)."""
    start_timeout_s: int = 3600
    """How long the script waits for /health (the step's timeout adds a margin)."""
    restart_triggers: Sequence[pulumi.Input[str]] = field(default_factory=list)
    """Values whose change restarts the instance (env files, weights revision, runtime pins)."""
    stop_after: Sequence[pulumi.Resource] = field(default_factory=list)
    """On destroy, stop this instance before these (their ``stopper``): decode before prefill."""
    rollout_after: Sequence[pulumi.Resource] = field(default_factory=list)
    """Restart only after these have (the previous instance's ``rollout``): one at a time."""


class VllmService(pulumi.ComponentResource):
    def __init__(self, name: str, args: VllmServiceArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("glm-infra:index:VllmService", name, None, opts)
        unit_path = f"/etc/systemd/system/{args.unit_name}"
        unit_file = run_step(
            f"{name}-unit", file_step("unit", unit_path, args.unit), args.connection, self, depends_on=inherited(opts)
        )
        # Two steps, so a first deploy starts every instance at once while a change restarts them
        # one at a time: "service" starts the unit (and only starts it); "rollout" is a no-op when
        # created and restarts the unit when the unit or what it reads changes, after the previous
        # instance's rollout.
        svc = ScriptStep(unit_stem(args.unit_name), args.script, action="start").step()
        timeout = f"{args.start_timeout_s + 120}s"
        self.service = run_step(f"{name}-service", svc, args.connection, self,
                                depends_on=[unit_file, *inherited(opts)], timeout=timeout)
        script_path = f"{LIBEXEC}/{svc.name}.sh"
        rollout = Step("rollout", f"echo {svc.name} started by {name}-service", update=f"{script_path} apply")
        self.rollout = run_step(
            f"{name}-rollout",
            rollout,
            args.connection,
            self,
            triggers=[digest(args.unit), *args.restart_triggers],
            depends_on=[self.service, *args.rollout_after],
            timeout=timeout,
        )
        # Stopping is its own resource, so destroy can order it (router, then decode, then prefill)
        # without making the instances start one after another.
        self.stopper = remote.Command(
            f"{name}-stop",
            connection=args.connection,
            create=f"echo {svc.name} stops on destroy",
            delete=f"if [ -x {LIBEXEC}/{svc.name}.sh ]; then {LIBEXEC}/{svc.name}.sh remove; fi",
            add_previous_output_in_env=False,
            # Not on the rollout: its chain through the whole pool would make every dependency check
            # on a stopper walk that chain (Pulumi looks for cycles on each declared dependency).
            opts=pulumi.ResourceOptions(parent=self, depends_on=[self.service, *args.stop_after]),
        )
        self.unit_file = unit_file
        self.health_url = pulumi.Output.from_input(args.health_url)
        self.register_outputs({"healthUrl": self.health_url, "unit": args.unit_name})
