"""What the parts of hostcheck share: each tool's time limit, the health gate's limits, and a problem's shape."""

from __future__ import annotations


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


Problem = tuple[str, str]  # (check, what is wrong)
