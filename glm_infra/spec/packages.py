"""Every external name the host scripts rely on, once, each with where it is documented: the
packages (name, version scheme, the virtual packages they provide, the relations apt resolves them
by, the repository they come from), the systemd units the packages ship, the binaries and
configuration paths that matter, and the install rules those relations impose (``INSTALL_RULES``:
what a real host refuses, and what glm-infra does about it). The repositories, their signing keys
and the sources cited: ``repositories.py`` beside it. The driver step, the RDMA step, the health gate
and the monitoring take their names from here; the stand-in packages of the simulated cluster are
built from here with the same relations (``python3 glm_infra/spec/packages.py standins``); a test
fails when a rendered script names something this module does not list.
``glm_infra.tools.packages_doc`` renders it as docs/PACKAGES.md.

A source is a URL or ``owner/repo@commit:path[#lines]`` on GitHub. Names that depend on the driver
branch come from a per-branch rule (``rule``): a branch with no rule is refused, because NVIDIA has
renamed packages between branches before (590 dropped the branch suffix of most names).

Standard library only: ``testbed/standins/build-apt-repo`` runs this file with a plain python3.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace

if __package__:
    from . import repositories as cite
else:  # run as a file by testbed/standins/build-apt-repo (a plain python3): this folder is on sys.path
    import repositories as cite  # type: ignore[no-redef]
Source, REPOSITORIES = cite.Source, cite.REPOSITORIES

# --- systemd units -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Unit:
    name: str  # with its suffix
    package: str  # the package that ships the file (may be a dependency of the one installed)
    enable: str  # who enables it, and when glm-infra does
    sources: tuple[Source, ...]


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

# --- packages ----------------------------------------------------------------------------------------

# Version schemes: {version} is the driver's (580.159.04), {branch} its branch (580), {dcgm} and {doca}
# the other release trains, N a packaging revision, {driver_scheme} and {versioned} the branch rule's.
# The scripts match the part before the revision: "<version>-" for the driver-versioned packages,
# "<doca>-" for DOCA.


@dataclass(frozen=True)
class Package:
    name: str  # for a per-branch name the rule fills in {branch} / {version} / the family's roles
    role: str  # drivers | fabric | dcgm | rdma | monitoring | kernel
    repository: str  # key of REPOSITORIES
    scheme: str  # version scheme (see above); "any" for packages held at whatever version the repo has
    sources: tuple[Source, ...]
    provides: tuple[str, ...] = ()  # virtual packages it provides on every branch (so installing these fails)
    branch_virtuals: tuple[str, ...] = ()  # virtual packages it provides where the branch rule says so
    conflicts: tuple[str, ...] = ()  # apt removes these (or refuses) when installing it
    replaces: tuple[str, ...] = ()
    exact_depends: tuple[str, ...] = ()  # packages it depends on at exactly its own version
    depends: tuple[str, ...] = ()  # other dependencies the stand-in mirrors (unversioned)
    units: tuple[str, ...] = ()  # units it ships
    binaries: tuple[str, ...] = ()  # programs glm-infra or the units run
    paths: tuple[str, ...] = ()  # configuration and data paths that matter
    standin: str = ""  # testbed/standins/debs/<standin>
    standin_version: str = ""  # the version the stand-in carries when it does not follow the driver
    note: str = ""  # what glm-infra does with it, where that is not plain install-and-hold

    def version_for(self, driver: str) -> str:
        """The stand-in's version for driver version ``driver``."""
        if self.standin_version:
            return self.standin_version
        return self.scheme.format(version=driver, branch=driver.split(".")[0])


# The roles of the driver's family: the packages the driver metapackage depends on at exactly its own
# version, which the stand-ins build and glm-infra pins (with their names per branch rule).
FAMILY_ROLES = ("utils", "compute_utils", "dkms", "kernel_common", "libcompute")
# Every name of the branch-named driver tree (the driver guide's rename table and the Ubuntu-style
# metapackages' dependencies): a package "<name>[-<branch>][-server][-open]" of another branch's naming
# than the stack's is the tree of another driver branch, removed when the driver changes branch.
# (cuda-drivers keeps its name across the rename: it is no branch's.)
DRIVER_TREE_NAMES = (
    "libnvidia-cfg1", "libnvidia-common", "libnvidia-compute", "libnvidia-decode",
    "libnvidia-encode", "libnvidia-extra", "libnvidia-fbc1", "libnvidia-gl", "libnvidia-gpucomp",
    "nvidia-compute-utils", "nvidia-dkms", "nvidia-driver", "nvidia-kernel-common", "nvidia-kernel-source",
    "nvidia-utils", "xserver-xorg-video-nvidia",
)


