"""What a host is given before it serves: preflight, the runtime, the NVIDIA driver and fabric, RDMA
and NIXL."""

from __future__ import annotations

import posixpath
from typing import Literal

from pydantic import (
    Field,
    field_validator,
)

from . import packages, pins, repositories
from .base import StrictModel, Url


class RuntimeConfig(StrictModel):
    """The Python runtime that runs vLLM and the router on every host."""

    user: str = Field("vllm", pattern=r"^[a-z_][a-z0-9_-]*$", description="System user the services run as.")
    venv: str = Field("/opt/glm-infra/venv", description="Virtualenv of vLLM, NIXL and vllm-router on every host.")
    vllm_version: str = Field(pins.VLLM, pattern=r"^[0-9][A-Za-z0-9.+_-]*$", description="vllm pin.")
    nixl_version: str = Field(pins.NIXL, pattern=r"^[0-9][A-Za-z0-9.+_-]*$", description="nixl pin.")
    router_version: str = Field(pins.VLLM_ROUTER, pattern=r"^[0-9][A-Za-z0-9.+_-]*$", description="vllm-router pin.")
    uv_version: str = Field(pins.UV, pattern=r"^[0-9][A-Za-z0-9.+_-]*$", description="uv pin (installs the venv).")
    index_url: Url = Field("https://pypi.org/simple", description="Python package index (PEP 503) for the hosts.")
    find_links: Url | None = Field(None, description="Wheel folder URL; with it the hosts use no index at all.")
    state_dir: str = Field("/var/lib/glm-infra", description="State of the services (their home).")

    @field_validator("venv", "state_dir")
    @classmethod
    def _abs(cls, v: str) -> str:
        if not v.startswith("/") or posixpath.normpath(v) != v or v == "/":
            raise ValueError(f"{v!r} must be a normalised absolute path")
        return v


class PreflightConfig(StrictModel):
    """What a host must already be before glm-infra installs anything."""

    allowed_os: list[str] = Field(
        default_factory=lambda: ["ubuntu 24.04"], description="'ID VERSION_ID' pairs from /etc/os-release."
    )
    min_kernel: str = Field("5.12", pattern=r"^[0-9]+\.[0-9]+$", description="DMA-BUF GPUDirect needs 5.12+.")
    min_free_disk_gb: float | None = Field(
        None, ge=0, description="Free space (or checkpoint already staged) needed at model.path before anything is "
        "installed; the weights step checks the exact size later.",
    )


class DriversConfig(StrictModel):
    """NVIDIA driver, fabric manager and tools: installed and held (install) or only checked (verify)."""

    mode: Literal["install", "verify"] = Field(
        "install", description="install (and hold) the driver, or verify a pre-installed image and change nothing.")
    version: str = Field("580.159.04", pattern=r"^[0-9]+\.[0-9]+(\.[0-9]+)?$",
                         description="NVIDIA driver version (fabric manager and NSCQ at exactly this one).")
    apt_repository: Url = Field(
        "https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2404/x86_64/",
        description="NVIDIA apt repository (deb line URL).",
    )
    apt_keyring_url: Url | None = Field(
        "https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2404/x86_64/3bf863cc.pub",
        description="Signing key of the repository; None means the repository is trusted as is.",
    )
    fabric_manager: bool = Field(True, description="Run nvidia-fabricmanager (NVLink 5 / NVSwitch systems).")
    dcgm_diag_level: int = Field(0, ge=0, le=3, description="Run `dcgmi diag -r N` in the health gate (0: skip).")
    reboot_timeout: int = Field(1800, ge=60, le=7200, description="Seconds to wait for a host to come back.")
    fabric_timeout: int = Field(600, ge=0, le=3600, description="Seconds the health gate waits for the fabric.")
    remove_on_destroy: bool = Field(False, description="Unhold and purge the driver on pulumi destroy.")

    @field_validator("version")
    @classmethod
    def _known_branch(cls, v: str) -> str:
        packages.rule(packages.branch_of(v))  # package names differ per branch: refuse one with no rule
        return v

    @property
    def branch(self) -> str:
        return packages.branch_of(self.version)

    def package_set(self, dcgm_exporter: bool = False) -> packages.DriverSet:
        """The packages and units of glm_infra/spec/packages.py for this version (the exporter's unit needs
        DCGM's host engine, as the health gate's dcgmi diag does)."""
        return packages.driver_set(self.version, self.fabric_manager, self.dcgm_diag_level > 0 or dcgm_exporter)

    @property
    def pin_package(self) -> str:
        """NVIDIA's pinning package of this exact driver version: the only one installed (they conflict)."""
        return self.package_set().pin.name

    @property
    def locked_packages(self) -> list[str]:
        """Packages whose version must be exactly the driver's (a mismatch breaks the fabric)."""
        return [p.name for p in self.package_set().locked]

    @property
    def family_packages(self) -> list[str]:
        """The driver's siblings: it depends on them at exactly its own version."""
        return [p.name for p in self.package_set().family]

    @property
    def tool_packages(self) -> list[str]:
        """Packages installed and held at whatever version the repository has."""
        return [p.name for p in self.package_set().tools]


