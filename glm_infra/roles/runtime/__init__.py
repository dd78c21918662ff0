"""The Python runtime on a host: uv and the venv with the pinned vllm, nixl and vllm-router (runtime.sh)."""

from __future__ import annotations

from glm_infra.plan.topology import HostPlan
from glm_infra.render import render_template
from glm_infra.spec.config import StackConfig
from glm_infra.steps import ScriptStep, Step


def runtime_script(stack: StackConfig, host: str) -> str:
    return render_template("runtime.sh.j2", host=host, rt=stack.runtime)


def runtime_step(stack: StackConfig, h: HostPlan) -> Step:
    return ScriptStep("runtime", runtime_script(stack, h.name)).step("runtime", timeout="60m")
