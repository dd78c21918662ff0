"""Every external name the host scripts rely on, once, each with where it is documented: the
packages (name, version scheme, the virtual packages they provide, the repository they come from),
the repositories and their signing keys, the systemd units the packages ship, the binaries and
configuration paths that matter. The driver step, the RDMA step, the health gate and the monitoring
take their names from here; the stand-in packages of the simulated cluster are built from here
(``python3 glm_infra/spec/packages.py standins``); a test fails when a rendered script names something
this module does not list.

A source is a URL or ``owner/repo@commit:path[#lines]`` on GitHub. Names that depend on the driver
branch come from a per-branch rule (``rule``): a branch with no rule is refused, because NVIDIA has
renamed packages between branches before (590 dropped the branch suffix of most names).

Standard library only: ``testbed/standins/build-apt-repo`` runs this file with a plain python3.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace

# --- where the facts come from -------------------------------------------------------------------

GDC = "NVIDIA/gpu-driver-container@06a208ca9747c82b1ba99b76ecdcf2469b0a0207"
GDC_NOBLE_INSTALL = f"{GDC}:ubuntu24.04/install.sh"
GDC_NOBLE_DRIVER = f"{GDC}:ubuntu24.04/nvidia-driver"
GDC_RESOLUTE_INSTALL = f"{GDC}:ubuntu26.04/install.sh"
GDC_BRANCH_RULE = "NVIDIA/gpu-driver-container@78fa4ac0e7c3c01c40ad5061bd4969f1454145d2:ubuntu22.04/install.sh"
GDC_PR_451 = "https://github.com/NVIDIA/gpu-driver-container/pull/451"
DRIVER_GUIDE = "https://docs.nvidia.com/datacenter/tesla/pdf/Driver_Installation_Guide.pdf"
NEMOCLAW = "NVIDIA/NemoClaw@f9164a99b7f3f18c1bd8584b9267281dfd39ccbb:scripts/prepare-dgx-station-host.sh"
ISSUE_26 = "glm-infra issue 26 (an apt-cache policy capture of a host with driver 580: 'Installed: 580-5')"
DCGM = "NVIDIA/DCGM@72fa3feaa67d716a75323a8f47c34ff3ee73f824"
DCGM_EXPORTER = "NVIDIA/dcgm-exporter@d5e5f510a1b6b393f39a43293ccd9dc985defc79"
DCGM_GUIDE = "https://docs.nvidia.com/datacenter/dcgm/latest/user-guide/getting-started.html"
DCGM_EXPORTER_GUIDE = "https://docs.nvidia.com/datacenter/dcgm/latest/installation/install-dcgm-exporter.html"
DOCA_GUIDE = "https://docs.nvidia.com/doca/sdk/doca-host+installation+and+upgrade/index.html"
DOCA_COPY = "mwiget/f5bnk-kubespray@d75bfd49dacb822daf224ad17d3f6e98dd28d82f:dpu/install-doca.sh"
UBUNTU_DOCA = "https://ubuntu.com/server/docs/how-to/networking/install-doca-ofed/"
NVLSM_SPEC = "vyaghras/bottlerocket-kernel-kit@ae96194ff0d644d9062287a4e025737e1dd5aa4b:packages/nvlsm/nvlsm.spec"
TALOS_FM = ("siderolabs/extensions@98c1fc105e678861b579179047318dfffa045b11:"
            "nvidia-gpu/nvidia-fabricmanager/nvidia-fabricmanager-wrapper/main.go")
FM_GUIDE = "https://docs.nvidia.com/datacenter/tesla/fabric-manager-user-guide/index.html"
CUDA_KEY = ("https://forums.developer.nvidia.com/t/unable-to-add-nvidia-cuda-repository-on-ubuntu-22-04-due-to-"
            "missing-key-7fa2af80-pub/252028/2")
UBUNTU_PERSISTENCED = "http://manpages.ubuntu.com/manpages/jammy/man1/nvidia-persistenced.1.html"
UBUNTU_NOBLE = "https://packages.ubuntu.com/noble/"


@dataclass(frozen=True)
class Source:
    """Where a fact is documented and what it shows there."""

    ref: str
    shows: str


# --- repositories ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Repository:
    key: str
    url: str  # the deb line's URL (a flat repository: suite "./")
    keyring_url: str | None
    sources: tuple[Source, ...]


CUDA_REPOSITORY = Repository(
    "cuda",
    "https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2404/x86_64/",
    "https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2404/x86_64/3bf863cc.pub",
    (Source(f"{GDC_NOBLE_INSTALL}#L40-L45", "the Ubuntu 24.04 CUDA repository NVIDIA's driver container installs "
                                            "fabric manager, NSCQ, NVSDM and NVLSM from"),
     Source(CUDA_KEY, "the repository's signing key is 3bf863cc.pub (rotated from 7fa2af80)")),
)
DOCA_VERSION = "3.1.0"  # the DOCA release the stacks pin by default
DOCA_REPOSITORY = Repository(
    "doca",
    f"https://linux.mellanox.com/public/repo/doca/{DOCA_VERSION}/ubuntu24.04/x86_64/",
    "https://linux.mellanox.com/public/repo/doca/GPG-KEY-Mellanox.pub",
    (Source(DOCA_GUIDE, "DOCA-Host online repo: DOCA_URL=https://linux.mellanox.com/public/repo/doca/<version>/"
                        "<distro>/<arch>/, key $BASE_URL/GPG-KEY-Mellanox.pub, 'deb [signed-by=…] $DOCA_URL ./', "
                        "apt-get install doca-ofed"),
     Source(DOCA_COPY, "the same commands, copied from the DOCA downloads page"),
     Source(UBUNTU_DOCA, "Ubuntu's own DOCA-OFED packages exist for 26.04 only, so 24.04 needs NVIDIA's repository")),
)
UBUNTU_ARCHIVE = Repository(
    "ubuntu", "http://archive.ubuntu.com/ubuntu/", None,
    (Source(UBUNTU_NOBLE, "Ubuntu 24.04's own archive (the host's configured mirror)"),),
)
REPOSITORIES = {r.key: r for r in (CUDA_REPOSITORY, DOCA_REPOSITORY, UBUNTU_ARCHIVE)}


def doca_repository_url(version: str) -> str:
    """NVIDIA's DOCA repository of one DOCA release for Ubuntu 24.04 x86_64."""
    return f"https://linux.mellanox.com/public/repo/doca/{version}/ubuntu24.04/x86_64/"