@dataclass(frozen=True)
class BranchRule:
    """How NVIDIA names and versions the driver packages of some branches in its Ubuntu repository."""

    branches: tuple[str, ...]
    driver: str  # the open-kernel-module driver metapackage
    driver_scheme: str  # its version, and its family's
    versioned_scheme: str  # fabric manager, NSCQ, NVSDM and the exact-version pinning package
    suffixed_virtuals: bool  # fabric manager and NVSDM provide their old "-<branch>" names
    family: dict[str, str]  # FAMILY_ROLES -> package name ({branch} filled in)
    tree_branch: bool  # the tree's names carry the branch ("nvidia-utils-580"), or not ("nvidia-utils")
    sources: tuple[Source, ...]


RULES = (
    BranchRule(
        ("580",), "nvidia-driver-{branch}-open", "{version}-1ubuntu1", "{version}-1", True,
        {"utils": "nvidia-utils-{branch}", "compute_utils": "nvidia-compute-utils-{branch}",
         "dkms": "nvidia-dkms-{branch}-open", "kernel_common": "nvidia-kernel-common-{branch}",
         "libcompute": "libnvidia-compute-{branch}"}, True,
        (Source(f"{cite.GDC_BRANCH_RULE}#L55-L94", "580 and later: nvidia-fabricmanager, libnvidia-nscq, libnvsdm, "
                                              "nvidia-imex without a branch suffix, at ${DRIVER_VERSION}-1; older "
                                              "branches -${DRIVER_BRANCH}"),
         Source(cite.GDC_PR_451, "Package nvidia-fabricmanager-580 is a virtual package provided by: nvidia-fabricmanager "
                            "580.65.06-1 (likewise libnvsdm-580)"),
         Source(cite.ISSUE_39_VERSIONS, "nvidia-driver-580-open 580.159.04 is versioned 580.159.04-1ubuntu1 in "
                                        "NVIDIA's repository (-0ubuntu1 ended around 580.105)"),
         Source(cite.DRIVER_GUIDE, "§4.1 Version locking packages for Ubuntu / Debian"))),
    BranchRule(
        ("590", "595", "610"), "nvidia-driver-open", "{version}-1ubuntu1", "{version}-1ubuntu1", False,
        {"utils": "nvidia-utils", "compute_utils": "nvidia-compute-utils", "dkms": "nvidia-dkms-open",
         "kernel_common": "nvidia-kernel-common", "libcompute": "libnvidia-compute"}, False,
        (Source(cite.DRIVER_GUIDE, "§4.1.1 Ubuntu 590 and later packages: the branch suffix is dropped "
                              "(nvidia-dkms-580-open → nvidia-dkms-open, libnvidia-compute-580 → libnvidia-compute, "
                              "…); libnvidia-nscq, libnvsdm unchanged"),
         Source(f"{cite.GDC_RESOLUTE_INSTALL}#L46-L97", "branch 595 (Dockerfile DRIVER_BRANCH=595): "
                "nvidia-driver-pinning-${DRIVER_VERSION}, nvidia-driver-open, nvidia-fabricmanager, "
                "libnvidia-nscq, libnvsdm, nvlsm, infiniband-diags"),
         Source(cite.GDC_PR_899, "nvidia-fabricmanager, libnvidia-nscq, nvidia-imex 595.71.05-1ubuntu1"),
         Source(cite.NEMOCLAW, "branch 610: nvidia-driver-pinning-610=610-2ubuntu1, "
                          "nvidia-driver-open=610.43.02-1ubuntu1"))),
)
BRANCHES = tuple(b for r in RULES for b in r.branches)


class UnknownBranch(ValueError):
    pass


def branch_of(version: str) -> str:
    return version.split(".")[0]


def rule(branch: str) -> BranchRule:
    """The naming rule of a driver branch; a branch no rule covers is refused."""
    for r in RULES:
        if branch in r.branches:
            return r
    raise UnknownBranch(
        f"no package naming rule for driver branch {branch} (known: {', '.join(BRANCHES)}): NVIDIA renames "
        "packages between branches, so check the driver installation guide and add the branch to "
        "glm_infra/spec/packages.py")


