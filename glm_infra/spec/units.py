"""The systemd units NVIDIA's and DCGM's packages ship, and the kernel modules the steps load or keep away:
each with where it is documented (the registry of external names: ``packages.py``)."""

from __future__ import annotations

if __package__:
    from . import repositories as cite
    from .package_model import Unit
else:  # run as a file by testbed/standins/build-apt-repo (a plain python3): this folder is on sys.path
    import repositories as cite  # type: ignore[no-redef]
    from package_model import Unit  # type: ignore[no-redef]
Source = cite.Source

UNITS = {u.name: u for u in (
    Unit("nvidia-persistenced.service", "nvidia-compute-utils-<branch> (590 and later: nvidia-compute-utils), a "
         "dependency of the driver package",
         "the driver step, always: the unit is static (no [Install]), so glm-infra adds it to multi-user.target's "
         "wants, and a drop-in runs the daemon with --persistence-mode instead of Ubuntu's --no-persistence-mode",
         (Source(cite.UBUNTU_PERSISTENCED, "nvidia-persistenced is provided by nvidia-compute-utils-<branch>; "
                 "--persistence-mode / --no-persistence-mode set persistence mode on the GPUs at start"),
          Source(cite.ISSUE_39_PERSISTENCED, "Ubuntu's unit runs --no-persistence-mode"),
          Source(f"{cite.GDC_NOBLE_DRIVER}#L614-L616", "NVIDIA's container runs nvidia-persistenced --persistence-mode "
                 "before the fabric"))),
    Unit("nvidia-fabricmanager.service", "nvidia-fabricmanager",
         "the driver step, with drivers.fabricManager, after ib_umad is loaded and persisted (modules-load.d): "
         "its ExecStartPre, nvidia-fabricmanager-start.sh --mode precheck, refuses on NVLink 5 without it; its "
         "ExecStart, nvidia-fabricmanager-start.sh --mode start, also starts NVLSM (nvlsm ships no unit of its own)",
         (Source(cite.CANVOS_PR_700, "nvidia-fabricmanager 570+ ships a systemd unit whose ExecStartPre invokes "
                 "nvidia-fabricmanager-start.sh --mode precheck; on NVL5+: Kernel module \"ib_umad\" has not been "
                 "loaded, fabric manager cannot be started"),
          Source(f"{cite.GDC_NOBLE_DRIVER}#L636-L647", "on an NVLink 5 system NVIDIA's container runs "
                 "nvidia-fabricmanager-start.sh --mode start --fm-config-file … --nvlsm-config-file "
                 "/usr/share/nvidia/nvlsm/nvlsm.conf --nvlsm-pid-file /var/run/nvidia-fabricmanager/nvlsm.pid"),
          Source("https://github.com/NVIDIA/NVSentinel/issues/883", "nvidia-fabricmanager.service is the fabric "
                 "manager's unit on bare-metal installs (/usr/lib/systemd/system/nvidia-fabricmanager.service)"),
          Source(cite.NVLSM_SPEC, "the nvlsm package NVIDIA ships has no unit: a distribution that runs NVLSM alone "
                             "adds its own nvlsm.service"),
          Source(cite.FM_GUIDE, "Fabric Manager user guide: NVLink 5 systems run NVLSM beside the fabric manager"))),
    Unit("nvidia-dcgm.service", "datacenter-gpu-manager-4-core (a dependency of datacenter-gpu-manager-4-cuda13)",
         "the driver step, when the health gate runs dcgmi diag (drivers.dcgmDiagLevel > 0) or the DCGM "
         "exporter runs (the exporter connects to it on localhost:5555)",
         (Source(f"{cite.DCGM}:config-files/systemd/nvidia-dcgm.service.in", "ExecStart=/usr/bin/nv-hostengine -n "
                 "--service-account nvidia-dcgm, Alias=dcgm.service, WantedBy=multi-user.target"),
          Source(f"{cite.DCGM}:config-files/CMakeLists.txt#L22-L25", "installed to lib/systemd/system by the Core "
                                                                "component (datacenter-gpu-manager-4-core)"),
          Source(f"{cite.DCGM}:scripts/deb/postinst", "the package's postinst does not enable it"),
          Source(cite.DCGM_GUIDE, "sudo systemctl --now enable nvidia-dcgm"))),
    Unit("nvidia-dcgm-exporter.service", "datacenter-gpu-manager-exporter",
         "the monitoring's dcgm-exporter step, its drop-in pointing it at nvidia-dcgm's host engine",
         (Source(f"{cite.DCGM_EXPORTER}:packaging/config-files/systemd/nvidia-dcgm-exporter.service",
                 "Wants=nvidia-dcgm.service, After=nvidia-dcgm.service"),)),
)}

# Kernel modules the steps load or keep away.
KERNEL_MODULES = {
    "ib_umad": (Source(f"{cite.GDC_NOBLE_DRIVER}#L186-L191", "NVLink 5 waits for the mlx5_core and ib_umad modules "
                                                        "before the fabric manager starts"),
                Source(cite.CANVOS_PR_700, "the fabric manager's precheck refuses on NVL5+ without ib_umad"),
                Source(cite.ISSUE_39_MODULES, "on a stock noble kernel ib_umad comes from "
                                              "linux-modules-extra-$(uname -r)")),
    "mlx5_ib": (Source(cite.ISSUE_39_MODULES, "on a stock noble kernel mlx5_ib comes from "
                                              "linux-modules-extra-$(uname -r); without it the ConnectX bridge to "
                                              "the NVSwitches never shows as an InfiniBand device"),),
    "nvidia-peermem": (Source("https://docs.nvidia.com/datacenter/tesla/driver-installation-guide/620/kernel-modules.html",
                              "nvidia-peermem.ko is one of the driver's kernel modules"),),
}
# What the fabric manager needs loaded, now and at every boot (/etc/modules-load.d), before it starts.
FABRIC_MODULES = ("ib_umad", "mlx5_ib")
