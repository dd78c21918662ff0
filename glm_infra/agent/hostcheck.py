#!/usr/bin/env python3
"""Host facts and health checks of a GPU server, run on the host itself (stdlib only).

glm-infra installs this file on every host and runs it from the preflight and health-gate steps:

    hostcheck.py facts [--model-path P]          JSON facts: OS, kernel, GPUs, driver, disk, RDMA, memlock
    hostcheck.py preflight --host NAME --allowed-os 'ubuntu 24.04' --min-kernel 5.12 --gpus N --gpu-model M
                        [--require-driver] [--model-path P [--min-free-gb G]]
                                                 facts on stdout; exit 1 with what rules the host out
    hostcheck.py health --host NAME --gpus N --gpu-model M [--driver V] [--fabric [--nvlinks 18]]
                        [--nics mlx5_0,... --link-layer Ethernet --mtu 4096 --gid-index 3]
    hostcheck.py health --host NAME --rdma-only --nics mlx5_0,... --link-layer Ethernet --mtu 4096 --gid-index 3
                                                 exit 1 with one "NAME: check: problem" line per failure;
                                                 a tool that fails, prints nothing or does not answer
                                                 within its limit (TOOL_TIMEOUT_S) is a failure
    hostcheck.py nic-affinity --host NAME --gpus N --nics mlx5_0,... --max-distance PXB --env-file F
                        [--acs check|disable] [--check | --acs-only]
                                                 each GPU's nearest compute NIC (nvidia-smi topo -m,
                                                 ibdev2netdev -v) as vLLM's VLLM_GPU_NIC_PCIE_MAPPING
                                                 in F; exit 1 when one is farther than the distance,
                                                 or when PCIe ACS is on between a GPU and its NIC
                                                 (lspci -D -vvv; --acs disable turns it off: setpci)

The parsers read what ``nvidia-smi``, ``ibv_devinfo [-v]``, ``show_gids`` and ``ibstat`` print; tests
run them on captures from real machines (tests/fixtures).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys

QUERY_FIELDS = "index,name,uuid,pci.bus_id,driver_version,memory.total,compute_cap"

# Seconds each tool may take before it counts as hung: a failure naming the tool, never a wait past
# the step's own timeout. nvidia-smi answers in seconds (its first call after a boot initialises
# every GPU, which takes longer); the RDMA tools read sysfs.
TOOL_TIMEOUT_S: dict[str, float] = {"nvidia-smi": 60, "ibv_devinfo": 30, "show_gids": 30, "ibstat": 30,
                                    "ibdev2netdev": 30, "lspci": 60, "setpci": 30,
                                    "systemd-detect-virt": 10}
TIMED_OUT = 124  # the exit status of a tool stopped at its limit, as coreutils' timeout reports it
REAP_S = 5  # how long a killed tool may take to go (one stuck in the driver goes only when it leaves it)
# The health gate's own limits (health-gate.sh.j2 runs this file and dcgmi under coreutils' timeout).
# `dcgmi diag -r LEVEL`, by DCGM's documentation: level 1 lasts seconds, level 2 about two minutes,
# level 3 about 15 minutes; the limits leave room for eight GPUs on a busy host.
DCGM_DIAG_TIMEOUT_S = {0: 0, 1: 300, 2: 900, 3: 2700}
GATE_POLL_S = 5  # the pause between two looks at the fabric
KILL_AFTER_S = 10  # from timeout's TERM to its KILL, for a tool that ignores TERM


# --- parsers -------------------------------------------------------------------------------------


def parse_query_csv(text: str) -> list[dict[str, str]]:
    """``nvidia-smi --query-*=... --format=csv``: one dict per row, keys from the header without
    units (``memory.total [MiB]`` → ``memory.total``)."""
    lines = [l for l in text.splitlines() if l.strip()]
    if not lines:
        return []
    keys = [re.sub(r"\s*\[.*\]$", "", k.strip()) for k in lines[0].split(",")]
    rows = []
    for line in lines[1:]:
        values = [v.strip() for v in line.split(",")]
        if len(values) != len(keys):
            raise ValueError(f"malformed nvidia-smi csv row: {line!r}")
        rows.append(dict(zip(keys, values)))
    return rows


_SMI_Q_TOP = {"Driver Version": "driver_version", "CUDA Version": "cuda_version", "Attached GPUs": "attached_gpus"}
_SMI_Q_GPU = {
    "Product Name": "name",
    "Product Architecture": "architecture",
    "GPU UUID": "uuid",
    "Persistence Mode": "persistence_mode",
    "Fabric/State": "fabric_state",
    "Fabric/Status": "fabric_status",
    "Remapped Rows/Pending": "remapped_pending",
    "Remapped Rows/Remapping Failure Occurred": "remapped_failure",
    "FB Memory Usage/Total": "memory_total",
}


def parse_smi_q(text: str) -> dict:
    """``nvidia-smi -q``: driver version and, per GPU, product name, fabric state and row remapping.

    The format nests sections by four spaces; ``Key : value`` lines are fields, lines without a
    colon open a section (``Fabric``, ``Remapped Rows``)."""
    out: dict = {"gpus": []}
    gpu: dict | None = None
    sections: list[str] = []
    for raw in text.splitlines():
        if not raw.strip() or raw.lstrip().startswith("="):
            continue
        m = re.match(r"^GPU ([0-9A-Fa-f]+:[0-9A-Fa-f:.]+)\s*$", raw)
        if m:
            gpu = {"bus_id": m.group(1)}
            out["gpus"].append(gpu)
            sections = []
            continue
        depth = (len(raw) - len(raw.lstrip(" "))) // 4  # 1 = directly under "GPU ..."
        key, sep, value = raw.strip().partition(":")
        key, value = key.strip(), value.strip()
        del sections[max(depth - 1, 0) :]
        if not sep:
            sections.append(key)
            continue
        if gpu is None:
            if key in _SMI_Q_TOP:
                out[_SMI_Q_TOP[key]] = value
            continue
        name = _SMI_Q_GPU.get("/".join([*sections, key]))
        if name:
            gpu[name] = value
    return out


def parse_nvlink_status(text: str) -> dict[int, dict[int, str | None]]:
    """``nvidia-smi nvlink -s``: {gpu index: {link: speed, or None when inactive}}."""
    out: dict[int, dict[int, str | None]] = {}
    current: dict[int, str | None] | None = None
    for line in text.splitlines():
        m = re.match(r"^GPU (\d+):", line)
        if m:
            current = out.setdefault(int(m.group(1)), {})
            continue
        m = re.match(r"^\s+Link (\d+): (.+?)\s*$", line)
        if m and current is not None:
            speed = m.group(2)
            # Up only with a speed: <inactive>, N/A, 0 GB/s or anything unreadable is not a working link.
            up = re.fullmatch(r"(\d+(?:\.\d+)?) GB/s", speed)
            current[int(m.group(1))] = speed if up and float(up.group(1)) > 0 else None
    return out


# ``nvidia-smi topo -m``'s distances between a GPU and a NIC, nearest first (its legend): PIX at most one
# PCIe bridge, PXB several bridges without the host bridge (both keep GPUDirect RDMA off the CPU), PHB
# through the host bridge, NODE between host bridges of one NUMA node, SYS across NUMA nodes.
TOPO_LEVELS = ("PIX", "PXB", "PHB", "NODE", "SYS")
_ANSI = re.compile(r"(?:\x1b)?\[[0-9;]*m")  # the header's underline; a paste may keep the text without ESC


def parse_topo_m(text: str) -> dict[int, dict[str, str]]:
    """``nvidia-smi topo -m``: {GPU index: {NIC device (its ``NIC Legend`` name, mlx5_N): distance}}.

    Columns are read by order, not position, so tabs and the spaces a paste turns them into read the
    same; the matrix ends where ``CPU Affinity`` begins. A NIC without a legend entry keeps its column
    name (older drivers name the columns mlx5_N themselves)."""
    lines = [_ANSI.sub("", line) for line in text.splitlines()]
    header = next((line.split() for line in lines if re.match(r"^\s*GPU0\s", line)), None)
    if header is None:
        raise ValueError("no header row (GPU0 ...) in nvidia-smi topo -m")
    columns = header[: header.index("CPU")] if "CPU" in header else header
    legend = dict(re.findall(r"^\s+(NIC\d+):\s+(\S+)\s*$", "\n".join(lines), re.M))
    out: dict[int, dict[str, str]] = {}
    for line in lines:
        m = re.match(r"^GPU(\d+)\s", line)
        if not m:
            continue
        cells = line.split()[1 : len(columns) + 1]
        if len(cells) != len(columns):
            raise ValueError(f"GPU{m.group(1)}: {len(cells)} cells for {len(columns)} columns")
        out[int(m.group(1))] = {legend.get(c, c): v for c, v in zip(columns, cells) if not c.startswith("GPU")}
    return out


def nearest_nics(topo: dict[int, dict[str, str]], nics: list[str] | None = None) -> dict[int, tuple[str, str]]:
    """Each GPU's nearest NIC (among ``nics`` when given) and its distance. Among equally near NICs, in
    GPU order, the one fewest GPUs got so far, then the lower-sorted name: two GPUs behind one switch with
    two NICs get one each, the same ones every time."""
    out: dict[int, tuple[str, str]] = {}
    taken: dict[str, int] = {}
    for gpu in sorted(topo):
        known = [(TOPO_LEVELS.index(v), taken.get(n, 0), n) for n, v in topo[gpu].items()
                 if v in TOPO_LEVELS and (nics is None or n in nics)]
        if known:
            level, _, nic = min(known)
            out[gpu] = (nic, TOPO_LEVELS[level])
            taken[nic] = taken.get(nic, 0) + 1
    return out


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


def parse_gpu_bus_ids(text: str) -> dict[int, str]:
    """``nvidia-smi --query-gpu=index,pci.bus_id --format=csv,noheader``: {GPU index: PCI address}."""
    out: dict[int, str] = {}
    for line in text.splitlines():
        if line.strip():
            index, _, bus_id = line.partition(",")
            out[int(index)] = normalize_bdf(bus_id)
    return out


def parse_ibdev2netdev(text: str) -> dict[str, str]:
    """``ibdev2netdev -v`` (DOCA-OFED): {RDMA device: its PCI address}."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        words = line.split()
        try:
            if len(words) > 2:
                out[words[1]] = normalize_bdf(words[0])
        except ValueError:  # the short form (no address) or another line
            pass
    return out