PINNING = "nvidia-driver-pinning"  # the virtual package every pinning package provides and conflicts with
_PIN_SOURCES = (
    Source(cite.ISSUE_39_PINNING, "Package: nvidia-driver-pinning-580 / Provides: nvidia-driver-pinning / Conflicts: "
                                  "nvidia-driver-pinning / Replaces: nvidia-driver-pinning: only one pinning package "
                                  "can be installed at a time"),
    Source(f"{cite.GDC_RESOLUTE_INSTALL}#L45-L49", "NVIDIA's container installs exactly one, "
                                               "nvidia-driver-pinning-${DRIVER_VERSION}, in an apt run of its own"),
)
BRANCH_PIN = Package(
    "nvidia-driver-pinning-{branch}", "drivers", "cuda", "{branch}-N",
    (Source(cite.ISSUE_26, "nvidia-driver-pinning-580 is versioned by branch: 580-5"),
     Source(cite.NEMOCLAW, "nvidia-driver-pinning-610=610-2ubuntu1"),
     Source(cite.DRIVER_GUIDE, "§4.1 one pinning package per branch locks the packages to that branch"),
     *_PIN_SOURCES),
    provides=(PINNING,), conflicts=(PINNING,), replaces=(PINNING,),
    paths=("/etc/apt/preferences.d/",),
    standin="nvidia-driver-pinning-branch", standin_version="{branch}-5",
    note="not installed: the exact-version pin replaces it (one pinning package only); found on a host, it goes",
)
VERSION_PIN = Package(
    "nvidia-driver-pinning-{version}", "drivers", "cuda", "{versioned}",
    (Source(f"{cite.GDC_RESOLUTE_INSTALL}#L45-L49", "apt-get install nvidia-driver-pinning-${DRIVER_VERSION}: pins the "
                                               "driver and the extra packages to the exact release"),
     Source(f"{cite.GDC_RESOLUTE_INSTALL}#L68-L69", "the pinning package constrains the driver-versioned packages "
                                               "(fabricmanager, nscq, imex) to DRIVER_VERSION"),
     Source(f"{cite.GDC}:ubuntu26.04/README.md#L8-L9", "the version-specific nvidia-driver-pinning-<version> package pins "
                                                  "the whole driver tree to DRIVER_VERSION"),
     Source(cite.GDC_PR_899, "595: nvidia-driver-pinning-595.71.05 595.71.05-1ubuntu1"),
     *_PIN_SOURCES),
    provides=(PINNING,), conflicts=(PINNING,), replaces=(PINNING,),
    paths=("/etc/apt/preferences.d/",),
    standin="nvidia-driver-pinning-version",
    note="installed alone, first, in an apt run of its own: apt reads its preferences only from the next run on",
)
_EXACT = (Source(cite.DATAPROC_1342, "nvidia-driver-550-open : Depends: libnvidia-gl-550 (= 550.54.15-0ubuntu1), "
                 "nvidia-dkms-550-open (<= 550.54.15-1), (>= 550.54.15), libnvidia-compute-550 (= …) … but it is not "
                 "going to be installed"),
          Source(cite.DAVID_SHARE_3, "nvidia-driver-565 : Depends: nvidia-dkms-565 (= 565.57.01-0ubuntu1), "
                 "nvidia-kernel-common-565 (= …), nvidia-compute-utils-565 (= …), …"),
          Source(cite.OPEN_GPU_537, "nvidia-driver-535-open : Depends: libnvidia-compute-535 (= 535.54.03-0ubuntu0.22.04.1) "
                 "but 535.54.03-0ubuntu1 is to be installed"))