class RdmaConfig(StrictModel):
    """RDMA networking for NIXL's KV transfer."""

    stack: Literal["doca-ofed", "inbox"] = Field("doca-ofed", description="DOCA-OFED or the distribution's rdma-core.")
    gpudirect: Literal["dmabuf", "peermem"] = Field(
        "dmabuf", description="GPUDirect RDMA through DMA-BUF (open driver, kernel 5.12+) or nvidia-peermem.")
    link_layer: Literal["Ethernet", "InfiniBand"] = Field(
        "Ethernet", description="Ethernet (RoCE v2) or InfiniBand on the compute NICs.")
    mtu: int = Field(9000, ge=1500, le=9216, description="Netdev MTU of the compute NICs (RoCE active_mtu 4096 at 9000).")
    gid_index: int = Field(3, ge=0, le=255, description="RoCE v2 GID index with the IPv4 address (show_gids).")
    doca_version: str = Field(
        repositories.DOCA_VERSION, pattern=r"^[0-9]+\.[0-9]+\.[0-9]+$",
        description="DOCA release of doca-ofed (stack doca-ofed): installed and checked at <docaVersion>-N.")
    doca_repository: Url | None = Field(
        None, description="DOCA apt repository (deb line URL). None: NVIDIA's for the DOCA release, "
                          "https://linux.mellanox.com/public/repo/doca/<docaVersion>/ubuntu24.04/x86_64/.")
    doca_keyring_url: Url | None = Field(
        repositories.DOCA_REPOSITORY.keyring_url,
        description="Signing key of the DOCA repository; None means the repository is trusted as is.")
    remove_on_destroy: bool = Field(True, description="Remove the RDMA packages glm-infra installed on destroy.")
    disable_acs: bool = Field(
        False, description="Turn PCIe ACS off on the switch ports between each GPU and its nearest compute NIC "
                           "(setpci), now and at every boot (glm-infra-acs.service): with it on, GPUDirect RDMA goes "
                           "up to the root complex or is refused, and the nic-affinity step fails naming the port. "
                           "Off: the step only checks. Taking it away leaves ACS off until the next boot.")

    @property
    def packages(self) -> list[str]:
        return [p.name for p in packages.rdma_packages(self.stack)]

    @property
    def doca_repository_url(self) -> str:
        return self.doca_repository or repositories.doca_repository_url(self.doca_version)

    @property
    def active_mtu(self) -> int:
        """The RDMA MTU the ports report for this netdev MTU (RoCE: 4096 for 9000)."""
        return max(m for m in (256, 512, 1024, 2048, 4096) if m <= self.mtu - 100) if self.link_layer == "Ethernet" else 4096


class NixlConfig(StrictModel):
    """NIXL's transport (UCX) settings on every serving host."""

    ucx_tls: str = Field("rc,cuda_copy,cuda_ipc", pattern=r"^[a-z0-9_,]+$", description="UCX_TLS for NIXL.")
    nic_per_rank: bool = Field(
        True, description="Each rank's KV traffic on the compute NIC nearest its GPU: vLLM's VLLM_GPU_NIC_PCIE_MAPPING, "
                          "read from each host's nvidia-smi topo -m by the nic-affinity step, instead of every "
                          "compute NIC for every rank (UCX_NET_DEVICES). Needs rdma.stack doca-ofed (ibdev2netdev).")
    max_nic_distance: Literal["PIX", "PXB", "PHB", "NODE", "SYS"] = Field(
        "PXB", description="How far (nvidia-smi topo -m) a GPU's nearest compute NIC may be: a GPU farther fails the "
                           "nic-affinity step and doctor. PXB: behind the same PCIe switch (HGX B300's ConnectX-8).")