def nic_affinity(topo: dict[int, dict[str, str]], gpu_bdfs: dict[int, str], nic_bdfs: dict[str, str],
                 nics: list[str], max_distance: str) -> tuple[dict[int, tuple[str, str]], list[Problem]]:
    """Each GPU's nearest compute NIC (``nearest_nics`` among ``nics``) and what keeps a GPU's rank from
    one at ``max_distance`` or nearer: no compute NIC in the matrix, a farther one, a GPU or NIC whose
    PCI address is unknown, a GPU the matrix leaves out."""
    problems: list[Problem] = []
    nearest = nearest_nics(topo, nics)
    for gpu in sorted(set(gpu_bdfs) | set(topo)):
        if gpu not in topo:
            problems.append(("affinity", f"GPU {gpu} is not in nvidia-smi topo -m"))
            continue
        if gpu not in gpu_bdfs:
            problems.append(("affinity", f"GPU {gpu}: nvidia-smi --query-gpu gives no PCI address"))
        if gpu not in nearest:
            problems.append(("affinity", f"GPU {gpu}: none of the compute NICs ({', '.join(nics)}) is in "
                                         "nvidia-smi topo -m"))
            continue
        nic, level = nearest[gpu]
        if TOPO_LEVELS.index(level) > TOPO_LEVELS.index(max_distance):
            problems.append(("affinity", f"GPU {gpu} ({gpu_bdfs.get(gpu, '?')}): its nearest compute NIC {nic} is "
                                         f"at {level}, farther than {max_distance} (nixl.maxNicDistance): its rank's "
                                         "KV traffic would cross the host bridge"))
        if nic not in nic_bdfs:
            problems.append(("affinity", f"{nic}: ibdev2netdev -v gives no PCI address"))
    return nearest, problems


