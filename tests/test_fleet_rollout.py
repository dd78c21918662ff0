"""`glm-infra fleet`: the fleet file's rules, what a resume trusts, and the waves' order, stop and resume with
a stand-in for the engine and the gate (the real engine and gate: tests/e2e/test_fleet.py). Fast."""

from __future__ import annotations

import argparse
import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import yaml
from conftest import ROOT

from glm_infra.tools.fleet import cli as fleet_cli
from glm_infra.tools.fleet import gate as fleet_gate
from glm_infra.tools.fleet import progress
from glm_infra.tools.fleet.engine import StackFailure
from glm_infra.tools.fleet.gate import Verdict
from glm_infra.tools.fleet.report import blast_radius, rendering_now
from glm_infra.tools.fleet.rollout import Rollout, already_done
from glm_infra.tools.fleet.spec import FleetError, load_fleet
from glm_infra.tools.review.preview import summarize_preview


def project(tmp_path: Path, stacks=("a", "b", "c")) -> Path:
    """A project (Pulumi.yaml, stacks/) whose stacks are copies of the sim stack."""
    d = tmp_path / "project"
    (d / "stacks").mkdir(parents=True)
    shutil.copy(ROOT / "Pulumi.yaml", d / "Pulumi.yaml")
    for s in stacks:
        shutil.copy(ROOT / "stacks" / "Pulumi.sim.yaml", d / "stacks" / f"Pulumi.{s}.yaml")
    return d


def fleet_file(d: Path, doc: dict | str, name: str = "fleet.yaml") -> Path:
    f = d / name
    f.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return f


THREE = {"name": "f", "waves": [{"name": "canary", "stacks": ["a"]}, {"name": "two", "stacks": ["b"]},
                                 {"name": "three", "stacks": ["c"]}]}


# --- the fleet file ------------------------------------------------------------------------------

def test_a_fleet_file_loads_with_its_project_found_above_it(tmp_path):
    d = project(tmp_path)
    (d / "fleets").mkdir()
    f = fleet_file(d / "fleets", {"name": "f", "parallel": 2, "waves": [
        {"name": "canary", "stacks": ["a"]}, {"name": "rest", "stacks": ["b", "c"], "parallel": 1}],
        "gate": {"slaArgs": ["--quiet"], "doctorArgs": ["--quick"]}})
    fleet = load_fleet(f)
    assert fleet.project == d.resolve() and fleet.stacks == ["a", "b", "c"]
    assert [(w.name, w.stacks, w.parallel) for w in fleet.waves] == [("canary", ("a",), 2), ("rest", ("b", "c"), 1)]
    assert fleet.sla_args == ("--quiet",) and fleet.doctor_args == ("--quick",)


@pytest.mark.parametrize("doc, where, says", [
    ({"name": "f", "waves": []}, "waves", "at least 1"),
    ({"name": "f", "waves": [{"name": "c", "stacks": ["a", "b"]}]}, "waves[0].stacks", "the canary: one stack"),
    ({**THREE, "waves": [*THREE["waves"], {"name": "four", "stacks": ["a"]}]}, "waves[3].stacks[0]",
     "already in wave canary"),
    ({**THREE, "waves": [*THREE["waves"], {"name": "two", "stacks": ["d"]}]}, "waves[3].name", "another wave"),
    ({**THREE, "wave": []}, "wave", "Extra inputs"),
    ({**THREE, "name": "a b"}, "name", "pattern"),
    ({**THREE, "parallel": 0}, "parallel", "greater than or equal to 1"),
    ({**THREE, "waves": [{"name": "canary", "stacks": ["zz"]}]}, "waves[0].stacks[0]", "no stack file"),
    ({**THREE, "gate": {"slaArgs": ["--out=/tmp/x"]}}, "gate.slaArgs[0]", "sets --out itself"),
    ({**THREE, "gate": {"slaArgs": ["--api-key-env", "X"]}}, "gate.slaArgs[0]", "sets --api-key-env"),
    ({**THREE, "project": "nowhere"}, "project", "no Pulumi.yaml"),
    ("name: [", "(yaml)", "YAML syntax error"),
    ("- a\n- b\n", "(file)", "a mapping"),
])
def test_a_bad_fleet_file_is_refused_naming_the_file_and_key(tmp_path, doc, where, says):
    d = project(tmp_path)
    f = fleet_file(d, doc)
    with pytest.raises(FleetError) as e:
        load_fleet(f)
    line = next(ln for ln in str(e.value).splitlines() if f"{f}: {where}" in ln)
    assert says in line, str(e.value)


