"""What the engine must allow (glm_infra/components/engine_limits.py): an `up` whose --parallel leaves no room
for a relay parent's step once its peers' steps wait for it is refused before any resource; a preview warns.
The deadlock it prevents was seen: 16 simulated hosts at the default --parallel 8 (scripts/bench/fleet_up.py),
eight peers' weights staging waiting for parents whose steps could not start."""

from __future__ import annotations

import pulumi
import pytest
from conftest import stack_config

from glm_infra.components import engine_limits
from glm_infra.plan import topology
from glm_infra.stack import load_dict, unprefixed
from testbed.bench.common import b300_fleet, sim_config


def loaded(cfg: dict):
    stack = load_dict(unprefixed(cfg), "test").config
    return stack, topology.plan(stack)


@pytest.mark.parametrize("cfg, need", [
    (stack_config("sim"), 3 + 2 + 1),  # 3 hosts stage the weights, prefill and decode roll, one to spare
    (stack_config("prod-b300"), 3 + 2 + 1),
    (sim_config(16), 16 + 1 + 1),  # one colocated pool
    (b300_fleet(96), 96 + 2 + 1),
])
def test_every_host_that_stages_the_weights_each_pool_and_one_more(cfg, need):
    stack, p = loaded(cfg)
    assert topology.parallel_needed(stack, p) == need
    assert len(topology.weights_relay(stack)) == need - len(topology.rolling(stack, p)) - 1


def test_a_local_checkpoint_stages_nothing_between_hosts():
    cfg = stack_config("prod-b300")
    cfg["glm-infra:model"] = {**cfg["glm-infra:model"], "source": "local"}
    stack, p = loaded(cfg)
    assert topology.parallel_needed(stack, p) == len(topology.rolling(stack, p)) + 1


class Said:
    def __init__(self, monkeypatch, parallel, dry_run):
        self.warnings: list[str] = []
        monkeypatch.setattr(engine_limits.settings.SETTINGS, "parallel", parallel, raising=False)
        monkeypatch.setattr(pulumi.runtime, "is_dry_run", lambda: dry_run)
        monkeypatch.setattr(pulumi.log, "warn", lambda msg, resource=None: self.warnings.append(msg))


@pytest.mark.parametrize("parallel", [None, 0, 6, 7, 64])
def test_enough_room_or_an_engine_that_does_not_say_passes(monkeypatch, parallel):
    said = Said(monkeypatch, parallel, dry_run=False)
    stack, p = loaded(stack_config("sim"))
    assert engine_limits.check_parallel(stack, p, None) is None and said.warnings == []


@pytest.mark.parametrize("parallel", [1, 4, 5])
def test_an_up_with_too_little_room_is_refused_naming_what_to_pass(monkeypatch, parallel):
    said = Said(monkeypatch, parallel, dry_run=False)
    stack, p = loaded(stack_config("sim"))
    with pytest.raises(pulumi.RunError) as e:
        engine_limits.check_parallel(stack, p, None)
    assert f"pulumi runs {parallel} resource operations at once (--parallel), fewer than the 6" in str(e.value)
    assert "Run `pulumi up --parallel 6` or more. Refused before any resource." in str(e.value)
    assert said.warnings == []


def test_a_preview_with_too_little_room_warns(monkeypatch):
    said = Said(monkeypatch, 4, dry_run=True)
    stack, p = loaded(stack_config("sim"))
    assert engine_limits.check_parallel(stack, p, None) is None
    assert len(said.warnings) == 1 and said.warnings[0].endswith("`pulumi up` at this --parallel is refused")
    assert "Run `pulumi up --parallel 6` or more" in said.warnings[0]
