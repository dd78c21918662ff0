"""glm-vllm-placement.sh: before a host's instances start, what the plan moved off the host is stopped and
removed and what moves to other GPUs or ports is stopped, against stub systemctl in a mount namespace.
Where an instance runs is read from its installed unit (rendered here by vllm.vllm_unit, as the unit step
writes it), never from what the step recorded."""

from __future__ import annotations

import pytest
from conftest import STACKS, stack_config, stack_file
from stubs import StubPath, in_root, isolated, shellcheck

from glm_infra.plan import topology
from glm_infra.roles import vllm
from glm_infra.spec import paths
from glm_infra.spec.config import StackConfig
from glm_infra.stack import load_file, unprefixed

DIRS = ["/etc/systemd/system", paths.STATE, paths.LIBEXEC]
UNITS = "/etc/systemd/system"


def _stack(name: str = "sim", **prefill) -> StackConfig:
    cfg = unprefixed(stack_config(name))
    if prefill:
        cfg["prefill"] = {**cfg["prefill"], **prefill}
    return StackConfig.model_validate(cfg)


BEFORE = _stack()
# The proposal applied over it: four TP2 instances of prefill per host where there were two of DP4.
AFTER = _stack(instancesPerHost=4, tp=2, dp=1, ep=False)


def script(stack: StackConfig, host: str) -> str:
    return vllm.placement_step(host, [i for i in topology.plan(stack).instances if i.host == host]).stdin


def instance(stack: StackConfig, unit: str) -> topology.Instance:
    return next(i for i in topology.plan(stack).instances if i.unit == unit)


@pytest.fixture
def stubs(tmp_path):
    s = StubPath(tmp_path)
    # a unit's state is the content of $STATE/active/UNIT (active when empty); no file: inactive
    s.add("systemctl", """mkdir -p "$STATE/active"
case "$1" in
  is-active)
    u="${@: -1}"
    if [ -e "$STATE/active/$u" ]; then s=$(cat "$STATE/active/$u"); s=${s:-active}; else s=inactive; fi
    [ "$2" = --quiet ] || echo "$s"
    [ "$s" = active ] ;;
  stop) rm -f "$STATE/active/$2" ;;
  disable) rm -f "$STATE/active/${@: -1}" ;;
  *) exit 0 ;;
esac""")
    return s