DRIVER = Package(
    "{driver}", "drivers", "cuda", "{driver_scheme}",
    (Source(f"{cite.GDC_RESOLUTE_INSTALL}#L93", "the open-module driver metapackage"), *_EXACT),
    exact_depends=tuple(f"{{{r}}}" for r in FAMILY_ROLES),
    standin="nvidia-driver-580-open",
)
UTILS = Package(
    "{utils}", "drivers", "cuda", "{driver_scheme}", _EXACT,
    binaries=("nvidia-smi",), standin="nvidia-utils",
)
COMPUTE_UTILS = Package(
    "{compute_utils}", "drivers", "cuda", "{driver_scheme}",
    (Source(cite.UBUNTU_PERSISTENCED, "nvidia-persistenced is provided by nvidia-compute-utils-<branch>"), *_EXACT),
    units=("nvidia-persistenced.service",), binaries=("nvidia-persistenced",), standin="nvidia-compute-utils",
)
DKMS = Package(
    "{dkms}", "drivers", "cuda", "{driver_scheme}",
    (Source(cite.DRIVER_GUIDE, "§4.1.1: nvidia-dkms-580-open → nvidia-dkms-open"),
     Source(cite.DKMS_HEADERS, "DKMS cannot build a module without the headers of the running kernel: "
                               "Your kernel headers for kernel … cannot be found at /lib/modules/…/build"), *_EXACT),
    standin="nvidia-dkms",
)
KERNEL_COMMON = Package(
    "{kernel_common}", "drivers", "cuda", "{driver_scheme}", _EXACT, standin="nvidia-kernel-common",
)
LIBCOMPUTE = Package(
    "{libcompute}", "drivers", "cuda", "{driver_scheme}", _EXACT, standin="libnvidia-compute",
)
FAMILY = (UTILS, COMPUTE_UTILS, DKMS, KERNEL_COMMON, LIBCOMPUTE)
NSCQ = Package(
    "libnvidia-nscq", "drivers", "cuda", "{versioned}",
    (Source(f"{cite.GDC_NOBLE_INSTALL}#L54-L57", "apt-get install libnvidia-nscq=${DRIVER_VERSION}*; apt-mark hold"),
     Source(f"{cite.GDC_BRANCH_RULE}#L63-L69", "libnvidia-nscq=${DRIVER_VERSION}-1 from branch 580 on"),
     Source(cite.GDC_PR_899, "595: libnvidia-nscq 595.71.05-1ubuntu1")),
    standin="libnvidia-nscq",
)
FABRICMANAGER = Package(
    "nvidia-fabricmanager", "fabric", "cuda", "{versioned}",
    (Source(f"{cite.GDC_NOBLE_INSTALL}#L47-L52", "apt-get install nvidia-fabricmanager=${DRIVER_VERSION}*; apt-mark hold"),
     Source(f"{cite.GDC_BRANCH_RULE}#L55-L61", "nvidia-fabricmanager=${DRIVER_VERSION}-1 from branch 580 on"),
     Source(cite.GDC_PR_451, "it provides the virtual nvidia-fabricmanager-580"),
     Source(cite.GDC_PR_899, "595: nvidia-fabricmanager 595.71.05-1ubuntu1"),
     Source(cite.TALOS_FM, "nv-fabricmanager reads /usr/share/nvidia/nvswitch/fabricmanager.cfg")),
    branch_virtuals=("nvidia-fabricmanager-{branch}",),
    units=("nvidia-fabricmanager.service",),
    binaries=("nv-fabricmanager", "nvidia-fabricmanager-start.sh"),
    paths=("/usr/share/nvidia/nvswitch/fabricmanager.cfg", "/var/run/nvidia-fabricmanager/nvlsm.pid"),
    standin="nvidia-fabricmanager",
)
NVSDM = Package(
    "libnvsdm", "fabric", "cuda", "{versioned}",
    (Source(f"{cite.GDC_NOBLE_INSTALL}#L59-L65", "apt-get install libnvsdm=${DRIVER_VERSION}* (amd64 only)"),
     Source(cite.GDC_PR_451, "it provides the virtual libnvsdm-580")),
    branch_virtuals=("libnvsdm-{branch}",),
    standin="libnvsdm",
)
NVLSM = Package(
    "nvlsm", "fabric", "cuda", "any",
    (Source(f"{cite.GDC_NOBLE_INSTALL}#L67-L69", "apt-get install nvlsm infiniband-diags, not pinned"),
     Source(f"{cite.GDC_RESOLUTE_INSTALL}#L68-L69", "nvlsm and infiniband-diags are versioned independently of the driver"),
     Source(cite.NVLSM_SPEC, "the package holds /opt/nvidia/nvlsm/sbin/nvlsm and /usr/share/nvidia/nvlsm/nvlsm.conf and "
                        "no systemd unit"),
     Source(cite.TALOS_FM, "the fabric manager's wrapper runs /opt/nvidia/nvlsm/sbin/nvlsm -F "
                      "/usr/share/nvidia/nvlsm/nvlsm.conf")),
    binaries=("/opt/nvidia/nvlsm/sbin/nvlsm",),
    paths=("/usr/share/nvidia/nvlsm/nvlsm.conf",),
    standin="nvlsm", standin_version="2025.06.5-1",
)
# Ubuntu's rdma-core packages (source rdma-core 50.0-2…): what a host has before DOCA.
UBUNTU_RDMA_VERSION = "50.0-2ubuntu0.2"
_UBUNTU_RDMA = Source(cite.ISSUE_39_RDMA, f"Ubuntu 24.04.3's own rdma-core packages: libibverbs1 {UBUNTU_RDMA_VERSION}, …")
LIBIBNETDISC = Package(
    "libibnetdisc5t64", "fabric", "ubuntu", "any",
    (Source(f"{cite.UBUNTU_NOBLE}libibnetdisc5t64", "infiniband-diags' library, from the rdma-core source"), _UBUNTU_RDMA),
    standin="libibnetdisc5t64", standin_version=UBUNTU_RDMA_VERSION,
)
INFINIBAND_DIAGS = Package(
    "infiniband-diags", "fabric", "ubuntu", "any",
    (Source(f"{cite.GDC_NOBLE_INSTALL}#L67-L69", "installed beside nvlsm for NVLink 5"),
     Source(f"{cite.UBUNTU_NOBLE}infiniband-diags", "from Ubuntu's archive (source rdma-core), depending on "
                                                    "libibnetdisc5t64 at exactly its own version"),
     _UBUNTU_RDMA),
    exact_depends=("libibnetdisc5t64",),
    binaries=("ibstat",),
    standin="infiniband-diags", standin_version=UBUNTU_RDMA_VERSION,
    note="from Ubuntu's archive until DOCA replaces it with its own build (the RDMA step, explicitly)",
)
DCGM_CUDA13 = Package(
    "datacenter-gpu-manager-4-cuda13", "dcgm", "cuda", "1:{dcgm}-1",
    (Source(f"{cite.DCGM}:cmake/packaging.cmake#L131-L175", "${CPACK_PACKAGE_NAME}-cuda13 depends on -core "
            "(= epoch:version-1) and provides datacenter-gpu-manager-4"),
     Source(f"{cite.DCGM}:CMakeLists.txt#L17", "CPACK_PACKAGE_NAME datacenter-gpu-manager-4"),
     Source(f"{cite.DCGM}:CMakeLists.txt#L889", "epoch 1")),
    provides=("datacenter-gpu-manager-4",),
    exact_depends=("datacenter-gpu-manager-4-core",),
    standin="datacenter-gpu-manager-4-cuda13", standin_version="1:4.4.1-1",
)
DCGM_CORE = Package(
    "datacenter-gpu-manager-4-core", "dcgm", "cuda", "1:{dcgm}-1",
    (Source(f"{cite.DCGM}:cmake/packaging.cmake#L131", "the Core component's package"),
     Source(f"{cite.DCGM}:CMakeLists.txt#L606-L619", "dcgmi and nv-hostengine are in the Core component"),
     Source(f"{cite.DCGM}:dcgmi/Command.cpp#L70-L106", "dcgmi connects to the host engine and fails without it"),
     Source(cite.DCGM_EXPORTER_GUIDE, "the exporter can connect to a separately managed DCGM host engine "
                                      "(nv-hostengine, port 5555)")),
    units=("nvidia-dcgm.service",),
    binaries=("dcgmi", "nv-hostengine"),
    standin="datacenter-gpu-manager-4-core", standin_version="1:4.4.1-1",
)
DCGM_EXPORTER_PACKAGE = Package(
    "datacenter-gpu-manager-exporter", "monitoring", "cuda", "{exporter}.{revision}-1",
    (Source(cite.DCGM_EXPORTER_GUIDE, "DCGM Exporter as a package-managed systemd service; RPM and Debian package "
            "versions identify the exporter version"),
     Source(f"{cite.DCGM_EXPORTER_PACKAGING}:hack/package/test.sh#L43-L45", "PACKAGE_VERSION=${EXPORTER_VERSION}."
            "${PACKAGE_REVISION}, PACKAGE_RELEASE=1: the deb is <exporter>.<revision>-1, depending on libc6 only"),
     Source(f"{cite.DCGM_EXPORTER}:packaging/config-files/systemd/nvidia-dcgm-exporter.service", "its unit"),
     Source(f"{cite.DCGM_EXPORTER}:README.md#L99-L110", "the remote host engine, -r or DCGM_REMOTE_HOSTENGINE_INFO"),
     Source(f"{cite.DCGM_EXPORTER}:pkg/cmd/app.go#L172-L178", "--remote-hostengine-info, alias -r, default "
            "localhost:5555, environment DCGM_REMOTE_HOSTENGINE_INFO"),
     Source(f"{cite.DCGM_EXPORTER}:pkg/cmd/app.go#L1096", "UseRemoteHE: c.IsSet(CLIRemoteHEInfo): without it set, an "
            "embedded host engine")),
    units=("nvidia-dcgm-exporter.service",),
    binaries=("dcgm-exporter",),
    paths=("/etc/dcgm-exporter/default-counters.csv",),
    standin="datacenter-gpu-manager-exporter", standin_version="4.5.2.001-1",
    note="its drop-in sets DCGM_REMOTE_HOSTENGINE_INFO=localhost:5555: no embedded host engine beside nvidia-dcgm",
)


