"""Preflight (what rules a host out) and the command line."""

from __future__ import annotations

import argparse
import json
import re
import sys

from .base import Problem
from .gpus import TOPO_LEVELS
from . import gather
from .checks import health
from .nics import affinity


def _version_tuple(v: str) -> tuple[int, ...] | None:
    parts = re.findall(r"\d+", v)[:2]
    return tuple(int(x) for x in parts) if len(parts) == 2 else None


def preflight_problems(f: dict, allowed_os: list[str], min_kernel: str, gpus: int, gpu_model: str,
                       require_driver: bool, min_free_gb: float | None = None) -> list[Problem]:
    """What rules a host out, from its facts (``gather.facts()``)."""
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
    f = gather.facts(args.model_path)
    problems = preflight_problems(f, args.allowed_os, args.min_kernel, args.gpus, args.gpu_model,
                                  args.require_driver, args.min_free_gb)
    print(json.dumps(f, sort_keys=True))
    for check, problem in problems:
        print(f"{args.host}: {check}: {problem}", file=sys.stderr)
    return 1 if problems else 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hostcheck.py", description=sys.modules[__package__].__doc__,  # pragma: no mutate
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
        print(json.dumps(gather.facts(args.model_path), sort_keys=True))
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
