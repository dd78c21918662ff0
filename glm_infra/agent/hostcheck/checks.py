"""The health gate's checks: GPUs, fabric, NVLink, row remaps and RDMA, each failing closed, and the healthy line."""

from __future__ import annotations

import argparse
import shutil
import sys

from .base import Problem, QUERY_FIELDS
from .gpus import parse_nvlink_status, parse_query_csv, parse_smi_q
from .rdma import gid_table, parse_ibv_devinfo
from . import gather


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
    rc, query = gather._run(["nvidia-smi", f"--query-gpu={QUERY_FIELDS}", "--format=csv"])
    if rc != 0:
        return [("driver", f"nvidia-smi failed (exit {rc}): {_first_line(query) or 'no output'}")]
    problems = [p for p in [tool_problem("gpus", "nvidia-smi --query-gpu", rc, query)] if p]
    rc_q, smi_q = gather._run(["nvidia-smi", "-q"])
    problems += [p for p in [tool_problem("gpus", "nvidia-smi -q", rc_q, smi_q)] if p]
    nvlink = ""
    if args.fabric:
        rc_l, nvlink = gather._run(["nvidia-smi", "nvlink", "-s"])
        problems += [p for p in [tool_problem("nvlink", "nvidia-smi nvlink -s", rc_l, nvlink)] if p]
    if problems:  # what failed or printed nothing is the problem; no judging of partial output
        return problems
    # The summary only of what passed (it would choke on what gpu_problems reports as unreadable).
    return (gpu_problems(query, smi_q, nvlink, args.gpus, args.gpu_model, args.driver, args.fabric, args.nvlinks)
            or gpu_summary(query, smi_q, nvlink, args.fabric))


def _rdma_health(args: argparse.Namespace) -> list[Problem] | str:
    """The problems of the RDMA NICs; when there are none, what was read of them."""
    nics = args.nics.split(",")
    rc, devinfo = gather._run(["ibv_devinfo", "-v"])
    problems = [p for p in [tool_problem("rdma", "ibv_devinfo -v", rc, devinfo)] if p]
    show: str | None = None
    if args.link_layer == "Ethernet" and shutil.which("show_gids"):
        rc_g, show = gather._run(["show_gids"])
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
