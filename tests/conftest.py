from __future__ import annotations

import copy
import os
import socket
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import proctree  # noqa: E402

STACKS = sorted(p.name[len("Pulumi.") : -len(".yaml")] for p in (ROOT / "stacks").glob("Pulumi.*.yaml"))
PROD_STACKS = [s for s in STACKS if s != "sim"]


def free_port() -> int:
    """A loopback TCP port nothing listens on now (for a server a test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int) -> None:
    """Until something listens on the loopback ``port``; fails after 10 s."""
    for _ in range(200):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on {port}")


def stack_file(name: str) -> Path:
    return ROOT / "stacks" / f"Pulumi.{name}.yaml"


def stack_config(name: str) -> dict:
    """The ``config:`` mapping of a committed stack, as a fresh dict."""
    return copy.deepcopy(yaml.safe_load(stack_file(name).read_text())["config"])


@pytest.fixture
def prod_config() -> dict:
    return stack_config("prod-b300")


@pytest.fixture
def write_stack(tmp_path):
    """Write a ``config:`` mapping (or raw text) as a stack file and return its path."""

    def write(config: dict | str, name: str = "Pulumi.test.yaml") -> Path:
        p = tmp_path / name
        p.write_text(config if isinstance(config, str) else yaml.safe_dump({"config": config}, sort_keys=False))
        return p

    return write


# --- the whole suite: end-to-end tests last, and nothing it started outlives it -------------------


E2E_ORDER = ("test_sim_e2e", "test_operations", "test_faults", "test_team_state", "test_examples", "test_rolling")  # each module leaves the hosts for the next


def pytest_collection_modifyitems(config, items):
    """The end-to-end suite (minutes, the real engine) runs after everything fast has passed, its
    modules in E2E_ORDER."""

    def key(item) -> tuple[int, int]:
        if "/tests/e2e/" not in str(item.path).replace(os.sep, "/"):
            return (0, 0)
        stem = item.path.stem
        return (1, E2E_ORDER.index(stem) if stem in E2E_ORDER else len(E2E_ORDER))

    items.sort(key=key)


_SESSION = {"id": "", "since": 0.0}


def pytest_sessionstart(session):
    # Every process the suite starts inherits this; the check below finds them by it. A new id per
    # session: a tool that forks pytest sessions (mutmut) must not see its siblings as leftovers.
    _SESSION["id"] = proctree.new_session_id()
    os.environ[proctree.SESSION_VAR] = _SESSION["id"]
    _SESSION["since"] = time.time()


def pytest_sessionfinish(session, exitstatus):
    keep = proctree.ancestors(os.getpid())
    deadline = time.monotonic() + 15  # hosts halting and servers closing get a moment
    left = proctree.leftovers(_SESSION["id"], _SESSION["since"], keep)
    while left and time.monotonic() < deadline:
        time.sleep(1)
        left = proctree.leftovers(_SESSION["id"], _SESSION["since"], keep)
    if not left:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [f"{len(left)} process(es) the test suite started outlived it (killed now):"]
    lines += [f"  {p}" for p in left]
    if reporter is not None:
        reporter.write_line("\n".join(lines), red=True, bold=True)
    else:
        print("\n".join(lines), file=sys.stderr)
    for p in left:
        proctree.kill_tree(p.pid)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
