"""``lspci -vvv``'s Access Control Services read by the host agent (glm_infra/agent/hostcheck.py), on
real captures (tests/fixtures/lspci-acs/, sources in tests/fixtures/CAPTURES-SOURCES.md): which switch
ports would send GPU-NIC peer-to-peer traffic to the root complex."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

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
