"""The stand-in hardware tools (nvidia-smi, dcgmi, the RDMA tools, the fabric manager) run straight from
their debs trees (testbed/standins/debs) against a temporary GLM_SIM_ROOT: what tests/standins checks
against the real formats and tests/test_hostcheck.py feeds hostcheck.py with."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from testbed import STANDINS

DEBS = STANDINS / "debs"
HW_LIB = DEBS / "glm-sim-hardware" / "usr" / "lib" / "glm-sim"
DRIVER = "580.159.04"  # the driver version a Sim root has installed and loaded

TOOLS = {
    "nvidia-smi": DEBS / "nvidia-utils/usr/bin/nvidia-smi",
    "dcgmi": DEBS / "datacenter-gpu-manager-4-core/usr/bin/dcgmi",
    "ibv_devinfo": DEBS / "glm-sim-rdma-tools/usr/bin/ibv_devinfo",
    "show_gids": DEBS / "doca-ofed/usr/sbin/show_gids",
    "ibdev2netdev": DEBS / "doca-ofed/usr/bin/ibdev2netdev",
    "ib_write_bw": DEBS / "doca-ofed/usr/bin/ib_write_bw",
    "ibstat": DEBS / "infiniband-diags/usr/sbin/ibstat",
    "nv-fabricmanager": DEBS / "nvidia-fabricmanager/usr/bin/nv-fabricmanager",
    "lspci": DEBS / "pciutils/usr/bin/lspci",
    "setpci": DEBS / "pciutils/usr/bin/setpci",
}


class Sim:
    """A GLM_SIM_ROOT: the shipped hardware.conf, the driver installed and loaded, the persistence daemon
    running with persistence mode on, the fabric manager installed at the driver's version and running."""

    def __init__(self, root: Path) -> None:
        self.root = root
        for d in ("etc/glm-sim/hardware.conf.d", "run/glm-sim", "usr/share/glm-sim", "var/run/nvidia-persistenced"):
            (root / d).mkdir(parents=True)
        shutil.copy(DEBS / "glm-sim-hardware/etc/glm-sim/hardware.conf", root / "etc/glm-sim/hardware.conf")
        self.write("usr/share/glm-sim/driver-version", DRIVER)
        self.write("run/glm-sim/loaded-driver-version", DRIVER)
        self.write("usr/share/glm-sim/fabricmanager-version", DRIVER)
        self.write("run/glm-sim/fabricmanager-active", "")
        self.write("var/run/nvidia-persistenced/persistence-mode", "Enabled")

    def write(self, path: str, text: str) -> None:
        (self.root / path).write_text(text + "\n" if text else "")

    def fault(self, **keys: str) -> None:
        """Drop keys into hardware.conf.d, as the tests of the product do."""
        self.write("etc/glm-sim/hardware.conf.d/50-test.conf", "\n".join(f'{k}="{v}"' for k, v in keys.items()))

    def run(self, tool: str, *args: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "GLM_SIM_ROOT": str(self.root), "PYTHONPATH": str(HW_LIB)}
        return subprocess.run([str(TOOLS[tool]), *args], capture_output=True, text=True, timeout=60, env=env)

    def out(self, tool: str, *args: str) -> str:
        r = self.run(tool, *args)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout
