from __future__ import annotations

import atexit
import copy
import ctypes
import os
import shutil
import socket
import subprocess
import sys
import tempfile
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
# What boots simulated hosts (one cluster on br-glmsim at a time): one worker runs all of it, in order.
CLUSTER_MODULES = ("test_sim_cluster",)
CLUSTER_GROUP = "simulated-cluster"
CLUSTER_ORDER = (*CLUSTER_MODULES, *E2E_ORDER)


def on_cluster_path(path: str) -> bool:
    path = path.replace(os.sep, "/")
    return "tests/e2e/" in path or Path(path).stem in CLUSTER_MODULES


def on_cluster(item) -> bool:
    return on_cluster_path(str(item.path))


def in_parallel(config) -> bool:
    """Run by pytest-xdist workers (scripts/test's -n 2), not in one process."""
    return (getattr(config.option, "numprocesses", None) or 0) != 0 or hasattr(config, "workerinput")


def pytest_collection_modifyitems(config, items):
    """The tests that boot simulated hosts, its end-to-end modules in E2E_ORDER: in one process after
    everything fast has passed; with workers first, so that one worker starts on them at once (they are
    one unit of work: scheduler_scope) while the other takes the fast tier."""
    parallel = in_parallel(config)

    def key(item) -> tuple[int, int]:
        if not on_cluster(item):
            return (1 if parallel else 0, 0)
        stem = item.path.stem
        return (0 if parallel else 1, CLUSTER_ORDER.index(stem) if stem in CLUSTER_ORDER else len(CLUSTER_ORDER))

    items.sort(key=key)


def scheduler_scope(nodeid: str) -> str:
    """The unit of work a test is sent to a worker in: every test that boots simulated hosts in one
    (one worker, collection order), every other test alone (spread over both workers)."""
    return CLUSTER_GROUP if on_cluster_path(nodeid.split("::", 1)[0]) else nodeid


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    # pytest-xdist's own grouping (--dist loadgroup, xdist_group marks) rewrites item._nodeid, which
    # pytest 9 no longer reads (Node.nodeid comes from _id): the scopes are given here instead.
    from xdist.scheduler import LoadScopeScheduling

    class ClusterAsOneUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scheduler_scope(nodeid)

    return ClusterAsOneUnit(config, log)


def private_stacks() -> Path:
    """From now on this process (its main thread) and what it starts see a copy of stacks/ in a mount
    namespace of their own: the end-to-end tests change stacks/Pulumi.sim.yaml (`pulumi config set`, put
    back at the end of each module) while, with two workers, the fast tier beside them reads the
    committed stack files, by name too (`glm-infra plan sim`). Returns the copy."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS): the suite runs as root")
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)  # nothing mounted here reaches the machine
    private = Path(tempfile.mkdtemp(prefix="glm-infra-e2e-stacks-"))
    shutil.copytree(ROOT / "stacks", private, dirs_exist_ok=True)
    subprocess.run(["mount", "--bind", str(private), str(ROOT / "stacks")], check=True)
    atexit.register(shutil.rmtree, private, True)
    return private


_WORKER = {"niced": False, "private": False}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """With workers: the one driving the simulated hosts writes its stack files in private; one on the
    fast tier yields the CPU to it (its waits are bounded in wall-clock time: the SLA gate, boot and
    health deadlines), so the fast tier takes what is left."""
    if not hasattr(item.config, "workerinput"):
        return
    cluster = on_cluster(item)
    if cluster and not _WORKER["private"]:
        private_stacks()
        _WORKER["private"] = True
    elif not cluster and not _WORKER["niced"]:
        os.nice(10)
        _WORKER["niced"] = True


_SESSION = {"id": "", "since": 0.0}


def pytest_sessionstart(session):
    # Every process the suite starts inherits this; the check below finds them by it. A new id per
    # session: a tool that forks pytest sessions (mutmut) must not see its siblings as leftovers.
    # An xdist worker keeps its controller's: the controller checks once every worker is done.
    if hasattr(session.config, "workerinput") and os.environ.get(proctree.SESSION_VAR):
        _SESSION["id"] = os.environ[proctree.SESSION_VAR]
        return
    _SESSION["id"] = proctree.new_session_id()
    os.environ[proctree.SESSION_VAR] = _SESSION["id"]
    _SESSION["since"] = time.time()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):
        return  # the other worker's hosts may still be running: the controller checks at the end
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
