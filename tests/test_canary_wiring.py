"""The canaries as deployed (issue 38): their reference is recorded only after every instance has rolled onto
what it is of, a change of identity is marked on the router's host before any instance restarts, and
doctor shows the reference. The program under Pulumi's mocks, the rendered steps, doctor's output."""

from __future__ import annotations

import argparse

import pytest
from conftest import stack_file
from pulumi_harness import run_program

from glm_infra import hostplan
from glm_infra.plan.topology import plan
from glm_infra.roles import router
from glm_infra.stack import load_file
from glm_infra.tools import doctor


@pytest.fixture
def key_file(tmp_path):
    k = tmp_path / "id_test"
    k.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nnot-a-real-key\n-----END OPENSSH PRIVATE KEY-----\n")
    return k


def test_the_reference_is_recorded_after_every_rollout_and_the_change_marked_before_any(key_file):
    """Issue 38: the canary step waited only for the router's service: on an upgrade the references were
    recorded again at the start of ``pulumi up``, from the old software."""
    run = run_program(stack_file("prod-b300"), key_file)
    cfg = load_file(stack_file("prod-b300")).config
    rollouts = [f"glm-{i.name}-rollout" for i in plan(cfg).instances]
    canary = run.get("glm-router-canary")
    assert set(map(run.urn, rollouts)) <= set(canary.dependencies), "after every instance has rolled"
    transition = run.urn("glm-canary-transition")
    for name in rollouts:
        assert transition in run.get(name).dependencies, f"{name} restarts after the change is marked"
    assert run.get("glm-canary-transition").inputs["connection"]["host"] == cfg.host(cfg.router.host).address


def test_the_transition_step_marks_the_identity_on_the_routers_host():
    cfg = load_file(stack_file("sim")).config
    p = plan(cfg)
    steps = hostplan.plan_all(cfg, p, stack_name="t")
    holders = [h for h, hs in steps.items() if router.CANARY_TRANSITION in hs.steps]
    assert holders == [cfg.router.host]
    names = list(steps[cfg.router.host].steps)
    assert names.index("vllm-placement") < names.index(router.CANARY_TRANSITION) < names.index("decode-0-unit")
    step = steps[cfg.router.host].steps[router.CANARY_TRANSITION]
    assert step.triggers == (router.canary_identity(cfg),), "runs again only when the identity changes"
    assert '{"to": ' + f'"{router.canary_identity(cfg)}"' in step.create
    assert step.delete == "rm -f /var/lib/glm-infra/canary/transition.json"


def test_doctor_shows_what_a_passing_check_asks_to_show(capsys, monkeypatch):
    out = "\n".join([f"{doctor.BEGIN} router-canary", "sim-3: canary: glm-canary.timer active; every canary passes",
                     f"{doctor.SHOW}sim-3: canary: reference of 'x': ' 11', agreed by a, b (2 of 2 instances) on now",
                     f"{doctor.END} router-canary 0", f"{doctor.BEGIN} other", f"{doctor.SHOW}shown once failing",
                     f"{doctor.END} other 1"])
    monkeypatch.setattr(doctor, "check_host", lambda stack, host, steps, args, lock: doctor.parse(host, out))
    cfg = load_file(stack_file("sim")).config
    args = argparse.Namespace(host=["sim-3"], quick=False, identity=None, ssh_option=None)
    assert doctor.run(cfg, "sim", args) == doctor.EXIT_DRIFT
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].split() == ["sim-3", "router-canary", "ok"]
    assert printed[1] == (f"sim-3  {'':<24} sim-3: canary: reference of 'x': ' 11', agreed by a, b (2 of 2 "
                          "instances) on now")
    assert printed[2].split(maxsplit=2) == ["sim-3", "other", "shown once failing"]
    assert len(printed) == 3, "a passing check's other lines are not shown"


def test_the_canary_script_shows_the_reference_and_takes_an_accept():
    cfg = load_file(stack_file("sim")).config
    script = router.canary_script(cfg, plan(cfg))
    assert "grep ': canary: reference of ' <<<\"$out\" | sed 's/^/@@glm-doctor-show /'" in script
    assert doctor.SHOW == "@@glm-doctor-show "
    assert 'accept) python3 "$program" accept --targets "$targets" --state "$state"' in script
