"""PCIe Access Control Services between a GPU and its NIC, as lspci -vvv shows them."""

from __future__ import annotations

import re

from .base import Problem


# ACS controls of a PCIe port that send GPU-NIC peer-to-peer traffic up to the root complex or refuse it
# (NVIDIA's GPUDirect RDMA and NCCL guides: disable ACS on the switch ports between them): source
# validation, P2P request and completion redirect, egress control.
ACS_BLOCKING = ("SrcValid", "ReqRedir", "CmpltRedir", "EgressCtrl")


_BDF = re.compile(r"^((?:[0-9a-f]{4}:)?[0-9a-f]{2}:[0-9a-f]{2}\.[0-7])\s+(.*)$")


def parse_acs_flags(line: str) -> dict[str, bool]:
    """An ``ACSCap:`` or ``ACSCtl:`` line of ``lspci -vvv``: {flag: on} (``SrcValid+`` is on)."""
    _, _, flags = line.partition(":")
    return {name: sign == "+" for name, sign in re.findall(r"([A-Za-z]+)([+-])", flags)}


def parse_lspci(text: str) -> dict[str, dict]:
    """``lspci -vvv`` (``-D`` or not): {device (with its domain, 0000:03:08.0): {"description"; for a
    bridge "secondary" and "subordinate" (its bus range); with an ACS capability "acs_cap" and "acs_ctl";
    "denied" when lspci could not read its capabilities (not root)}}. Tabs or spaces before the fields,
    as pciutils prints them or a paste leaves them."""
    out: dict[str, dict] = {}
    current: dict | None = None
    for line in text.splitlines():
        m = _BDF.match(line)
        if m:
            bdf = m.group(1) if m.group(1).count(":") == 2 else f"0000:{m.group(1)}"
            current = {"description": m.group(2).strip()}
            out[bdf] = current
            continue
        field = line.strip()
        if current is None:
            continue
        if field.startswith(("ACSCap:", "ACSCtl:")):
            current["acs_cap" if field.startswith("ACSCap:") else "acs_ctl"] = parse_acs_flags(field)
        elif field.startswith("Bus: primary="):
            bus = dict(re.findall(r"(secondary|subordinate)=([0-9a-fA-F]+)", field))
            current["secondary"], current["subordinate"] = int(bus["secondary"], 16), int(bus["subordinate"], 16)
        elif field == "Capabilities: <access denied>":
            current["denied"] = True
    return out


def parse_lspci_acs(text: str) -> dict[str, dict]:
    """The devices of ``parse_lspci`` with an Access Control Services capability."""
    return {bdf: d for bdf, d in parse_lspci(text).items() if "acs_ctl" in d}


def pci_ancestors(devices: dict[str, dict], bdf: str) -> list[str]:
    """The bridges above ``bdf`` (its bus in their secondary..subordinate range), nearest first."""
    domain, bus = bdf[:4], int(bdf[5:7], 16)
    above = [(d["subordinate"] - d["secondary"], b) for b, d in devices.items()
             if b != bdf and b[:4] == domain and "secondary" in d and d["secondary"] <= bus <= d["subordinate"]]
    return [b for _, b in sorted(above)]


def bridges_between(devices: dict[str, dict], a: str, b: str) -> list[str]:
    """The bridges peer-to-peer traffic between ``a`` and ``b`` crosses below where their paths meet:
    the downstream ports of the switch (or switches) they share, where ACS would redirect it upward."""
    up_a, up_b = pci_ancestors(devices, a), pci_ancestors(devices, b)
    return [x for x in up_a if x not in up_b] + [x for x in up_b if x not in up_a]


def acs_blocking(acs_ctl: dict[str, bool]) -> list[str]:
    """The ACS controls on that would block or reroute GPU-NIC peer-to-peer traffic."""
    return [f for f in ACS_BLOCKING if acs_ctl.get(f)]


def normalize_bdf(text: str) -> str:
    """A PCI address as vLLM and sysfs write it: a 4-digit domain, lower case (nvidia-smi prints
    ``00000000:1A:00.0``, lspci ``1a:00.0`` without a domain)."""
    m = re.fullmatch(r"(?:([0-9a-fA-F]{4,8}):)?([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])", text.strip())
    if not m:
        raise ValueError(f"not a PCI address: {text!r}")
    domain = int(m.group(1) or "0", 16)
    return f"{domain:04x}:{m.group(2)}:{m.group(3)}.{m.group(4)}".lower()


def acs_problems(devices: dict[str, dict], pairs: list[tuple[int, str, str, str]]) -> tuple[dict[str, list[str]], list[Problem]]:
    """({bridge: the ACS controls on that block}, problems) for each (GPU, its address, its NIC, the NIC's
    address) of ``pairs``, from ``parse_lspci``: a GPU or NIC lspci does not list, a bridge on the way
    whose capabilities lspci could not read, a bridge with ACS controls on that would send GPUDirect RDMA
    between them up to the root complex (or refuse it). Fails closed: what cannot be read is a problem."""
    blocking: dict[str, list[str]] = {}
    problems: list[Problem] = []
    for gpu, gpu_bdf, nic, nic_bdf in pairs:
        missing = [f"{what} {bdf}" for what, bdf in ((f"GPU {gpu}", gpu_bdf), (nic, nic_bdf)) if bdf not in devices]
        if missing:
            problems.append(("acs", f"lspci -vvv does not list {' or '.join(missing)}"))
            continue
        # A discrete GPU or NIC always hangs below a port: none in lspci's output is output it cut short,
        # not a path without ports.
        lone = [f"{what} {bdf}" for what, bdf in ((f"GPU {gpu}", gpu_bdf), (nic, nic_bdf))
                if not pci_ancestors(devices, bdf)]
        if lone:
            problems.append(("acs", f"lspci -vvv shows no bridge above {' or '.join(lone)} (no Bus: ranges?): "
                                    "cannot tell which ports lie between them"))
            continue
        for bridge in bridges_between(devices, gpu_bdf, nic_bdf):
            d = devices[bridge]
            if d.get("denied"):
                problems.append(("acs", f"{bridge}: lspci cannot read its capabilities (not run as root?)"))
            elif acs_blocking(d.get("acs_ctl", {})):
                blocking[bridge] = acs_blocking(d["acs_ctl"])
                problems.append(("acs", f"{bridge} ({d['description']}) has ACS {', '.join(blocking[bridge])} on, "
                                        f"between GPU {gpu} ({gpu_bdf}) and {nic} ({nic_bdf}): GPUDirect RDMA between "
                                        "them goes up to the root complex or is refused (rdma.disableAcs turns it off)"))
    return blocking, list(dict.fromkeys(problems))
