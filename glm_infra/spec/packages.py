"""Every external name the host scripts rely on, once, each with where it is documented: the
packages (name, version scheme, the virtual packages they provide, the relations apt resolves them
by, the repository they come from), the systemd units the packages ship (``units.py``), the binaries
and configuration paths that matter; the install rules those relations impose are ``install_rules.py``
(what a real host refuses, and what glm-infra does about it). The repositories, their signing keys
and the sources cited: ``repositories.py``; the types: ``package_model.py``; the distribution's and
DOCA's packages: ``host_packages.py``. The driver step, the RDMA step, the health gate and the
monitoring take their names from here; the stand-in packages of the simulated cluster are built from
here with the same relations (``standins.py``); a test fails when a rendered script names something
this registry does not list. ``glm_infra.tools.packages_doc`` renders it as docs/PACKAGES.md.

A source is a URL or ``owner/repo@commit:path[#lines]`` on GitHub. Names that depend on the driver
branch come from a per-branch rule (``rule``): a branch with no rule is refused, because NVIDIA has
renamed packages between branches before (590 dropped the branch suffix of most names).

Standard library only: ``testbed/standins/build-apt-repo`` runs ``standins.py``, which imports this
file, with a plain python3.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

if __package__:
    from . import repositories as cite
    from .host_packages import (DOCA_COMPONENTS, DOCA_OFED, DOCA_REPLACES, IBVERBS_UTILS, INFINIBAND_DIAGS,
                                LIBIBNETDISC, LINUX_HEADERS, LINUX_MODULES_EXTRA, RDMA_CORE, UBUNTU_RDMA_VERSION)
    from .package_model import BranchRule, Package, UnknownBranch
    from .units import FABRIC_MODULES, KERNEL_MODULES, UNITS
else:  # run as a file by testbed/standins/build-apt-repo (a plain python3): this folder is on sys.path
    import repositories as cite  # type: ignore[no-redef]
    from host_packages import (DOCA_COMPONENTS, DOCA_OFED, DOCA_REPLACES, IBVERBS_UTILS,  # type: ignore[no-redef]
                               INFINIBAND_DIAGS, LIBIBNETDISC, LINUX_HEADERS, LINUX_MODULES_EXTRA, RDMA_CORE,
                               UBUNTU_RDMA_VERSION)
    from package_model import BranchRule, Package, UnknownBranch  # type: ignore[no-redef]
    from units import FABRIC_MODULES, KERNEL_MODULES, UNITS  # type: ignore[no-redef]
# The registry's one entry point: what its other modules hold is read from here too.
Source, REPOSITORIES = cite.Source, cite.REPOSITORIES

# --- packages ----------------------------------------------------------------------------------------

# Version schemes: {version} is the driver's (580.159.04), {branch} its branch (580), {dcgm} and {doca}
# the other release trains, N a packaging revision, {driver_scheme} and {versioned} the branch rule's.
# The scripts match the part before the revision: "<version>-" for the driver-versioned packages,
# "<doca>-" for DOCA.

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
PIN_SOURCES = (
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
     *PIN_SOURCES),
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
     *PIN_SOURCES),
    provides=(PINNING,), conflicts=(PINNING,), replaces=(PINNING,),
    paths=("/etc/apt/preferences.d/",),
    standin="nvidia-driver-pinning-version",
    note="installed alone, first, in an apt run of its own: apt reads its preferences only from the next run on",
)
EXACT_SOURCES = (Source(cite.DATAPROC_1342, "nvidia-driver-550-open : Depends: libnvidia-gl-550 (= 550.54.15-0ubuntu1), "
                 "nvidia-dkms-550-open (<= 550.54.15-1), (>= 550.54.15), libnvidia-compute-550 (= …) … but it is not "
                 "going to be installed"),
          Source(cite.DAVID_SHARE_3, "nvidia-driver-565 : Depends: nvidia-dkms-565 (= 565.57.01-0ubuntu1), "
                 "nvidia-kernel-common-565 (= …), nvidia-compute-utils-565 (= …), …"),
          Source(cite.OPEN_GPU_537, "nvidia-driver-535-open : Depends: libnvidia-compute-535 (= 535.54.03-0ubuntu0.22.04.1) "
                 "but 535.54.03-0ubuntu1 is to be installed"))
DRIVER = Package(
    "{driver}", "drivers", "cuda", "{driver_scheme}",
    (Source(f"{cite.GDC_RESOLUTE_INSTALL}#L93", "the open-module driver metapackage"), *EXACT_SOURCES),
    exact_depends=tuple(f"{{{r}}}" for r in FAMILY_ROLES),
    standin="nvidia-driver-580-open",
)
UTILS = Package(
    "{utils}", "drivers", "cuda", "{driver_scheme}", EXACT_SOURCES,
    binaries=("nvidia-smi",), standin="nvidia-utils",
)
COMPUTE_UTILS = Package(
    "{compute_utils}", "drivers", "cuda", "{driver_scheme}",
    (Source(cite.UBUNTU_PERSISTENCED, "nvidia-persistenced is provided by nvidia-compute-utils-<branch>"), *EXACT_SOURCES),
    units=("nvidia-persistenced.service",), binaries=("nvidia-persistenced",), standin="nvidia-compute-utils",
)
DKMS = Package(
    "{dkms}", "drivers", "cuda", "{driver_scheme}",
    (Source(cite.DRIVER_GUIDE, "§4.1.1: nvidia-dkms-580-open → nvidia-dkms-open"),
     Source(cite.DKMS_HEADERS, "DKMS cannot build a module without the headers of the running kernel: "
                               "Your kernel headers for kernel … cannot be found at /lib/modules/…/build"), *EXACT_SOURCES),
    standin="nvidia-dkms",
)
KERNEL_COMMON = Package(
    "{kernel_common}", "drivers", "cuda", "{driver_scheme}", EXACT_SOURCES, standin="nvidia-kernel-common",
)
LIBCOMPUTE = Package(
    "{libcompute}", "drivers", "cuda", "{driver_scheme}", EXACT_SOURCES, standin="libnvidia-compute",
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
DCGM_HOSTENGINE_PORT = 5555
DCGM_HOSTENGINE = f"localhost:{DCGM_HOSTENGINE_PORT}"

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