def nic_affinity_env(nearest: dict[int, tuple[str, str]], gpu_bdfs: dict[int, str], nic_bdfs: dict[str, str],
                     host: str) -> str:
    """The EnvironmentFile vLLM's units read: vLLM 0.33's GPU-to-NIC pairs (vllm/v1/executor/
    vllm_net_devices.py; docs/research/vllm-0.33-nic-per-rank.md), one per GPU, nearest first."""
    pairs = ",".join(f"{gpu_bdfs[g]}={nic_bdfs[nic]}" for g, (nic, _) in sorted(nearest.items()))
    lines = [f"# Managed by glm-infra: each GPU of {host} and its nearest compute NIC (nvidia-smi topo -m):"]
    lines += [f"#   GPU {g} {gpu_bdfs[g]} -> {nic} {nic_bdfs[nic]} ({level})" for g, (nic, level) in sorted(nearest.items())]
    return "\n".join(lines + [f"VLLM_GPU_NIC_PCIE_MAPPING={pairs}"]) + "\n"


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


def parse_ibv_devinfo(text: str) -> dict[str, dict]:
    """``ibv_devinfo`` or ``ibv_devinfo -v``: {device: {port number: {state, active_mtu, link_layer,
    gids}}}, ``gids`` (from ``-v`` only) {index: {gid, ver, ipv4}}. Tabs or spaces alike."""
    out: dict[str, dict] = {}
    dev = port = None
    for line in text.splitlines():
        s = line.strip()
        m = re.match(r"^hca_id:\s*(\S+)", s)
        if m:
            dev = out.setdefault(m.group(1), {})
            port = None
            continue
        m = re.match(r"^port:\s*(\d+)", s)
        if m and dev is not None:
            port = dev.setdefault(int(m.group(1)), {"gids": {}})
            continue
        if port is None:
            continue
        m = re.match(r"^GID\[\s*(\d+)\]:\s*([0-9A-Fa-f:.]+)(?:,\s*RoCE (v\d))?$", s)
        if m:
            port["gids"][int(m.group(1))] = {"gid": m.group(2), "ver": m.group(3) or "", "ipv4": gid_ipv4(m.group(2))}
            continue
        key, _, value = s.partition(":")
        value = value.strip()
        if key == "state":
            port["state"] = value.split()[0] if value else ""
        elif key == "active_mtu" and value.split() and value.split()[0].isdigit():
            port["active_mtu"] = int(value.split()[0])
        elif key == "link_layer":
            port["link_layer"] = value
    return out


def gid_ipv4(gid: str) -> str:
    """The IPv4 address of an IPv4-mapped GID, in either form the tools print
    (``::ffff:10.0.3.1`` or ``0000:…:ffff:0a00:0301``); "" for any other GID."""
    try:
        mapped = ipaddress.IPv6Address(gid).ipv4_mapped
    except ValueError:
        return ""
    return str(mapped) if mapped else ""


def parse_show_gids(text: str) -> list[dict[str, str]]:
    """``show_gids``: one dict per GID row (dev, port, index, gid, ipv4, ver, netdev)."""
    rows = []
    for line in text.splitlines():
        parts = line.split()
        # A row without a number for port and index is not a GID row (headers, rules, a mangled line).
        if len(parts) < 5 or not (parts[1].isdigit() and parts[2].isdigit()):
            continue
        dev, port, index, gid = parts[:4]
        rest = parts[4:]
        ipv4 = rest.pop(0) if rest and re.match(r"^\d+\.\d+\.\d+\.\d+$", rest[0]) else ""
        ver = rest[0] if rest else ""
        netdev = rest[1] if len(rest) > 1 else ""
        rows.append({"dev": dev, "port": port, "index": index, "gid": gid, "ipv4": ipv4, "ver": ver, "netdev": netdev})
    return rows


def parse_ibstat(text: str) -> dict[str, dict]:
    """``ibstat``: {CA: {type, firmware, ports: {number: {state, physical_state, rate, link_layer}}}}."""
    out: dict[str, dict] = {}
    ca = port = None
    keys = {"State": "state", "Physical state": "physical_state", "Rate": "rate", "Link layer": "link_layer",
            "Base lid": "base_lid"}
    for line in text.splitlines():
        s = line.strip()
        m = re.match(r"^CA '([^']+)'$", s)
        if m:
            ca = out.setdefault(m.group(1), {"ports": {}})
            port = None
            continue
        if ca is None:
            continue
        m = re.match(r"^Port (\d+):$", s)
        if m:
            port = ca["ports"].setdefault(int(m.group(1)), {})
            continue
        key, _, value = s.partition(":")
        value = value.strip()
        if port is None:
            if key == "CA type":
                ca["type"] = value
            elif key == "Firmware version":
                ca["firmware"] = value
        elif key in keys:
            port[keys[key]] = int(value) if key == "Rate" and value.isdigit() else value
    return out


