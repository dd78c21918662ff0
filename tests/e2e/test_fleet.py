"""`glm-infra fleet` end to end: three one-host stacks over the disjoint hosts of the simulated cluster (fleet-a on
sim-1, fleet-b on sim-2, fleet-c on sim-3), rolled in three waves through the Automation API and the real
engine, each stack gated by its own doctor and SLA gate. A first rollout deploys them; a vLLM pin change is
previewed with its restarts, then rolled with a planted regression on the second wave's stack (its TPOT over
the SLA): the rollout stops there and the third stack is not touched; fixed, a resume skips the canary and
finishes."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from e2e.harness import ROOT, on_host, sh, sim_host_key
from testbed.bench.rollout import NEW_VLLM, OLD_VLLM, SLOW, STACKS, build_vllm_wheel, fleet_doc, one_host_stack

TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="module")
def project(toolchain, sim, tmp_path_factory):
    """A Pulumi project of this checkout's program (its Pulumi.yaml, program and venv) with the three stacks
    and the fleet file; the stacks destroyed and removed at the end, whatever happened."""
    build_vllm_wheel(NEW_VLLM)  # what the pin change installs
    d = tmp_path_factory.mktemp("fleet") / "project"
    (d / "stacks").mkdir(parents=True)
    for name in ("Pulumi.yaml", "__main__.py", "venv"):
        (d / name).symlink_to(ROOT / name)
    key = sim_host_key()
    for stack, (host, address) in STACKS.items():
        doc = one_host_stack(host, address)
        doc["config"]["glm-infra:hosts"][0]["hostKey"] = key
        (d / "stacks" / f"Pulumi.{stack}.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    (d / "fleet.yaml").write_text(yaml.safe_dump(fleet_doc("e2e"), sort_keys=False))
    for stack in STACKS:
        in_project(d, f"pulumi stack rm -s {stack} --yes --force --preserve-config", check=False)
        in_project(d, f"pulumi stack init {stack} --secrets-provider passphrase")
    try:
        yield d
    finally:
        for stack in STACKS:
            in_project(d, f"pulumi cancel -s {stack} --yes", check=False)
            in_project(d, f"pulumi destroy -s {stack} --yes --skip-preview --non-interactive", check=False)
            in_project(d, f"pulumi stack rm -s {stack} --yes --preserve-config --force", check=False)
        if TIMINGS:
            print(f"\nfleet rollout timings: {json.dumps({k: round(v, 1) for k, v in TIMINGS.items()})}")


def in_project(d: Path, cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return sh(f"cd {shlex.quote(str(d))} && {cmd}", check=check)


def fleet(d: Path, action: str) -> subprocess.CompletedProcess:
    return sh(f"{ROOT}/venv/bin/glm-infra fleet {action} {d / 'fleet.yaml'}", check=False, timeout=3000)


def updates(d: Path, stack: str) -> int:
    p = in_project(d, f"pulumi stack history -s {stack} --json")
    return len(json.loads(p.stdout or "[]"))


def edit(d: Path, stack: str, change) -> None:
    f = d / "stacks" / f"Pulumi.{stack}.yaml"
    doc = yaml.safe_load(f.read_text())
    change(doc["config"])
    f.write_text(yaml.safe_dump(doc, sort_keys=False))


def installed_vllm(host: str) -> str:
    return on_host(host, "/opt/glm-infra/venv/bin/python -c 'import importlib.metadata as m; print(m.version(\"vllm\"))'").strip()


def outcome(stdout: str, stack: str) -> str:
    m = re.search(rf"^{stack}: ([a-z ]+?)(?: \(\d+ s\))?(?::|$)", stdout, re.M)
    assert m, stdout
    return m[1]


def test_a_first_rollout_deploys_the_canary_then_each_wave(project):
    start = time.monotonic()
    p = fleet(project, "up")
    TIMINGS["first rollout (3 stacks deployed)"] = time.monotonic() - start
    assert p.returncode == 0, p.stdout + p.stderr[-6000:]
    assert [outcome(p.stdout, s) for s in STACKS] == ["passed"] * 3
    # Wave after wave: a stack's up starts only after the wave before passed (its gate included).
    log = p.stderr
    order = [log.index(s) for s in ("wave 1/3 canary", "fleet-a: gate passed", "wave canary passed",
                                    "wave 2/3 second", "fleet-b: pulumi up", "fleet-b: gate passed",
                                    "wave 3/3 third", "fleet-c: pulumi up", "fleet-c: gate passed")]
    assert order == sorted(order), log
    assert "PASS: every bucket" in p.stdout
    s = fleet(project, "status")
    assert s.returncode == 0, s.stderr
    for stack in STACKS:
        assert re.search(rf"^  {stack}: passed .*, the current target, by (update \S+); latest \1 succeeded$",
                         s.stdout, re.M), s.stdout


def test_a_pin_change_is_previewed_stack_by_stack_with_its_restarts(project):
    for stack in STACKS:
        edit(project, stack, lambda c: c["glm-infra:runtime"].update(vllmVersion=NEW_VLLM))
    # The regression planted in the second wave's stack: what its new vLLM does to TPOT.
    edit(project, "fleet-b", lambda c: c["glm-infra:colocated"].setdefault("env", {}).update({SLOW: "150"}))
    p = fleet(project, "preview")
    assert p.returncode == 0, p.stdout + p.stderr[-4000:]
    for stack, (host, _) in STACKS.items():
        part = p.stdout[p.stdout.index(f"  {stack}: "):]
        part = part[:part.index("\n  fleet-", 1)] if "\n  fleet-" in part[1:] else part
        assert re.match(rf"  {stack}: \d+ to update", part), part
        assert f"blast radius: instances restarting: colocated 2/2; router restarts: no; hosts changed: {host}" in part
        for unit in ("glm-vllm-colocated-0.service", "glm-vllm-colocated-1.service"):
            assert re.search(rf"restarts \S+: {re.escape(unit)}", part), part


def test_a_regression_in_the_second_wave_stops_the_rollout_before_the_third(project):
    before = {s: updates(project, s) for s in STACKS}
    start = time.monotonic()
    p = fleet(project, "up")
    TIMINGS["pin change until the stop at wave 2"] = time.monotonic() - start
    assert p.returncode == 1, p.stdout + p.stderr[-6000:]
    assert [outcome(p.stdout, s) for s in STACKS] == ["passed", "failed", "not started"]
    assert re.search(r"^fleet-b: failed \(\d+ s\): the SLA gate failed: FAIL .*TPOT", p.stdout, re.M), p.stdout
    assert "STOPPED at wave second: fleet-b" in p.stderr and "not started: fleet-c" in p.stderr
    assert "stopped at wave second" in p.stdout
    after = {s: updates(project, s) for s in STACKS}
    assert after == {"fleet-a": before["fleet-a"] + 1, "fleet-b": before["fleet-b"] + 1, "fleet-c": before["fleet-c"]}
    assert installed_vllm("sim-2") == NEW_VLLM and installed_vllm("sim-3") == OLD_VLLM
    s = fleet(project, "status")
    assert re.search(r"^  fleet-b: failed .*the current target", s.stdout, re.M), s.stdout
    assert "TPOT" in s.stdout[s.stdout.index("  fleet-b:"):s.stdout.index("wave 3")]


def test_after_the_fix_a_resume_skips_the_canary_and_finishes(project):
    edit(project, "fleet-b", lambda c: c["glm-infra:colocated"]["env"].pop(SLOW))
    canary_updates = updates(project, "fleet-a")
    start = time.monotonic()
    p = fleet(project, "up")
    TIMINGS["resume after the fix"] = time.monotonic() - start
    assert p.returncode == 0, p.stdout + p.stderr[-6000:]
    assert [outcome(p.stdout, s) for s in STACKS] == ["skipped", "passed", "passed"]
    assert updates(project, "fleet-a") == canary_updates  # not rolled again
    assert installed_vllm("sim-3") == NEW_VLLM
    # Everything at its target: the preview changes nothing anywhere.
    pv = fleet(project, "preview")
    assert pv.returncode == 0 and all(f"  {s}: no change" in pv.stdout for s in STACKS), pv.stdout
    assert os.path.isfile(project / ".glm-infra-fleet" / "e2e" / "fleet-c-sla" / "sla.json")
