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

import shutil  # noqa: F401  (hostcheck.shutil: what the tests reach the tools' lookup through)

from . import base, checks, cli, gather, gpus, nics, pcie, rdma  # noqa: F401
from .base import (  # noqa: F401
    DCGM_DIAG_TIMEOUT_S, GATE_POLL_S, KILL_AFTER_S, Problem, QUERY_FIELDS, REAP_S, TIMED_OUT, TOOL_TIMEOUT_S,
)
from .gpus import (  # noqa: F401
    TOPO_LEVELS, _ANSI, _SMI_Q_GPU, _SMI_Q_TOP, nearest_nics, nic_affinity, nic_affinity_env, parse_gpu_bus_ids,
    parse_ibdev2netdev, parse_nvlink_status, parse_query_csv, parse_smi_q, parse_topo_m,
)
from .pcie import (  # noqa: F401
    ACS_BLOCKING, _BDF, acs_blocking, acs_problems, bridges_between, normalize_bdf, parse_acs_flags,
    parse_lspci, parse_lspci_acs, pci_ancestors,
)
from .rdma import _canonical_gid, gid_ipv4, gid_table, parse_ibstat, parse_ibv_devinfo, parse_show_gids  # noqa: F401
from .gather import (  # noqa: F401
    _run, facts, free_bytes, gate_limits, gate_timeout_s, gpu_facts, health_budget_s, memlock, os_release,
    rdma_facts, staged_bytes,
)
from .checks import (  # noqa: F401
    _first_line, _gpu_health, _rdma_health, fabric_problems, gpu_problems, gpu_summary, health, rdma_problems,
    rdma_summary, remap_problems, tool_problem,
)
from .nics import _acs, _affinity, _lspci, affinity  # noqa: F401
from .cli import _version_tuple, main, parser, preflight, preflight_problems  # noqa: F401
