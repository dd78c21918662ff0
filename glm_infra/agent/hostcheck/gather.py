"""Running the tools (each within its limit) and the host's facts: OS, kernel, disk, memlock, GPUs, RDMA."""

from __future__ import annotations

import os
import platform
import re
import shutil
import signal
import subprocess

from .base import DCGM_DIAG_TIMEOUT_S, GATE_POLL_S, KILL_AFTER_S, QUERY_FIELDS, REAP_S, TIMED_OUT, TOOL_TIMEOUT_S
from .gpus import parse_query_csv
from .rdma import parse_ibstat, parse_ibv_devinfo


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
