"""How the suite schedules itself (tests/conftest.py): what boots simulated hosts is one xdist group,
first with workers (one worker starts on it at once) and last in one process (the fast tier first)."""

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


def groups(items: list[Item]) -> dict[str, list[str]]:
    return {i.rel: [m.args[0] for m in i.marks if m.name == "xdist_group"] for i in items}


def test_one_process_runs_the_fast_tier_first_then_the_cluster_in_order():
    items = ordered(numprocesses=None)
    assert [i.rel for i in items] == ["tests/test_render.py", "tests/test_hostcheck.py", "tests/test_sim_cluster.py",
                                      "tests/e2e/test_sim_e2e.py", "tests/e2e/test_operations.py",
                                      "tests/e2e/test_faults.py", "tests/e2e/test_rolling.py"]


def test_workers_get_the_cluster_first_as_one_group_and_the_fast_tier_loose():
    items = ordered(numprocesses=2)
    assert [i.rel for i in items][:5] == ["tests/test_sim_cluster.py", "tests/e2e/test_sim_e2e.py",
                                          "tests/e2e/test_operations.py", "tests/e2e/test_faults.py",
                                          "tests/e2e/test_rolling.py"]
    g = groups(items)
    assert {k for k, v in g.items() if v == ["simulated-cluster"]} == {f for f in FILES if "e2e" in f or "sim_cluster" in f}
    assert g["tests/test_render.py"] == g["tests/test_hostcheck.py"] == [], "the fast tier spreads over both workers"


def test_every_end_to_end_module_has_its_place():
    """A new module not in E2E_ORDER would run after the others, on hosts the last one left."""
    modules = {p.stem for p in (ROOT / "tests" / "e2e").glob("test_*.py")}
    assert modules == set(conftest.E2E_ORDER)
    assert all(Path(ROOT / "tests" / f"{m}.py").exists() for m in conftest.CLUSTER_MODULES)
