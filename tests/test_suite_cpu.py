"""scripts/bench/suite_cpu.py: each test's CPU-seconds, counted over the worker's whole process tree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

BENCH = ROOT / "scripts" / "bench"


def test_a_tests_cpu_counts_what_its_children_burn_and_its_group_goes_afterwards(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    # 0.6 s of CPU in a grandchild (what a test's pulumi, ssh or simulated host does), and a test that only waits.
    (project / "test_burn.py").write_text(
        "import subprocess, sys, time\n\n"
        "def test_burns():\n"
        "    code = 'import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.6: pass'\n"
        "    subprocess.run(['bash', '-c', f'{sys.executable} -c \"{code}\"'], check=True)\n\n"
        "def test_waits():\n"
        "    time.sleep(0.5)\n")
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, GLM_SUITE_CPU_DIR=str(out), PYTHONPATH=str(BENCH))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "suite_cpu", "-n", "1",
                        "test_burn.py"], cwd=project, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = {r["id"]: r for r in (json.loads(line) for line in (out / "gw0.jsonl").read_text().splitlines())}
    burns, waits = rows["test_burn.py::test_burns"], rows["test_burn.py::test_waits"]
    assert 0.55 <= burns["cpu"] <= burns["wall"] + 0.5, burns
    assert waits["wall"] >= 0.5 and waits["cpu"] < 0.3, waits
    assert burns["machine_busy"] >= 0.55, burns  # the machine saw it too
    assert not (Path("/sys/fs/cgroup/cpuacct/glm-suite-cpu") / out.name).exists(), "the run's groups go when it ends"


def test_the_report_sums_by_lane_and_lists_the_costliest(tmp_path):
    (tmp_path / "gw0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "tests/e2e/test_sim_e2e.py::test_up", "wall": 100.0, "cpu": 60.0},
        {"id": "tests/e2e/test_operations.py::test_sla", "wall": 50.0, "cpu": 10.0}]))
    (tmp_path / "gw1.jsonl").write_text(json.dumps({"id": "tests/test_render.py::test_x", "wall": 2.0, "cpu": 1.5}) + "\n")
    p = subprocess.run([sys.executable, str(BENCH / "suite_cpu.py"), "--report", str(tmp_path), "--top", "2"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "| fast tier | 2 | 2 | 0.75 |" in p.stdout and "| lane a | 100 | 60 | 0.60 |" in p.stdout
    assert "| lane b | 50 | 10 | 0.20 |" in p.stdout and "| all | | 72 | |" in p.stdout
    listed = [line for line in p.stdout.splitlines() if line.startswith("| ") and "::" in line]
    assert listed == ["| 60.0 | 100.0 | tests/e2e/test_sim_e2e.py::test_up |",
                      "| 10.0 | 50.0 | tests/e2e/test_operations.py::test_sla |"]
