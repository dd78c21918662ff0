"""glm-vllm-placement.sh: before a host's instances start, what the plan moved off the host is stopped and
removed and what moves to other GPUs or ports is stopped, against stub systemctl in a mount namespace."""

from __future__ import annotations

import pytest
from conftest import stack_config
from stubs import StubPath, in_root, isolated, shellcheck

from glm_infra.plan import topology
from glm_infra.roles import vllm
from glm_infra.spec import paths
from glm_infra.spec.config import StackConfig

DIRS = ["/etc/systemd/system", paths.STATE, paths.LIBEXEC]
UNITS = "/etc/systemd/system"


def _plan(**prefill) -> topology.Plan:
    cfg = {k.removeprefix("glm-infra:"): v for k, v in stack_config("sim").items()}
    cfg["prefill"] = {**cfg["prefill"], **prefill}
    return topology.plan(StackConfig.model_validate(cfg))


def script(plan: topology.Plan, host: str) -> str:
    return vllm.placement_step(host, [i for i in plan.instances if i.host == host]).stdin


@pytest.fixture
def stubs(tmp_path):
    s = StubPath(tmp_path)
    # active units are files in $STATE/active/
    s.add("systemctl", """mkdir -p "$STATE/active"
case "$1" in
  is-active) [ -e "$STATE/active/${@: -1}" ] ;;
  stop) rm -f "$STATE/active/$2" ;;
  disable) rm -f "$STATE/active/${@: -1}" ;;
  *) exit 0 ;;
esac""")
    return s


def _install(tmp_path, stubs, *units: str, active: bool = True) -> None:
    for u in units:
        in_root(tmp_path, f"{UNITS}/{u}").parent.mkdir(parents=True, exist_ok=True)
        in_root(tmp_path, f"{UNITS}/{u}").write_text("[Service]\n")
        if active:
            (stubs.state / "active").mkdir(exist_ok=True)
            (stubs.state / "active" / u).touch()


def test_shellcheck_clean(tmp_path):
    r = shellcheck(script(_plan(), "sim-1"), tmp_path)
    assert r.returncode == 0, r.stdout


def test_a_first_run_records_and_stops_nothing(tmp_path, stubs):
    """A host deployed before this step: its instances keep running, their places recorded."""
    _install(tmp_path, stubs, "glm-vllm-prefill-0.service", "glm-vllm-prefill-1.service")
    r = isolated(stubs, script(_plan(), "sim-1"), ["apply"], DIRS, tmp_path)
    assert r.returncode == 0, r.stderr
    assert not r.called("systemctl stop") and not r.called("systemctl disable")
    assert in_root(tmp_path, f"{paths.PLACEMENT_DIR}/glm-vllm-prefill-0.service").read_text() == \
        "gpus:0,1,2,3;http:8100;rpc:29550;nixl:5600+4\n"
    assert "sim-1: instances here: 2 planned" in r.stdout
    again = isolated(stubs, script(_plan(), "sim-1"), ["check"], DIRS, tmp_path)
    assert again.returncode == 0 and "every instance unit here is planned here" in again.stdout


def test_a_re_layout_stops_what_leaves_and_what_moves_and_keeps_the_rest(tmp_path, stubs):
    before, after = _plan(), _plan(instancesPerHost=4, tp=2, dp=1, ep=False)
    # sim-2 ran prefill-2 and -3; the new layout puts prefill-4..7 there and prefill-2 and -3 on sim-1.
    _install(tmp_path, stubs, "glm-vllm-prefill-2.service", "glm-vllm-prefill-3.service")
    libexec = in_root(tmp_path, paths.LIBEXEC)
    libexec.mkdir(parents=True, exist_ok=True)
    (libexec / "glm-vllm-prefill-2.sh").write_text('#!/bin/bash\necho "prefill-2 script: $1"\nsystemctl disable --now glm-vllm-prefill-2.service\n')
    (libexec / "glm-vllm-prefill-2.sh").chmod(0o755)
    assert isolated(stubs, script(before, "sim-2"), ["apply"], DIRS, tmp_path).returncode == 0
    r = isolated(stubs, script(after, "sim-2"), ["apply"], DIRS, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "sim-2: glm-vllm-prefill-2.service is not planned here any more: stopping and removing it" in r.stdout
    assert "prefill-2 script: remove" in r.stdout, "through the instance's own script where it is there"
    assert "systemctl disable --now --quiet glm-vllm-prefill-3.service" in r.calls, "else by systemctl"
    assert not in_root(tmp_path, f"{UNITS}/glm-vllm-prefill-2.service").exists()
    assert not (libexec / "glm-vllm-prefill-2.sh").exists()
    assert sorted(p.name for p in in_root(tmp_path, paths.PLACEMENT_DIR).iterdir()) == [
        f"glm-vllm-prefill-{i}.service" for i in range(4, 8)]

    # sim-1 keeps prefill-0 and -1 on other GPUs and ports: stopped until their rollout; nothing removed.
    _install(tmp_path, stubs, "glm-vllm-prefill-0.service", "glm-vllm-prefill-1.service")
    assert isolated(stubs, script(before, "sim-1"), ["apply"], DIRS, tmp_path).returncode == 0
    r = isolated(stubs, script(after, "sim-1"), ["apply"], DIRS, tmp_path)
    assert r.returncode == 0, r.stderr
    assert ("sim-1: glm-vllm-prefill-0.service moves from gpus:0,1,2,3;http:8100;rpc:29550;nixl:5600+4 to "
            "gpus:0,1;http:8100;rpc:29550;nixl:5600+1 here") in r.stdout
    assert "systemctl stop glm-vllm-prefill-0.service" in r.calls and "systemctl stop glm-vllm-prefill-1.service" in r.calls
    assert in_root(tmp_path, f"{UNITS}/glm-vllm-prefill-0.service").exists()
    # Applied again (an up re-run): the places are recorded, nothing more stops.
    again = isolated(stubs, script(after, "sim-1"), ["apply"], DIRS, tmp_path)
    assert not again.called("systemctl stop")


def test_check_names_an_instance_the_plan_does_not_put_here(tmp_path, stubs):
    _install(tmp_path, stubs, "glm-vllm-prefill-0.service", "glm-vllm-prefill-1.service", "glm-vllm-decode-0.service")
    assert isolated(stubs, script(_plan(), "sim-1"), ["apply"], DIRS, tmp_path).returncode == 0
    _install(tmp_path, stubs, "glm-vllm-decode-0.service")  # back by hand
    r = isolated(stubs, script(_plan(), "sim-1"), ["check"], DIRS, tmp_path)
    assert r.returncode == 1 and "sim-1: glm-vllm-decode-0.service is installed here but not planned here" in r.stderr


def test_remove_forgets_the_records(tmp_path, stubs):
    _install(tmp_path, stubs, "glm-vllm-prefill-0.service")
    isolated(stubs, script(_plan(), "sim-1"), ["apply"], DIRS, tmp_path)
    r = isolated(stubs, script(_plan(), "sim-1"), ["remove"], DIRS, tmp_path)
    assert r.returncode == 0 and not in_root(tmp_path, paths.PLACEMENT_DIR).exists()