def test_a_stack_that_does_not_validate_is_refused_with_its_own_problems(tmp_path):
    d = project(tmp_path)
    f = d / "stacks" / "Pulumi.b.yaml"
    f.write_text(f.read_text().replace("tp: 1", "tp: 3", 1))
    with pytest.raises(FleetError) as e:
        load_fleet(fleet_file(d, THREE))
    assert "waves[1].stacks[0]: b does not validate" in str(e.value) and "over-subscribed" in str(e.value)


def test_the_guides_fleet_file_loads(tmp_path):
    guide = (ROOT / "docs" / "OPERATIONS.md").read_text()
    text = guide[guide.index("```yaml\n# fleets/prod.yaml"):].split("\n", 1)[1].split("```", 1)[0]
    stacks = [s for w in yaml.safe_load(text)["waves"] for s in w["stacks"]]
    d = project(tmp_path, stacks)
    (d / "fleets").mkdir()
    fleet = load_fleet(fleet_file(d / "fleets", text, "prod.yaml"))
    assert fleet.stacks == stacks and fleet.waves[0].stacks == ("canary-b300",) and fleet.sla_args == ("--quiet",)
    assert progress.folder(fleet) == d.resolve() / "fleets" / ".glm-infra-fleet" / "prod"


def test_the_command_says_a_bad_fleet_file_and_exits_2(tmp_path, capsys):
    f = fleet_file(project(tmp_path), {"name": "f"})
    assert fleet_cli.run(argparse.Namespace(action="up", file=str(f), restart=False)) == fleet_cli.EXIT_INVALID
    assert "waves: Field required" in capsys.readouterr().err


# --- what a resume trusts ------------------------------------------------------------------------

def test_the_target_is_the_program_the_stack_file_and_the_package(tmp_path):
    d = project(tmp_path)
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text("x = 1\n")
    first = progress.target_digest(d, "a", pkg)
    assert progress.target_digest(d, "a", pkg) == first == progress.target_digest(d, "b", pkg)  # same content
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "m.pyc").write_text("noise")
    assert progress.target_digest(d, "a", pkg) == first
    (pkg / "m.py").write_text("x = 2\n")
    assert progress.target_digest(d, "a", pkg) != first
    (pkg / "m.py").write_text("x = 1\n")
    (d / "stacks" / "Pulumi.a.yaml").write_text((d / "stacks" / "Pulumi.a.yaml").read_text() + "# edited\n")
    assert progress.target_digest(d, "a", pkg) != first and progress.target_digest(d, "b", pkg) == first
    (d / "Pulumi.yaml").write_text((d / "Pulumi.yaml").read_text() + "# edited\n")
    assert progress.target_digest(d, "b", pkg) != first


def test_an_update_is_told_apart_by_its_times_where_the_backend_numbers_none():
    from datetime import datetime

    from glm_infra.tools.fleet.engine import update_id

    def summary(version, start, end):
        return type("S", (), {"version": version, "kind": "update", "start_time": datetime(2026, 12, 7, 3, 56, start),
                              "end_time": None if end is None else datetime(2026, 12, 7, 3, 57, end)})()

    diy = [update_id(summary(0, 1, 2)), update_id(summary(0, 1, 3)), update_id(summary(0, 4, 9)),
           update_id(summary(None, 1, None))]
    assert len(set(diy)) == 4 and diy[0] == "update 2026-12-07T03:56:01..2026-12-07T03:57:02"
    assert update_id(summary(12, 1, 2)).startswith("#12 update ")


def rec(phase="passed", target="t", update="u3"):
    return progress.StackRecord(target, phase, update, "PASS", time.time())


@pytest.mark.parametrize("record, latest, skipped", [
    (None, ("u3", "succeeded"), False),  # never rolled
    (rec(), ("u3", "succeeded"), True),
    (rec(phase="failed"), ("u3", "succeeded"), False),
    (rec(phase="gating"), ("u3", "succeeded"), False),  # interrupted before its verdict
    (rec(target="older"), ("u3", "succeeded"), False),  # another change since
    (rec(), ("u4", "succeeded"), False),  # someone's update since: its gate is not this one's
    (rec(), ("u3", "failed"), False),
    (rec(), None, False),  # the backend has no update (a stack made again)
    (rec(update=None), None, False),
])
def test_a_resume_skips_only_a_stack_still_at_its_gated_update(record, latest, skipped):
    assert (already_done(record, "t", latest) is not None) == skipped