def gid_table(devinfo: str, show_gids: str | None) -> dict[str, dict[int, dict[str, str]]]:
    """{device: {GID index: {gid, ver, ipv4}}} of port 1: from ``show_gids`` (DOCA-OFED's tool) when it
    ran, else from the GID lines of ``ibv_devinfo -v`` (inbox rdma-core has no show_gids)."""
    out: dict[str, dict[int, dict[str, str]]] = {}
    if show_gids is not None:
        for r in parse_show_gids(show_gids):
            if r["port"] == "1":
                out.setdefault(r["dev"], {})[int(r["index"])] = {"gid": r["gid"], "ver": r["ver"], "ipv4": r["ipv4"]}
    else:
        out = {dev: dict(ports[1]["gids"]) if 1 in ports else {} for dev, ports in parse_ibv_devinfo(devinfo).items()}
    # One spelling per GID (the tools print some compressed, some as eight groups).
    return {dev: {i: {**g, "gid": _canonical_gid(g["gid"])} for i, g in gids.items()} for dev, gids in out.items()}


def _canonical_gid(gid: str) -> str:
    try:
        return str(ipaddress.IPv6Address(gid))
    except ValueError:
        return gid


# --- gathering -----------------------------------------------------------------------------------


def _run(cmd: list[str], timeout: float | None = None) -> tuple[int, str]:
    """(exit status, output) of a tool; its stderr too when it fails. A tool still running after
    ``timeout`` (default: its TOOL_TIMEOUT_S) is killed with what it started, and reads as
    (TIMED_OUT, "TOOL timed out after Ns")."""
    if shutil.which(cmd[0]) is None:
        return 127, f"{cmd[0]}: not installed"
    limit = TOOL_TIMEOUT_S[cmd[0]] if timeout is None else timeout
    # A session of its own, so that a timeout kills what the tool started too (a wrapper script's
    # children would otherwise live on).
    # No input for it to wait on; text pipes (errors= makes them text) that take any bytes.
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                         errors="replace", start_new_session=True)
    try:
        out, err = p.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=REAP_S)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        for pipe in (p.stdout, p.stderr):
            pipe.close()  # type: ignore[union-attr]
        return TIMED_OUT, f"{cmd[0]} timed out after {limit:g}s"
    return p.returncode, (out if p.returncode == 0 else (out + err)).strip()


def health_budget_s(fabric: bool) -> int:
    """The longest ``health`` of the GPUs takes with every tool it runs at its limit, plus Python's own
    start: what the gate's limit around it must exceed, so that the tool that hangs is the one named."""
    looks = 3 if fabric else 2  # --query-gpu, -q [, nvlink -s]
    return int((TOOL_TIMEOUT_S["nvidia-smi"] + REAP_S) * looks) + 15


def gate_limits(fabric: bool, dcgm_level: int) -> dict[str, int]:
    """What health-gate.sh.j2 gives each thing it runs (seconds): a look (this file's ``health``), dcgmi
    diag, timeout's grace before KILL, the pause between looks."""
    return {"hostcheck_s": health_budget_s(fabric), "dcgm_s": DCGM_DIAG_TIMEOUT_S[dcgm_level],
            "kill_after_s": KILL_AFTER_S, "poll_s": GATE_POLL_S}


def gate_timeout_s(fabric_timeout: int, fabric: bool, dcgm_level: int) -> int:
    """The longest the health gate (health-gate.sh.j2 apply) runs: its last look at the fabric starts within
    a pause of ``fabric_timeout`` and ends within its limit, then dcgmi diag within its own."""
    g = gate_limits(fabric, dcgm_level)
    dcgm = g["dcgm_s"] + g["kill_after_s"] if dcgm_level else 0
    return fabric_timeout + g["poll_s"] + g["hostcheck_s"] + g["kill_after_s"] + dcgm


def os_release(path: str = "/etc/os-release") -> dict[str, str]:
    out = {}
    try:
        with open(path) as f:
            for line in f:
                k, _, v = line.strip().partition("=")
                out[k] = v.strip('"')
    except OSError:
        pass
    return out


