#!/usr/bin/env python3
"""Host facts and health checks of a GPU server, run on the host itself (stdlib only).

glm-infra installs this file on every host and runs it from the preflight and health-gate steps:

    hostcheck.py facts [--model-path P]          JSON facts: OS, kernel, GPUs, driver, disk, RDMA, memlock
    hostcheck.py preflight --host NAME --allowed-os 'ubuntu 24.04' [--min-kernel 5.12] [--gpus N --gpu-model M]
                        [--require-driver] [--model-path P [--min-free-gb G]]
                                                 facts on stdout; exit 1 with what rules the host out
    hostcheck.py health --host NAME --gpus N --gpu-model M [--driver V] [--fabric [--nvlinks 18]]
                        [--nics mlx5_0,...] [--link-layer Ethernet] [--mtu 4096] [--gid-index 3]
                                                 exit 1 with one "NAME: check: problem" line per failure;
                                                 a tool that fails, prints nothing or does not answer
                                                 within its limit (TOOL_TIMEOUT_S) is a failure

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
                                    "systemd-detect-virt": 10}
TIMED_OUT = 124  # the exit status of a tool stopped at its limit, as coreutils' timeout reports it
REAP_S = 5  # how long a killed tool may take to go (one stuck in the driver goes only when it leaves it)
# The health gate's own limits (fabric.sh.j2 runs this file and dcgmi under coreutils' timeout).
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


def parse_lspci_acs(text: str) -> dict[str, dict]:
    """``lspci -vvv``: {device (with its domain, 0000:03:08.0): {"description", "acs_cap", "acs_ctl"}}
    for each device with an Access Control Services capability. Tabs or spaces before the fields, as
    pciutils prints them or a paste leaves them."""
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
        if current is not None and field.startswith(("ACSCap:", "ACSCtl:")):
            current["acs_cap" if field.startswith("ACSCap:") else "acs_ctl"] = parse_acs_flags(field)
    return {bdf: d for bdf, d in out.items() if "acs_ctl" in d}


def acs_blocking(acs_ctl: dict[str, bool]) -> list[str]:
    """The ACS controls on that would block or reroute GPU-NIC peer-to-peer traffic."""
    return [f for f in ACS_BLOCKING if acs_ctl.get(f)]


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
    """What fabric.sh.j2 gives each thing it runs (seconds): a look (this file's ``health``), dcgmi
    diag, timeout's grace before KILL, the pause between looks."""
    return {"hostcheck_s": health_budget_s(fabric), "dcgm_s": DCGM_DIAG_TIMEOUT_S[dcgm_level],
            "kill_after_s": KILL_AFTER_S, "poll_s": GATE_POLL_S}


def gate_timeout_s(fabric_timeout: int, fabric: bool, dcgm_level: int) -> int:
    """The longest the health gate (fabric.sh.j2 apply) runs: its last look at the fabric starts within
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
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.cmd == "facts":
        print(json.dumps(facts(args.model_path), sort_keys=True))
        return 0
    if args.cmd == "preflight":
        return preflight(args)
    if not args.rdma_only and (args.gpus is None or not args.gpu_model):
        ap.error("health needs --gpus and --gpu-model (or --rdma-only)")
    if args.nics and None in (args.link_layer, args.mtu, args.gid_index):
        ap.error("--nics needs --link-layer, --mtu and --gid-index")
    if args.rdma_only and not args.nics:
        ap.error("--rdma-only needs --nics")
    return health(args)


if __name__ == "__main__":
    sys.exit(main())
