"""``lspci -vvv``'s Access Control Services read by the host agent (glm_infra/agent/hostcheck.py), on
real captures (tests/fixtures/lspci-acs/, sources in tests/fixtures/CAPTURES-SOURCES.md): which switch
ports would send GPU-NIC peer-to-peer traffic to the root complex."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
from conftest import host_program
from stubs import Result, StubPath

from glm_infra.agent import hostcheck
from testbed.hardware import Sim

ACS = Path(__file__).parent / "fixtures" / "lspci-acs"
ENABLED = ACS / "linux-arm-kernel-n1sdp-plx-8749-dsp-0000-02-08.0-acs-enabled-tabs.txt"
DISABLED = ACS / "blog-pcie-lspci-plx-pex8747-dsp-03-08.0-acs-disabled-spaces.txt"


def test_a_switch_port_with_acs_on_is_found_and_named():
    ports = hostcheck.parse_lspci_acs(ENABLED.read_text())
    assert list(ports) == ["0000:02:08.0"]
    port = ports["0000:02:08.0"]
    assert port["description"].startswith("PCI bridge: PLX Technology, Inc. Device 8749")
    assert port["acs_ctl"] == {"SrcValid": True, "TransBlk": False, "ReqRedir": True, "CmpltRedir": True,
                               "UpstreamFwd": True, "EgressCtrl": False, "DirectTrans": False}
    assert hostcheck.acs_blocking(port["acs_ctl"]) == ["SrcValid", "ReqRedir", "CmpltRedir"]


def test_a_switch_port_with_acs_off_blocks_nothing():
    ports = hostcheck.parse_lspci_acs(DISABLED.read_text())
    assert list(ports) == ["0000:03:08.0"], "the domain is added where lspci leaves it out"
    port = ports["0000:03:08.0"]
    assert all(port["acs_cap"].values()) and not any(port["acs_ctl"].values())
    assert hostcheck.acs_blocking(port["acs_ctl"]) == []


@pytest.mark.parametrize("capture, blocking", [
    ("nccl-issue-523-grep-acsctl-mixed-spaces-partial.txt",
     [["SrcValid", "ReqRedir", "CmpltRedir"], ["SrcValid"], ["SrcValid"], [], [], [], [], [],
      ["ReqRedir", "CmpltRedir"], ["ReqRedir", "CmpltRedir"], ["SrcValid", "ReqRedir", "CmpltRedir"],
      ["SrcValid", "ReqRedir", "CmpltRedir"]]),
    # older pciutils: a tab after the label; the 4th, 10th, 11th and 13th of 15 ports with ACS on
    ("nccl-issue-629-grep-acsctl-mixed-tabs-partial.txt",
     [["SrcValid", "ReqRedir", "CmpltRedir"] if i in (3, 9, 10, 12) else [] for i in range(15)]),
])
def test_each_acsctl_line_as_a_grep_shows_it(capture, blocking):
    lines = [line for line in (ACS / capture).read_text().splitlines() if "ACSCtl:" in line]
    got = [hostcheck.acs_blocking(hostcheck.parse_acs_flags(line)) for line in lines]
    assert all(len(hostcheck.parse_acs_flags(line)) == 7 for line in lines)
    assert got == blocking


def test_devices_without_acs_are_left_out():
    text = "0000:17:00.0 3D controller: NVIDIA Corporation Device 2901 (rev a1)\n\tSubsystem: NVIDIA Corporation\n"
    assert hostcheck.parse_lspci_acs(text + ENABLED.read_text()) == hostcheck.parse_lspci_acs(ENABLED.read_text())


# --- the path between a GPU and its NIC, and ACS on it -------------------------------------------------


def test_a_bridge_gives_its_bus_range():
    port = hostcheck.parse_lspci(ENABLED.read_text())["0000:02:08.0"]
    assert (port["secondary"], port["subordinate"]) == (3, 3) and "denied" not in port
    port = hostcheck.parse_lspci(DISABLED.read_text())["0000:03:08.0"]
    assert (port["secondary"], port["subordinate"]) == (4, 4)


@pytest.fixture
def sim(tmp_path):
    return Sim(tmp_path)


def stand_in(sim) -> dict[str, dict]:
    return hostcheck.parse_lspci(sim.out("lspci", "-D", "-vvv"))


B300_PAIRS = [(g, f"0000:{bus:02x}:00.0", f"mlx5_{g}", f"0000:{bus - 2:02x}:00.0")
              for g, bus in enumerate((0x1A, 0x3C, 0x62, 0x73, 0x9A, 0xBC, 0xDF, 0xF0))]


def test_between_a_b300_gpu_and_its_nic_are_the_two_downstream_ports_of_their_switch(sim):
    devices = stand_in(sim)
    # GPU 0 on bus 1a behind 17:01.0, its NIC on 18 behind 17:00.0; both under the switch's upstream port.
    assert hostcheck.pci_ancestors(devices, "0000:1a:00.0") == ["0000:17:01.0", "0000:16:00.0"]
    assert hostcheck.bridges_between(devices, "0000:1a:00.0", "0000:18:00.0") == ["0000:17:01.0", "0000:17:00.0"]
    assert hostcheck.bridges_between(devices, "0000:1a:00.0", "0000:3c:00.0") == [
        "0000:17:01.0", "0000:16:00.0", "0000:39:01.0", "0000:38:00.0"], "two switches: across the host"
    assert hostcheck.acs_problems(devices, B300_PAIRS) == ({}, [])


def test_acs_on_between_a_gpu_and_its_nic_is_named_and_setpci_turns_it_off(sim):
    sim.fault(PCIE_ACS_ON="2")
    blocking, problems = hostcheck.acs_problems(stand_in(sim), B300_PAIRS)
    assert blocking == {"0000:5f:01.0": ["SrcValid", "ReqRedir", "CmpltRedir"],
                        "0000:5f:00.0": ["SrcValid", "ReqRedir", "CmpltRedir"]}
    assert problems[0] == ("acs", "0000:5f:01.0 (PCI bridge: Mellanox Technologies ConnectX-8 PCIe switch port "
                                  "[simulated] (prog-if 00 [Normal decode])) has ACS SrcValid, ReqRedir, CmpltRedir "
                                  "on, between GPU 2 (0000:62:00.0) and mlx5_2 (0000:60:00.0): GPUDirect RDMA between "
                                  "them goes up to the root complex or is refused (rdma.disableAcs turns it off)")
    for bridge in blocking:
        sim.out("setpci", "-s", bridge, "ECAP_ACS+0x6.w=0000")
    assert hostcheck.acs_problems(stand_in(sim), B300_PAIRS) == ({}, [])
    # Off until the next boot: the state is under /run.
    (sim.root / "run/glm-sim/acs-off").unlink()
    assert len(hostcheck.acs_problems(stand_in(sim), B300_PAIRS)[1]) == 2


def test_the_stand_in_prints_acs_as_pciutils_does(sim):
    sim.fault(PCIE_ACS_ON="0")
    record = sim.out("lspci", "-D", "-vvv", "-s", "0000:17:01.0").splitlines()
    real = ENABLED.read_text().splitlines()  # newer pciutils: tabs, "ACSCap:" then a tab
    for field in ("Capabilities: [f24 v1] Access Control Services", "ACSCap:", "ACSCtl:", "Kernel driver in use:"):
        ours = next(line for line in record if field in line)
        theirs = next(line for line in real if field in line)
        assert ours[: ours.index(field) + len(field) + 1] == theirs[: theirs.index(field) + len(field) + 1], field
    assert next(l for l in record if "ACSCtl:" in l) == next(l for l in real if "ACSCtl:" in l)
    bus = next(l for l in record if "Bus:" in l)
    assert bus == "\tBus: primary=17, secondary=1a, subordinate=1a, sec-latency=0"
    assert re.fullmatch(r"\tBus: primary=\w\w, secondary=\w\w, subordinate=\w\w, sec-latency=0",
                        next(l for l in real if "Bus:" in l))
    assert sim.out("lspci", "-s", "17:01.0").startswith("17:01.0 PCI bridge:"), "no domain without -D"


def test_what_lspci_cannot_read_or_list_fails_closed(sim):
    denied = "0000:17:01.0 PCI bridge: X\n\tBus: primary=17, secondary=1a, subordinate=1a, sec-latency=0\n" \
             "\tCapabilities: <access denied>\n"
    devices = stand_in(sim) | hostcheck.parse_lspci(denied)
    _, problems = hostcheck.acs_problems(devices, B300_PAIRS[:1])
    assert problems == [("acs", "0000:17:01.0: lspci cannot read its capabilities (not run as root?)")]
    # Cut short: the records without their Bus: lines leave the GPU and NIC with no port above them.
    bare = {bdf: {k: v for k, v in d.items() if k not in ("secondary", "subordinate")} for bdf, d in stand_in(sim).items()}
    _, problems = hostcheck.acs_problems(bare, B300_PAIRS[:1])
    assert problems == [("acs", "lspci -vvv shows no bridge above GPU 0 0000:1a:00.0 or mlx5_0 0000:18:00.0 (no Bus: "
                                "ranges?): cannot tell which ports lie between them")]
    sim.fault(GPU_COUNT="7")
    _, problems = hostcheck.acs_problems(stand_in(sim), B300_PAIRS)
    assert problems == [("acs", "lspci -vvv does not list GPU 7 0000:f0:00.0")]


def test_setpci_takes_only_the_acs_write(sim):
    r = sim.run("setpci", "-s", "0000:17:01.0", "COMMAND=0x02")
    assert r.returncode == 2 and "only -s BDF ECAP_ACS+0x6.w=0000" in r.stderr
    r = sim.run("setpci", "-s", "0000:1a:00.0", "ECAP_ACS+0x6.w=0000")
    assert r.returncode == 1 and "no device with an ACS capability" in r.stderr


# --- the boot unit (rdma.disableAcs): tried again after a failure, bounded, and named while it fails ---------

ACS_DIRS = ["/etc/systemd/system"]


def acs_script(tmp_path, disable_acs: bool = True) -> Path:
    """The nic-affinity step's script of a B300 host, the env file under tmp_path."""
    from glm_infra.render import render_template
    from glm_infra.roles import nixl
    script = tmp_path / ("glm-nic-affinity.sh" if disable_acs else "glm-nic-affinity-acs-off.sh")
    script.write_text(render_template(
        "nic-affinity.sh.j2", host="b300-1", nics=[f"mlx5_{i}" for i in range(8)], max_distance="PXB", gpus=8,
        env_file=str(tmp_path / "nic-affinity.env"), hostcheck=str(host_program("hostcheck", tmp_path)), disable_acs=disable_acs,
        acs_unit=nixl.ACS_UNIT, acs_retry_s=nixl.ACS_RETRY_S, acs_tries=nixl.ACS_TRIES, acs_window_s=nixl.ACS_WINDOW_S,
        acs_timeout_s=nixl.ACS_TIMEOUT_S, script_path="/usr/local/libexec/glm-infra/glm-nic-affinity.sh"))
    return script


