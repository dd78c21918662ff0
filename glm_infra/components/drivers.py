"""NVIDIA driver, fabric manager and tools: installed, pinned and held (or verified), then a reboot
only when the kernel module changed, waiting for the host to come back."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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


def driver_steps(name: str, connection: remote.ConnectionArgs, steps: Mapping[str, Step], parent: pulumi.Resource, *,
                 live: Mapping[str, pulumi.Output[Step]] | None = None, after: Sequence[pulumi.Resource] = (),
                 moved_from: Sequence[pulumi.Input[str]] = ()) -> tuple[remote.Command, remote.Command]:
    """The driver steps of one host, ``{name}-install``, ``-reboot``, ``-wait`` and ``-back``, under ``parent``, after
    ``after``. Returns (install, back): what it installed, and the last step (the host runs the pinned driver).
    ``moved_from``: the parents these steps had before (run_step)."""
    live = live or {}

    def step(suffix: str, key: str, conn: remote.ConnectionArgs | None, **kw) -> remote.Command:
        return run_step(f"{name}-{suffix}", steps[key], conn, parent, live=live.get(key), moved_from=moved_from, **kw)

    install = step("install", "drivers-install", connection, depends_on=list(after))
    reboot = step("reboot", "drivers-reboot", connection, triggers=[install.stdout], depends_on=[install])
    wait = step("wait", "drivers-wait", None, triggers=[reboot.stdout], depends_on=[reboot],
                environment={"REBOOT_STATUS": reboot.stdout})
    # Back on a new boot: the boot id differs from the one the reboot step left.
    back = step("back", "drivers-back", connection, triggers=[reboot.stdout], depends_on=[wait])
    return install, back


class Drivers(pulumi.ComponentResource):
    """``glm-infra:index:Drivers``: the driver steps of one host as a component of their own (``Cluster`` and
    ``Hosts`` register the same steps, ``driver_steps``, directly under themselves)."""

    ready: remote.Command
    """The last step: the host runs the pinned driver (after a reboot if one was needed)."""

    def __init__(self, name: str, args: DriversArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("glm-infra:index:Drivers", name, None, opts)
        install, self.ready = driver_steps(name, args.connection, args.steps, self, live=args.live,
                                           after=inherited(opts))
        self.register_outputs({"installed": install.stdout})
