"""The health gate: NVLink fabric, GPUs and DCGM's diagnostics checked after the driver step and at every
boot (health-gate.sh, through hostcheck.py), before any vLLM instance may start."""

from __future__ import annotations

from glm_infra.agent import hostcheck
from glm_infra.plan.topology import HostPlan
from glm_infra.render import render_template
from glm_infra.spec.config import StackConfig
from glm_infra.spec.paths import HOSTCHECK
from glm_infra.steps import ScriptStep, Step


def health_script(stack: StackConfig, host: str) -> str:
    h = stack.host(host)
    return render_template(
        "health-gate.sh.j2",
        host=host,
        hostcheck=HOSTCHECK,
        gpus=h.gpus,
        gpu_model=h.gpu_model,
        driver=stack.drivers.version,
        fabric=stack.drivers.fabric_manager,
        nvlinks=h.nvlinks,
        dcgm_level=stack.drivers.dcgm_diag_level,
        timeout_s=stack.drivers.fabric_timeout,
        limits=hostcheck.gate_limits(stack.drivers.fabric_manager, stack.drivers.dcgm_diag_level),
    )


def health_gate_step(stack: StackConfig, h: HostPlan) -> Step:
    # The gate's wait, its looks and dcgmi diag, each limited; a minute more for SSH and bash.
    d = stack.drivers
    gate_s = hostcheck.gate_timeout_s(d.fabric_timeout, d.fabric_manager, d.dcgm_diag_level)
    return ScriptStep("health-gate", health_script(stack, h.name), removable=False).step(
        "health-gate", timeout=f"{gate_s + 60}s")
