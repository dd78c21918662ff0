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

import proctree
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent

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


def host_program(name: str, folder: Path) -> Path:
    """glm_infra/agent/NAME as the one file a host gets (glm_infra/agent/bundle.py), written to FOLDER/NAME.py."""
    from glm_infra.agent import bundle

    path = folder / f"{name}.py"
    path.write_text(bundle.program(name))
    path.chmod(0o755)
    return path


_BUNDLED: dict[str, Path] = {}


def bundled(name: str) -> Path:
    """glm_infra/agent/NAME as the one file a host gets, written once per test process to a folder of its own
    (removed at exit): what a test runs as a script, as a host would."""
    if name not in _BUNDLED:
        folder = Path(tempfile.mkdtemp(prefix=f"glm-{name}-bundle-"))
        atexit.register(shutil.rmtree, folder, True)
        _BUNDLED[name] = host_program(name, folder)
    return _BUNDLED[name]


def stack_file(name: str) -> Path:
    return ROOT / "stacks" / f"Pulumi.{name}.yaml"


def stack_config(name: str) -> dict:
    """The ``config:`` mapping of a committed stack, as a fresh dict."""
    return copy.deepcopy(yaml.safe_load(stack_file(name).read_text())["config"])


@pytest.fixture
def prod_config() -> dict:
    return stack_config("prod-b300")


def one_router(config: dict) -> dict:
    """A committed stack's ``config:`` with its router alone on router.host (no standby, no virtual address) and
    Prometheus where the router is: a single-router stack, as prod-b300 was before issue 40. Its keys with the
    glm-infra: prefix (a stack file's) or without (load_dict's)."""
    ns = "glm-infra:" if "glm-infra:router" in config else ""
    config[f"{ns}router"].pop("standbyHosts", None)
    config[f"{ns}router"].pop("virtualAddress", None)
    config.get(f"{ns}monitoring", {}).pop("host", None)
    return config


@pytest.fixture
def one_router_stack(tmp_path):
    """prod-b300 with one router (one_router), loaded."""
    from glm_infra.stack import load_file

    path = tmp_path / "Pulumi.one-router.yaml"
    path.write_text(yaml.safe_dump({"config": one_router(stack_config("prod-b300"))}, sort_keys=False))
    return load_file(path).config


@pytest.fixture
def write_stack(tmp_path):
    """Write a ``config:`` mapping (or raw text) as a stack file and return its path."""

    def write(config: dict | str, name: str = "Pulumi.test.yaml") -> Path:
        p = tmp_path / name
        p.write_text(config if isinstance(config, str) else yaml.safe_dump({"config": config}, sort_keys=False))
        return p

    return write


# --- the whole suite: end-to-end tests last, and nothing it started outlives it -------------------


# What boots simulated hosts runs in three lanes, each a unit of work on a worker of its own with a
# cluster of its own (private_cluster): the modules of a lane in this order, each leaving its lane's
# hosts as destroy leaves them for the next. The lanes are balanced by the seconds the suite prints per
# lane at its end (at 2ad5b0e, two lanes, by module: test_sim_e2e 881, test_operations 750, test_faults 550,
# test_rolling 425, test_fleet 392, test_team_state 157, test_examples 55, test_sim_cluster 40).
CLUSTER_LANES = {
    "a": ("test_sim_cluster", "test_sim_e2e", "test_team_state"),
    "b": ("test_operations", "test_fleet"),
    "c": ("test_faults", "test_rolling", "test_examples"),
}
CLUSTER_MODULES = ("test_sim_cluster",)  # outside tests/e2e
CLUSTER_GROUP = "simulated-cluster"
CLUSTER_ORDER = tuple(m for lane in CLUSTER_LANES.values() for m in lane)  # in one process: lane after lane
E2E_ORDER = tuple(m for m in CLUSTER_ORDER if m not in CLUSTER_MODULES)


def on_cluster_path(path: str) -> bool:
    path = path.replace(os.sep, "/")
    return "tests/e2e/" in path or Path(path).stem in CLUSTER_MODULES


def on_cluster(item) -> bool:
    return on_cluster_path(str(item.path))


def lane_of(path: str) -> str:
    stem = Path(path).stem
    return next((lane for lane, modules in CLUSTER_LANES.items() if stem in modules), next(iter(CLUSTER_LANES)))


def in_parallel(config) -> bool:
    """Run by pytest-xdist workers (scripts/test's -n 4), not in one process."""
    return (getattr(config.option, "numprocesses", None) or 0) != 0 or hasattr(config, "workerinput")


def pytest_collection_modifyitems(config, items):
    """The tests that boot simulated hosts, in CLUSTER_ORDER: in one process after everything fast has
    passed; with workers first, so that a worker starts on each lane at once (a lane is one unit of
    work: scheduler_scope) while another takes the fast tier."""
    parallel = in_parallel(config)

    def key(item) -> tuple[int, int]:
        if not on_cluster(item):
            return (1 if parallel else 0, 0)
        stem = item.path.stem
        return (0 if parallel else 1, CLUSTER_ORDER.index(stem) if stem in CLUSTER_ORDER else len(CLUSTER_ORDER))

    items.sort(key=key)