# Where nvidia-dcgm's host engine listens (nv-hostengine's default port), for the exporter to use it.
DCGM_HOSTENGINE = "localhost:5555"


@dataclass(frozen=True)
class DocaRelease:
    """A DOCA release as the stand-in DOCA repository carries it: doca-ofed's version and the version of the
    packages it ships under Ubuntu's rdma-core names."""

    version: str  # 3.1.0
    build: str  # doca-ofed's version
    components: str  # rdma-core, ibverbs-utils, infiniband-diags of this release (DOCA's scheme)


# The releases the stand-in DOCA repository serves: the stacks' default and a newer one, in one folder
# (as on a host with a second DOCA source), so an RDMA step that does not pin DOCA's own packages meets
# the newer ones. The newer release's numbers are the stand-ins' own (no real release has them).
SIM_DOCAS = (DocaRelease(cite.DOCA_VERSION, "3.1.0-091000", "2507mlnx56-1"),
             DocaRelease("3.99.0", "3.99.0-999000", "2599mlnx99-1"))
_DOCA_SHIPS = Source(cite.HPCCM_DOCA, "NVIDIA's DOCA repository ships its own builds under Ubuntu's rdma-core names "
                                      "(libibverbs1, ibverbs-providers, ibverbs-utils, libibumad3, librdmacm1, …)")