# --- systemd units -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Unit:
    name: str  # with its suffix
    package: str  # the package that ships the file (may be a dependency of the one installed)
    enable: str  # who enables it, and when glm-infra does
    sources: tuple[Source, ...]


UNITS = {u.name: u for u in (
    Unit("nvidia-persistenced.service", "nvidia-compute-utils-<branch> (a dependency of the driver package)",
         "the driver step, always",
         (Source(UBUNTU_PERSISTENCED, "nvidia-persistenced is provided by nvidia-compute-utils-<branch>"),
          Source(f"{GDC_NOBLE_DRIVER}#L616", "NVIDIA's container starts nvidia-persistenced before the fabric"))),
    Unit("nvidia-fabricmanager.service", "nvidia-fabricmanager",
         "the driver step, with drivers.fabricManager; on NVLink 5 its ExecStart, nvidia-fabricmanager-start.sh, "
         "also starts NVLSM (nvlsm ships no unit of its own)",
         (Source(f"{GDC_NOBLE_DRIVER}#L636-L647", "on an NVLink 5 system NVIDIA's container runs "
                 "nvidia-fabricmanager-start.sh --mode start --fm-config-file … --nvlsm-config-file "
                 "/usr/share/nvidia/nvlsm/nvlsm.conf --nvlsm-pid-file /var/run/nvidia-fabricmanager/nvlsm.pid"),
          Source("https://github.com/NVIDIA/NVSentinel/issues/883", "nvidia-fabricmanager.service is the fabric "
                 "manager's unit on bare-metal installs (/usr/lib/systemd/system/nvidia-fabricmanager.service)"),
          Source(NVLSM_SPEC, "the nvlsm package NVIDIA ships has no unit: a distribution that runs NVLSM alone "
                             "adds its own nvlsm.service"),
          Source(FM_GUIDE, "Fabric Manager user guide: NVLink 5 systems run NVLSM beside the fabric manager"))),
    Unit("nvidia-dcgm.service", "datacenter-gpu-manager-4-core (a dependency of datacenter-gpu-manager-4-cuda13)",
         "the driver step, when the health gate runs dcgmi diag (drivers.dcgmDiagLevel > 0) or the DCGM "
         "exporter runs",
         (Source(f"{DCGM}:config-files/systemd/nvidia-dcgm.service.in", "ExecStart=/usr/bin/nv-hostengine -n "
                 "--service-account nvidia-dcgm, Alias=dcgm.service, WantedBy=multi-user.target"),
          Source(f"{DCGM}:config-files/CMakeLists.txt#L22-L25", "installed to lib/systemd/system by the Core "
                                                                "component (datacenter-gpu-manager-4-core)"),
          Source(f"{DCGM}:scripts/deb/postinst", "the package's postinst does not enable it"),
          Source(DCGM_GUIDE, "sudo systemctl --now enable nvidia-dcgm"))),
    Unit("nvidia-dcgm-exporter.service", "datacenter-gpu-manager-exporter", "the monitoring's dcgm-exporter step",
         (Source(f"{DCGM_EXPORTER}:packaging/config-files/systemd/nvidia-dcgm-exporter.service",
                 "Wants=nvidia-dcgm.service, After=nvidia-dcgm.service"),)),
)}

