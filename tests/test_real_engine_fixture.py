"""The real-engine proof kept true (issue 41): the newest transcript under tests/fixtures/real-engine/ ran the
pinned vLLM, NIXL and router on exactly the lines the render gives now, and every check passed; and the stand-in
logs its startup phases in the lines the real engine logged them (tests/standins/test_vllm.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import ROOT, stack_file

from glm_infra.roles import monitoring
from glm_infra.spec import pins
from glm_infra.stack import load_file
from glm_infra.tools import real_engine
from testbed.real_engine import check

FIXTURES = ROOT / "tests" / "fixtures" / "real-engine"
RERUN = "re-run the real-engine check on a GPU machine and add its transcript (docs/DEVELOPING.md)"
GPU_SHARE = 0.28  # three instances on one GPU: prefill, decode and the planted wrong one


def newest() -> Path:
    runs = sorted(p for p in FIXTURES.iterdir() if p.is_dir() and re.match(r"\d{4}-\d{2}-\d{2}-", p.name))
    assert runs, "no transcript"
    return runs[-1]


def test_the_newest_transcript_ran_the_pinned_software():
    run = newest()
    versions = dict(line.split() for line in (run / "versions.txt").read_text().splitlines() if line.strip())
    want = {"vllm": pins.VLLM, "nixl": pins.NIXL, "nixl-cu13": pins.NIXL, "vllm-router": pins.VLLM_ROUTER}
    for name, version in want.items():
        assert versions.get(name) == version, f"{run.name} ran {name} {versions.get(name)}, the pin is {version}: {RERUN}"


def test_the_newest_transcript_ran_the_lines_the_render_gives_now():
    run = newest()
    cfg = load_file(stack_file("prod-b300")).config
    for line in real_engine.lines(cfg, "prod-b300", "${GLM_CHECK_MODEL}", GPU_SHARE):
        ran_argv = json.loads((run / "lines" / f"{line.role}.argv.json").read_text())
        ran_env = json.loads((run / "lines" / f"{line.role}.env.json").read_text())
        assert (ran_argv, ran_env) == (line.argv, line.env), f"{line.role}'s line changed since {run.name}: {RERUN}"
    ran_metrics = json.loads((run / "lines" / "expected-metrics.json").read_text())
    now = {m: who for m, who in monitoring.read_metrics(cfg, "prod-b300").items() if m.startswith(("vllm:", "vllm_router_"))}
    assert set(now) <= set(ran_metrics), f"the rules or panels read {sorted(set(now) - set(ran_metrics))} now: {RERUN}"


def test_every_check_of_the_newest_transcript_passed_on_a_gpu():
    run = newest()
    results = json.loads((run / "results.json").read_text())
    names = [c["name"] for c in results["checks"]]
    assert names == ["prefill healthy", "decode healthy", "router healthy", "chat through the router (not streamed)",
                     "chat through the router (streamed)", "KV over NIXL", "metrics the rules and panels read",
                     "canary against the instances", "wrong healthy", "canary against a planted wrong instance"]
    assert all(c["ok"] for c in results["checks"]), [c for c in results["checks"] if not c["ok"]]
    assert "NVIDIA" in results["machine"] and results["nixl"]["transfers"] > 0 and results["nixl"]["failed"] == 0
    # Several API servers, as deployed: the real engine serves no process_* metric (the unit-memory timer's reason).
    assert results["process_metrics"] == []


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_check_reads_the_startup_phases_the_real_engine_logged(role):
    log = (newest() / f"{role}.log").read_text()
    assert set(check.phases(log)) == set(check.PHASES)
