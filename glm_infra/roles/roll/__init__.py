"""Rolling host changes: a disruptive step (driver, reboot, RDMA) runs on one host of a pool at a time,
its instances drained from the router first and healthy again before the next host's turn."""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from pathlib import Path

from glm_infra.plan.topology import HostPlan, Instance, Plan, rolling
from glm_infra.render import render_template
from glm_infra.roles import vllm
from glm_infra.roles.roll import runs
from glm_infra.spec import paths, pins
from glm_infra.spec.config import StackConfig
from glm_infra.steps import RenderedFile, Step, digest, seconds


def roll_script(stack: StackConfig, plan: Plan, host: str, pools: list[tuple[str, int]], bounds: Mapping[str, int]) -> str:
    """roll.sh of ``host``: drain and return its instances around a disruptive change (roll_steps)."""
    mine = [i for i in plan.instances if i.host == host]
    roles = {p for p, _ in pools}
    # The router knows each worker by the URL of its gate; without a router, its own /health is asked.
    def known_as(i: Instance) -> str:
        return plan.router.worker_url(i.name) if plan.router is not None else i.url

    others = [(i.role, i.host, known_as(i)) for i in plan.instances if i.host != host and i.role in roles]
    metrics = ""
    if plan.router is not None and stack.router is not None:  # every router host's (each checks the workers itself)
        metrics = " ".join(f"http://{paths.url_host(plan.router.own_address(h))}:{stack.router.metrics_port}/metrics"
                           for h in plan.router.host_names)
    return render_template("roll.sh.j2", host=host, instances=mine, workers=[known_as(i) for i in mine],
                           metrics_url=metrics, pools=pools, others=others, **bounds)


def lease_script(host: str, folder: str, pools: list[tuple[str, int]], wait_s: int) -> str:
    """lease.sh of ``host``: its turn in its pools' roll, on the machine running pulumi."""
    return render_template("lease.sh.j2", host=host, folder=folder, pools=pools, wait_s=wait_s,
                           run_failed=runs.RUN_FAILED)


def lease_folder(stack: StackConfig, stack_name: str) -> str:
    """The stack's folder of turns (and of its runs' failure records) under the lease root: one per stack
    and set of hosts."""
    return f"{stack_name}-{digest(stack_name, *sorted(x.name for x in stack.hosts))}"


def failure_folder(stack: StackConfig, steps: Mapping[str, Mapping[str, Step]], stack_name: str) -> Path | None:
    """Where the program records that a step of its run failed, for the hosts of the run waiting for a turn
    (runs.py): the stack's lease folder; None when no host of these per-host steps takes turns."""
    if not any("turn-acquire" in s for s in steps.values()):
        return None
    return runs.lease_root(lease_folder(stack, stack_name))


# The steps that take a host down or change what its instances run on: they roll, one turn at a time.
DISRUPTIVE = ("drivers-install", "drivers-reboot", "rdma")


ROLL_FORCE = "GLM_INFRA_ROLL_FORCE"  # =1: the roll goes on without the router's view (docs/OPERATIONS.md)


UNTIMED_STEP_S = 600  # what a step without a timeout is assumed to take at most, for the roll's bounds


def roll_steps(stack: StackConfig, plan: Plan, h: HostPlan, stack_name: str,
               around: list[Step]) -> tuple[list[Step], list[Step]]:
    """The steps before and after ``around`` (drivers … ucx-env) on a serving host: its turn in its pools
    (turn-acquire, on the machine running pulumi), the drain of its instances (host-drain), and after
    them their return (host-return) and the turn given back (turn-release). They run when the disruptive
    steps change (their digest is in every command) and do nothing on a first deploy; hosts without
    instances have none."""
    groups = [g for g in rolling(stack, plan) if h.name in g.hosts]
    if not groups or not plan.serve:
        return [], []
    by_name = {x.name: x for x in around}
    roll = digest(*(part for k in DISRUPTIVE if k in by_name
                    for part in (by_name[k].create, by_name[k].stdin or "", *by_name[k].triggers)))
    pools = [(g.pool, g.max_unavailable) for g in groups]
    r = stack.router
    interval = r.health_check_interval if r is not None else 0
    check = interval + pins.ROUTER_HEALTH_CHECK_TIMEOUT_S
    stop_s = max(pool.shutdown_timeout + 30 for role, pool in stack.pools() if role in dict(pools))
    # Down after the failure threshold's checks, up after the success threshold's, each with one more
    # check and half a minute of margin (a loaded or restarting router is late).
    down_s = (pins.ROUTER_HEALTH_FAILURE_THRESHOLD + 1) * check + 30
    # A returning instance its canary had taken out comes back after that canary's next pass.
    canary = r.canary_interval + r.canary_timeout if r is not None else 0
    up_s = (pins.ROUTER_HEALTH_SUCCESS_THRESHOLD + 1) * check + 30 + canary
    start_s = vllm.SERVICE_START_TIMEOUT_S
    turn_s = stop_s + down_s + sum(seconds(x.timeout, UNTIMED_STEP_S) for x in around) + start_s + up_s
    wait_s = turn_s + 300  # another host's whole turn, from the timeouts of its steps
    bounds = {"guard_s": wait_s, "down_s": down_s, "up_s": up_s, "start_s": start_s}
    script = roll_script(stack, plan, h.name, pools, bounds)
    lease = lease_script(h.name, lease_folder(stack, stack_name), pools, wait_s)
    path = paths.script("roll")
    install = f"install -D -m 0755 /dev/stdin {path}"
    # roll.sh refuses to go on blind (the router unreadable) unless the operator sets this for one up;
    # SSH does not carry the environment, so the command does (and that up re-runs drain and return:
    # no-ops for a roll already done).
    run = f"{ROLL_FORCE}=1 {path}" if os.environ.get(ROLL_FORCE) == "1" else path
    first = f"echo {shlex.quote(f'{h.name}: turn: roll {roll} recorded (first deploy: nothing serves yet)')}"
    before = [
        Step("turn-acquire", first, stdin=lease, update=f"bash -s acquire {roll}", local=True,
             timeout=f"{wait_s + 120}s"),
        # Destroy leaves no trace of the rolls (the instances themselves are removed by their own steps).
        Step("host-drain", f"{install} && {path} record {roll}",
             f"rm -f {path} {paths.DRAINED} {paths.ROLLED} {paths.ROLL_LOG}", script,
             update=f"{install} && {run} drain {roll}", timeout=f"{wait_s + stop_s + down_s + 120}s",
             files=(RenderedFile(path, script, 0o755),), check=f"{path} check"),
    ]
    after = [
        Step("host-return", f"{run} return {roll}", timeout=f"{start_s + up_s + 120}s"),
        Step("turn-release", first, stdin=lease, update=f"bash -s release {roll}", local=True),
    ]
    return before, after
