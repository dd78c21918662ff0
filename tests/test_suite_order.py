"""How the suite schedules itself (tests/conftest.py): what boots simulated hosts is one unit of work
for pytest-xdist, first with workers (one worker starts on it at once) and last in one process (the
fast tier first)."""

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


def test_one_process_runs_the_fast_tier_first_then_the_cluster_in_order():
    items = ordered(numprocesses=None)
    assert [i.rel for i in items] == ["tests/test_render.py", "tests/test_hostcheck.py", "tests/test_sim_cluster.py",
                                      "tests/e2e/test_sim_e2e.py", "tests/e2e/test_operations.py",
                                      "tests/e2e/test_faults.py", "tests/e2e/test_rolling.py"]


def test_workers_get_the_cluster_first_as_one_unit_and_the_fast_tier_loose():
    items = ordered(numprocesses=2)
    assert [i.rel for i in items][:5] == ["tests/test_sim_cluster.py", "tests/e2e/test_sim_e2e.py",
                                          "tests/e2e/test_operations.py", "tests/e2e/test_faults.py",
                                          "tests/e2e/test_rolling.py"]
    scopes = {f: conftest.scheduler_scope(f"{f}::test_x") for f in FILES}
    assert {f for f, s in scopes.items() if s == "simulated-cluster"} == {f for f in FILES if "e2e" in f or "sim_cluster" in f}
    assert scopes["tests/test_render.py"] == "tests/test_render.py::test_x", "the fast tier spreads over both workers"
    assert conftest.scheduler_scope("tests/test_render.py::test_y[sim]") != conftest.scheduler_scope("tests/test_render.py::test_x")


def test_the_scheduler_sends_the_cluster_to_one_worker_in_order(tmp_path):
    """Through pytest-xdist itself: a copy of the suite's scheduling hooks, three 'cluster' tests that
    record their worker, two fast ones."""
    import subprocess
    import sys

    (tmp_path / "tests" / "e2e").mkdir(parents=True)
    hooks = (ROOT / "tests" / "conftest.py").read_text()
    (tmp_path / "tests" / "conftest.py").write_text(hooks)
    (tmp_path / "tests" / "proctree.py").write_text((ROOT / "tests" / "proctree.py").read_text())
    (tmp_path / "stacks").mkdir()
    record = ("import os\n\ndef _seen(name):\n    with open(os.environ['ORDER_LOG'], 'a') as f:\n"
              "        f.write(f\"{name} {os.environ['PYTEST_XDIST_WORKER']}\\n\")\n\n")
    for module in ("test_sim_e2e", "test_operations"):
        (tmp_path / "tests" / "e2e" / f"{module}.py").write_text(
            record + "".join(f"def test_{module}_{n}():\n    _seen('{module}_{n}')\n\n" for n in (1, 2)))
    (tmp_path / "tests" / "test_fast.py").write_text(
        record + "".join(f"def test_fast_{n}():\n    _seen('fast_{n}')\n\n" for n in range(6)))
    log = tmp_path / "order.log"
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "load",
                        "--no-loadscope-reorder", "tests"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "ORDER_LOG": str(log)})
    assert p.returncode == 0, p.stdout + p.stderr
    seen = [line.split() for line in log.read_text().splitlines()]
    cluster = [(n, w) for n, w in seen if not n.startswith("fast")]
    assert [n for n, _ in cluster] == ["test_sim_e2e_1", "test_sim_e2e_2", "test_operations_1", "test_operations_2"]
    assert len({w for _, w in cluster}) == 1, f"one worker drives the cluster: {seen}"
    assert {w for n, w in seen if n.startswith("fast")} - {w for _, w in cluster}, "the other worker takes the fast tier"


def test_every_end_to_end_module_has_its_place():
    """A new module not in E2E_ORDER would run after the others, on hosts the last one left."""
    modules = {p.stem for p in (ROOT / "tests" / "e2e").glob("test_*.py")}
    assert modules == set(conftest.E2E_ORDER)
    assert all(Path(ROOT / "tests" / f"{m}.py").exists() for m in conftest.CLUSTER_MODULES)


def test_the_cluster_worker_writes_its_stack_files_in_private():
    """What the worker driving the simulated hosts writes to stacks/ (pulumi config set) stays in its
    own mount namespace: the committed file, which the fast tier reads beside it, does not change."""
    import subprocess
    import sys

    sim = ROOT / "stacks" / "Pulumi.sim.yaml"
    before = sim.read_bytes()
    code = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; import conftest; conftest.private_stacks(); "
            "from pathlib import Path; p = Path(sys.argv[3]); p.write_text(p.read_text() + '# changed in private\\n'); "
            "print(p.read_text().splitlines()[-1])")
    p = subprocess.run([sys.executable, "-c", code, str(ROOT / "tests"), str(ROOT), str(sim)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "# changed in private", "the worker sees its own change"
    assert sim.read_bytes() == before, "the committed file is as it was"
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(ROOT / "stacks") not in mounts, "nothing was mounted in the machine's namespace"
