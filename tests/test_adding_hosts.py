"""A host joins a running stack through the stack's own file (issue 40): vllm-router 0.1.17 in P/D mode answers
`POST /add_worker` with 400, so the router's worker list is part of the stack, never a runtime call.
prod-b300 → stacks/Pulumi.prod-b300-2decode.yaml is prod-b300 with a second decode host: what reaches each host
of the running stack when it is applied, step by step from the per-host plan (what `pulumi up` runs)."""

from __future__ import annotations

import re

import pytest
from conftest import stack_file

from glm_infra import hostplan
from glm_infra.plan.topology import plan
from glm_infra.roles.roll import DISRUPTIVE
from glm_infra.stack import load_file

NEW = ("b300-4", "10.0.0.14")


@pytest.fixture(scope="module")
def before_after():
    def steps(name: str):
        cfg = load_file(stack_file(name)).config
        # One Pulumi stack: the file grew, the stack's name (its labels, its leases' folder) did not.
        return cfg, hostplan.plan_all(cfg, plan(cfg), stack_name="prod-b300")
    return steps("prod-b300"), steps("prod-b300-2decode")


def changed(before, after) -> dict[str, set[str]]:
    """Per host of the running stack, the steps whose commands, stdin or triggers differ (they run again)."""
    out = {}
    for host, hs in before.items():
        old, new = hs.steps, after[host].steps
        out[host] = {k for k in old if k in new and (old[k].create, old[k].update, old[k].stdin, old[k].triggers)
                     != (new[k].create, new[k].update, new[k].stdin, new[k].triggers)}
        assert set(old) <= set(new), f"{host}: a step of the running stack would be deleted"
    return out


def test_a_decode_host_joins_through_the_stack_file_and_restarts_no_instance(before_after):
    (_, before), (cfg, after) = before_after
    diff = changed(before, after)
    # The new host gets the whole chain and its own decode instance.
    assert {"preflight", "drivers-install", "firewall", "rdma", "weights-stage", "decode-1-unit", "decode-1-service",
            "decode-warm-cache", "node-exporter", "unit-memory"} <= set(after[NEW[0]].steps)
    for host, keys in diff.items():
        # No instance of the running stack restarts, no driver or RDMA step runs again.
        assert not {k for k in keys if re.match(r"(prefill|decode)-\d+-", k)}, (host, keys)
        assert not keys & set(DISRUPTIVE), (host, keys)
        # Every host's firewall lets the new host in (its NIXL side channels and instances): its table changed.
        assert "firewall" in keys and NEW[1] in after[host].steps["firewall"].stdin
        assert NEW[1] not in before[host].steps["firewall"].stdin
    # The worker list: each router host's unit, gates and canaries name the new instance; the routers restart (one at
    # a time, tests/test_router_ha.py); Prometheus scrapes the new host.
    for router_host in (cfg.router.host, *cfg.router.standby_hosts):
        assert {"router-unit", "router-service", "router-gates-conf", "router-gates", "router-canary"} <= (
            diff[router_host]), router_host
        unit = after[router_host].steps["router-unit"].stdin
        new_gate = next(g for g in plan(cfg).router.gates if g.instance == "decode-1")
        assert new_gate.url in unit and new_gate.url not in before[router_host].steps["router-unit"].stdin
        assert f"{NEW[1]}:" in after[router_host].steps["router-gates-conf"].stdin
    assert "prometheus" in diff[cfg.monitoring_host]
    router_host = cfg.router.host
    # The decode pool has two hosts now: its warm-start caches are relayed from the first, which gains the step.
    assert "decode-warm-cache" in after[router_host].steps and "decode-warm-cache" not in before[router_host].steps


def test_the_roll_steps_that_change_only_reinstall_their_script_and_drain_nothing(before_after):
    """The host-drain step's update drains its host: it may change (the pools it rolls in grew), but with the roll's
    digest as recorded, so roll.sh says the roll is already done and stops nothing."""
    (_, before), (_, after) = before_after
    for host in before:
        old, new = before[host].steps, after[host].steps
        if "host-drain" not in old:
            continue
        digest_of = lambda s: s.update.rsplit(" ", 1)[1]  # noqa: E731  "… drain DIGEST"
        assert digest_of(old["host-drain"]) == digest_of(new["host-drain"]), host
        assert old["turn-acquire"].update == new["turn-acquire"].update, host
