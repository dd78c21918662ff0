"""The unit-memory program (glm_infra/agent/unit_memory.py) against cgroup trees of each kind and real
processes, its output under promtool's parser, and the host script that installs its timer."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, stack_file
from stubs import StubPath, in_root, isolated, shellcheck

from glm_infra.plan.topology import plan
from glm_infra.roles import monitoring
from glm_infra.spec import paths
from glm_infra.stack import load_file

PROGRAM = ROOT / "glm_infra" / "agent" / "unit_memory.py"
DECODE = {"unit": "glm-vllm-decode-0.service", "instance": "decode-0", "pool": "decode"}
ROUTER = {"unit": "glm-vllm-router.service", "instance": "router", "pool": "router"}


@pytest.fixture(scope="module")
def promtool() -> Path:
    p = subprocess.run([str(ROOT / "scripts/prometheus-tools")], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    return Path(p.stdout.strip().splitlines()[-1]) / "promtool"


def systemctl_stub(stubs: StubPath, states: dict[str, tuple[str, str]]) -> None:
    """``systemctl show`` as systemd prints it for several units: one block each, a blank line between."""
    blocks = "\n\n".join(f"Id={u}\nActiveState={a}\nControlGroup={g}" for u, (a, g) in states.items())
    (stubs.state / "show").write_text(blocks + "\n")
    stubs.add("systemctl", '[ "$1" = show ] && cat "$STATE/show"')


def run(stubs: StubPath, tmp: Path, units: list | str, cgroup: Path, proc: str = "/proc",
        out: Path | None = None) -> tuple[subprocess.CompletedProcess, Path]:
    stubs.log.write_text("")
    units_file = tmp / "units.json"
    units_file.write_text(units if isinstance(units, str) else json.dumps(units))
    out = out or tmp / "glm-unit-memory.prom"
    p = subprocess.run([sys.executable, str(PROGRAM), "--units", str(units_file), "--out", str(out),
                        "--cgroup-root", str(cgroup), "--proc", proc], capture_output=True, text=True, timeout=60,
                       env={"PATH": f"{stubs.bin}:/usr/bin:/bin", "STUB_LOG": str(stubs.log), "STATE": str(stubs.state)})
    return p, out


def samples(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


LABELS = 'unit="glm-vllm-decode-0.service",glm_instance="decode-0",pool="decode"'
ROUTER_LABELS = 'unit="glm-vllm-router.service",glm_instance="router",pool="router"'


def test_on_cgroup_v2_each_active_unit_is_its_cgroups_anonymous_memory(tmp_path, promtool):
    stubs = StubPath(tmp_path)
    cg = tmp_path / "cgroup"
    write(cg / "cgroup.controllers", "cpu memory pids\n")
    write(cg / "system.slice/glm-vllm-decode-0.service/memory.stat", "anon 7340032000\nfile 999\nkernel 5\n")
    write(cg / "system.slice/glm-vllm-router.service/memory.stat", "file 1\nanon 52428800\n")
    systemctl_stub(stubs, {DECODE["unit"]: ("active", "/system.slice/glm-vllm-decode-0.service"),
                           ROUTER["unit"]: ("active", "/system.slice/glm-vllm-router.service")})
    p, out = run(stubs, tmp_path, [DECODE, ROUTER], cg)
    assert p.returncode == 0, p.stderr
    text = out.read_text()
    checked = subprocess.run([str(promtool), "check", "metrics"], input=text, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    got = samples(text)
    assert got[f'glm_unit_memory_anon_bytes{{{LABELS},method="cgroup"}}'] == 7340032000
    assert got[f'glm_unit_memory_anon_bytes{{{ROUTER_LABELS},method="cgroup"}}'] == 52428800
    assert got[f"glm_unit_memory_measured{{{LABELS}}}"] == 1
    assert abs(got["glm_unit_memory_sample_time_seconds"] - time.time()) < 60
    assert oct(out.stat().st_mode & 0o777) == "0o644"
    assert [f.name for f in tmp_path.iterdir() if f.name.startswith(".")] == []  # renamed whole, nothing left
    assert stubs.log.read_text().split() == ["systemctl", "show", "--property=Id,ActiveState,ControlGroup", "--",
                                             DECODE["unit"], ROUTER["unit"]]


def test_on_cgroup_v1_with_the_units_memory_hierarchy_its_total_rss(tmp_path):
    stubs = StubPath(tmp_path)
    cg = tmp_path / "cgroup"
    write(cg / "memory/system.slice/glm-vllm-decode-0.service/memory.stat", "cache 5\nrss 10\ntotal_cache 6\ntotal_rss 4096\n")
    (cg / "systemd/system.slice/glm-vllm-decode-0.service").mkdir(parents=True)
    systemctl_stub(stubs, {DECODE["unit"]: ("active", "/system.slice/glm-vllm-decode-0.service")})
    p, out = run(stubs, tmp_path, [DECODE], cg)
    assert p.returncode == 0, p.stderr
    assert samples(out.read_text())[f'glm_unit_memory_anon_bytes{{{LABELS},method="cgroup"}}'] == 4096


def test_without_the_memory_controller_the_units_processes_are_summed_from_the_kernels_status(tmp_path):
    """A v1 host whose memory hierarchy is not the unit's (the simulated hosts, containers): every process of
    the unit's cgroup and of cgroups below it, read from the real /proc; one that exited meanwhile is skipped."""
    stubs = StubPath(tmp_path)
    cg = tmp_path / "cgroup"
    ballast = 64 * 2**20
    holders = [subprocess.Popen([sys.executable, "-c", f"b = bytearray({ballast}); import sys; sys.stdin.read()"],
                                stdin=subprocess.PIPE) for _ in range(2)]
    try:
        def settled() -> bool:
            return all(_rss_anon(h.pid) >= ballast for h in holders)
        _wait(settled)
        gone = subprocess.Popen(["true"])
        gone.wait()
        unit = cg / "systemd/system.slice/glm-vllm-decode-0.service"
        write(unit / "cgroup.procs", f"{holders[0].pid}\n{gone.pid}\n")
        write(unit / "engine-core/cgroup.procs", f"{holders[1].pid}\n")  # a child cgroup
        write(cg / "memory/cgroup.procs", "")  # the hierarchy is mounted, but holds no cgroup of the unit
        systemctl_stub(stubs, {DECODE["unit"]: ("active", "/system.slice/glm-vllm-decode-0.service")})
        p, out = run(stubs, tmp_path, [DECODE], cg)
        expected = _rss_anon(holders[0].pid) + _rss_anon(holders[1].pid)
    finally:
        for h in holders:
            h.kill()
            h.wait()
    assert p.returncode == 0, p.stderr
    measured = samples(out.read_text())[f'glm_unit_memory_anon_bytes{{{LABELS},method="procs"}}']
    assert measured >= 2 * ballast
    assert abs(measured - expected) < 8 * 2**20