# Kernel modules the steps load or keep away.
KERNEL_MODULES = {
    "ib_umad": (Source(f"{GDC_NOBLE_DRIVER}#L186-L191", "NVLink 5 waits for the mlx5_core and ib_umad modules "
                                                        "before the fabric manager starts"),),
    "nvidia-peermem": (Source("https://docs.nvidia.com/datacenter/tesla/driver-installation-guide/620/kernel-modules.html",
                              "nvidia-peermem.ko is one of the driver's kernel modules"),),
}

# --- packages ----------------------------------------------------------------------------------------

# Version schemes: {version} is the driver's (580.159.04), {branch} its branch (580), {dcgm} and {doca}
# the other release trains, N a packaging revision. The scripts match the part before the revision:
# "<version>-" for the driver-versioned packages, "<branch>-" for the branch pin, "<doca>-" for DOCA.
DRIVER_VERSIONED = "{version}-1"  # fabric manager, NSCQ, NVSDM, the exact-version pinning package


@dataclass(frozen=True)
class Package:
    name: str  # for a per-branch name the rule fills in {branch} / {version}
    role: str  # drivers | fabric | dcgm | rdma | monitoring
    repository: str  # key of REPOSITORIES
    scheme: str  # version scheme (see above); "any" for packages held at whatever version the repo has
    sources: tuple[Source, ...]
    provides: tuple[str, ...] = ()  # virtual packages it provides (so installing these names fails)
    depends: tuple[str, ...] = ()  # only the dependencies the stand-in mirrors
    units: tuple[str, ...] = ()  # units it (or a dependency the stand-in folds in) ships
    binaries: tuple[str, ...] = ()  # programs glm-infra or the units run
    paths: tuple[str, ...] = ()  # configuration and data paths that matter
    standin: str = ""  # testbed/standins/debs/<standin>
    standin_version: str = ""  # the version the stand-in carries when it does not follow the driver

    def version_for(self, driver: str) -> str:
        """The stand-in's version for driver version ``driver``."""
        if self.standin_version:
            return self.standin_version
        return self.scheme.format(version=driver, branch=driver.split(".")[0])