def free_bytes(path: str) -> tuple[str, int]:
    """Free bytes on the file system that holds ``path`` (or its nearest existing parent)."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    st = os.statvfs(p)
    return p, st.f_bavail * st.f_frsize


def memlock() -> dict[str, str]:
    rc, out = _run(["systemd-detect-virt", "--container"])
    container = out if rc == 0 else "none"
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        effective = "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
    except (ImportError, ValueError):
        effective = "unknown"
    return {"container": container, "effective_memlock": effective}


def gpu_facts() -> dict:
    rc, out = _run(["nvidia-smi", f"--query-gpu={QUERY_FIELDS}", "--format=csv"])
    if rc != 0:
        return {"error": out.splitlines()[0] if out else f"nvidia-smi exited {rc}", "exit": rc}
    try:
        rows = parse_query_csv(out)
    except ValueError as e:
        return {"error": f"cannot read nvidia-smi --query-gpu: {e}", "exit": rc}
    missing = [k for k in ("name", "driver_version") if rows and k not in rows[0]]
    if missing:
        return {"error": f"cannot read nvidia-smi --query-gpu: no {' or '.join(missing)} column", "exit": rc}
    return {
        "count": len(rows),
        "models": sorted({r["name"] for r in rows}),
        "driver_version": rows[0]["driver_version"] if rows else None,
        "compute_cap": sorted({r.get("compute_cap", "") for r in rows}),
        # The smallest GPU's memory (capacity planning's GPU memory once the host is known).
        "memory_total_mib": min(mib) if (mib := [int(m.group(1)) for r in rows
                                                 if (m := re.match(r"(\d+) MiB$", str(r.get("memory.total"))))]) else None,
    }


def rdma_facts() -> dict:
    rc, out = _run(["ibv_devinfo", "-v"])
    if rc != 0 or not out.strip():
        return {"error": out.splitlines()[0] if out.strip() else f"ibv_devinfo -v exited {rc} and printed nothing"}
    rates = {}
    rc_s, ibstat = _run(["ibstat"])
    if rc_s == 0:
        rates = {ca: {p: info.get("rate") for p, info in v["ports"].items()} for ca, v in parse_ibstat(ibstat).items()}
    out_facts = {}
    for dev, ports in sorted(parse_ibv_devinfo(out).items()):
        out_facts[dev] = {}
        for p, info in ports.items():
            port = {k: v for k, v in info.items() if k != "gids"}
            port["roce_v2_ipv4_gids"] = sorted(i for i, g in info["gids"].items() if g["ver"] == "v2" and g["ipv4"])
            if rates.get(dev, {}).get(p) is not None:
                port["rate_gbps"] = rates[dev][p]
            out_facts[dev][str(p)] = port
    return out_facts


def facts(model_path: str | None) -> dict:
    osr = os_release()
    out: dict = {
        "os": f"{osr.get('ID', 'unknown')} {osr.get('VERSION_ID', '')}".strip(),
        "os_pretty": osr.get("PRETTY_NAME", ""),
        "kernel": platform.release(),
        "arch": platform.machine(),
        "gpus": gpu_facts(),
        "rdma": rdma_facts(),
    }
    out.update(memlock())
    if model_path:
        where, free = free_bytes(model_path)
        out["disk"] = {"path": where, "free_bytes": free, "staged_bytes": staged_bytes(model_path)}
    return out


def staged_bytes(path: str) -> int:
    """Bytes of the checkpoint already at ``path`` (a folder or a symlink to one): room it would
    give back if staged again, so a host that holds the weights passes the disk check again."""
    total = 0
    for root, _, files in os.walk(os.path.realpath(path)):  # nothing for a file or a missing path
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


# --- health --------------------------------------------------------------------------------------
#
# Every check fails closed: a tool that fails, prints nothing, or describes fewer GPUs, links or
# ports than the stack expects is a problem, and the "healthy" line says what was read.

Problem = tuple[str, str]  # (check, what is wrong)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def tool_problem(check: str, what: str, rc: int, out: str) -> Problem | None:
    """A problem when ``what`` failed or printed nothing; None when it printed something."""
    if rc != 0:
        return (check, f"{what} failed (exit {rc}): {_first_line(out) or 'no output'}")
    if not out.strip():
        return (check, f"{what} printed nothing")
    return None


def gpu_problems(query_csv: str, smi_q: str, nvlink: str, gpus: int, model: str, driver: str | None,
                 fabric: bool, nvlinks: int = 18) -> list[Problem]:
    """(check, problem) pairs from what ``nvidia-smi --query-gpu``, ``-q`` and ``nvlink -s`` printed."""
    problems: list[Problem] = []
    try:
        rows = parse_query_csv(query_csv)
    except ValueError as e:
        return [("gpus", f"cannot read nvidia-smi --query-gpu: {e}")]
    if len(rows) != gpus:
        problems.append(("gpus", f"{len(rows)} GPUs visible, stack expects {gpus}"))
    for r in rows:
        if model.lower() not in str(r.get("name")).lower():
            problems.append(("gpus", f"GPU {r.get('index')} is {r.get('name')!r}, stack expects {model}"))
        if driver and r.get("driver_version") != driver:
            problems.append(("driver", f"GPU {r.get('index')} runs driver {r.get('driver_version')}, stack pins {driver}"))
    q = parse_smi_q(smi_q)
    if len(q["gpus"]) != gpus:
        problems.append(("gpus", f"nvidia-smi -q describes {len(q['gpus'])} GPUs, stack expects {gpus}"))
    for i, g in enumerate(q["gpus"]):
        label = f"GPU {i} ({g['bus_id']})"
        if fabric:
            problems += fabric_problems(label, g.get("fabric_state"), g.get("fabric_status"))
        problems += remap_problems(label, g.get("remapped_pending"), g.get("remapped_failure"))
    if fabric:
        links = parse_nvlink_status(nvlink)
        if len(links) != gpus:
            problems.append(("nvlink", f"nvidia-smi nvlink -s lists {len(links)} GPUs, stack expects {gpus}"))
        for gpu, ls in sorted(links.items()):
            down = [str(n) for n, speed in sorted(ls.items()) if speed is None]
            if down:
                problems.append(("nvlink", f"GPU {gpu} NVLink links down: {', '.join(down)}"))
            if len(ls) < nvlinks:
                problems.append(("nvlink", f"GPU {gpu} lists {len(ls)} NVLink links, expected {nvlinks}"))
    return problems


def fabric_problems(label: str, state: str | None, status: str | None) -> list[Problem]:
    """NVML's fabric registration of one GPU (``nvidia-smi -q`` Fabric): State goes Not Started, In
    Progress, Completed; only then does Status say whether it worked ("Success", else an NVML error
    such as "Failure" or "Insufficient Resources"). Missing (None) or empty is a problem too."""
    if state != "Completed":
        return [("fabric", f"{label} fabric state is {state or 'missing'!r} (fabric manager or NVLSM not ready)")]
    if status != "Success":
        # Waiting does not fix a failed registration: its own check, which the gate does not wait on.
        return [("fabric-status", f"{label} fabric state is 'Completed' with status {status or 'missing'!r}: "
                                  "its fabric registration failed (see the nvidia-fabricmanager log)")]
    return []


def remap_problems(label: str, pending: str | None, failure: str | None) -> list[Problem]:
    """``nvidia-smi -q`` Remapped Rows of one GPU: Pending and Remapping Failure Occurred must both read
    No; a missing or unreadable field is a problem."""
    if pending is None and failure is None:
        return [("remapped-rows", f"{label}: nvidia-smi -q shows no Remapped Rows section")]
    problems: list[Problem] = []
    for field, value, meaning in (("Pending", pending, "has a pending row remap (reset the GPU before serving)"),
                                  ("Remapping Failure Occurred", failure, "had a row remapping failure")):
        if value == "Yes":
            problems.append(("remapped-rows", f"{label} {meaning}"))
        elif value != "No":
            problems.append(("remapped-rows", f"{label}: Remapped Rows {field} reads {value or 'nothing'!r}, "
                                              "expected No"))
    return problems


def gpu_summary(query_csv: str, smi_q: str, nvlink: str, fabric: bool) -> str:
    """What the outputs said, for the "healthy" line: count, model, driver, fabric states, links."""
    rows = parse_query_csv(query_csv)
    q = parse_smi_q(smi_q)
    models = sorted({r.get("name", "?") for r in rows})
    drivers = sorted({r.get("driver_version", "?") for r in rows})
    out = [f"{len(rows)} × {', '.join(models)}, driver {', '.join(drivers)}"]
    if fabric:
        states = sorted({g.get("fabric_state", "missing") for g in q["gpus"]})
        out.append(f"fabric {'/'.join(states)} on {len(q['gpus'])} GPUs")
        links = parse_nvlink_status(nvlink)
        up = sorted({sum(1 for v in ls.values() if v is not None) for ls in links.values()})
        total = sorted({len(ls) for ls in links.values()})
        out.append(f"NVLink {'/'.join(map(str, up))} of {'/'.join(map(str, total))} links up on each of {len(links)} GPUs")
    pending = sum(1 for g in q["gpus"] if g.get("remapped_pending") != "No")
    out.append(f"{pending} pending row remaps on {len(q['gpus'])} GPUs")
    return "; ".join(out)


def rdma_problems(devinfo: str, gids: dict[str, dict[int, dict[str, str]]], nics: list[str], link_layer: str,
                  mtu: int, gid_index: int) -> list[Problem]:
    """``devinfo``: what ``ibv_devinfo -v`` printed; ``gids``: ``gid_table()``."""
    problems: list[Problem] = []
    devs = parse_ibv_devinfo(devinfo)
    for nic in nics:
        if nic not in devs:
            problems.append(("rdma", f"{nic} not found (devices: {', '.join(sorted(devs)) or 'none'})"))
            continue
        if not devs[nic]:
            problems.append(("rdma", f"{nic}: ibv_devinfo lists no port"))
        for port, info in sorted(devs[nic].items()):
            if info.get("state") != "PORT_ACTIVE":
                problems.append(("rdma", f"{nic} port {port} is {info.get('state') or 'of unknown state'}, expected PORT_ACTIVE"))
            if info.get("link_layer") != link_layer:
                problems.append(("rdma", f"{nic} port {port} link layer {info.get('link_layer') or 'unknown'}, expected {link_layer}"))
            if info.get("active_mtu") != mtu:
                problems.append(("rdma", f"{nic} port {port} active_mtu {info.get('active_mtu', 'unknown')}, expected {mtu}"))
        if link_layer == "Ethernet":
            gid = gids.get(nic, {}).get(gid_index)
            if gid is None:
                problems.append(("rdma", f"{nic} has no GID at index {gid_index}"))
            elif gid["ver"] != "v2" or not gid["ipv4"]:
                problems.append(("rdma", f"{nic} GID index {gid_index} is not a RoCE v2 GID with an IPv4 address "
                                         f"({gid['gid']}, {'RoCE ' + gid['ver'] if gid['ver'] else 'no RoCE version'})"))
    return problems


def rdma_summary(devinfo: str, gids: dict[str, dict[int, dict[str, str]]], nics: list[str], link_layer: str,
                 gid_index: int) -> str:
    devs = parse_ibv_devinfo(devinfo)
    ports = [info for nic in nics for info in devs.get(nic, {}).values()]
    states = sorted({p.get("state", "?") for p in ports})
    mtus = sorted({str(p.get("active_mtu", "?")) for p in ports})
    out = f"RDMA {','.join(nics)}: {len(ports)} ports {'/'.join(states)} {link_layer} active_mtu {'/'.join(mtus)}"
    if link_layer == "Ethernet":
        found = [gids[n][gid_index] for n in nics if gid_index in gids.get(n, {})]
        out += f", GID {gid_index} RoCE {'/'.join(sorted({g['ver'] for g in found}))} IPv4 on {len(found)} NICs"
    return out


def _gpu_health(args: argparse.Namespace) -> list[Problem] | str:
    """The problems of the GPUs; when there are none, what was read of them."""
    rc, query = _run(["nvidia-smi", f"--query-gpu={QUERY_FIELDS}", "--format=csv"])
    if rc != 0:
        return [("driver", f"nvidia-smi failed (exit {rc}): {_first_line(query) or 'no output'}")]
    problems = [p for p in [tool_problem("gpus", "nvidia-smi --query-gpu", rc, query)] if p]
    rc_q, smi_q = _run(["nvidia-smi", "-q"])
    problems += [p for p in [tool_problem("gpus", "nvidia-smi -q", rc_q, smi_q)] if p]
    nvlink = ""
    if args.fabric:
        rc_l, nvlink = _run(["nvidia-smi", "nvlink", "-s"])
        problems += [p for p in [tool_problem("nvlink", "nvidia-smi nvlink -s", rc_l, nvlink)] if p]
    if problems:  # what failed or printed nothing is the problem; no judging of partial output
        return problems
    # The summary only of what passed (it would choke on what gpu_problems reports as unreadable).
    return (gpu_problems(query, smi_q, nvlink, args.gpus, args.gpu_model, args.driver, args.fabric, args.nvlinks)
            or gpu_summary(query, smi_q, nvlink, args.fabric))


def _rdma_health(args: argparse.Namespace) -> list[Problem] | str:
    """The problems of the RDMA NICs; when there are none, what was read of them."""
    nics = args.nics.split(",")
    rc, devinfo = _run(["ibv_devinfo", "-v"])
    problems = [p for p in [tool_problem("rdma", "ibv_devinfo -v", rc, devinfo)] if p]
    show: str | None = None
    if args.link_layer == "Ethernet" and shutil.which("show_gids"):
        rc_g, show = _run(["show_gids"])
        problems += [p for p in [tool_problem("rdma", "show_gids", rc_g, show)] if p]
    if problems:
        return problems
    gids = gid_table(devinfo, show)
    return (rdma_problems(devinfo, gids, nics, args.link_layer, args.mtu, args.gid_index)
            or rdma_summary(devinfo, gids, nics, args.link_layer, args.gid_index))


def health(args: argparse.Namespace) -> int:
    results = ([] if args.rdma_only else [_gpu_health(args)]) + ([_rdma_health(args)] if args.nics else [])
    problems = [p for r in results if not isinstance(r, str) for p in r]
    read = [r for r in results if isinstance(r, str)]
    for check, problem in problems:
        print(f"{args.host}: {check}: {problem}", file=sys.stderr)
    if not problems:
        print(f"{args.host}: healthy ({'; '.join(read)})")
    return 1 if problems else 0


def _affinity(args: argparse.Namespace) -> tuple[str | None, list[Problem], str]:
    """(the env file's text, problems, what the ACS check read) from the host's own tools; any that
    fails is the problem."""
    nics = args.nics.split(",")
    results = {name: _run(cmd) for name, cmd in (
        ("nvidia-smi topo -m", ["nvidia-smi", "topo", "-m"]),
        ("nvidia-smi --query-gpu=index,pci.bus_id", ["nvidia-smi", "--query-gpu=index,pci.bus_id",
                                                     "--format=csv,noheader"]),
        ("ibdev2netdev -v", ["ibdev2netdev", "-v"]))}
    problems = [p for name, (rc, out) in results.items() for p in [tool_problem("affinity", name, rc, out)] if p]
    if problems:
        return None, problems, ""
    try:
        topo = parse_topo_m(results["nvidia-smi topo -m"][1])
        gpu_bdfs = parse_gpu_bus_ids(results["nvidia-smi --query-gpu=index,pci.bus_id"][1])
    except ValueError as e:
        return None, [("affinity", f"cannot read nvidia-smi: {e}")], ""
    if len(gpu_bdfs) != args.gpus:  # a GPU off the bus: no pairs without it (nor ACS turned off for it)
        return None, [("affinity", f"{len(gpu_bdfs)} GPUs visible, stack expects {args.gpus}")], ""
    nic_bdfs = parse_ibdev2netdev(results["ibdev2netdev -v"][1])
    nearest, problems = nic_affinity(topo, gpu_bdfs, nic_bdfs, nics, args.max_distance)
    if problems:
        return None, problems, ""
    pairs = [(g, gpu_bdfs[g], nic, nic_bdfs[nic]) for g, (nic, _) in sorted(nearest.items())]
    acs, problems = _acs(args, pairs)
    return (None if problems else nic_affinity_env(nearest, gpu_bdfs, nic_bdfs, args.host)), problems, acs


def _lspci() -> tuple[dict[str, dict] | None, list[Problem]]:
    rc, text = _run(["lspci", "-D", "-vvv"])
    problem = tool_problem("acs", "lspci -D -vvv", rc, text)
    return (None, [problem]) if problem else (parse_lspci(text), [])


def _acs(args: argparse.Namespace, pairs: list[tuple[int, str, str, str]]) -> tuple[str, list[Problem]]:
    """What the ACS check read (or turned off), and its problems: ACS controls on between a GPU and its
    NIC fail unless --acs disable turns them off (setpci, as NVIDIA's NCCL guide does: ECAP_ACS+0x6.w=0000,
    the ACS Control register zeroed), which holds until the next boot."""
    devices, problems = _lspci()
    if devices is None:
        return "", problems
    blocking, problems = acs_problems(devices, pairs)
    turned_off = []
    if blocking and args.acs == "disable" and not args.check:
        for bridge in blocking:
            rc, out = _run(["setpci", "-s", bridge, "ECAP_ACS+0x6.w=0000"])
            if rc != 0:
                return "", [("acs", f"setpci -s {bridge} ECAP_ACS+0x6.w=0000 failed (exit {rc}): "
                                    f"{_first_line(out) or 'no output'}")]
            turned_off.append(bridge)
        devices, problems = _lspci()  # read back: what setpci wrote is what counts
        if devices is None:
            return "", problems
        _, problems = acs_problems(devices, pairs)
    ports = sorted({b for _, g, _, n in pairs for b in bridges_between(devices, g, n)})
    if turned_off:
        return f"ACS turned off on {len(turned_off)} of the {len(ports)} switch ports between them", problems
    return f"ACS off on the {len(ports)} switch ports between them", problems


def affinity(args: argparse.Namespace) -> int:
    """Each GPU's nearest compute NIC written to (or, with --check, compared with) --env-file; exit 1
    with one line per problem, and then the file is left as it was."""
    text, problems, acs = _affinity(args)
    if text is not None and args.check and not args.acs_only:
        try:
            current = open(args.env_file).read()
        except OSError as e:
            current = None
            problems = [("affinity", f"{args.env_file}: {e.strerror or e}")]
        if current is not None and current != text:
            problems = [("affinity", f"{args.env_file} no longer matches the GPUs' nearest NICs (apply writes it again)")]
    for check, problem in problems:
        print(f"{args.host}: {check}: {problem}", file=sys.stderr)
    if problems or text is None:
        return 1
    if not args.check and not args.acs_only:
        try:
            changed = open(args.env_file).read() != text
        except OSError:
            changed = True
        if changed:  # whole or not at all: a unit starting now reads the old file or the new one
            tmp = f"{args.env_file}.tmp"
            with open(tmp, "w") as out:
                out.write(text)
            os.chmod(tmp, 0o644)
            os.replace(tmp, args.env_file)
    pairs = [line[2:].strip() for line in text.splitlines() if line.startswith("#   ")]
    print(f"{args.host}: nearest NICs ({'; '.join(pairs)}); {acs}")
    return 0


def _version_tuple(v: str) -> tuple[int, ...] | None:
    parts = re.findall(r"\d+", v)[:2]
    return tuple(int(x) for x in parts) if len(parts) == 2 else None


def preflight_problems(f: dict, allowed_os: list[str], min_kernel: str, gpus: int, gpu_model: str,
                       require_driver: bool, min_free_gb: float | None = None) -> list[Problem]:
    """What rules a host out, from its facts (``facts()``)."""
    problems: list[Problem] = []
    os_id = f.get("os", "unknown")
    if os_id.startswith("unknown"):
        problems.append(("os", "cannot tell the OS: /etc/os-release is missing or has no ID"))
    elif os_id.lower() not in [a.lower() for a in allowed_os]:
        problems.append(("os", f"{f.get('os_pretty') or os_id} is not supported here (allowed: {', '.join(allowed_os)})"))
    kernel_text = f.get("kernel", "")
    kernel, wanted = _version_tuple(kernel_text), _version_tuple(min_kernel)
    if kernel is None:
        problems.append(("kernel", f"cannot read the kernel version {kernel_text!r}"))
    elif wanted is not None and kernel < wanted:
        problems.append(("kernel", f"kernel {f['kernel']} is older than {min_kernel} (DMA-BUF GPUDirect)"))
    g = f.get("gpus", {})
    if "error" in g:
        if require_driver:
            problems.append(("driver", f"drivers.mode is verify but the driver does not answer: {g['error']}"))
    elif gpus:
        if g.get("count") != gpus:
            problems.append(("gpus", f"{g.get('count', 0)} GPUs visible, stack expects {gpus}"))
        wrong = [m for m in g.get("models", []) if gpu_model.lower() not in m.lower()]
        if wrong:
            problems.append(("gpus", f"GPU model {', '.join(wrong)}, stack expects {gpu_model}"))
    if min_free_gb is not None:
        disk = f.get("disk")
        if not disk:
            problems.append(("disk", "no disk facts (the model path was not given)"))
        else:
            room = disk.get("free_bytes", 0) + disk.get("staged_bytes", 0)
            if room < min_free_gb * 1e9:
                problems.append(("disk", f"{room / 1e9:.0f} GB free or staged at {disk.get('path')}, stack needs "
                                         f"{min_free_gb:g} GB (preflight.minFreeDiskGb)"))
    return problems


def preflight(args: argparse.Namespace) -> int:
    """Facts as one JSON line on stdout; what rules out this host, one line each on stderr."""
    f = facts(args.model_path)
    problems = preflight_problems(f, args.allowed_os, args.min_kernel, args.gpus, args.gpu_model,
                                  args.require_driver, args.min_free_gb)
    print(json.dumps(f, sort_keys=True))
    for check, problem in problems:
        print(f"{args.host}: {check}: {problem}", file=sys.stderr)
    return 1 if problems else 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hostcheck.py", description=__doc__,  # pragma: no mutate
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("facts")
    f.add_argument("--model-path")
    p = sub.add_parser("preflight")
    p.add_argument("--host", required=True)
    p.add_argument("--allowed-os", action="append", required=True, help="'ID VERSION_ID', repeatable")  # pragma: no mutate
    p.add_argument("--min-kernel", required=True)
    p.add_argument("--model-path")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpu-model", required=True)
    p.add_argument("--require-driver", action="store_true")
    p.add_argument("--min-free-gb", type=float, help="free (or staged) room needed at the model path")  # pragma: no mutate
    h = sub.add_parser("health")
    h.add_argument("--host", required=True)
    h.add_argument("--rdma-only", action="store_true", help="check only the RDMA NICs")  # pragma: no mutate
    h.add_argument("--gpus", type=int)
    h.add_argument("--gpu-model")
    h.add_argument("--driver")
    h.add_argument("--fabric", action="store_true")
    h.add_argument("--nvlinks", type=int, default=18, help="NVLink links per GPU (18 on HGX B300)")  # pragma: no mutate
    h.add_argument("--nics")
    h.add_argument("--link-layer", choices=["Ethernet", "InfiniBand"])
    h.add_argument("--mtu", type=int)
    h.add_argument("--gid-index", type=int)
    a = sub.add_parser("nic-affinity", help="each GPU's nearest compute NIC, into vLLM's EnvironmentFile")  # pragma: no mutate
    a.add_argument("--host", required=True)
    a.add_argument("--nics", required=True, help="the compute NICs, comma-separated")  # pragma: no mutate
    a.add_argument("--max-distance", choices=TOPO_LEVELS, required=True)
    a.add_argument("--env-file", required=True)
    a.add_argument("--check", action="store_true", help="compare with --env-file, change nothing")  # pragma: no mutate
    a.add_argument("--gpus", type=int, required=True, help="GPUs the stack expects on the host")  # pragma: no mutate
    a.add_argument("--acs-only", action="store_true",
                   help="only the reading and ACS: neither write nor compare --env-file (at boot)")  # pragma: no mutate
    a.add_argument("--acs", choices=("check", "disable"), default="check",
                   help="PCIe ACS between each GPU and its NIC: fail when on, or turn it off (setpci)")  # pragma: no mutate
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.cmd == "facts":
        print(json.dumps(facts(args.model_path), sort_keys=True))
        return 0
    if args.cmd == "preflight":
        return preflight(args)
    if args.cmd == "nic-affinity":
        return affinity(args)
    if not args.rdma_only and (args.gpus is None or not args.gpu_model):
        ap.error("health needs --gpus and --gpu-model (or --rdma-only)")
    if args.nics and None in (args.link_layer, args.mtu, args.gid_index):
        ap.error("--nics needs --link-layer, --mtu and --gid-index")
    if args.rdma_only and not args.nics:
        ap.error("--rdma-only needs --nics")
    return health(args)


if __name__ == "__main__":
    sys.exit(main())