def test_progress_that_does_not_parse_is_refused_not_guessed(tmp_path):
    fleet = load_fleet(fleet_file(project(tmp_path), THREE))
    progress.write(fleet, {"a": rec()})
    assert progress.read(fleet)["a"].update == "u3"
    path = progress.folder(fleet) / progress.PROGRESS_FILE
    for text in ("{", json.dumps({"fleet": "other", "stacks": {}}),
                 json.dumps({"fleet": "f", "stacks": {"a": {"phase": "passed"}}}),
                 json.dumps({"fleet": "f", "stacks": {"a": {"target": "t", "update": "u1", "reason": "", "at": 0,
                                                            "phase": "done"}}}),
                 json.dumps({"fleet": "f", "stacks": {"a": {"target": "t", "update": 1, "reason": "", "at": 0,
                                                            "phase": "passed"}}}),
                 json.dumps(["f"])):
        path.write_text(text)
        with pytest.raises(progress.ProgressError, match=str(path)):
            progress.read(fleet)


def test_one_rollout_of_a_fleet_at_a_time(tmp_path):
    fleet = load_fleet(fleet_file(project(tmp_path), THREE))
    with progress.locked(fleet):
        with pytest.raises(progress.ProgressError, match="another `glm-infra fleet up` of fleet f"):
            with progress.locked(fleet):
                pass
    with progress.locked(fleet):  # released
        pass


# --- the waves -----------------------------------------------------------------------------------

class FakeStacks:
    """The engine as the rollout sees it: ups recorded in order, each a new update of its stack (u1, u2…)."""

    def __init__(self, fail_up=(), hold=None, started=None):
        self.versions: dict[str, int] = {}
        self.ups: list[str] = []
        self.fail_up = set(fail_up)
        self.hold = hold or {}  # stack → event its up waits for
        self.started = started or {}  # stack → event its up sets when it starts
        self.running = 0
        self.most = 0
        self._lock = threading.Lock()

    def preview(self, stack):
        return {"steps": [], "changeSummary": {"same": 3}}

    def up(self, stack, log, progress_cb):
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
            self.ups.append(stack)
        if stack in self.started:
            self.started[stack].set()
        try:
            if stack in self.hold:
                assert self.hold[stack].wait(10)
            if stack in self.fail_up:
                raise StackFailure(f"{stack}: pulumi up failed:\nerror: planted")
            log.write(f"up {stack}\n")
            self.versions[stack] = self.versions.get(stack, 0) + 1
            return f"u{self.versions[stack]}"
        finally:
            with self._lock:
                self.running -= 1

    def latest(self, stack):
        return (f"u{self.versions[stack]}", "succeeded") if stack in self.versions else None

    def outputs(self, stack):
        return {"routerApiKey": "k", "routerCaCertificate": "pem"}


class FakeGate:
    def __init__(self, failing=()):
        self.failing = set(failing)
        self.gated: list[str] = []

    def __call__(self, stack, outputs, out, log):
        self.gated.append(stack)
        assert outputs["routerApiKey"] == "k" and log.name == f"{stack}.log"
        if stack in self.failing:
            return Verdict(False, "the SLA gate failed: FAIL 16K: mean TPOT 40 ms > 20 ms")
        return Verdict(True, "PASS: every bucket")


def rollout(tmp_path, stacks, gate, doc=THREE, restart=False):
    d = tmp_path / "project"
    fleet = load_fleet(fleet_file(d if d.exists() else project(tmp_path, ("a", "b", "c", "d")), doc))
    said: list[str] = []
    return Rollout(fleet, stacks, gate, said.append, restart).run(), said, fleet


def test_waves_roll_in_order_each_stack_gated_before_the_next_wave(tmp_path):
    stacks, gate = FakeStacks(), FakeGate()
    result, said, fleet = rollout(tmp_path, stacks, gate)
    assert result.ok and stacks.ups == gate.gated == ["a", "b", "c"]
    assert [o.status for o in result.outcomes] == ["passed"] * 3
    records = progress.read(fleet)
    assert {s: (r.phase, r.update) for s, r in records.items()} == {s: ("passed", "u1") for s in "abc"}
    assert (progress.folder(fleet) / "a.log").read_text() == "up a\n"