def scheduler_scope(nodeid: str) -> str:
    """The unit of work a test is sent to a worker in: each lane of the tests that boot simulated hosts
    in one (one worker, collection order), every other test alone (spread over the workers)."""
    path = nodeid.split("::", 1)[0]
    return f"{CLUSTER_GROUP}-{lane_of(path)}" if on_cluster_path(path) else nodeid


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    # pytest-xdist's own grouping (--dist loadgroup, xdist_group marks) rewrites item._nodeid, which
    # pytest 9 no longer reads (Node.nodeid comes from _id): the scopes are given here instead.
    from xdist.scheduler import LoadScopeScheduling

    class LanesAsUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scheduler_scope(nodeid)

        def _reschedule(self, node) -> None:
            # A worker still driving its lane's hosts takes nothing else: a fast test would nice it
            # (pytest_runtest_setup) and the lane's wall-clock bounds (SLA gate, boot) with it.
            pending = (n for scope, unit in self.assigned_work.get(node, {}).items()
                       if scope.startswith(CLUSTER_GROUP) for n, done in unit.items() if not done)
            if any(True for _ in pending):
                return
            super()._reschedule(node)

    return LanesAsUnits(config, log)


def private_stacks() -> Path:
    """From now on this process (its main thread) and what it starts see a copy of stacks/ in a mount
    namespace of their own: the end-to-end tests change stacks/Pulumi.sim.yaml (`pulumi config set`, put
    back at the end of each module) while, with workers, the fast tier beside them reads the
    committed stack files, by name too (`glm-infra plan sim`). Returns the copy."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS): the suite runs as root")
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)  # nothing mounted here reaches the machine
    private = _private_dir("stacks")
    shutil.copytree(ROOT / "stacks", private, dirs_exist_ok=True)
    subprocess.run(["mount", "--bind", str(private), str(ROOT / "stacks")], check=True)
    return private


def private_cluster(lane: str) -> None:
    """This worker's own simulated cluster, beside another worker's: from now on this process (its main
    thread) and what it starts have a network namespace of their own (the sim stack's bridge and
    addresses, loopback ports), the cluster's run folder (GLM_SIM_RUN), and, in the mount namespace of
    private_stacks, their own file backend (.pulumi-state) and nspawn folder. The machine's cache
    (image, stand-ins, toolchain) stays shared: scripts/sim builds it under a lock."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x40000000) != 0:  # CLONE_NEWNET
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET): the suite runs as root")
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    state = ROOT / ".pulumi-state"
    state.mkdir(exist_ok=True)
    subprocess.run(["mount", "--bind", str(_private_dir("pulumi-state")), str(state)], check=True)
    Path("/run/systemd/nspawn").mkdir(parents=True, exist_ok=True)  # nspawn keeps a folder per host name here
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", "/run/systemd/nspawn"], check=True)
    os.environ["GLM_SIM_RUN"] = f"/run/glm-infra-sim-lane-{lane}"


def prepare_cluster_cache() -> None:
    """Make what the clusters take from the network (host image, stand-ins, SLA client, toolchain) while
    this process still has the machine's network: a lane's namespace has none. Lanes wait for each
    other's builds on locks; on a machine with the builds cached this only checks them."""
    if not (ROOT / "scripts" / "sim").exists():
        return  # a copy of these hooks without the project (tests/test_suite_order.py)
    for cmd in (["scripts/sim", "prepare"], ["scripts/toolchain"]):
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")


def _private_dir(what: str) -> Path:
    d = Path(tempfile.mkdtemp(prefix=f"glm-infra-e2e-{what}-"))
    atexit.register(shutil.rmtree, d, True)
    return d


_WORKER = {"niced": False, "lane": ""}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """With workers: one driving a lane of simulated hosts does it in private (its stack files, its
    cluster); one on the fast tier yields the CPU to the lanes (their waits are bounded in wall-clock
    time: the SLA gate, boot and health deadlines), so the fast tier takes what is left."""
    if not hasattr(item.config, "workerinput"):
        return
    if on_cluster(item):
        if not _WORKER["lane"]:
            prepare_cluster_cache()
            private_stacks()
            private_cluster(lane_of(str(item.path)))
            _WORKER["lane"] = lane_of(str(item.path))
    elif not _WORKER["niced"]:
        os.nice(10)
        _WORKER["niced"] = True


_SESSION = {"id": "", "since": 0.0}
# Seconds of setup, call and teardown per lane of CLUSTER_LANES and for the fast tier: what balancing the lanes
# needs (the suite's wall time is its longest lane's), printed at the end.
LANE_SECONDS: dict[str, float] = {}


def lane_label(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return f"lane {lane_of(path)}" if on_cluster_path(path) else "fast tier"


def pytest_runtest_logreport(report):
    label = lane_label(report.nodeid)
    LANE_SECONDS[label] = LANE_SECONDS.get(label, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if LANE_SECONDS and not hasattr(terminalreporter.config, "workerinput"):
        terminalreporter.write_line("seconds per lane (setup, call and teardown summed): " + ", ".join(
            f"{label} {seconds:.0f}" for label, seconds in sorted(LANE_SECONDS.items())))


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
