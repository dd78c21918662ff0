"""The registry's packages of the distribution and of DOCA (``packages.py`` has NVIDIA's driver tree, the
fabric's and DCGM's): Ubuntu's rdma-core packages, DOCA-OFED and DOCA's own builds of Ubuntu's rdma packages,
the running kernel's headers and extra modules."""

from __future__ import annotations

if __package__:
    from . import repositories as cite
    from .package_model import Package
else:  # run as a file by testbed/standins/build-apt-repo (a plain python3): this folder is on sys.path
    import repositories as cite  # type: ignore[no-redef]
    from package_model import Package  # type: ignore[no-redef]
Source = cite.Source

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
DOCA_SHIPS = Source(cite.HPCCM_DOCA, "NVIDIA's DOCA repository ships its own builds under Ubuntu's rdma-core names "
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
     DOCA_SHIPS),
    binaries=("show_gids", "ibdev2netdev", "ib_write_bw", "ibv_devinfo"),
    standin="doca-ofed",
    note="installed with every package it depends on at an exact version, at that version",
)
# DOCA's builds of Ubuntu's packages (stand-ins in the DOCA repository, at the versions of standins.SIM_DOCAS).
DOCA_COMPONENTS = tuple(
    Package(name, "rdma", "doca", "{doca_components}", (DOCA_SHIPS, Source(cite.ISSUE_39_RDMA,
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
