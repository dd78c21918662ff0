#!/usr/bin/env python3
"""Host facts and health checks of a GPU server, run on the host itself (stdlib only).

glm-infra installs this file on every host and runs it from the preflight and health-gate steps:

    hostcheck.py facts [--model-path P]          JSON facts: OS, kernel, GPUs, driver, disk, RDMA, memlock
    hostcheck.py preflight --host NAME --allowed-os 'ubuntu 24.04' [--min-kernel 5.12] [--gpus N --gpu-model M]
                        [--require-driver] [--model-path P]
                                                 facts on stdout; exit 1 with what rules the host out
    hostcheck.py health --host NAME --gpus N --gpu-model M [--driver V] [--fabric]
                        [--nics mlx5_0,...] [--link-layer Ethernet] [--mtu 4096] [--gid-index 3]
                                                 exit 1 with one "NAME: check: problem" line per failure

The parsers read what ``nvidia-smi``, ``ibv_devinfo`` and ``show_gids`` print; tests run them on
captures from real machines.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys

QUERY_FIELDS = "index,name,uuid,pci.bus_id,driver_version,memory.total,compute_cap"


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
            current[int(m.group(1))] = None if "inactive" in speed.lower() else speed
    return out


def parse_ibv_devinfo(text: str) -> dict[str, dict]:
    """``ibv_devinfo``: {device: {port number: {state, active_mtu, link_layer}}}."""
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
            port = dev.setdefault(int(m.group(1)), {})
            continue
        if port is None:
            continue
        key, _, value = s.partition(":")
        value = value.strip()
        if key == "state":
            port["state"] = value.split()[0]
        elif key == "active_mtu":
            port["active_mtu"] = int(value.split()[0])
        elif key == "link_layer":
            port["link_layer"] = value
    return out


def parse_show_gids(text: str) -> list[dict[str, str]]:
    """``show_gids``: one dict per GID row (dev, port, index, gid, ipv4, ver, netdev)."""
    rows = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 5 or parts[0] in ("DEV", "---") or not parts[1].isdigit():
            continue
        dev, port, index, gid = parts[:4]
        rest = parts[4:]
        ipv4 = rest.pop(0) if rest and re.match(r"^\d+\.\d+\.\d+\.\d+$", rest[0]) else ""
        ver = rest[0] if rest else ""
        netdev = rest[1] if len(rest) > 1 else ""
        rows.append({"dev": dev, "port": port, "index": index, "gid": gid, "ipv4": ipv4, "ver": ver, "netdev": netdev})
    return rows


# --- gathering -----------------------------------------------------------------------------------


def _run(cmd: list[str]) -> tuple[int, str]:
    if shutil.which(cmd[0]) is None:
        return 127, f"{cmd[0]}: not installed"
    p = subprocess.run(cmd, capture_output=True, text=True)
    return p.returncode, (p.stdout if p.returncode == 0 else (p.stdout + p.stderr)).strip()


def os_release() -> dict[str, str]:
    out = {}
    try:
        with open("/etc/os-release") as f:
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
    rows = parse_query_csv(out)
    return {
        "count": len(rows),
        "models": sorted({r["name"] for r in rows}),
        "driver_version": rows[0]["driver_version"] if rows else None,
        "compute_cap": sorted({r.get("compute_cap", "") for r in rows}),
    }


def rdma_facts() -> dict:
    rc, out = _run(["ibv_devinfo"])
    if rc != 0:
        return {"error": out.splitlines()[0] if out else f"ibv_devinfo exited {rc}"}
    devs = parse_ibv_devinfo(out)
    return {
        dev: {str(p): info for p, info in ports.items()} for dev, ports in sorted(devs.items())
    }


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
        out["disk"] = {"path": where, "free_bytes": free}
    return out


# --- health --------------------------------------------------------------------------------------


def gpu_problems(query_csv: str, smi_q: str, nvlink: str, gpus: int, model: str, driver: str | None,
                 fabric: bool) -> list[tuple[str, str]]:
    """(check, problem) pairs from the outputs of nvidia-smi."""
    problems: list[tuple[str, str]] = []
    rows = parse_query_csv(query_csv)
    if len(rows) != gpus:
        problems.append(("gpus", f"{len(rows)} GPUs visible, stack expects {gpus}"))
    for r in rows:
        if model.lower() not in r.get("name", "").lower():
            problems.append(("gpus", f"GPU {r.get('index')} is {r.get('name')!r}, stack expects {model}"))
        if driver and r.get("driver_version") != driver:
            problems.append(("driver", f"GPU {r.get('index')} runs driver {r.get('driver_version')}, stack pins {driver}"))
    q = parse_smi_q(smi_q)
    for i, g in enumerate(q["gpus"]):
        label = f"GPU {i} ({g['bus_id']})"
        if fabric and g.get("fabric_state") != "Completed":
            problems.append(
                ("fabric", f"{label} fabric state is {g.get('fabric_state', 'missing')!r} (fabric manager or NVLSM not ready)")
            )
        if g.get("remapped_pending") == "Yes":
            problems.append(("remapped-rows", f"{label} has a pending row remap (reset the GPU before serving)"))
        if g.get("remapped_failure") == "Yes":
            problems.append(("remapped-rows", f"{label} had a row remapping failure"))
    if fabric:
        links = parse_nvlink_status(nvlink)
        if not links and rows:
            problems.append(("nvlink", "nvidia-smi nvlink -s lists no links"))
        for gpu, ls in sorted(links.items()):
            down = [str(n) for n, speed in sorted(ls.items()) if speed is None]
            if down:
                problems.append(("nvlink", f"GPU {gpu} NVLink links down: {', '.join(down)}"))
    return problems


def rdma_problems(devinfo: str, gids: str, nics: list[str], link_layer: str, mtu: int,
                  gid_index: int) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    devs = parse_ibv_devinfo(devinfo)
    rows = parse_show_gids(gids)
    for nic in nics:
        if nic not in devs:
            problems.append(("rdma", f"{nic} not found (devices: {', '.join(sorted(devs)) or 'none'})"))
            continue
        for port, info in sorted(devs[nic].items()):
            if info.get("state") != "PORT_ACTIVE":
                problems.append(("rdma", f"{nic} port {port} is {info.get('state')}, expected PORT_ACTIVE"))
            if info.get("link_layer") != link_layer:
                problems.append(("rdma", f"{nic} port {port} link layer {info.get('link_layer')}, expected {link_layer}"))
            if info.get("active_mtu") != mtu:
                problems.append(("rdma", f"{nic} port {port} active_mtu {info.get('active_mtu')}, expected {mtu}"))
        if link_layer == "Ethernet":
            gid = [r for r in rows if r["dev"] == nic and r["index"] == str(gid_index)]
            if not gid or gid[0]["ver"] != "v2" or not gid[0]["ipv4"]:
                problems.append(("rdma", f"{nic} GID index {gid_index} is not a RoCE v2 GID with an IPv4 address"))
    return problems


def _gpu_health(args: argparse.Namespace) -> list[tuple[str, str]]:
    rc, query = _run(["nvidia-smi", f"--query-gpu={QUERY_FIELDS}", "--format=csv"])
    if rc != 0:
        return [("driver", f"nvidia-smi failed (exit {rc}): {query.splitlines()[0] if query else ''}")]
    _, smi_q = _run(["nvidia-smi", "-q"])
    _, nvlink = _run(["nvidia-smi", "nvlink", "-s"]) if args.fabric else (0, "")
    return gpu_problems(query, smi_q, nvlink, args.gpus, args.gpu_model, args.driver, args.fabric)


def _rdma_health(args: argparse.Namespace) -> list[tuple[str, str]]:
    rc, devinfo = _run(["ibv_devinfo"])
    if rc != 0:
        return [("rdma", f"ibv_devinfo failed: {devinfo.splitlines()[0] if devinfo else rc}")]
    rc, gids = _run(["show_gids"])
    return rdma_problems(devinfo, gids if rc == 0 else "", args.nics.split(","), args.link_layer, args.mtu,
                         args.gid_index)


def health(args: argparse.Namespace) -> int:
    problems: list[tuple[str, str]] = []
    what: list[str] = []
    if not args.rdma_only:
        problems += _gpu_health(args)
        what.append(f"{args.gpus} × {args.gpu_model}" + (", fabric Completed, NVLink up" if args.fabric else ""))
    if args.nics:
        problems += _rdma_health(args)
        what.append(f"RDMA {args.nics} {args.link_layer} active_mtu {args.mtu}")
    for check, problem in problems:
        print(f"{args.host}: {check}: {problem}", file=sys.stderr)
    if not problems:
        print(f"{args.host}: healthy ({'; '.join(what)})")
    return 1 if problems else 0


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:2])


def preflight(args: argparse.Namespace) -> int:
    """Facts as one JSON line on stdout; what rules out this host, one line each on stderr."""
    f = facts(args.model_path)
    problems: list[tuple[str, str]] = []
    allowed = [a.lower() for a in args.allowed_os]
    if f["os"].lower() not in allowed:
        problems.append(("os", f"{f['os_pretty'] or f['os']} is not supported here (allowed: {', '.join(args.allowed_os)})"))
    if _version_tuple(f["kernel"]) < _version_tuple(args.min_kernel):
        problems.append(("kernel", f"kernel {f['kernel']} is older than {args.min_kernel} (DMA-BUF GPUDirect)"))
    gpus = f["gpus"]
    if "error" in gpus:
        if args.require_driver:
            problems.append(("driver", f"drivers.mode is verify but the driver does not answer: {gpus['error']}"))
    elif args.gpus:
        if gpus["count"] != args.gpus:
            problems.append(("gpus", f"{gpus['count']} GPUs visible, stack expects {args.gpus}"))
        wrong = [m for m in gpus["models"] if args.gpu_model.lower() not in m.lower()]
        if wrong:
            problems.append(("gpus", f"GPU model {', '.join(wrong)}, stack expects {args.gpu_model}"))
    print(json.dumps(f, sort_keys=True))
    for check, problem in problems:
        print(f"{args.host}: {check}: {problem}", file=sys.stderr)
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hostcheck.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("facts")
    f.add_argument("--model-path")
    p = sub.add_parser("preflight")
    p.add_argument("--host", required=True)
    p.add_argument("--allowed-os", action="append", required=True, help="'ID VERSION_ID', repeatable")
    p.add_argument("--min-kernel", default="5.12")
    p.add_argument("--model-path")
    p.add_argument("--gpus", type=int, default=0)
    p.add_argument("--gpu-model", default="")
    p.add_argument("--require-driver", action="store_true")
    h = sub.add_parser("health")
    h.add_argument("--host", required=True)
    h.add_argument("--gpus", type=int, default=0)
    h.add_argument("--gpu-model", default="")
    h.add_argument("--rdma-only", action="store_true", help="check only the RDMA NICs")
    h.add_argument("--driver")
    h.add_argument("--fabric", action="store_true")
    h.add_argument("--nics", default="")
    h.add_argument("--link-layer", default="Ethernet")
    h.add_argument("--mtu", type=int, default=4096)
    h.add_argument("--gid-index", type=int, default=3)
    args = ap.parse_args(argv)
    if args.cmd == "facts":
        print(json.dumps(facts(args.model_path), sort_keys=True))
        return 0
    if args.cmd == "preflight":
        return preflight(args)
    return health(args)


if __name__ == "__main__":
    sys.exit(main())
