"""How the suite schedules itself (tests/conftest.py): what boots simulated hosts is three lanes, each one
unit of work for pytest-xdist with a cluster of its own, first with workers (a worker starts on each at
once) and last in one process (the fast tier first)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import conftest
from conftest import ROOT

FILES = ["tests/test_render.py", "tests/e2e/test_rolling.py", "tests/test_sim_cluster.py", "tests/e2e/test_sim_e2e.py",
         "tests/test_hostcheck.py", "tests/e2e/test_operations.py", "tests/e2e/test_faults.py"]


class Item:
    def __init__(self, rel: str) -> None:
        self.path = ROOT / rel
        self.rel = rel
        self.marks: list = []

    def add_marker(self, mark) -> None:
        self.marks.append(mark)


def ordered(**option) -> list[Item]:
    items = [Item(f) for f in FILES]
    config = SimpleNamespace(option=SimpleNamespace(**option))
    conftest.pytest_collection_modifyitems(config, items)
    return items


def test_one_process_runs_the_fast_tier_first_then_the_cluster_lane_after_lane():
    items = ordered(numprocesses=None)
    assert [i.rel for i in items] == ["tests/test_render.py", "tests/test_hostcheck.py", "tests/test_sim_cluster.py",
                                      "tests/e2e/test_sim_e2e.py", "tests/e2e/test_operations.py",
                                      "tests/e2e/test_faults.py", "tests/e2e/test_rolling.py"]


def test_workers_get_each_lane_first_as_one_unit_and_the_fast_tier_loose():
    items = ordered(numprocesses=4)
    assert [i.rel for i in items][:5] == ["tests/test_sim_cluster.py", "tests/e2e/test_sim_e2e.py",
                                          "tests/e2e/test_operations.py", "tests/e2e/test_faults.py",
                                          "tests/e2e/test_rolling.py"]
    scopes = {f: conftest.scheduler_scope(f"{f}::test_x") for f in FILES}
    assert {f for f, s in scopes.items() if s == "simulated-cluster-a"} == {
        "tests/test_sim_cluster.py", "tests/e2e/test_sim_e2e.py"}
    assert {f for f, s in scopes.items() if s == "simulated-cluster-b"} == {"tests/e2e/test_operations.py"}
    assert {f for f, s in scopes.items() if s == "simulated-cluster-c"} == {
        "tests/e2e/test_faults.py", "tests/e2e/test_rolling.py"}
    assert scopes["tests/test_render.py"] == "tests/test_render.py::test_x", "the fast tier spreads over the workers"
    assert conftest.scheduler_scope("tests/test_render.py::test_y[sim]") != conftest.scheduler_scope("tests/test_render.py::test_x")


def test_the_scheduler_sends_each_lane_to_a_worker_of_its_own_in_order(tmp_path):
    """Through pytest-xdist itself: a copy of the suite's scheduling hooks, two modules of each lane
    whose tests record their worker, their network namespace and their run folder, and fast tests."""
    import subprocess
    import sys

    (tmp_path / "tests" / "e2e").mkdir(parents=True)
    hooks = (ROOT / "tests" / "conftest.py").read_text()
    (tmp_path / "tests" / "conftest.py").write_text(hooks)
    (tmp_path / "tests" / "proctree.py").write_text((ROOT / "tests" / "proctree.py").read_text())
    (tmp_path / "stacks").mkdir()
    record = ("import os\n\ndef _seen(name):\n    with open(os.environ['ORDER_LOG'], 'a') as f:\n"
              "        f.write(f\"{name} {os.environ['PYTEST_XDIST_WORKER']} {os.readlink('/proc/thread-self/ns/net')} "
              "{os.environ.get('GLM_SIM_RUN', '-')}\\n\")\n\n")
    for module in ("test_sim_e2e", "test_team_state", "test_operations", "test_fleet", "test_faults", "test_rolling"):
        (tmp_path / "tests" / "e2e" / f"{module}.py").write_text(
            record + "".join(f"def test_{module}_{n}():\n    _seen('{module}_{n}')\n\n" for n in (1, 2)))
    (tmp_path / "tests" / "test_fast.py").write_text(
        record + "".join(f"def test_fast_{n}():\n    _seen('fast_{n}')\n\n" for n in range(6)))
    log = tmp_path / "order.log"
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "4", "--dist", "load",
                        "--no-loadscope-reorder", "tests"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "ORDER_LOG": str(log)})
    assert p.returncode == 0, p.stdout + p.stderr
    seen = [line.split() for line in log.read_text().splitlines()]
    machine_net = __import__("os").readlink("/proc/thread-self/ns/net")
    lanes = {"a": ["test_sim_e2e_1", "test_sim_e2e_2", "test_team_state_1", "test_team_state_2"],
             "b": ["test_operations_1", "test_operations_2", "test_fleet_1", "test_fleet_2"],
             "c": ["test_faults_1", "test_faults_2", "test_rolling_1", "test_rolling_2"]}
    where = {}
    for lane, names in lanes.items():
        rows = [r for r in seen if r[0] in names]
        assert [r[0] for r in rows] == names, f"lane {lane} in order: {seen}"
        assert len({tuple(r[1:]) for r in rows}) == 1, f"lane {lane} on one worker, one namespace: {seen}"
        worker, net, run = rows[0][1:]
        assert net != machine_net and run == f"/run/glm-infra-sim-lane-{lane}", rows[0]
        where[lane] = (worker, net)
    assert len({w for w, _ in where.values()}) == len({n for _, n in where.values()}) == 3, \
        f"the lanes run side by side, apart: {where}"
    fast = [r for r in seen if r[0].startswith("fast")]
    assert len(fast) == 6 and all(r[2] == machine_net and r[3] == "-" for r in fast), "the fast tier stays on the machine"


def test_every_end_to_end_module_has_its_place():
    """A new module in no lane would run after the others, on hosts the last one left."""
    modules = {p.stem for p in (ROOT / "tests" / "e2e").glob("test_*.py")}
    assert modules == set(conftest.E2E_ORDER)
    lanes = [m for lane in conftest.CLUSTER_LANES.values() for m in lane]
    assert len(lanes) == len(set(lanes)), "a module in two lanes"
    assert all(Path(ROOT / "tests" / f"{m}.py").exists() for m in conftest.CLUSTER_MODULES)


def conftest_env() -> dict:
    """The environment of a process that imports tests/conftest.py as pytest would (pyproject.toml's
    pythonpath)."""
    import os

    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}


def test_the_cluster_worker_writes_its_stack_files_in_private():
    """What the worker driving the simulated hosts writes to stacks/ (pulumi config set) stays in its
    own mount namespace: the committed file, which the fast tier reads beside it, does not change."""
    import subprocess
    import sys

    sim = ROOT / "stacks" / "Pulumi.sim.yaml"
    before = sim.read_bytes()
    code = ("import sys; import conftest; conftest.private_stacks(); "
            "from pathlib import Path; p = Path(sys.argv[1]); p.write_text(p.read_text() + '# changed in private\\n'); "
            "print(p.read_text().splitlines()[-1])")
    p = subprocess.run([sys.executable, "-c", code, str(sim)], capture_output=True, text=True, timeout=60,
                       env=conftest_env())
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "# changed in private", "the worker sees its own change"
    assert sim.read_bytes() == before, "the committed file is as it was"
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(ROOT / "stacks") not in mounts, "nothing was mounted in the machine's namespace"


def test_a_lane_worker_has_its_own_network_state_and_run_folder():
    """What a lane's worker makes (its cluster's bridge, the file backend's state, nspawn's folder) stays
    in its namespaces: the machine, and the other lane, never see it."""
    import subprocess
    import sys

    state_file = ROOT / ".pulumi-state" / "lane-probe"
    code = ("import os, subprocess, sys; import conftest; "
            "conftest.private_stacks(); conftest.private_cluster('b'); "
            "subprocess.run(['ip', 'link', 'add', 'br-laneprobe', 'type', 'bridge'], check=True); "
            "open(sys.argv[1], 'w').write('x'); open('/run/systemd/nspawn/lane-probe', 'w').write('x'); "
            "print(os.environ['GLM_SIM_RUN'], subprocess.run(['ip', '-o', 'link', 'show', 'lo'], capture_output=True, "
            "text=True).stdout.count('<LOOPBACK,UP,'))")
    p = subprocess.run([sys.executable, "-c", code, str(state_file)], capture_output=True, text=True, timeout=60,
                       env=conftest_env())
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["/run/glm-infra-sim-lane-b", "1"], "its run folder, and loopback up for its servers"
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    assert "br-laneprobe" not in links, "the bridge was made in the lane's network namespace"
    assert not state_file.exists() and not Path("/run/systemd/nspawn/lane-probe").exists()
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(ROOT / ".pulumi-state") not in mounts, "nothing was mounted in the machine's namespace"


def test_the_end_says_how_long_each_lane_took(monkeypatch):
    """What balancing the lanes needs: each test's setup, call and teardown summed per lane and for the fast tier,
    on the controller (pytest-xdist sends it every worker's reports), printed once at the end."""
    monkeypatch.setattr(conftest, "LANE_SECONDS", {})
    for nodeid, seconds in [("tests/e2e/test_fleet.py::test_a", 100.0), ("tests/test_sim_cluster.py::test_b", 20.5),
                            ("tests/e2e/test_rolling.py::test_c", 30.0), ("tests/test_render.py::test_d", 0.25),
                            ("tests/e2e/test_fleet.py::test_a", 4.0)]:
        conftest.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, duration=seconds))
    lines: list[str] = []
    reporter = SimpleNamespace(config=SimpleNamespace(), write_line=lines.append)
    conftest.pytest_terminal_summary(reporter)
    assert lines == ["seconds per lane (setup, call and teardown summed): fast tier 0, lane a 20, lane b 104, lane c 30"]
    worker = SimpleNamespace(config=SimpleNamespace(workerinput={}), write_line=lines.append)
    conftest.pytest_terminal_summary(worker)
    assert len(lines) == 1, "a worker's summary is not shown: the controller's alone"