def test_a_failing_gate_in_the_second_wave_stops_before_the_third_then_a_resume_goes_on(tmp_path):
    stacks = FakeStacks()
    result, said, fleet = rollout(tmp_path, stacks, FakeGate(failing={"b"}))
    assert not result.ok and result.stopped_at == "two" and stacks.ups == ["a", "b"]
    assert [(o.stack, o.status) for o in result.outcomes] == [("a", "passed"), ("b", "failed"), ("c", "not started")]
    assert any("STOPPED at wave two: b: the SLA gate failed: FAIL 16K" in s for s in said)
    assert progress.read(fleet)["b"].phase == "failed"
    # Fixed (the stack's file): a resume skips the canary, rolls b again and goes on to c.
    f = fleet.project / "stacks" / "Pulumi.b.yaml"
    f.write_text(f.read_text() + "# fixed\n")
    gate = FakeGate()
    result, said, _ = rollout(tmp_path, stacks, gate)
    assert result.ok and stacks.ups == ["a", "b", "b", "c"] and gate.gated == ["b", "c"]
    assert [(o.stack, o.status) for o in result.outcomes] == [("a", "skipped"), ("b", "passed"), ("c", "passed")]


def test_a_stack_updated_by_someone_since_its_gate_rolls_and_gates_again(tmp_path):
    stacks, gate = FakeStacks(), FakeGate()
    rollout(tmp_path, stacks, gate)
    stacks.versions["a"] += 1  # a `pulumi up -s a` of someone's own
    result, _, _ = rollout(tmp_path, stacks, gate)
    assert [o.status for o in result.outcomes] == ["passed", "skipped", "skipped"] and gate.gated[3:] == ["a"]


def test_restart_forgets_the_progress(tmp_path):
    stacks, gate = FakeStacks(), FakeGate()
    rollout(tmp_path, stacks, gate)
    result, _, _ = rollout(tmp_path, stacks, gate, restart=True)
    assert [o.status for o in result.outcomes] == ["passed"] * 3 and stacks.ups == ["a", "b", "c"] * 2


def test_a_failed_up_stops_the_rollout_and_is_recorded(tmp_path):
    stacks = FakeStacks(fail_up={"a"})
    result, said, fleet = rollout(tmp_path, stacks, FakeGate())
    assert result.stopped_at == "canary" and stacks.ups == ["a"]
    assert [o.status for o in result.outcomes] == ["failed", "not started", "not started"]
    assert progress.read(fleet)["a"].phase == "failed" and "planted" in progress.read(fleet)["a"].reason


def test_a_stack_the_backend_does_not_have_fails_its_wave(tmp_path):
    class Missing(FakeStacks):
        def latest(self, stack):
            if stack == "b":
                raise StackFailure("b: the backend has no such stack (`pulumi stack init b` once, ...)")
            return super().latest(stack)

    result, said, _ = rollout(tmp_path, Missing(), FakeGate())
    assert result.stopped_at == "two" and "pulumi stack init b" in result.outcomes[1].reason


def test_a_wave_runs_its_stacks_in_parallel_up_to_its_limit_and_starts_none_after_a_failure(tmp_path):
    doc = {"name": "f", "waves": [{"name": "canary", "stacks": ["a"]},
                                  {"name": "wide", "stacks": ["b", "c", "d"], "parallel": 2}]}
    release, c_started = threading.Event(), threading.Event()
    stacks = FakeStacks(fail_up={"b"}, hold={"b": c_started, "c": release}, started={"c": c_started})
    gate = FakeGate()
    # b fails once c runs; c holds its slot a while longer; d would take b's slot: it must not start.
    threading.Timer(1.0, release.set).start()
    result, said, _ = rollout(tmp_path, stacks, gate, doc)
    assert [(o.stack, o.status) for o in result.outcomes] == [("a", "passed"), ("b", "failed"), ("c", "passed"),
                                                              ("d", "not started")]
    assert stacks.most == 2 and "d" not in stacks.ups
    stacks2 = FakeStacks(hold={})
    result, _, _ = rollout(tmp_path, stacks2, FakeGate(), {**doc, "name": "g"})
    assert result.ok and stacks2.most <= 2


# --- the gate ------------------------------------------------------------------------------------

