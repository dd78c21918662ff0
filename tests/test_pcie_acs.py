"""``lspci -vvv``'s Access Control Services read by the host agent (glm_infra/agent/hostcheck.py), on
real captures (tests/fixtures/lspci-acs/, sources in tests/fixtures/CAPTURES-SOURCES.md): which switch
ports would send GPU-NIC peer-to-peer traffic to the root complex."""

from __future__ import annotations

from pathlib import Path

import pytest

from glm_infra.agent import hostcheck

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