def acs_unit_text(script: Path) -> str:
    text = script.read_text()
    return text[text.index("  cat <<UNIT\n") + len("  cat <<UNIT\n"):text.index("\nUNIT\n}")] + "\n"


def test_the_acs_unit_is_tried_again_after_a_failure_and_bounded(tmp_path):
    """Issue 38: the unit ran once at boot; a reading that failed then (a GPU or NIC not up yet) was never
    tried again by the unit itself. Now systemd tries again every 15 s, at most 20 times in 10 min, each
    try bounded; and Debian 12's systemd (this machine's, 252) accepts the unit as it is."""
    from glm_infra.roles import nixl
    unit = acs_unit_text(acs_script(tmp_path))
    lines = unit.splitlines()
    for line in ("Type=oneshot", "RemainAfterExit=yes", "Restart=on-failure", "RestartSec=15",
                 "StartLimitIntervalSec=600", "StartLimitBurst=20", "TimeoutStartSec=300",
                 "ExecStart=/usr/local/libexec/glm-infra/glm-nic-affinity.sh boot", "WantedBy=multi-user.target"):
        assert line in lines, line
    assert lines.index("StartLimitBurst=20") < lines.index("[Service]"), "start limits are [Unit] keys"
    assert (nixl.ACS_RETRY_S, nixl.ACS_TRIES, nixl.ACS_WINDOW_S) == (15, 20, 600)
    assert nixl.ACS_RETRY_S * nixl.ACS_TRIES < nixl.ACS_WINDOW_S, "the tries are spent inside one window: bounded"
    verify = tmp_path / "verify" / nixl.ACS_UNIT
    verify.parent.mkdir()
    verify.write_text(unit.replace("/usr/local/libexec/glm-infra/glm-nic-affinity.sh", "/bin/true"))
    p = subprocess.run(["systemd-analyze", "verify", str(verify)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout == p.stderr == "", p


@pytest.fixture
def acs_host(tmp_path, sim):
    """``run(action, state)``: the script (rdma.disableAcs) on a simulated B300 (its nvidia-smi, ibdev2netdev,
    lspci, setpci), in a mount namespace where /etc/systemd/system is a folder of the test's, with a stub
    systemctl saying ``state`` of the ACS unit (ActiveState SubState Result NRestarts, "-": not enabled too)."""
    from testbed.hardware import HW_LIB, TOOLS
    stubs = StubPath(tmp_path / "stubs")
    for tool in ("nvidia-smi", "ibdev2netdev", "lspci", "setpci"):
        (stubs.bin / tool).symlink_to(TOOLS[tool])
    stubs.add("systemctl", '''read -r active sub result restarts < "$STATE/acs"
case "$1" in
  show) printf 'ActiveState=%s\\nSubState=%s\\nResult=%s\\nNRestarts=%s\\n' "$active" "$sub" "$result" "$restarts" ;;
  is-active) [ "$active" = active ] ;;
  is-enabled) [ ! -e "$STATE/disabled" ] ;;
  start) [ ! -e "$STATE/start-fails" ] && echo "active running success 0" > "$STATE/acs" ;;
  *) exit 0 ;;
esac''')
    stubs.add("journalctl", 'echo "b300-1: affinity: 7 GPUs visible, stack expects 8"')
    script = acs_script(tmp_path)
    script_off = acs_script(tmp_path, disable_acs=False)
    root = tmp_path / "root"

    def run(action: str, state: str = "active running success 0", disable_acs: bool = True) -> Result:
        (stubs.state / "acs").write_text(state + "\n")
        binds = []
        for d in ACS_DIRS:
            (root / d.lstrip("/")).mkdir(parents=True, exist_ok=True)
            binds.append(f"mount --bind {shlex.quote(str(root / d.lstrip('/')))} {d}")
        inner = " && ".join([*binds, f"exec bash {shlex.quote(str(script if disable_acs else script_off))} {action}"])
        return stubs.run(f"unshare --mount --propagation private bash -c {shlex.quote(inner)}\n",
                         env={"PATH": f"{stubs.bin}:/usr/sbin:/usr/bin:/sbin:/bin", "GLM_SIM_ROOT": str(sim.root),
                              "PYTHONPATH": str(HW_LIB)})

    return run, root / "etc/systemd/system/glm-infra-acs.service", stubs, script


def test_doctor_names_the_acs_unit_while_it_has_not_succeeded_since_boot(acs_host):
    """The step's check (drift; doctor runs it) reads the unit as systemd runs it: ACS off on the ports is
    not enough while the unit that keeps it off at every boot failed, retries or is not enabled."""
    run, unit, stubs, _ = acs_host
    assert run("apply").returncode == 0
    assert run("drift").returncode == 0
    r = run("drift", "activating auto-restart exit-code 3")
    assert r.returncode == 1, r.stderr
    assert ("b300-1: acs: glm-infra-acs.service is activating (auto-restart, result exit-code, 3 automatic restarts): "
            "it has not turned ACS off since this boot; systemd tries again every 15 s (20 times in 600 s) and with "
            "every vLLM start; last lines: b300-1: affinity: 7 GPUs visible, stack expects 8") in r.stderr, r.stderr
    r = run("drift", "failed failed start-limit-hit 19")
    assert r.returncode == 1 and "glm-infra-acs.service is failed (failed, result start-limit-hit, 19 automatic" in r.stderr
    # What every vLLM start runs (ExecStartPre ... check) reads the hardware only: ACS is off, it passes.
    assert run("check", "failed failed start-limit-hit 19").returncode == 0
    (stubs.state / "disabled").touch()
    r = run("drift")
    assert r.returncode == 1 and "glm-infra-acs.service is not enabled: ACS would stay on after the next boot" in r.stderr
    (stubs.state / "disabled").unlink()
    unit.write_text(unit.read_text().replace("Restart=on-failure\n", ""))
    r = run("drift")
    assert r.returncode == 1 and f"{unit.name} is missing or not the unit glm-infra writes" in r.stderr, r.stderr
    # rdma.disableAcs taken away: the unit is drift until apply removes it.
    r = run("drift", disable_acs=False)
    assert r.returncode == 1 and ("b300-1: acs: /etc/systemd/system/glm-infra-acs.service is there but "
                                  "rdma.disableAcs is off (apply removes it)") in r.stderr, r.stderr
    assert "affinity" not in r.stderr, "the reading itself holds"
    assert run("apply", disable_acs=False).returncode == 0 and not unit.exists()
    assert run("drift", disable_acs=False).returncode == 0


def test_apply_starts_an_acs_unit_that_failed_or_spent_its_tries(acs_host, sim):
    run, unit, stubs, script = acs_host
    sim.fault(PCIE_ACS_ON="2")
    r = run("apply", "failed failed start-limit-hit 19")
    assert r.returncode == 0, r.stderr
    assert "ACS turned off on 2 of the 16 switch ports between them" in r.stdout
    assert r.calls[-2:] == ["systemctl reset-failed glm-infra-acs.service", "systemctl start glm-infra-acs.service"], r.calls
    assert unit.read_text() == acs_unit_text(script)
    # Active already: left alone (a oneshot that ran; starting it again would only read again).
    r = run("apply")
    assert r.returncode == 0 and not any(c.startswith(("systemctl start", "systemctl reset-failed")) for c in r.calls)
    (stubs.state / "start-fails").touch()
    r = run("apply", "failed failed exit-code 0")
    assert r.returncode == 1 and "b300-1: acs: glm-infra-acs.service failed to start (its last lines above)" in r.stderr


def test_the_step_checks_the_boot_unit_and_vllm_starts_check_the_hardware():
    """doctor runs ``drift``; each vLLM start runs ``check`` (the hardware only: a unit still retrying does
    not hold back an instance whose ports are right), its unit unchanged."""
    from conftest import stack_file

    from glm_infra.plan.topology import plan
    from glm_infra.roles import nixl, vllm
    from glm_infra.spec import paths
    from glm_infra.stack import load_file
    stack = load_file(stack_file("prod-b300")).config
    on = stack.model_copy(update={"rdma": stack.rdma.model_copy(update={"disable_acs": True})})
    h = plan(on).hosts[0]
    assert nixl.nic_affinity_step(on, h).check == f"{paths.script(nixl.NIC_AFFINITY)} drift"
    unit = vllm.vllm_unit(on, h.instances[0])
    assert f"ExecStartPre=+{paths.script(nixl.NIC_AFFINITY)} check\n" in unit
    assert f"Wants={nixl.ACS_UNIT}\nAfter={nixl.ACS_UNIT}\n" in unit