# The packages a DOCA install may replace under Ubuntu's names, held or not: the RDMA step lets exactly
# these change when the driver step holds them (infiniband-diags), and refuses any other held package.
DOCA_REPLACES = ("rdma-core", "ibverbs-utils", "ibverbs-providers", "libibverbs1", "libibumad3", "libibmad5",
                 "librdmacm1", "infiniband-diags", "libibnetdisc5", "libibnetdisc5t64")
DOCA_OFED = Package(
    "doca-ofed", "rdma", "doca", "{doca}-N",
    (Source(cite.DOCA_GUIDE, "sudo apt-get -y install doca-ofed from the DOCA online repository; the installation "
                             "requires the kernel headers of the running kernel (DKMS)"),
     Source("https://docs.oracle.com/en/industries/communications/session-monitor/6.1/upgrade/"
            "installing-doca-ofed-package-oracle-linux.html", "DOCA 3.1.0 is build 3.1.0-091000"),
     _DOCA_SHIPS),
    binaries=("show_gids", "ibdev2netdev", "ib_write_bw", "ibv_devinfo"),
    standin="doca-ofed",
    note="installed with every package it depends on at an exact version, at that version",
)
# DOCA's builds of Ubuntu's packages (stand-ins in the DOCA repository; versions per SIM_DOCAS).
DOCA_COMPONENTS = tuple(
    Package(name, "rdma", "doca", "{doca_components}", (_DOCA_SHIPS, Source(cite.ISSUE_39_RDMA,
            "2507mlnx56-1 is DOCA's version scheme for these packages")), standin=name)
    for name in ("rdma-core", "ibverbs-utils", "infiniband-diags"))
RDMA_CORE = Package(
    "rdma-core", "rdma", "ubuntu", "any",
    (Source(f"{cite.UBUNTU_NOBLE}rdma-core", "the distribution's RDMA stack"), _UBUNTU_RDMA),
    standin="rdma-core", standin_version=UBUNTU_RDMA_VERSION,
)
IBVERBS_UTILS = Package(
    "ibverbs-utils", "rdma", "ubuntu", "any",
    (Source(f"{cite.UBUNTU_NOBLE}ibverbs-utils", "ibv_devinfo"), _UBUNTU_RDMA),
    binaries=("ibv_devinfo",),
    standin="ibverbs-utils", standin_version=UBUNTU_RDMA_VERSION,
)
# The running kernel's packages (Ubuntu's names; the stand-ins are built for the machine's kernel, which the
# simulated hosts share).
LINUX_HEADERS = Package(
    "linux-headers-{kernel}", "kernel", "ubuntu", "any",
    (Source(cite.DOCA_GUIDE, "kernel headers that match the version of the currently running kernel"),
     Source(cite.DKMS_HEADERS, "DKMS builds against /lib/modules/<kernel>/build")),
    paths=("/lib/modules/<kernel>/build",),
    standin="linux-headers",
    note="installed before any DKMS build (the driver's, DOCA's) when /lib/modules/$(uname -r)/build is missing",
)
LINUX_MODULES_EXTRA = Package(
    "linux-modules-extra-{kernel}", "kernel", "ubuntu", "any",
    (Source(cite.ISSUE_39_MODULES, "on a stock noble kernel ib_umad and mlx5_ib come from "
                                   "linux-modules-extra-$(uname -r)"),),
    standin="linux-modules-extra",
    note="installed when ib_umad or mlx5_ib cannot be loaded",
)
PACKAGES = (BRANCH_PIN, VERSION_PIN, DRIVER, *FAMILY, NSCQ, FABRICMANAGER, NVSDM, NVLSM, LIBIBNETDISC,
            INFINIBAND_DIAGS, DCGM_CUDA13, DCGM_CORE, DCGM_EXPORTER_PACKAGE, DOCA_OFED, *DOCA_COMPONENTS, RDMA_CORE,
            IBVERBS_UTILS, LINUX_HEADERS, LINUX_MODULES_EXTRA)
