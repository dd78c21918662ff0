"""NIXL's transport: the UCX environment every vLLM instance of the host reads (ucx.env)."""

from __future__ import annotations

from glm_infra.plan.topology import HostPlan
from glm_infra.render import render_template
from glm_infra.spec import paths
from glm_infra.spec.config import StackConfig
from glm_infra.steps import Step, file_step


def ucx_env(stack: StackConfig, host_name: str) -> str:
    host = stack.host(host_name)
    return render_template("ucx.env.j2", host=host, rdma=stack.rdma, nixl=stack.nixl)


def ucx_env_step(stack: StackConfig, h: HostPlan) -> Step:
    return file_step("ucx-env", paths.UCX_ENV, ucx_env(stack, h.name))