def test_the_gate_gives_the_key_by_environment_and_the_certificate_by_a_private_file(tmp_path, monkeypatch):
    seen = []

    class Done:
        def __init__(self, rc, out=""):
            self.returncode, self.stdout, self.stderr = rc, out, ""

    def fake_run(cmd, cwd, env, **kw):
        ca = cmd[cmd.index("--cacert") + 1] if "--cacert" in cmd else None
        seen.append((cmd, env.get("GLM_INFRA_API_KEY"), ca and Path(ca).read_text(), ca and Path(ca).parent.stat().st_mode))
        return Done(0) if cmd[3] == "doctor" else Done(1, "FAIL 16K: mean TPOT 40 ms > 20 ms\nFAIL 64K: ...\n")

    monkeypatch.setattr(fleet_gate.subprocess, "run", fake_run)
    monkeypatch.setenv("GLM_INFRA_API_KEY", "the caller's own")
    v = fleet_gate.run_gate(tmp_path, "b", {"routerApiKey": "s3cret", "routerCaCertificate": "PEM"}, tmp_path / "out",
                            tmp_path / "b.log", ["--quick"], ["--quiet"])
    assert not v.passed and v.reason == "the SLA gate failed: FAIL 16K: mean TPOT 40 ms > 20 ms; FAIL 64K: ..."
    (doctor, key1, _, _), (sla, key2, ca, mode) = seen
    assert doctor[3:] == ["doctor", "b", "--quick"] and sla[3:5] == ["sla", "b"] and sla[-1] == "--quiet"
    assert key1 == key2 == "s3cret" and all("s3cret" not in a for a in doctor + sla)
    assert ca == "PEM" and mode & 0o077 == 0 and not Path(sla[sla.index("--cacert") + 1]).exists()
    assert "s3cret" not in (tmp_path / "b.log").read_text()


def test_a_stack_without_a_key_output_gets_no_key_from_the_callers_environment(tmp_path, monkeypatch):
    envs = []

    def fake_run(cmd, cwd, env, **kw):
        envs.append(env)
        return type("P", (), {"returncode": 3, "stdout": "", "stderr": "doctor: sim-1: unreachable"})()

    monkeypatch.setattr(fleet_gate.subprocess, "run", fake_run)
    monkeypatch.setenv("GLM_INFRA_API_KEY", "another stack's")
    v = fleet_gate.run_gate(tmp_path, "b", {}, tmp_path / "o", tmp_path / "b.log", [], [])
    assert not v.passed and "doctor found drift (exit 3)" in v.reason and "unreachable" in v.reason
    assert len(envs) == 1 and "GLM_INFRA_API_KEY" not in envs[0]  # the SLA gate does not run after doctor fails


# --- preview -------------------------------------------------------------------------------------

def test_the_preview_names_each_stacks_restarts_and_blast_radius(tmp_path, capsys, monkeypatch):
    d = project(tmp_path)
    f = fleet_file(d, THREE)
    fleet = load_fleet(f)
    rendering = rendering_now(fleet, "a")
    prefill = min((i for i in rendering.instances.values() if i.pool == "prefill"), key=lambda i: i.name)

    class Changing(FakeStacks):
        def preview(self, stack):
            if stack == "c":
                return "not run: c: the backend has no such stack"
            return {"steps": [], "changeSummary": {"update": 1}}

    import glm_infra.tools.fleet.cli as c

    def summarize(stack, data, rendering):
        s = summarize_preview(stack, data, rendering)
        if stack == "b":
            s.resources["update"].append(f"glm-{prefill.host}-{prefill.name}-service")
            s.counts["update"] += 1
            s.restarts.append(f"glm-{prefill.host}-{prefill.name}-service: {prefill.unit}")
        return s

    monkeypatch.setattr(c, "summarize_preview", summarize)
    assert c.preview(fleet, Changing()) == c.EXIT_FAILED  # c has no preview
    out = capsys.readouterr().out
    assert "  a: no change" in out and "  c: preview not run: c: the backend has no such stack" in out
    b = out[out.index("  b: "):out.index("  c: ")]
    assert "1 to update" in b and f"restarts glm-{prefill.host}-{prefill.name}-service: {prefill.unit}" in b
    assert f"blast radius: instances restarting: decode 0/1, prefill 1/4; router restarts: no; hosts changed: " \
           f"{prefill.host}" in b


def test_blast_radius_counts_the_router_and_each_pools_instances():
    from glm_infra.tools.review.preview import PreviewSummary

    fleet = type("F", (), {"project": ROOT})()
    r = rendering_now(fleet, "sim")
    units = [i.unit for i in r.instances.values() if i.pool == "prefill"][:2] + [r.router[1]]
    s = PreviewSummary("sim", {}, {}, {"create": [], "update": ["glm-sim-3-router"], "replace": [], "delete": []},
                       [f"x: {u}" for u in units])
    radius = blast_radius(s, r)
    assert radius.pools == {"prefill": (2, 4), "decode": (0, 1)} and radius.router and radius.hosts == ["sim-3"]