DRIVER_VERSIONED = (VERSION_PIN, DRIVER, *FAMILY, NSCQ, FABRICMANAGER, NVSDM)


def resolve(p: Package, version: str) -> Package:
    """``p`` with the names and schemes of driver ``version``'s branch filled in."""
    b = branch_of(version)
    r = rule(b)
    fill = {"branch": b, "version": version, "driver": r.driver.format(branch=b), "driver_scheme": r.driver_scheme,
            "versioned": r.versioned_scheme, **{k: v.format(branch=b) for k, v in r.family.items()},
            "kernel": "{kernel}"}  # the running kernel's: the scripts name it, $(uname -r)

    def f(s: str) -> str:
        return s.format(**fill) if "{" in s else s

    scheme = p.scheme.format(**fill) if p.scheme in ("{driver_scheme}", "{versioned}") else p.scheme
    virtuals = tuple(f(v) for v in p.branch_virtuals) if r.suffixed_virtuals else ()
    sources = p.sources + (r.sources if p is DRIVER else ())
    return replace(p, name=f(p.name), scheme=scheme, provides=p.provides + virtuals, branch_virtuals=(),
                   exact_depends=tuple(f(d) for d in p.exact_depends),
                   standin_version=p.standin_version.format(**fill), sources=sources)


# --- the install rules: what a real host refuses, what glm-infra does ------------------------------------


@dataclass(frozen=True)
class InstallRule:
    """A behaviour of the real packages that decides how they must be installed."""

    rule: str  # what the real packages (or apt) do
    action: str  # what glm-infra does about it: the order, the pin, or the check that stops with a message
    settled: bool  # a source shows it (else: no source here settles it, and glm-infra guards against it)
    standin: str  # how the simulated cluster's stand-ins reproduce it
    sources: tuple[Source, ...]