@dataclass(frozen=True)
class BranchRule:
    """How NVIDIA names the driver packages of some branches in its Ubuntu repository."""

    branches: tuple[str, ...]
    driver: str  # the open-kernel-module driver metapackage
    driver_scheme: str
    suffixed_virtuals: bool  # fabric manager and NVSDM provide their old "-<branch>" names
    sources: tuple[Source, ...]


RULES = (
    BranchRule(
        ("580",), "nvidia-driver-{branch}-open", "{version}-0ubuntu1", True,
        (Source(f"{GDC_BRANCH_RULE}#L55-L94", "580 and later: nvidia-fabricmanager, libnvidia-nscq, libnvsdm, "
                                              "nvidia-imex without a branch suffix, at ${DRIVER_VERSION}-1; older "
                                              "branches -${DRIVER_BRANCH}"),
         Source(GDC_PR_451, "Package nvidia-fabricmanager-580 is a virtual package provided by: nvidia-fabricmanager "
                            "580.65.06-1 (likewise libnvsdm-580)"),
         Source("https://packages.ubuntu.com/tenacious/amd64/nvidia-dkms-580",
                "the 580 driver packages keep the branch in their name, versioned <driver>-0ubuntu1"),
         Source(DRIVER_GUIDE, "§4.1 Version locking packages for Ubuntu / Debian"))),
    BranchRule(
        ("590", "595", "610"), "nvidia-driver-open", "{version}-1ubuntu1", False,
        (Source(DRIVER_GUIDE, "§4.1.1 Ubuntu 590 and later packages: the branch suffix is dropped "
                              "(nvidia-dkms-580-open → nvidia-dkms-open, …); libnvidia-nscq, libnvsdm unchanged"),
         Source(f"{GDC_RESOLUTE_INSTALL}#L46-L97", "branch 595 (Dockerfile DRIVER_BRANCH=595): "
                "nvidia-driver-pinning-${DRIVER_VERSION}, nvidia-driver-open, nvidia-fabricmanager, "
                "libnvidia-nscq, libnvsdm, nvlsm, infiniband-diags"),
         Source(NEMOCLAW, "branch 610: nvidia-driver-pinning-610=610-2ubuntu1, "
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


BRANCH_PIN = Package(
    "nvidia-driver-pinning-{branch}", "drivers", "cuda", "{branch}-N",
    (Source(ISSUE_26, "nvidia-driver-pinning-580 is versioned by branch: 580-5"),
     Source(NEMOCLAW, "nvidia-driver-pinning-610=610-2ubuntu1"),
     Source(DRIVER_GUIDE, "§4.1 one pinning package per branch locks the packages to that branch")),
    standin="nvidia-driver-pinning-branch", standin_version="{branch}-5",
)
VERSION_PIN = Package(
    "nvidia-driver-pinning-{version}", "drivers", "cuda", DRIVER_VERSIONED,
    (Source(f"{GDC_RESOLUTE_INSTALL}#L45-L49", "apt-get install nvidia-driver-pinning-${DRIVER_VERSION}: pins the "
                                               "driver and the extra packages to the exact release"),
     Source(f"{GDC}:ubuntu26.04/README.md#L8-L9", "the version-specific nvidia-driver-pinning-<version> package pins "
                                                  "the whole driver tree to DRIVER_VERSION"),
     Source("botus99/.my-scripts@36ebfad6f2c5fd6865a1f9a095d71c1a032104a8:nvidia/pin-driver-version.sh",
            "version-locking packages track a branch or an exact version: apt install nvidia-driver-pinning-<version>")),
    standin="nvidia-driver-pinning-version",
)
DRIVER = Package(
    "{driver}", "drivers", "cuda", "{driver_scheme}",
    (Source(f"{GDC_RESOLUTE_INSTALL}#L93", "the open-module driver metapackage"),),
    units=("nvidia-persistenced.service",),
    binaries=("nvidia-smi", "nvidia-persistenced"),
    standin="nvidia-driver-580-open",
)
NSCQ = Package(
    "libnvidia-nscq", "drivers", "cuda", DRIVER_VERSIONED,
    (Source(f"{GDC_NOBLE_INSTALL}#L54-L57", "apt-get install libnvidia-nscq=${DRIVER_VERSION}*; apt-mark hold"),
     Source(f"{GDC_BRANCH_RULE}#L63-L69", "libnvidia-nscq=${DRIVER_VERSION}-1 from branch 580 on")),
    standin="libnvidia-nscq",
)
FABRICMANAGER = Package(
    "nvidia-fabricmanager", "fabric", "cuda", DRIVER_VERSIONED,
    (Source(f"{GDC_NOBLE_INSTALL}#L47-L52", "apt-get install nvidia-fabricmanager=${DRIVER_VERSION}*; apt-mark hold"),
     Source(f"{GDC_BRANCH_RULE}#L55-L61", "nvidia-fabricmanager=${DRIVER_VERSION}-1 from branch 580 on"),
     Source(GDC_PR_451, "it provides the virtual nvidia-fabricmanager-580"),
     Source(TALOS_FM, "nv-fabricmanager reads /usr/share/nvidia/nvswitch/fabricmanager.cfg")),
    provides=("nvidia-fabricmanager-{branch}",),
    units=("nvidia-fabricmanager.service",),
    binaries=("nv-fabricmanager", "nvidia-fabricmanager-start.sh"),
    paths=("/usr/share/nvidia/nvswitch/fabricmanager.cfg", "/var/run/nvidia-fabricmanager/nvlsm.pid"),
    standin="nvidia-fabricmanager",
)
NVSDM = Package(
    "libnvsdm", "fabric", "cuda", DRIVER_VERSIONED,
    (Source(f"{GDC_NOBLE_INSTALL}#L59-L65", "apt-get install libnvsdm=${DRIVER_VERSION}* (amd64 only)"),
     Source(GDC_PR_451, "it provides the virtual libnvsdm-580")),
    provides=("libnvsdm-{branch}",),
    standin="libnvsdm",
)
NVLSM = Package(
    "nvlsm", "fabric", "cuda", "any",
    (Source(f"{GDC_NOBLE_INSTALL}#L67-L69", "apt-get install nvlsm infiniband-diags, not pinned"),
     Source(f"{GDC_RESOLUTE_INSTALL}#L68-L69", "nvlsm and infiniband-diags are versioned independently of the driver"),
     Source(NVLSM_SPEC, "the package holds /opt/nvidia/nvlsm/sbin/nvlsm and /usr/share/nvidia/nvlsm/nvlsm.conf and "
                        "no systemd unit"),
     Source(TALOS_FM, "the fabric manager's wrapper runs /opt/nvidia/nvlsm/sbin/nvlsm -F "
                      "/usr/share/nvidia/nvlsm/nvlsm.conf")),
    binaries=("/opt/nvidia/nvlsm/sbin/nvlsm",),
    paths=("/usr/share/nvidia/nvlsm/nvlsm.conf",),
    standin="nvlsm", standin_version="2025.06.5-1",
)
INFINIBAND_DIAGS = Package(
    "infiniband-diags", "fabric", "cuda", "any",
    (Source(f"{GDC_NOBLE_INSTALL}#L67-L69", "installed beside nvlsm for NVLink 5"),),
    binaries=("ibstat",),
    standin="infiniband-diags", standin_version="2507mlnx56-1",
)
DCGM_CUDA13 = Package(
    "datacenter-gpu-manager-4-cuda13", "dcgm", "cuda", "1:{dcgm}-1",
    (Source(f"{DCGM}:cmake/packaging.cmake#L131-L175", "${CPACK_PACKAGE_NAME}-cuda13 depends on -core "
            "(= epoch:version-1) and provides datacenter-gpu-manager-4"),
     Source(f"{DCGM}:CMakeLists.txt#L17", "CPACK_PACKAGE_NAME datacenter-gpu-manager-4"),
     Source(f"{DCGM}:CMakeLists.txt#L889", "epoch 1")),
    provides=("datacenter-gpu-manager-4",),
    depends=("datacenter-gpu-manager-4-core",),
    standin="datacenter-gpu-manager-4-cuda13", standin_version="1:4.4.1-1",
)
DCGM_CORE = Package(
    "datacenter-gpu-manager-4-core", "dcgm", "cuda", "1:{dcgm}-1",
    (Source(f"{DCGM}:cmake/packaging.cmake#L131", "the Core component's package"),
     Source(f"{DCGM}:CMakeLists.txt#L606-L619", "dcgmi and nv-hostengine are in the Core component"),
     Source(f"{DCGM}:dcgmi/Command.cpp#L70-L106", "dcgmi connects to the host engine and fails without it")),
    units=("nvidia-dcgm.service",),
    binaries=("dcgmi", "nv-hostengine"),
    standin="datacenter-gpu-manager-4-core", standin_version="1:4.4.1-1",
)
DCGM_EXPORTER_PACKAGE = Package(
    "datacenter-gpu-manager-exporter", "monitoring", "cuda", "any",
    (Source(DCGM_EXPORTER_GUIDE, "DCGM Exporter as a package-managed systemd service"),
     Source(f"{DCGM_EXPORTER}:packaging/config-files/systemd/nvidia-dcgm-exporter.service", "its unit")),
    units=("nvidia-dcgm-exporter.service",),
    binaries=("dcgm-exporter",),
    paths=("/etc/dcgm-exporter/default-counters.csv",),
    standin="datacenter-gpu-manager-exporter", standin_version="4.4.1-4.5.2-1",
)
DOCA_OFED = Package(
    "doca-ofed", "rdma", "doca", "{doca}-N",
    (Source(DOCA_GUIDE, "sudo apt-get -y install doca-ofed from the DOCA online repository"),
     Source("https://docs.oracle.com/en/industries/communications/session-monitor/6.1/upgrade/"
            "installing-doca-ofed-package-oracle-linux.html", "DOCA 3.1.0 is build 3.1.0-091000")),
    binaries=("show_gids", "ibdev2netdev", "ib_write_bw", "ibv_devinfo"),
    standin="doca-ofed", standin_version="3.1.0-091000",
)
RDMA_CORE = Package(
    "rdma-core", "rdma", "ubuntu", "any",
    (Source(f"{UBUNTU_NOBLE}rdma-core", "the distribution's RDMA stack"),),
    standin="rdma-core", standin_version="50.0-2glmsim1",
)
IBVERBS_UTILS = Package(
    "ibverbs-utils", "rdma", "ubuntu", "any",
    (Source(f"{UBUNTU_NOBLE}ibverbs-utils", "ibv_devinfo"),),
    binaries=("ibv_devinfo",),
    standin="ibverbs-utils", standin_version="50.0-2glmsim1",
)
PACKAGES = (BRANCH_PIN, VERSION_PIN, DRIVER, NSCQ, FABRICMANAGER, NVSDM, NVLSM, INFINIBAND_DIAGS, DCGM_CUDA13,
            DCGM_CORE, DCGM_EXPORTER_PACKAGE, DOCA_OFED, RDMA_CORE, IBVERBS_UTILS)


def resolve(p: Package, version: str) -> Package:
    """``p`` with the names and scheme of driver ``version``'s branch filled in."""
    b = branch_of(version)
    r = rule(b)
    fill = {"branch": b, "version": version, "driver": r.driver.format(branch=b), "driver_scheme": r.driver_scheme}
    name = p.name.format(**fill)
    scheme = p.scheme.format(**fill) if "{driver_scheme}" in p.scheme else p.scheme
    provides = tuple(v.format(**fill) for v in p.provides) if r.suffixed_virtuals else ()
    sources = p.sources + (r.sources if p is DRIVER else ())
    return replace(p, name=name, scheme=scheme, provides=provides, standin_version=p.standin_version.format(**fill),
                   sources=sources)


# --- what the roles install ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DriverSet:
    """The driver step's packages for one driver version."""

    branch_pin: Package  # installed at "<branch>-*"
    locked: tuple[Package, ...]  # installed at exactly "<version>-*"
    tools: tuple[Package, ...]  # installed and held at whatever version the repository has
    units: tuple[str, ...] = field(default=())  # enabled (without .service)


def driver_set(version: str, fabric_manager: bool, dcgm: bool) -> DriverSet:
    """Raises UnknownBranch for a branch no rule covers."""
    locked = [VERSION_PIN, DRIVER, NSCQ] + ([FABRICMANAGER, NVSDM] if fabric_manager else [])
    tools = [DCGM_CUDA13] + ([NVLSM, INFINIBAND_DIAGS] if fabric_manager else [])
    units = ["nvidia-persistenced"] + (["nvidia-fabricmanager"] if fabric_manager else []) + \
        (["nvidia-dcgm"] if dcgm else [])
    return DriverSet(resolve(BRANCH_PIN, version), tuple(resolve(p, version) for p in locked),
                     tuple(resolve(p, version) for p in tools), tuple(units))


def rdma_packages(stack: str) -> tuple[Package, ...]:
    return (DOCA_OFED,) if stack == "doca-ofed" else (RDMA_CORE, IBVERBS_UTILS)


# --- what a test may check a rendered script against --------------------------------------------------


def cited_names(versions: tuple[str, ...] = ()) -> set[str]:
    """Every package, unit (with and without .service), binary and kernel module listed here, with the
    per-branch names of the given driver versions (virtual packages apart: ``virtual_names``)."""
    out: set[str] = set()
    for p in PACKAGES:
        ps = [resolve(p, v) for v in versions] if "{" in p.name + "".join(p.provides) else [p]
        for q in ps:
            out |= {q.name, *q.depends, *q.binaries, *q.units}
    for u in UNITS:
        out |= {u, u.removesuffix(".service")}
    return out | set(KERNEL_MODULES)


def virtual_names(versions: tuple[str, ...]) -> set[str]:
    """The virtual packages of the given driver versions: names a script must never install."""
    return {v for p in PACKAGES for ver in versions for v in resolve(p, ver).provides}


def cited_urls() -> set[str]:
    return {u for r in REPOSITORIES.values() for u in (r.url, r.keyring_url) if u}


# --- the stand-in packages of the simulated cluster -------------------------------------------------

# The driver versions the stand-in repository carries: the stacks' default and a second one, so the
# simulated cluster can move the driver (upgrade, reboot, downgrade).
SIM_DRIVERS = ("580.159.04", "580.172.08")
# Which stand-in repository serves a package: the main one stands in for NVIDIA's CUDA repository
# and the distribution's mirror, doca/ for NVIDIA's DOCA repository.
STANDIN_REPOSITORY = {"cuda": ".", "ubuntu": ".", "doca": "doca"}


def standin_builds(drivers: tuple[str, ...] = SIM_DRIVERS) -> list[tuple[str, str, str, str, str, str]]:
    """(stand-in dir, package, version, Provides, Depends, repository dir) of every stand-in build:
    the driver-versioned packages once per driver version, the others once."""
    rows: dict[tuple[str, str], tuple[str, str, str, str, str, str]] = {}
    for v in drivers:
        for p in PACKAGES:
            q = resolve(p, v)
            version = q.version_for(v)
            depends = ", ".join(f"{d} (= {version})" if d == "datacenter-gpu-manager-4-core" else d for d in q.depends)
            rows.setdefault((q.name, version), (q.standin, q.name, version, ", ".join(q.provides), depends,
                                                STANDIN_REPOSITORY[q.repository]))
    return list(rows.values())


# --- docs/PACKAGES.md ---------------------------------------------------------------------------------


def _cite(sources: tuple[Source, ...]) -> str:
    return "<br>".join(f"`{s.ref}`: {s.shows}" for s in sources)


def markdown() -> str:
    """docs/PACKAGES.md: this registry as a page (a test keeps the two equal)."""
    lines = [
        "# External names: packages, repositories, units",
        "",
        "Generated from `glm_infra/spec/packages.py` (`python3 glm_infra/spec/packages.py markdown > docs/PACKAGES.md`);",
        "edit that file, not this one. Every name a host script relies on is listed there once, with where",
        "NVIDIA (or Ubuntu) documents it; the driver, RDMA, health-gate and monitoring steps take their names",
        "from it, the simulated cluster's stand-in packages are built from it, and a test fails when a rendered",
        "script names a package, unit or repository it does not list. A source is a URL or",
        "`owner/repo@commit:path#lines` on GitHub.",
        "",
        "## Driver branches",
        "",
        "A driver version whose branch has no rule here is refused (`drivers.version`): NVIDIA renamed most",
        "packages at branch 590.",
        "",
        "| branches | driver package | its version | fabric manager / NVSDM also provide | sources |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in RULES:
        virt = "`nvidia-fabricmanager-<branch>`, `libnvsdm-<branch>`" if r.suffixed_virtuals else "—"
        lines.append(f"| {', '.join(r.branches)} | `{r.driver}` | `{r.driver_scheme}` | {virt} | {_cite(r.sources)} |")
    lines += ["", "## Packages", "",
              "| package | role | repository | version | provides | units | binaries, paths | sources |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in PACKAGES:
        scheme = "any (held)" if p.scheme == "any" else f"`{p.scheme}`"
        if p is DRIVER:
            scheme = "per branch (above)"
        cells = [f"`{p.name}`", p.role, p.repository, scheme, ", ".join(f"`{v}`" for v in p.provides) or "—",
                 ", ".join(f"`{u}`" for u in p.units) or "—",
                 ", ".join(f"`{b}`" for b in p.binaries + p.paths) or "—", _cite(p.sources)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Repositories", "", "| key | deb line URL | signing key | sources |", "| --- | --- | --- | --- |"]
    for r in REPOSITORIES.values():
        lines.append(f"| {r.key} | `{r.url}` | {f'`{r.keyring_url}`' if r.keyring_url else '—'} | {_cite(r.sources)} |")
    lines += ["", "## Systemd units", "", "| unit | shipped by | enabled | sources |", "| --- | --- | --- | --- |"]
    for u in UNITS.values():
        lines.append(f"| `{u.name}` | {u.package} | {u.enable} | {_cite(u.sources)} |")
    lines += ["", "## Kernel modules", "", "| module | sources |", "| --- | --- |"]
    for m, src in KERNEL_MODULES.items():
        lines.append(f"| `{m}` | {_cite(src)} |")
    lines += ["", "## Stand-ins", "",
              "`testbed/standins/build-apt-repo` builds every package above that has a stand-in (`debs/<dir>`) with",
              "the registry's name, version, `Provides:` and repository: the driver-versioned ones for each of "
              + ", ".join(f"`{v}`" for v in SIM_DRIVERS) + ". Its `apt/` folder stands in for",
              "the CUDA repository and the distribution's mirror, `apt/doca/` for the DOCA repository. The",
              "stand-ins ship only the units listed here, plus `nvidia-sim-module.service`, which loads the",
              "simulated kernel module at boot and which no host script names.", ""]
    return "\n".join(lines)


def _main(argv: list[str]) -> int:
    if argv[:1] == ["markdown"]:
        print(markdown(), end="")
        return 0
    if argv[:1] != ["standins"]:
        print("usage: packages.py standins [DRIVER_VERSION...] | markdown", file=sys.stderr)
        return 2
    drivers = tuple(argv[1:]) or SIM_DRIVERS
    for row in standin_builds(drivers):
        print("\t".join(x or "-" for x in row))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
