"""NVIDIA driver, fabric manager and tools: installed, pinned and held (or verified), then a reboot
only when the kernel module changed, waiting for the host to come back."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import pulumi
import pulumi_command.remote as remote

from glm_infra.steps import Step

from .remote_step import inherited, run_step


@dataclass
class DriversArgs:
    connection: remote.ConnectionArgs
    """SSH connection."""
    steps: Mapping[str, Step]
    """hostplan's drivers-install (drivers.sh), drivers-reboot (reboot.sh), drivers-wait (waitboot.sh,
    on the machine running pulumi) and drivers-back (the boot id changed) steps."""
    live: Mapping[str, pulumi.Output[Step]] = field(default_factory=dict)
    """The same steps as resolved at deploy time, when they depend on values other resources produce."""


class Drivers(pulumi.ComponentResource):
    ready: remote.Command
    """The last step: the host runs the pinned driver (after a reboot if one was needed)."""

    def __init__(self, name: str, args: DriversArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("glm-infra:index:Drivers", name, None, opts)
        s, live = args.steps, args.live
        install = run_step(f"{name}-install", s["drivers-install"], args.connection, self,
                           live=live.get("drivers-install"), depends_on=inherited(opts))
        reboot = run_step(f"{name}-reboot", s["drivers-reboot"], args.connection, self,
                          live=live.get("drivers-reboot"), triggers=[install.stdout], depends_on=[install])
        wait = run_step(f"{name}-wait", s["drivers-wait"], None, self, live=live.get("drivers-wait"),
                        triggers=[reboot.stdout], depends_on=[reboot], environment={"REBOOT_STATUS": reboot.stdout})
        # Back on a new boot: the boot id differs from the one the reboot step left.
        self.ready = run_step(f"{name}-back", s["drivers-back"], args.connection, self, live=live.get("drivers-back"),
                              triggers=[reboot.stdout], depends_on=[wait])
        self.register_outputs({"installed": install.stdout})
