"""NVIDIA driver, fabric manager and tools: installed, pinned and held (or verified), then a reboot
only when the kernel module changed, waiting for the host to come back."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_command.local as local
import pulumi_command.remote as remote

from ..steps import ScriptStep, Step
from .remote_step import inherited, run_step, with_triggers


@dataclass
class DriversArgs:
    host: str
    """Host name."""
    connection: remote.ConnectionArgs
    """SSH connection."""
    script: str
    """Rendered drivers.sh (install or verify, pin, hold)."""
    reboot_script: str
    """Rendered reboot.sh (reboots only if the kernel module changed)."""
    wait_script: str
    """Rendered waitboot.sh, run on the machine running pulumi."""
    reboot_timeout: int = 1800
    """Seconds a host may take to come back."""


class Drivers(pulumi.ComponentResource):
    ready: remote.Command
    """The last step: the host runs the pinned driver (after a reboot if one was needed)."""

    def __init__(self, name: str, args: DriversArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("glm-infra:index:Drivers", name, None, opts)
        install = run_step(f"{name}-install", ScriptStep("drivers", args.script).step(), args.connection, self,
                           depends_on=inherited(opts), timeout="30m")
        reboot = run_step(
            f"{name}-reboot",
            Step("reboot", "bash -s", None, args.reboot_script),
            args.connection,
            self,
            triggers=[install.stdout],
            depends_on=[install],
        )
        timeout = f"{args.reboot_timeout + 180}s"
        wait_cmd = with_triggers("bash -s", [reboot.stdout])
        wait = local.Command(
            f"{name}-wait",
            create=wait_cmd,
            update=wait_cmd,
            stdin=args.wait_script,
            environment={"REBOOT_STATUS": reboot.stdout},
            add_previous_output_in_env=False,
            opts=pulumi.ResourceOptions(
                parent=self,
                depends_on=[reboot],
                custom_timeouts=pulumi.CustomTimeouts(create=timeout, update=timeout),
            ),
        )
        # Back on a new boot: the boot id differs from the one the reboot step left.
        back_cmd = reboot.stdout.apply(_back_command)
        self.ready = remote.Command(
            f"{name}-back",
            connection=args.connection,
            create=back_cmd,
            update=back_cmd,
            add_previous_output_in_env=False,
            opts=pulumi.ResourceOptions(parent=self, depends_on=[wait]),
        )
        self.register_outputs({"installed": install.stdout})


def _back_command(reboot_stdout: str | None) -> str:
    words = (reboot_stdout or "").split()
    if len(words) == 2 and words[0] == "reboot":
        old = words[1]
        return (
            f'now=$(cat /proc/sys/kernel/random/boot_id); if [ "$now" = {old} ]; then '
            f'echo "host did not reboot (boot {old})" >&2; exit 1; fi; echo "rebooted: boot $now"'
        )
    return "echo no reboot"
