"""The NVIDIA driver and fabric packages, pinned and held (drivers.sh), and the reboot a new kernel module
needs: reboot, wait for the host on the machine running pulumi, back."""

from __future__ import annotations

from glm_infra.plan.topology import HostPlan
from glm_infra.render import render_template
from glm_infra.spec import packages
from glm_infra.spec.config import StackConfig
from glm_infra.steps import ScriptStep, Step


def drivers_script(stack: StackConfig, host: str) -> str:
    m = stack.monitoring  # the DCGM exporter's unit wants DCGM's host engine (monitoring.dcgm_hosts)
    exporter = m.enabled and m.dcgm_exporter_package is not None and stack.drivers.mode == "install"
    return render_template("drivers.sh.j2", host=host, d=stack.drivers, p=stack.drivers.package_set(exporter),
                           tree_names=packages.DRIVER_TREE_NAMES, modules=packages.FABRIC_MODULES)


def reboot_script(host: str) -> str:
    return render_template("reboot.sh.j2", host=host)


def back_script(host: str) -> str:
    return render_template("back.sh.j2", host=host)


def waitboot_script(stack: StackConfig, host: str) -> str:
    h = stack.host(host)
    # Going down takes as long as the slowest unit's stop: a draining instance's TimeoutStopSec, and some.
    drain = max((pool.shutdown_timeout + 30 for _, pool in stack.pools()), default=0)
    return render_template(
        "waitboot.sh.j2", host=host, address=h.address, port=h.ssh_port, timeout_s=stack.drivers.reboot_timeout,
        down_timeout_s=drain + 120,
    )


def driver_steps(stack: StackConfig, h: HostPlan) -> list[Step]:
    d = stack.drivers
    wait_timeout = f"{d.reboot_timeout + 180}s"
    return [
        ScriptStep("drivers", drivers_script(stack, h.name)).step("drivers-install", timeout="30m"),
        Step("drivers-reboot", "bash -s", None, reboot_script(h.name)),
        Step("drivers-wait", "bash -s", None, waitboot_script(stack, h.name), local=True, timeout=wait_timeout),
        Step("drivers-back", "bash -s", None, back_script(h.name)),
    ]