def _rss_anon(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def _wait(condition, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize(("tree", "why"), [
    ({}, "no cgroup"),
    ({"systemd/system.slice/glm-vllm-decode-0.service/cgroup.procs": ""}, "no process in"),
    ({"systemd/system.slice/glm-vllm-decode-0.service/cgroup.procs": "4194303999\n"}, "no readable process status"),
    ({"memory/system.slice/glm-vllm-decode-0.service/memory.stat": "total_rss many\n"}, "no cgroup"),
], ids=["no-cgroup", "empty-cgroup", "processes-gone", "garbled-stat"])
def test_an_active_unit_that_cannot_be_read_is_reported_unmeasured_never_as_zero(tmp_path, tree, why):
    stubs = StubPath(tmp_path)
    cg = tmp_path / "cgroup"
    cg.mkdir()
    for rel, text in tree.items():
        write(cg / rel, text)
    systemctl_stub(stubs, {DECODE["unit"]: ("active", "/system.slice/glm-vllm-decode-0.service"),
                           ROUTER["unit"]: ("inactive", "")})
    p, out = run(stubs, tmp_path, [DECODE, ROUTER], cg)
    assert p.returncode == 1
    assert f"unit-memory: {DECODE['unit']}: {why}" in p.stderr
    got = samples(out.read_text())
    assert got[f"glm_unit_memory_measured{{{LABELS}}}"] == 0
    assert not [k for k in got if k.startswith("glm_unit_memory_anon_bytes")]
    # An inactive unit has nothing to measure: no sample, no complaint (the instance-down alerts cover it).
    assert "router" not in out.read_text() and ROUTER["unit"] not in p.stderr


@pytest.mark.parametrize("units", [
    "", "not json", "{}", json.dumps([{"unit": "a.service", "instance": "a"}]),
    json.dumps([{"unit": "", "instance": "a", "pool": "decode"}]), json.dumps([{"unit": 1, "instance": "a", "pool": "d"}]),
], ids=["empty", "not-json", "not-a-list", "no-pool", "empty-unit", "not-a-string"])
def test_a_bad_units_file_is_named_and_the_last_sample_is_left_alone(tmp_path, units):
    stubs = StubPath(tmp_path)
    systemctl_stub(stubs, {})
    out = tmp_path / "glm-unit-memory.prom"
    out.write_text("the last sample\n")
    p, _ = run(stubs, tmp_path, units, tmp_path, out=out)
    assert p.returncode == 2
    assert f"unit-memory: {tmp_path / 'units.json'}" in p.stderr
    assert out.read_text() == "the last sample\n"  # it goes stale, and the rules count it as no measure
    assert stubs.log.read_text() == ""


def test_when_systemd_cannot_be_asked_nothing_is_written(tmp_path):
    stubs = StubPath(tmp_path)
    stubs.add("systemctl", "echo 'Failed to connect to bus' >&2; exit 1")
    out = tmp_path / "glm-unit-memory.prom"
    out.write_text("the last sample\n")
    p, _ = run(stubs, tmp_path, [DECODE], tmp_path, out=out)
    assert p.returncode == 2 and "systemctl show failed" in p.stderr
    assert out.read_text() == "the last sample\n"


# --- the host script ------------------------------------------------------------------------------

DIRS = [paths.LIBEXEC, paths.ETC, paths.UNIT_DIR, paths.NODE_EXPORTER_TEXTFILES]


def script_for(stack: str = "prod-b300") -> tuple[str, str]:
    cfg = load_file(stack_file(stack)).config
    p = plan(cfg)
    host = next(h for h in p.hosts if h.runs_router)
    return host.name, monitoring.unit_memory_script(p, host)


def test_the_script_is_shellcheck_clean(tmp_path):
    _, script = script_for()
    sc = shellcheck(script, tmp_path)
    assert sc.returncode == 0, sc.stdout


def test_apply_installs_the_timer_and_samples_check_finds_an_edit_remove_leaves_nothing(tmp_path):
    host, script = script_for()
    stubs = StubPath(tmp_path)
    # Every unit inactive: nothing to measure yet, which is no problem.
    stubs.add("systemctl", 'if [ "$1" = show ]; then shift 2; for u in "${@:2}"; do printf "Id=%s\\nActiveState=inactive\\nControlGroup=\\n\\n" "$u"; done; '
                           'elif [ "$1" = is-active ]; then [ -e "$STATE/timer-on" ]; '
                           'elif [ "$1" = enable ]; then touch "$STATE/timer-on"; elif [ "$1" = disable ]; then rm -f "$STATE/timer-on"; fi')
    applied = isolated(stubs, script, ["apply"], DIRS, tmp_path)
    assert applied.returncode == 0, applied.stderr
    assert f"{host}: unit-memory: every active unit measured" in applied.stdout
    assert applied.called("systemctl daemon-reload") and applied.called("systemctl enable --quiet glm-unit-memory.timer")
    assert applied.called("systemctl start glm-unit-memory.timer")
    units = json.loads(in_root(tmp_path, paths.UNIT_MEMORY_UNITS).read_text())
    assert {"unit": "glm-vllm-router.service", "instance": "router", "pool": "router"} in units
    assert in_root(tmp_path, paths.UNIT_MEMORY).read_text() == PROGRAM.read_text()
    service = in_root(tmp_path, f"{paths.UNIT_DIR}/glm-unit-memory.service").read_text()
    assert f"ExecStart=/usr/bin/python3 {paths.UNIT_MEMORY} --units {paths.UNIT_MEMORY_UNITS} --out {paths.UNIT_MEMORY_METRICS}" in service
    assert f"ReadWritePaths={paths.NODE_EXPORTER_TEXTFILES}" in service
    metrics = in_root(tmp_path, paths.UNIT_MEMORY_METRICS).read_text()
    assert "glm_unit_memory_sample_time_seconds " in metrics

    again = isolated(stubs, script, ["apply"], DIRS, tmp_path)
    assert again.returncode == 0 and not again.called("systemctl daemon-reload")  # nothing changed

    assert isolated(stubs, script, ["check"], DIRS, tmp_path).returncode == 0
    before = in_root(tmp_path, paths.UNIT_MEMORY_METRICS).read_text()
    in_root(tmp_path, paths.UNIT_MEMORY_UNITS).write_text("[]\n")
    checked = isolated(stubs, script, ["check"], DIRS, tmp_path)
    assert checked.returncode == 1
    assert f"{host}: unit-memory: {paths.UNIT_MEMORY_UNITS} differs from what glm-infra wrote" in checked.stderr
    assert in_root(tmp_path, paths.UNIT_MEMORY_METRICS).read_text() == before  # a check writes no sample

    removed = isolated(stubs, script, ["remove"], DIRS, tmp_path)
    assert removed.returncode == 0
    for path in (paths.UNIT_MEMORY, paths.UNIT_MEMORY_UNITS, paths.UNIT_MEMORY_METRICS,
                 f"{paths.UNIT_DIR}/glm-unit-memory.service", f"{paths.UNIT_DIR}/glm-unit-memory.timer"):
        assert not in_root(tmp_path, path).exists(), path


def test_apply_warns_naming_a_unit_it_cannot_measure_and_fails_when_the_program_cannot_run(tmp_path):
    _, script = script_for()
    stubs = StubPath(tmp_path)
    stubs.add("systemctl", 'if [ "$1" = show ]; then shift 2; for u in "${@:2}"; do printf "Id=%s\\nActiveState=active\\nControlGroup=/system.slice/%s\\n\\n" "$u" "$u"; done; fi')
    applied = isolated(stubs, script, ["apply"], DIRS, tmp_path)
    assert applied.returncode == 0, applied.stderr
    assert "unit-memory: warning: unit-memory: glm-vllm-" in applied.stderr
    assert "GlmUnitMemoryUnmeasured" in applied.stderr
    assert isolated(stubs, script, ["check"], DIRS, tmp_path).returncode == 1  # doctor says so

    stubs.add("systemctl", "exit 1")
    failed = isolated(stubs, script, ["apply"], DIRS, tmp_path)
    assert failed.returncode == 1 and "could not run (exit 2): unit-memory: systemctl show failed" in failed.stderr
    assert not failed.called("systemctl enable")


def test_every_host_with_an_instance_or_the_router_measures_exactly_its_units():
    for stack in ("prod-b300", "sim"):
        cfg = load_file(stack_file(stack)).config
        p = plan(cfg)
        for h in p.hosts:
            units = monitoring.measured_units(p, h)
            assert [u["unit"] for u in units] == [i.unit for i in h.instances] + (
                ["glm-vllm-router.service"] if h.runs_router else [])
            assert all(u["instance"] and u["pool"] for u in units)
