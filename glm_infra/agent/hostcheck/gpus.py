"""The GPUs as nvidia-smi describes them (the query CSV, -q, NVLink status, topo -m) and each GPU's nearest compute NIC."""

from __future__ import annotations

import re

from .base import Problem
from .pcie import normalize_bdf


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
