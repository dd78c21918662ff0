"""Each GPU's nearest compute NIC as vLLM's VLLM_GPU_NIC_PCIE_MAPPING, and PCIe ACS between them checked or turned off."""

from __future__ import annotations

import argparse
import os
import sys

from .base import Problem
from .gpus import nic_affinity, nic_affinity_env, parse_gpu_bus_ids, parse_ibdev2netdev, parse_topo_m
from .pcie import acs_problems, bridges_between, parse_lspci
from . import gather
from .checks import _first_line, tool_problem


def _affinity(args: argparse.Namespace) -> tuple[str | None, list[Problem], str]:
    """(the env file's text, problems, what the ACS check read) from the host's own tools; any that
    fails is the problem."""
    nics = args.nics.split(",")
    results = {name: gather._run(cmd) for name, cmd in (
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
    rc, text = gather._run(["lspci", "-D", "-vvv"])
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
            rc, out = gather._run(["setpci", "-s", bridge, "ECAP_ACS+0x6.w=0000"])
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
