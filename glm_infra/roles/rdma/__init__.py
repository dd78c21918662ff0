"""RDMA on the compute NICs: DOCA-OFED, the link and GID checks and a loopback bandwidth test (rdma.sh)."""

from __future__ import annotations

from glm_infra.plan.topology import HostPlan
from glm_infra.render import render_template
from glm_infra.spec import packages
from glm_infra.spec.config import StackConfig
from glm_infra.spec.paths import HOSTCHECK
from glm_infra.steps import ScriptStep, Step


def rdma_script(stack: StackConfig, host: str) -> str:
    return render_template(
        "rdma.sh.j2", host=host, r=stack.rdma, nics=stack.host(host).compute_nics, hostcheck=HOSTCHECK,
        doca_replaces=packages.DOCA_REPLACES,
    )


def rdma_step(stack: StackConfig, h: HostPlan) -> Step:
    return ScriptStep("rdma", rdma_script(stack, h.name)).step("rdma", timeout="20m")
