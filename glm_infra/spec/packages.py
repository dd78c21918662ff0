"""Every external name the host scripts rely on, once, each with where it is documented: the
packages (name, version scheme, the virtual packages they provide, the repository they come from),
the systemd units the packages ship, the binaries and configuration paths that matter (the
repositories, their signing keys and the sources cited: ``repositories.py`` beside it). The driver
step, the RDMA step, the health gate and the monitoring take their names from here; the stand-in
packages of the simulated cluster are built from here (``python3 glm_infra/spec/packages.py
standins``); a test fails when a rendered script names something this module does not list.
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
    Unit("nvidia-persistenced.service", "nvidia-compute-utils-<branch> (a dependency of the driver package)",
         "the driver step, always",
         (Source(cite.UBUNTU_PERSISTENCED, "nvidia-persistenced is provided by nvidia-compute-utils-<branch>"),
          Source(f"{cite.GDC_NOBLE_DRIVER}#L616", "NVIDIA's container starts nvidia-persistenced before the fabric"))),
    Unit("nvidia-fabricmanager.service", "nvidia-fabricmanager",
         "the driver step, with drivers.fabricManager; on NVLink 5 its ExecStart, nvidia-fabricmanager-start.sh, "
         "also starts NVLSM (nvlsm ships no unit of its own)",
         (Source(f"{cite.GDC_NOBLE_DRIVER}#L636-L647", "on an NVLink 5 system NVIDIA's container runs "
                 "nvidia-fabricmanager-start.sh --mode start --fm-config-file … --nvlsm-config-file "
                 "/usr/share/nvidia/nvlsm/nvlsm.conf --nvlsm-pid-file /var/run/nvidia-fabricmanager/nvlsm.pid"),
          Source("https://github.com/NVIDIA/NVSentinel/issues/883", "nvidia-fabricmanager.service is the fabric "
                 "manager's unit on bare-metal installs (/usr/lib/systemd/system/nvidia-fabricmanager.service)"),
          Source(cite.NVLSM_SPEC, "the nvlsm package NVIDIA ships has no unit: a distribution that runs NVLSM alone "
                             "adds its own nvlsm.service"),
          Source(cite.FM_GUIDE, "Fabric Manager user guide: NVLink 5 systems run NVLSM beside the fabric manager"))),
    Unit("nvidia-dcgm.service", "datacenter-gpu-manager-4-core (a dependency of datacenter-gpu-manager-4-cuda13)",
         "the driver step, when the health gate runs dcgmi diag (drivers.dcgmDiagLevel > 0) or the cite.DCGM "
         "exporter runs",
         (Source(f"{cite.DCGM}:config-files/systemd/nvidia-dcgm.service.in", "ExecStart=/usr/bin/nv-hostengine -n "
                 "--service-account nvidia-dcgm, Alias=dcgm.service, WantedBy=multi-user.target"),
          Source(f"{cite.DCGM}:config-files/CMakeLists.txt#L22-L25", "installed to lib/systemd/system by the Core "
                                                                "component (datacenter-gpu-manager-4-core)"),
          Source(f"{cite.DCGM}:scripts/deb/postinst", "the package's postinst does not enable it"),
          Source(cite.DCGM_GUIDE, "sudo systemctl --now enable nvidia-dcgm"))),
    Unit("nvidia-dcgm-exporter.service", "datacenter-gpu-manager-exporter", "the monitoring's dcgm-exporter step",
         (Source(f"{cite.DCGM_EXPORTER}:packaging/config-files/systemd/nvidia-dcgm-exporter.service",
                 "Wants=nvidia-dcgm.service, After=nvidia-dcgm.service"),)),
)}

# Kernel modules the steps load or keep away.
KERNEL_MODULES = {
    "ib_umad": (Source(f"{cite.GDC_NOBLE_DRIVER}#L186-L191", "NVLink 5 waits for the mlx5_core and ib_umad modules "
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
        (Source(f"{cite.GDC_BRANCH_RULE}#L55-L94", "580 and later: nvidia-fabricmanager, libnvidia-nscq, libnvsdm, "
                                              "nvidia-imex without a branch suffix, at ${DRIVER_VERSION}-1; older "
                                              "branches -${DRIVER_BRANCH}"),
         Source(cite.GDC_PR_451, "Package nvidia-fabricmanager-580 is a virtual package provided by: nvidia-fabricmanager "
                            "580.65.06-1 (likewise libnvsdm-580)"),
         Source("https://packages.ubuntu.com/tenacious/amd64/nvidia-dkms-580",
                "the 580 driver packages keep the branch in their name, versioned <driver>-0ubuntu1"),
         Source(cite.DRIVER_GUIDE, "§4.1 Version locking packages for Ubuntu / Debian"))),
    BranchRule(
        ("590", "595", "610"), "nvidia-driver-open", "{version}-1ubuntu1", False,
        (Source(cite.DRIVER_GUIDE, "§4.1.1 Ubuntu 590 and later packages: the branch suffix is dropped "
                              "(nvidia-dkms-580-open → nvidia-dkms-open, …); libnvidia-nscq, libnvsdm unchanged"),
         Source(f"{cite.GDC_RESOLUTE_INSTALL}#L46-L97", "branch 595 (Dockerfile DRIVER_BRANCH=595): "
                "nvidia-driver-pinning-${DRIVER_VERSION}, nvidia-driver-open, nvidia-fabricmanager, "
                "libnvidia-nscq, libnvsdm, nvlsm, infiniband-diags"),
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


BRANCH_PIN = Package(
    "nvidia-driver-pinning-{branch}", "drivers", "cuda", "{branch}-N",
    (Source(cite.ISSUE_26, "nvidia-driver-pinning-580 is versioned by branch: 580-5"),
     Source(cite.NEMOCLAW, "nvidia-driver-pinning-610=610-2ubuntu1"),
     Source(cite.DRIVER_GUIDE, "§4.1 one pinning package per branch locks the packages to that branch")),
    standin="nvidia-driver-pinning-branch", standin_version="{branch}-5",
)
VERSION_PIN = Package(
    "nvidia-driver-pinning-{version}", "drivers", "cuda", DRIVER_VERSIONED,
    (Source(f"{cite.GDC_RESOLUTE_INSTALL}#L45-L49", "apt-get install nvidia-driver-pinning-${DRIVER_VERSION}: pins the "
                                               "driver and the extra packages to the exact release"),
     Source(f"{cite.GDC}:ubuntu26.04/README.md#L8-L9", "the version-specific nvidia-driver-pinning-<version> package pins "
                                                  "the whole driver tree to DRIVER_VERSION"),
     Source("botus99/.my-scripts@36ebfad6f2c5fd6865a1f9a095d71c1a032104a8:nvidia/pin-driver-version.sh",
            "version-locking packages track a branch or an exact version: apt install nvidia-driver-pinning-<version>")),
    standin="nvidia-driver-pinning-version",
)
DRIVER = Package(
    "{driver}", "drivers", "cuda", "{driver_scheme}",
    (Source(f"{cite.GDC_RESOLUTE_INSTALL}#L93", "the open-module driver metapackage"),),
    units=("nvidia-persistenced.service",),
    binaries=("nvidia-smi", "nvidia-persistenced"),
    standin="nvidia-driver-580-open",
)
NSCQ = Package(
    "libnvidia-nscq", "drivers", "cuda", DRIVER_VERSIONED,
    (Source(f"{cite.GDC_NOBLE_INSTALL}#L54-L57", "apt-get install libnvidia-nscq=${DRIVER_VERSION}*; apt-mark hold"),
     Source(f"{cite.GDC_BRANCH_RULE}#L63-L69", "libnvidia-nscq=${DRIVER_VERSION}-1 from branch 580 on")),
    standin="libnvidia-nscq",
)
FABRICMANAGER = Package(
    "nvidia-fabricmanager", "fabric", "cuda", DRIVER_VERSIONED,
    (Source(f"{cite.GDC_NOBLE_INSTALL}#L47-L52", "apt-get install nvidia-fabricmanager=${DRIVER_VERSION}*; apt-mark hold"),
     Source(f"{cite.GDC_BRANCH_RULE}#L55-L61", "nvidia-fabricmanager=${DRIVER_VERSION}-1 from branch 580 on"),
     Source(cite.GDC_PR_451, "it provides the virtual nvidia-fabricmanager-580"),
     Source(cite.TALOS_FM, "nv-fabricmanager reads /usr/share/nvidia/nvswitch/fabricmanager.cfg")),
    provides=("nvidia-fabricmanager-{branch}",),
    units=("nvidia-fabricmanager.service",),
    binaries=("nv-fabricmanager", "nvidia-fabricmanager-start.sh"),
    paths=("/usr/share/nvidia/nvswitch/fabricmanager.cfg", "/var/run/nvidia-fabricmanager/nvlsm.pid"),
    standin="nvidia-fabricmanager",
)
NVSDM = Package(
    "libnvsdm", "fabric", "cuda", DRIVER_VERSIONED,
    (Source(f"{cite.GDC_NOBLE_INSTALL}#L59-L65", "apt-get install libnvsdm=${DRIVER_VERSION}* (amd64 only)"),
     Source(cite.GDC_PR_451, "it provides the virtual libnvsdm-580")),
    provides=("libnvsdm-{branch}",),
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
INFINIBAND_DIAGS = Package(
    "infiniband-diags", "fabric", "cuda", "any",
    (Source(f"{cite.GDC_NOBLE_INSTALL}#L67-L69", "installed beside nvlsm for NVLink 5"),),
    binaries=("ibstat",),
    standin="infiniband-diags", standin_version="2507mlnx56-1",
)
DCGM_CUDA13 = Package(
    "datacenter-gpu-manager-4-cuda13", "dcgm", "cuda", "1:{dcgm}-1",
    (Source(f"{cite.DCGM}:cmake/packaging.cmake#L131-L175", "${CPACK_PACKAGE_NAME}-cuda13 depends on -core "
            "(= epoch:version-1) and provides datacenter-gpu-manager-4"),
     Source(f"{cite.DCGM}:CMakeLists.txt#L17", "CPACK_PACKAGE_NAME datacenter-gpu-manager-4"),
     Source(f"{cite.DCGM}:CMakeLists.txt#L889", "epoch 1")),
    provides=("datacenter-gpu-manager-4",),
    depends=("datacenter-gpu-manager-4-core",),
    standin="datacenter-gpu-manager-4-cuda13", standin_version="1:4.4.1-1",
)
DCGM_CORE = Package(
    "datacenter-gpu-manager-4-core", "dcgm", "cuda", "1:{dcgm}-1",
    (Source(f"{cite.DCGM}:cmake/packaging.cmake#L131", "the Core component's package"),
     Source(f"{cite.DCGM}:CMakeLists.txt#L606-L619", "dcgmi and nv-hostengine are in the Core component"),
     Source(f"{cite.DCGM}:dcgmi/Command.cpp#L70-L106", "dcgmi connects to the host engine and fails without it")),
    units=("nvidia-dcgm.service",),
    binaries=("dcgmi", "nv-hostengine"),
    standin="datacenter-gpu-manager-4-core", standin_version="1:4.4.1-1",
)
DCGM_EXPORTER_PACKAGE = Package(
    "datacenter-gpu-manager-exporter", "monitoring", "cuda", "any",
    (Source(cite.DCGM_EXPORTER_GUIDE, "cite.DCGM Exporter as a package-managed systemd service"),
     Source(f"{cite.DCGM_EXPORTER}:packaging/config-files/systemd/nvidia-dcgm-exporter.service", "its unit")),
    units=("nvidia-dcgm-exporter.service",),
    binaries=("dcgm-exporter",),
    paths=("/etc/dcgm-exporter/default-counters.csv",),
    standin="datacenter-gpu-manager-exporter", standin_version="4.4.1-4.5.2-1",
)
DOCA_OFED = Package(
    "doca-ofed", "rdma", "doca", "{doca}-N",
    (Source(cite.DOCA_GUIDE, "sudo apt-get -y install doca-ofed from the DOCA online repository"),
     Source("https://docs.oracle.com/en/industries/communications/session-monitor/6.1/upgrade/"
            "installing-doca-ofed-package-oracle-linux.html", "DOCA 3.1.0 is build 3.1.0-091000")),
    binaries=("show_gids", "ibdev2netdev", "ib_write_bw", "ibv_devinfo"),
    standin="doca-ofed", standin_version="3.1.0-091000",
)
RDMA_CORE = Package(
    "rdma-core", "rdma", "ubuntu", "any",
    (Source(f"{cite.UBUNTU_NOBLE}rdma-core", "the distribution's RDMA stack"),),
    standin="rdma-core", standin_version="50.0-2glmsim1",
)
IBVERBS_UTILS = Package(
    "ibverbs-utils", "rdma", "ubuntu", "any",
    (Source(f"{cite.UBUNTU_NOBLE}ibverbs-utils", "ibv_devinfo"),),
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


def _main(argv: list[str]) -> int:
    if argv[:1] != ["standins"]:
        print("usage: packages.py standins [DRIVER_VERSION...]", file=sys.stderr)
        return 2
    drivers = tuple(argv[1:]) or SIM_DRIVERS
    for row in standin_builds(drivers):
        print("\t".join(x or "-" for x in row))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
