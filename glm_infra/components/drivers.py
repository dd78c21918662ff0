"""NVIDIA driver, fabric manager and tools: installed, pinned and held (or verified), then a reboot
only when the kernel module changed, waiting for the host to come back."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_command.local as local
import pulumi_command.remote as remote

from ..config import DriversConfig
from ..render import render_template
from ..steps import ScriptStep, Step
from .remote_step import inherited, run_step


@dataclass
class DriversArgs:
    host: str
    """Host name."""
    address: str
    """Host address (the wait for a reboot watches its SSH port)."""
    ssh_port: int
    """SSH port."""
    connection: remote.ConnectionArgs
    """SSH connection."""
    drivers: DriversConfig
    """Driver settings of the stack."""


class Drivers(pulumi.ComponentResource):
    ready: remote.Command
    """The last step: the host runs the pinned driver (after a reboot if one was needed)."""

    def __init__(self, name: str, args: DriversArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("glm-infra:index:Drivers", name, None, opts)
        d = args.drivers
        script = render_template("drivers.sh.j2", host=args.host, d=d)
        install = run_step(f"{name}-install", ScriptStep("drivers", script).step(), args.connection, self,
                           depends_on=inherited(opts), timeout="30m")
        reboot_script = render_template("reboot.sh.j2", host=args.host)
        reboot = run_step(
            f"{name}-reboot",
            Step("reboot", "bash -s", None, reboot_script),
            args.connection,
            self,
            triggers=[install.stdout],
            depends_on=[install],
        )
        wait_script = render_template(
            "waitboot.sh.j2", host=args.host, address=args.address, port=args.ssh_port, timeout_s=d.reboot_timeout
        )
        wait = local.Command(
            f"{name}-wait",
            create="bash -s",
            update="bash -s",
            stdin=wait_script,
            environment={"REBOOT_STATUS": reboot.stdout},
            triggers=[reboot.stdout],
            add_previous_output_in_env=False,
            opts=pulumi.ResourceOptions(
                parent=self,
                depends_on=[reboot],
                custom_timeouts=pulumi.CustomTimeouts(create=f"{d.reboot_timeout + 180}s", update=f"{d.reboot_timeout + 180}s"),
            ),
        )
        # Back on a new boot: the boot id differs from the one the reboot step left.
        back_cmd = reboot.stdout.apply(_back_command)
        self.ready = remote.Command(
            f"{name}-back",
            connection=args.connection,
            create=back_cmd,
            update=back_cmd,
            triggers=[wait.stdout],
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
