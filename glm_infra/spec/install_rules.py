"""The install rules NVIDIA's packages impose (docs/PACKAGES.md, "Install rules"): what a real host refuses
or does, what glm-infra does about it, whether a source settles it, and how the stand-ins reproduce it."""

from __future__ import annotations

from . import repositories as cite
from .host_packages import DOCA_SHIPS
from .package_model import InstallRule
from .packages import DCGM_EXPORTER_PACKAGE, EXACT_SOURCES, PIN_SOURCES, RULES
from .repositories import Source
from .units import KERNEL_MODULES, UNITS

INSTALL_RULES = (
    InstallRule(
        "Every NVIDIA pinning package Provides, Conflicts and Replaces nvidia-driver-pinning: only one can be installed.",
        "The driver step installs one, the exact-version pin nvidia-driver-pinning-<version>; any other pinning "
        "package found (the branch pin, another version's) is removed.",
        True, "both pinning stand-ins carry the three fields", PIN_SOURCES),
    InstallRule(
        "apt reads a preferences file only when it starts: a pin installed in the same transaction as the driver "
        "pins nothing in it. NVIDIA: install the pinning package prior to installing the driver.",
        "The pin alone first, in an apt run of its own; then the driver, its family, NSCQ, fabric manager and NVSDM "
        "in the next.",
        True, "the pinning stand-ins ship a preferences file pinning the driver tree at their version",
        (Source(cite.DRIVER_GUIDE_RECENT, "For the best experience when locking a branch, we suggest to install the "
                                          "pinning package prior to installing the driver"),
         Source(f"{cite.GDC_RESOLUTE_INSTALL}#L104-L113", "pin_driver_version runs before userspace_install and "
                                                      "extra_pkgs_install"))),
    InstallRule(
        "The driver metapackage depends on its siblings (nvidia-utils, nvidia-compute-utils, nvidia-dkms, "
        "nvidia-kernel-common, libnvidia-compute, …) at exactly its own version; with a newer release in the "
        "repository apt picks the newest sibling and stops with unmet dependencies.",
        "The family is pinned too (glm-infra's apt preferences at 1001) and every exact-version dependency of the "
        "driver is named on the command line at that version.",
        True, "the driver stand-in depends on its family at its exact version; the repository also serves a newer "
              "release of every branch it carries",
        EXACT_SOURCES),
    InstallRule(
        "The fabric manager's unit (570 and later) runs nvidia-fabricmanager-start.sh --mode precheck first; on "
        "NVLink 5 it refuses to start without ib_umad.",
        "ib_umad and mlx5_ib are written to /etc/modules-load.d and loaded before any unit is started; a module "
        "that cannot be loaded brings in linux-modules-extra-$(uname -r), else the step stops naming it.",
        True, "the stand-in unit has the precheck, which refuses without the (simulated) module",
        (Source(cite.CANVOS_PR_700, "ExecStartPre=…nvidia-fabricmanager-start.sh --mode precheck; Kernel module "
                                    "\"ib_umad\" has not been loaded, fabric manager cannot be started"),
         *KERNEL_MODULES["ib_umad"][:1], Source(cite.ISSUE_39_MODULES, "ib_umad and mlx5_ib come from "
                                                                       "linux-modules-extra-$(uname -r)"))),
    InstallRule(
        "DKMS (the driver's nvidia-dkms, DOCA's modules) builds against the running kernel's headers and fails "
        "without them.",
        "linux-headers-$(uname -r) is installed before the driver and before DOCA when /lib/modules/$(uname -r)/build "
        "is missing; a kernel without that package stops the step naming it.",
        True, "the nvidia-dkms and doca-ofed stand-ins fail to configure without the headers, as DKMS does",
        (Source(cite.DOCA_GUIDE, "installation requires kernel headers that match the running kernel"),
         Source(cite.DKMS_HEADERS, "Your kernel headers for kernel … cannot be found"))),
    InstallRule(
        "nvidia-smi exits 9 when no NVIDIA kernel module is loaded (a fresh host whose module loads only at the "
        "next boot, or nouveau bound to the GPUs).",
        "Exit 9 right after an install, or with a reboot already pending, asks for the reboot; exit 9 on a host "
        "whose packages were already right and that has no reboot pending stops the step: the module does not load.",
        True, "the stand-in nvidia-smi exits 9 without its (simulated) module",
        (Source(cite.NVIDIA_SMI_DOC, "Return code 9: NVIDIA Driver is not loaded"),)),
    InstallRule(
        "DOCA's repository ships its own builds of Ubuntu's rdma-core packages (infiniband-diags among them) at "
        "higher versions; apt refuses to change a held package without --allow-change-held-packages, and the "
        "driver step holds infiniband-diags.",
        "The RDMA step installs doca-ofed with its exact-version dependencies named; of the held packages it "
        "unholds and holds again exactly those DOCA replaces (a fixed list), and stops naming any other.",
        True, "the DOCA stand-in repository carries DOCA's infiniband-diags, rdma-core and ibverbs-utils, and a "
              "newer DOCA release",
        (DOCA_SHIPS, Source(cite.APT_GET_MAN, "--allow-change-held-packages: Force yes; this is a dangerous option "
                                               "that will cause apt to continue without prompting if it is changing "
                                               "held packages"))),
    InstallRule(
        "DOCA replaces mlx5_core/ib_core with its own modules; modules built against the inbox ib_core (the driver's "
        "nvidia-peermem) may then fail to load until they are rebuilt and the host reboots.",
        "With gpudirect peermem, the RDMA step stops naming that cause when nvidia-peermem does not load "
        "(dmabuf, the default, needs no such module). Whether DOCA's postinst reloads the modules: not settled here.",
        False, "not simulated (the simulated hosts load no kernel modules of their own)",
        (Source(cite.DOCA_GUIDE, "DOCA-Host installs its kernel modules through DKMS"),)),
    InstallRule(
        "cuda-keyring writes its own list for the CUDA repository; the same repository configured twice with "
        "different Signed-By keyrings is a fatal apt error. Whether apt counts '/' and './' as one suite: not "
        "settled here.",
        "Before writing its list, the driver step (and the RDMA step for DOCA) stops when another source file names "
        "the same repository URL, naming the file.",
        False, "-",
        (Source(cite.CUDA_REPO_4, "E: Conflicting values set for option Signed-By regarding source …"),
         Source(f"{cite.GDC_NOBLE_INSTALL}#L40-L45", "NVIDIA's container sets the repository up with cuda-keyring"))),
    InstallRule(
        "dcgm-exporter starts an embedded DCGM host engine unless --remote-hostengine-info (-r, or "
        "DCGM_REMOTE_HOSTENGINE_INFO) is set: beside nvidia-dcgm that is a second engine on the same GPUs.",
        "The exporter's drop-in sets DCGM_REMOTE_HOSTENGINE_INFO=localhost:5555 (nvidia-dcgm's port).",
        True, "the stand-in exporter connects to the stand-in nv-hostengine when told to, and says which engine it uses",
        DCGM_EXPORTER_PACKAGE.sources[3:]),
    InstallRule(
        "Ubuntu's nvidia-persistenced.service is static (no [Install]) and runs --no-persistence-mode: enabling "
        "or starting it never turns persistence mode on.",
        "A drop-in runs the daemon with --persistence-mode, the unit is added to multi-user.target's wants, and "
        "persistence mode is set now (nvidia-smi -pm 1) where it is off, without restarting the daemon (the "
        "serving units require it).",
        True, "the stand-in unit is Ubuntu's; the stand-in daemon sets persistence mode only when told to",
        UNITS["nvidia-persistenced.service"].sources),
    InstallRule(
        "From branch 590 NVIDIA's packages drop the branch from their names; whether the 590+ packages declare "
        "Conflicts/Replaces against the 580 names: not settled here.",
        "A driver change that changes the branch removes the other branch's tree in an apt run of its own (after "
        "a simulated run of the whole change succeeded), then installs the new one.",
        False, "the stand-ins are built for branches 580 and 595, without relations between the two namings",
        (RULES[1].sources[0],)),
)