def _install(tmp_path, stubs, stack: StackConfig, *units: str, state: str | None = "") -> None:
    """Write each unit as the unit step renders it for ``stack``; ``state``: what systemd says of it
    ("" active, "activating", "failed", …; None: inactive)."""
    for u in units:
        path = in_root(tmp_path, f"{UNITS}/{u}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(vllm.vllm_unit(stack, instance(stack, u)))
        (stubs.state / "active").mkdir(exist_ok=True)
        if state is None:
            (stubs.state / "active" / u).unlink(missing_ok=True)
        else:
            (stubs.state / "active" / u).write_text(state)


def run(stubs, tmp_path, stack: StackConfig, host: str, action: str):
    return isolated(stubs, script(stack, host), [action], DIRS, tmp_path)


def test_shellcheck_clean(tmp_path):
    r = shellcheck(script(BEFORE, "sim-1"), tmp_path)
    assert r.returncode == 0, r.stdout


def test_units_where_the_plan_puts_them_stop_nothing(tmp_path, stubs):
    """A host deployed before this step, its units where the plan puts them: nothing stops, check passes."""
    _install(tmp_path, stubs, BEFORE, "glm-vllm-prefill-0.service", "glm-vllm-prefill-1.service")
    r = run(stubs, tmp_path, BEFORE, "sim-1", "apply")
    assert r.returncode == 0, r.stderr
    assert not r.called("systemctl stop") and not r.called("systemctl disable")
    assert "sim-1: instances here: 2 planned; 0 removed, 0 moving" in r.stdout
    again = run(stubs, tmp_path, BEFORE, "sim-1", "check")
    assert again.returncode == 0, again.stderr
    assert "sim-1: every instance unit here is planned here and runs where the plan puts it" in again.stdout


def test_without_records_a_moved_instance_is_stopped_and_check_names_it(tmp_path, stubs):
    """Issue 38: a host with no placement records (deployed before the step) kept a moved instance running
    on its old GPUs and ports, and check then said nothing had drifted. Its unit says where it runs."""
    _install(tmp_path, stubs, BEFORE, "glm-vllm-prefill-0.service", "glm-vllm-prefill-1.service")
    assert not in_root(tmp_path, paths.PLACEMENT_DIR).exists()
    before = run(stubs, tmp_path, AFTER, "sim-1", "check")
    assert before.returncode == 1
    assert ("sim-1: glm-vllm-prefill-0.service runs on gpus:0,1,2,3;http:8100;rpc:29550;nixl:5600+4 (its unit), "
            "the plan puts it on gpus:0,1;http:8100;rpc:29550;nixl:5600+1") in before.stderr, before.stderr
    r = run(stubs, tmp_path, AFTER, "sim-1", "apply")
    assert r.returncode == 0, r.stderr
    assert ("sim-1: glm-vllm-prefill-0.service moves from gpus:0,1,2,3;http:8100;rpc:29550;nixl:5600+4 to "
            "gpus:0,1;http:8100;rpc:29550;nixl:5600+1 here: stopping it until its rollout starts it there") in r.stdout
    assert "systemctl stop glm-vllm-prefill-0.service" in r.calls and "systemctl stop glm-vllm-prefill-1.service" in r.calls
    # Until the unit step writes the new units, check still sees where they would start: drift.
    after = run(stubs, tmp_path, AFTER, "sim-1", "check")
    assert after.returncode == 1 and after.stderr.count("(its unit), the plan puts it on") == 2, after.stderr
    # Applied again (an up re-run before the units are rewritten): stopped already, nothing more stops.
    again = run(stubs, tmp_path, AFTER, "sim-1", "apply")
    assert again.returncode == 0 and not again.called("systemctl stop"), again.calls
    assert "glm-vllm-prefill-0.service moves from" in again.stdout and "it is inactive" in again.stdout
    # The unit step writes them where the plan puts them: no drift, nothing stops.
    _install(tmp_path, stubs, AFTER, "glm-vllm-prefill-0.service", "glm-vllm-prefill-1.service")
    assert run(stubs, tmp_path, AFTER, "sim-1", "check").returncode == 0
    assert not run(stubs, tmp_path, AFTER, "sim-1", "apply").called("systemctl stop")


def test_records_that_agree_with_the_plan_decide_nothing(tmp_path, stubs):
    """Records an older glm-infra wrote for the new plan (its apply ran, the instance kept its old place):
    the unit still says the old place, so check fails and apply stops it; the records go."""
    _install(tmp_path, stubs, BEFORE, "glm-vllm-prefill-0.service")
    records = in_root(tmp_path, paths.PLACEMENT_DIR)
    records.mkdir(parents=True)
    (records / "glm-vllm-prefill-0.service").write_text(vllm.placement(instance(AFTER, "glm-vllm-prefill-0.service")) + "\n")
    assert run(stubs, tmp_path, AFTER, "sim-1", "check").returncode == 1
    r = run(stubs, tmp_path, AFTER, "sim-1", "apply")
    assert r.returncode == 0 and "systemctl stop glm-vllm-prefill-0.service" in r.calls, r.stdout + r.stderr
    assert not records.exists()


@pytest.mark.parametrize("state, stops", [("", True), ("activating", True), ("deactivating", True),
                                          ("failed", False), (None, False)])
def test_a_moved_unit_is_stopped_unless_it_is_down(tmp_path, stubs, state, stops):
    """Between two automatic restarts a unit is "activating": it would come back where it was."""
    _install(tmp_path, stubs, BEFORE, "glm-vllm-prefill-1.service", state=state)
    r = run(stubs, tmp_path, AFTER, "sim-1", "apply")
    assert r.returncode == 0, r.stderr
    assert ("systemctl stop glm-vllm-prefill-1.service" in r.calls) == stops, r.calls


def test_a_re_layout_stops_what_leaves_and_what_moves_and_keeps_the_rest(tmp_path, stubs):
    # sim-2 ran prefill-2 and -3; the new layout puts prefill-4..7 there and prefill-2 and -3 on sim-1.
    _install(tmp_path, stubs, BEFORE, "glm-vllm-prefill-2.service", "glm-vllm-prefill-3.service")
    libexec = in_root(tmp_path, paths.LIBEXEC)
    libexec.mkdir(parents=True, exist_ok=True)
    (libexec / "glm-vllm-prefill-2.sh").write_text('#!/bin/bash\necho "prefill-2 script: $1"\nsystemctl disable --now glm-vllm-prefill-2.service\n')
    (libexec / "glm-vllm-prefill-2.sh").chmod(0o755)
    assert run(stubs, tmp_path, BEFORE, "sim-2", "apply").returncode == 0
    r = run(stubs, tmp_path, AFTER, "sim-2", "apply")
    assert r.returncode == 0, r.stderr
    assert "sim-2: glm-vllm-prefill-2.service is not planned here any more: stopping and removing it" in r.stdout
    assert "prefill-2 script: remove" in r.stdout, "through the instance's own script where it is there"
    assert "systemctl disable --now --quiet glm-vllm-prefill-3.service" in r.calls, "else by systemctl"
    assert not in_root(tmp_path, f"{UNITS}/glm-vllm-prefill-2.service").exists()
    assert not (libexec / "glm-vllm-prefill-2.sh").exists()
    assert "sim-2: instances here: 4 planned; 2 removed, 0 moving" in r.stdout

    # sim-1 keeps prefill-0 and -1 on other GPUs and ports: stopped until their rollout; nothing removed.
    _install(tmp_path, stubs, BEFORE, "glm-vllm-prefill-0.service", "glm-vllm-prefill-1.service")
    r = run(stubs, tmp_path, AFTER, "sim-1", "apply")
    assert r.returncode == 0, r.stderr
    assert "systemctl stop glm-vllm-prefill-0.service" in r.calls and "systemctl stop glm-vllm-prefill-1.service" in r.calls
    assert in_root(tmp_path, f"{UNITS}/glm-vllm-prefill-0.service").exists()
    assert "sim-1: instances here: 4 planned; 0 removed, 2 moving" in r.stdout


def test_check_names_an_instance_the_plan_does_not_put_here(tmp_path, stubs):
    _install(tmp_path, stubs, BEFORE, "glm-vllm-prefill-0.service", "glm-vllm-prefill-1.service", "glm-vllm-decode-0.service")
    r = run(stubs, tmp_path, BEFORE, "sim-1", "check")
    assert r.returncode == 1 and "sim-1: glm-vllm-decode-0.service is installed here but not planned here" in r.stderr


def _edit(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new)


UNREADABLE = {
    "no-port": (lambda u: _edit(u, " --port 8101", ""), "no --port in its ExecStart"),
    "port-not-a-number": (lambda u: _edit(u, " --port 8101", " --port 81x1"), "its ExecStart gives --port '81x1', not a number"),
    "port-given-twice": (lambda u: _edit(u, " --port 8101", " --port 8101 --port=8102"), "its ExecStart gives --port twice"),
    "no-rpc-port": (lambda u: _edit(u, " --data-parallel-rpc-port 29551", ""), "no --data-parallel-rpc-port in its ExecStart"),
    "no-dp": (lambda u: _edit(u, " -dp 4", ""), "no -dp in its ExecStart"),
    "no-gpus": (lambda u: _edit(u, "Environment=CUDA_VISIBLE_DEVICES=4,5,6,7\n", ""), "no Environment=CUDA_VISIBLE_DEVICES"),
    "gpus-garbled": (lambda u: _edit(u, "CUDA_VISIBLE_DEVICES=4,5,6,7", "CUDA_VISIBLE_DEVICES=GPU-4"),
                     "Environment=CUDA_VISIBLE_DEVICES=GPU-4: not a list of GPU indices"),
    # systemd ignores an Environment= line it cannot split (an unbalanced quote): the variable is not set.
    "gpus-unbalanced-quote": (lambda u: _edit(u, "CUDA_VISIBLE_DEVICES=4,5,6,7", "CUDA_VISIBLE_DEVICES='4,5,6,7"),
                              "no Environment=CUDA_VISIBLE_DEVICES"),
    "no-nixl-port": (lambda u: _edit(u, "Environment=VLLM_NIXL_SIDE_CHANNEL_PORT=5604\n", ""),
                     "no Environment=VLLM_NIXL_SIDE_CHANNEL_PORT (a prefill instance's KV transfer)"),
    "no-exec-start": (lambda u: "\n".join(l for l in u.splitlines() if not l.startswith("ExecStart=")) + "\n",
                      "no ExecStart= in its [Service] section"),
    "exec-start-twice": (lambda u: _edit(u, "\nRestart=on-failure", "\nExecStart=/bin/true\nRestart=on-failure"),
                         "a second ExecStart= (a Type=exec unit runs one)"),
    "unbalanced-quote": (lambda u: _edit(u, " --port 8101", " --port '8101"), "ExecStart= does not split into words"),
    "empty": (lambda u: "", "no ExecStart= in its [Service] section"),
}


@pytest.mark.parametrize("edit", list(UNREADABLE), ids=list(UNREADABLE))
def test_a_unit_that_does_not_say_where_it_runs_is_named_and_stops_nothing(tmp_path, stubs, edit):
    change, why = UNREADABLE[edit]
    _install(tmp_path, stubs, BEFORE, "glm-vllm-prefill-0.service", "glm-vllm-prefill-1.service", "glm-vllm-decode-0.service")
    unit = in_root(tmp_path, f"{UNITS}/glm-vllm-prefill-1.service")
    unit.write_text(change(unit.read_text()))
    r = run(stubs, tmp_path, BEFORE, "sim-1", "check")
    assert r.returncode == 1 and f"sim-1: glm-vllm-prefill-1.service: cannot tell where it runs: " in r.stderr, r.stderr
    assert why in r.stderr, r.stderr
    # apply: named, and nothing stopped or removed (decode-0, not planned here, stays until the unit is fixed).
    r = run(stubs, tmp_path, AFTER, "sim-1", "apply")
    assert r.returncode == 1 and why in r.stderr and "nothing stopped" in r.stderr, r.stdout + r.stderr
    assert not r.called("systemctl stop") and not r.called("systemctl disable"), r.calls
    assert in_root(tmp_path, f"{UNITS}/glm-vllm-decode-0.service").exists()


def test_a_drop_in_is_where_the_unit_runs(tmp_path, stubs):
    """systemd reads a unit's drop-ins after it: one that moves the instance's GPUs or port moves it."""
    _install(tmp_path, stubs, BEFORE, "glm-vllm-prefill-0.service")
    dropins = in_root(tmp_path, f"{UNITS}/glm-vllm-prefill-0.service.d")
    dropins.mkdir()
    (dropins / "10-gpus.conf").write_text("[Service]\nEnvironment=CUDA_VISIBLE_DEVICES=4,5,6,7\n")
    (dropins / "20-port.conf").write_text("[Service]\nExecStart=\nExecStart=/opt/vllm serve m -dp 4 --port 8105 "
                                          "--data-parallel-rpc-port 29550\n")
    r = run(stubs, tmp_path, BEFORE, "sim-1", "check")
    assert r.returncode == 1 and ("glm-vllm-prefill-0.service runs on gpus:4,5,6,7;http:8105;rpc:29550;nixl:5600+4 "
                                  "(its unit)") in r.stderr, r.stderr
    (dropins / "20-port.conf").write_text("# nothing\n")
    (dropins / "10-gpus.conf").write_text("[Service]\nEnvironment=\"CUDA_VISIBLE_DEVICES=0,1,2,3\" HOME=/tmp\n"
                                          "Environment=GLM_NOTE=it's\n")  # a line systemd ignores
    assert run(stubs, tmp_path, BEFORE, "sim-1", "check").returncode == 0


@pytest.mark.parametrize("name", STACKS)
def test_every_stacks_units_read_back_where_the_plan_puts_them(tmp_path, stubs, name):
    """The plan's placement (vllm.placement) and the script's reading of the unit vllm.vllm_unit renders agree
    for every instance of every committed stack (a colocated one has no NIXL side channel)."""
    stack = load_file(stack_file(name)).config
    p = topology.plan(stack)
    for h in p.hosts:
        if not h.instances:
            continue
        for old in in_root(tmp_path, UNITS).glob("glm-vllm-*") if in_root(tmp_path, UNITS).exists() else []:
            old.unlink()
        _install(tmp_path, stubs, stack, *(i.unit for i in h.instances))
        r = run(stubs, tmp_path, stack, h.name, "check")
        assert r.returncode == 0, (h.name, r.stderr)
        if name == "b300-1node-colocated":
            assert vllm.placement(h.instances[0]).endswith(";nixl:-")


def test_remove_forgets_what_an_older_step_recorded(tmp_path, stubs):
    in_root(tmp_path, paths.PLACEMENT_DIR).mkdir(parents=True)
    r = run(stubs, tmp_path, BEFORE, "sim-1", "remove")
    assert r.returncode == 0 and not in_root(tmp_path, paths.PLACEMENT_DIR).exists()


def test_an_unknown_action_is_refused(tmp_path, stubs):
    r = run(stubs, tmp_path, BEFORE, "sim-1", "reset")
    assert r.returncode == 2 and "usage:" in r.stderr and not r.calls