INSTALL_RULES = (
    InstallRule(
        "Every NVIDIA pinning package Provides, Conflicts and Replaces nvidia-driver-pinning: only one can be installed.",
        "The driver step installs one, the exact-version pin nvidia-driver-pinning-<version>; any other pinning "
        "package found (the branch pin, another version's) is removed.",
        True, "both pinning stand-ins carry the three fields", _PIN_SOURCES),
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
        _EXACT),
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
        (_DOCA_SHIPS, Source(cite.APT_GET_MAN, "--allow-change-held-packages: Force yes; this is a dangerous option "
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


# --- what the roles install ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DriverSet:
    """The driver step's packages for one driver version."""

    pin: Package  # NVIDIA's exact-version pinning package: installed alone, first
    locked: tuple[Package, ...]  # installed at exactly "<version>-*": the driver, NSCQ (fabric manager, NVSDM)
    family: tuple[Package, ...]  # the driver's siblings, at exactly its version (its dependencies)
    tools: tuple[Package, ...]  # installed and held at whatever version the repository has, if missing
    units: tuple[str, ...] = field(default=())  # enabled (without .service)
    tree_branch: str = ""  # the branch the driver tree's names carry ("" from 590 on)


def driver_set(version: str, fabric_manager: bool, dcgm: bool) -> DriverSet:
    """Raises UnknownBranch for a branch no rule covers."""
    locked = [DRIVER, NSCQ] + ([FABRICMANAGER, NVSDM] if fabric_manager else [])
    tools = [DCGM_CUDA13] + ([NVLSM, INFINIBAND_DIAGS] if fabric_manager else [])
    units = ["nvidia-persistenced"] + (["nvidia-fabricmanager"] if fabric_manager else []) + \
        (["nvidia-dcgm"] if dcgm else [])
    r = rule(branch_of(version))
    return DriverSet(resolve(VERSION_PIN, version), tuple(resolve(p, version) for p in locked),
                     tuple(resolve(p, version) for p in FAMILY), tuple(resolve(p, version) for p in tools),
                     tuple(units), branch_of(version) if r.tree_branch else "")


def rdma_packages(stack: str) -> tuple[Package, ...]:
    return (DOCA_OFED,) if stack == "doca-ofed" else (RDMA_CORE, IBVERBS_UTILS)


# --- what a test may check a rendered script against --------------------------------------------------


def cited_names(versions: tuple[str, ...] = ()) -> set[str]:
    """Every package, unit (with and without .service), binary and kernel module listed here, with the
    per-branch names of the given driver versions (virtual packages apart: ``virtual_names``)."""
    out: set[str] = set(DRIVER_TREE_NAMES) | set(DOCA_REPLACES)
    for p in PACKAGES:
        if "{kernel}" in p.name:
            continue
        ps = [resolve(p, v) for v in versions] if "{" in p.name + "".join(p.exact_depends) else [p]
        for q in ps:
            out |= {q.name, *q.depends, *q.exact_depends, *q.binaries, *q.units}
    for u in UNITS:
        out |= {u, u.removesuffix(".service")}
    return out | set(KERNEL_MODULES)


def virtual_names(versions: tuple[str, ...]) -> set[str]:
    """The virtual packages of the given driver versions: names a script must never install."""
    return {v for p in PACKAGES for ver in versions for v in resolve(p, ver).provides}


def cited_urls() -> set[str]:
    return {u for r in REPOSITORIES.values() for u in (r.url, r.keyring_url) if u}


# --- the stand-in packages of the simulated cluster -------------------------------------------------

# The driver versions the stand-in repository carries: the stacks' default, a second 580 (the simulated
# cluster moves the driver: upgrade, reboot, downgrade), branch 595 (the move across the 590 rename), and
# of each branch a newer release than any stack pins, as NVIDIA's repository always has one (so a pin that
# is missing or comes too late bites). The ".999." releases are the stand-ins' own (no real release has them).
SIM_DRIVERS = ("580.159.04", "580.172.08", "580.999.01", "595.71.05", "595.999.01")
# Which stand-in repository serves a package: the main one stands in for NVIDIA's CUDA repository
# and the distribution's mirror, doca/ for NVIDIA's DOCA repository.
STANDIN_REPOSITORY = {"cuda": ".", "ubuntu": ".", "doca": "doca"}


@dataclass(frozen=True)
class StandinBuild:
    """One stand-in .deb: its debs/<dir>, control fields from the registry, and the repository folder."""

    dir: str
    package: str
    version: str
    provides: str
    depends: str
    conflicts: str
    replaces: str
    repository: str

    def row(self) -> str:
        return "\t".join(x or "-" for x in (self.dir, self.package, self.version, self.provides, self.depends,
                                             self.conflicts, self.replaces, self.repository))


def _build(q: Package, version: str, depends_on: dict[str, str]) -> StandinBuild:
    depends = [f"{d} (= {depends_on.get(d, version)})" for d in q.exact_depends] + list(q.depends)
    return StandinBuild(q.standin, q.name, version, ", ".join(q.provides), ", ".join(depends),
                        ", ".join(q.conflicts), ", ".join(q.replaces), STANDIN_REPOSITORY[q.repository])


def standin_builds(drivers: tuple[str, ...] = SIM_DRIVERS, kernel: str = "") -> list[StandinBuild]:
    """Every stand-in build: the driver-versioned packages once per driver version, DOCA's once per DOCA
    release, the running kernel's for ``kernel`` (none without one), the others once."""
    rows: dict[tuple[str, str, str], StandinBuild] = {}

    def add(b: StandinBuild) -> None:
        rows.setdefault((b.package, b.version, b.repository), b)

    doca = {DOCA_OFED.name, *(c.name for c in DOCA_COMPONENTS)}
    for v in drivers:
        for p in PACKAGES:
            if not p.standin or p.name in doca and p.repository == "doca" or "{kernel}" in p.name:
                continue
            q = resolve(p, v)
            add(_build(q, q.version_for(v), {LIBIBNETDISC.name: LIBIBNETDISC.standin_version}))
    for d in SIM_DOCAS:
        comps = {c.name: d.components for c in DOCA_COMPONENTS}
        ofed = replace(DOCA_OFED, exact_depends=tuple(comps))
        add(_build(ofed, d.build, comps))
        for c in DOCA_COMPONENTS:
            add(_build(c, d.components, {}))
    if kernel:
        for p in (LINUX_HEADERS, LINUX_MODULES_EXTRA):
            add(_build(replace(p, name=p.name.format(kernel=kernel)), "1.0-1", {}))
    return list(rows.values())


def _main(argv: list[str]) -> int:
    if argv[:1] != ["standins"]:
        print("usage: packages.py standins [--kernel RELEASE] [DRIVER_VERSION...]", file=sys.stderr)
        return 2
    args, kernel = argv[1:], ""
    if args[:1] == ["--kernel"]:
        if len(args) < 2:
            print("packages.py standins: --kernel needs a release (uname -r)", file=sys.stderr)
            return 2
        kernel, args = args[1], args[2:]
    for b in standin_builds(tuple(args) or SIM_DRIVERS, kernel):
        print(b.row())
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
