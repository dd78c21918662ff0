"""NIXL's transport: the UCX environment every vLLM instance of the host reads (ucx.env) and, with
nixl.nicPerRank, each GPU's nearest compute NIC (nic-affinity.env, from the host's own topology)."""

from __future__ import annotations

from glm_infra.plan.topology import HostPlan
from glm_infra.render import render_template
from glm_infra.spec import paths
from glm_infra.spec.config import StackConfig
from glm_infra.steps import ScriptStep, Step, file_step

NIC_AFFINITY = "glm-nic-affinity"  # the step's script, under paths.LIBEXEC
ACS_UNIT = "glm-infra-acs.service"  # rdma.disableAcs: turns ACS off again at every boot
# A boot whose reading fails (a GPU or NIC not up yet) is tried again: every ACS_RETRY_S, at most ACS_TRIES
# times in ACS_WINDOW_S (then with each vLLM start, which wants the unit); one try may take ACS_TIMEOUT_S
# (each tool has its own timeout in hostcheck.py: this bounds the whole).
ACS_RETRY_S, ACS_TRIES, ACS_WINDOW_S, ACS_TIMEOUT_S = 15, 20, 600, 300


def ucx_env(stack: StackConfig, host_name: str) -> str:
    host = stack.host(host_name)
    return render_template("ucx.env.j2", host=host, rdma=stack.rdma, nixl=stack.nixl,
                           per_rank=per_rank(stack, host_name), nic_affinity_env=paths.NIC_AFFINITY_ENV)


def ucx_env_step(stack: StackConfig, h: HostPlan) -> Step:
    return file_step("ucx-env", paths.UCX_ENV, ucx_env(stack, h.name))


def nic_affinity_script(stack: StackConfig, host_name: str) -> str:
    return render_template("nic-affinity.sh.j2", host=host_name, nics=stack.host(host_name).compute_nics,
                           gpus=stack.host(host_name).gpus,
                           max_distance=stack.nixl.max_nic_distance, env_file=paths.NIC_AFFINITY_ENV,
                           hostcheck=paths.HOSTCHECK, disable_acs=stack.rdma.disable_acs, acs_unit=ACS_UNIT,
                           acs_retry_s=ACS_RETRY_S, acs_tries=ACS_TRIES, acs_window_s=ACS_WINDOW_S,
                           acs_timeout_s=ACS_TIMEOUT_S, script_path=paths.script(NIC_AFFINITY))


def nic_affinity_step(stack: StackConfig, h: HostPlan) -> Step | None:
    """With nixl.nicPerRank, on a host that serves P/D over RDMA: each GPU's nearest compute NIC
    (templates/nic-affinity.sh.j2), after the RDMA step and before any instance starts. Its check
    (``drift``) is the reading every vLLM start runs (``check``) and, with rdma.disableAcs, the ACS boot
    unit as systemd runs it."""
    if not (h.instances and per_rank(stack, h.name)):
        return None
    return ScriptStep(NIC_AFFINITY, nic_affinity_script(stack, h.name), check_action="drift").step("nic-affinity")


def per_rank(stack: StackConfig, host_name: str) -> bool:
    """Whether the host's instances read nic-affinity.env (and check it before they start)."""
    return stack.nixl.nic_per_rank and bool(stack.host(host_name).compute_nics)
