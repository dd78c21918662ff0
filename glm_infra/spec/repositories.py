"""Where glm-infra's external names are documented, and the apt repositories their packages come from
(with their signing keys): the citations ``packages.py`` gives for every package, unit and rule.

Standard library only, as ``packages.py`` is: ``testbed/standins/build-apt-repo`` runs that file with a
plain python3, and it imports this one beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

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
GDC_PR_899 = "https://github.com/NVIDIA/gpu-driver-container/pull/899"
DRIVER_GUIDE_RECENT = "https://docs.nvidia.com/datacenter/tesla/driver-installation-guide/recent-updates.html"
NVIDIA_SMI_DOC = "https://docs.nvidia.com/deploy/nvidia-smi/index.html"
CANVOS_PR_700 = "https://github.com/spectrocloud/CanvOS/pull/700"
CUDA_REPO_4 = "https://github.com/NVIDIA/cuda-repo-management/issues/4"
DATAPROC_1342 = "https://github.com/GoogleCloudDataproc/initialization-actions/issues/1342"
DAVID_SHARE_3 = "https://github.com/david-xinyuwei/david-share/issues/3"
OPEN_GPU_537 = "https://github.com/NVIDIA/open-gpu-kernel-modules/issues/537"
DKMS_HEADERS = "dell/dkms@998e3b5e903d15715333d849979bbb20e93ecd36:run_test.sh"
HPCCM_DOCA = "NVIDIA/hpc-container-maker@01f9bb8c4e28e3b7e50ee08404c53a800a158fb1:hpccm/building_blocks/doca_ofed.py"
DCGM_EXPORTER_PACKAGING = "NVIDIA/dcgm-exporter@7ad58324b4447b64dc3dedf946b889b648b7f476"
APT_GET_MAN = "https://manpages.debian.org/bookworm/apt/apt-get.8.en.html"
# What issue 39 brought from NVIDIA's repository and a borrowed Ubuntu 24.04.3 GPU machine (captures, no URL).
ISSUE_39_PINNING = ("glm-infra issue 39 (a control-file capture of NVIDIA's Ubuntu 24.04 CUDA repository: the pinning "
                    "packages Provide, Conflict with and Replace nvidia-driver-pinning)")
ISSUE_39_VERSIONS = ("glm-infra issue 39 (NVIDIA's Ubuntu 24.04 CUDA repository: nvidia-driver-580-open "
                     "580.159.04-1ubuntu1)")
ISSUE_39_MODULES = "glm-infra issue 39 (a stock noble kernel: ib_umad and mlx5_ib in linux-modules-extra-$(uname -r))"
ISSUE_39_RDMA = ("glm-infra issue 39 (Ubuntu 24.04.3 with Ubuntu's rdma-core packages, libibverbs1 50.0-2ubuntu0.2; "
                 "DOCA's builds are versioned 2507mlnx56-1…)")
ISSUE_39_PERSISTENCED = ("glm-infra issue 39 (captures of Ubuntu's nvidia-persistenced.service: static, "
                         "StopWhenUnneeded=true, Type=forking, ExecStart=/usr/bin/nvidia-persistenced --user "
                         "nvidia-persistenced --no-persistence-mode --verbose)")


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
