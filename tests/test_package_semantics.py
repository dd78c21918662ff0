"""The driver and RDMA steps against the stand-in repository with this machine's real apt (tests/aptroot.py):
the stand-ins carry NVIDIA's relations (one pinning package: they conflict; the driver's family at its exact
version; DOCA's own builds of Ubuntu's rdma packages), and the repository a newer release of every driver
branch and a newer DOCA, so an install that does not follow NVIDIA's order, or pins too little or too late,
fails here as on a real host. f176da7's steps (tests/fixtures/f176da7) do; this checkout's install, upgrade
within a branch and move across the 590 rename. Needs root (unshare, mount), apt, dpkg and gpg."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from aptroot import AptRoot
from conftest import ROOT, stack_file
from stubs import DRIVER_SYSTEMCTL, in_root

from glm_infra.roles import drivers as drivers_role
from glm_infra.roles import rdma as rdma_role
from glm_infra.spec import packages
from glm_infra.spec.paths import HOSTCHECK
from glm_infra.stack import load_file
from testbed import STANDINS

PROD = load_file(stack_file("prod-b300")).config
HOST = "b300-1"
KERNEL = os.uname().release
F176DA7 = ROOT / "tests" / "fixtures" / "f176da7"
DIRS = ["/etc/modules-load.d", "/run/glm-infra", "/etc/systemd/system", "/etc/modprobe.d", "/etc/security/limits.d",
        "/var/lib/glm-infra", "/usr/local/libexec/glm-infra"]
FAMILY_580 = ["nvidia-utils-580", "nvidia-compute-utils-580", "nvidia-dkms-580-open", "nvidia-kernel-common-580",
              "libnvidia-compute-580"]
FAMILY_595 = ["nvidia-utils", "nvidia-compute-utils", "nvidia-dkms-open", "nvidia-kernel-common", "libnvidia-compute"]

# The host beyond apt. The driver's tool reads the installed module (nvidia-dkms*, else the driver package of
# an older stand-in) and the loaded one: a first install loads it at once, a later one at the reboot.
NVIDIA_SMI = r"""inst=$(dpkg-query -W -f='${db:Status-Status} ${Package} ${Version}\n' 2>/dev/null \
  | awk '$1 == "installed" && $2 ~ /^nvidia-(dkms|driver-[0-9]*-?open$)/ {v = $3; sub(/-[^-]*$/, "", v); print v; exit}')
loaded=$(cat "$STATE/loaded" 2>/dev/null || true)
if [ -z "$loaded" ] && [ -n "$inst" ]; then echo "$inst" > "$STATE/loaded"; loaded=$inst; fi
[ -n "$loaded" ] || { echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."; exit 9; }
[ "$loaded" = "$inst" ] || { echo "Failed to initialize NVML: Driver/library version mismatch"; exit 18; }
case "$*" in
  "-pm 1") touch "$STATE/persistence"; echo "All done." ;;
  *persistence_mode*) for i in 0 1 2 3 4 5 6 7; do if [ -e "$STATE/persistence" ]; then echo Enabled; else echo Disabled; fi; done ;;
  *) echo "$loaded" ;;
esac"""
# A stock noble kernel: ib_umad and mlx5_ib only with linux-modules-extra-<kernel> installed.
MODPROBE = r"""m=${!#}; m=${m//-/_}
dpkg-query -W -f='${db:Status-Status}' "linux-modules-extra-$(uname -r)" 2>/dev/null | grep -qx installed \
  || { echo "modprobe: FATAL: Module $m not found in directory /lib/modules/$(uname -r)" >&2; exit 1; }
mkdir -p "$STATE/modules"; touch "$STATE/modules/$m"
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    missing = [t for t in ("apt-get", "dpkg-deb", "dpkg-scanpackages", "gpg", "unshare") if not shutil.which(t)]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    if os.geteuid() != 0:
        pytest.fail("these tests need root (unshare --mount), as CI runs them", pytrace=False)
    base = tmp_path_factory.mktemp("semantics-repo")
    r = build_apt_repo(STANDINS / "build-apt-repo", base / "apt")
    assert r.returncode == 0, r.stderr
    return base / "apt"


def build_apt_repo(script: Path, out: Path) -> subprocess.CompletedProcess:
    """``script`` (a build-apt-repo) writing to ``out``, its signing key in a GNUPGHOME of its own under a short
    path: gpg-agent's socket lives there and a Unix socket's path holds at most 107 bytes, which pytest's
    folders exceed (gpg then fails with "can't connect to the agent")."""
    with tempfile.TemporaryDirectory(prefix="glm-apt-", dir="/tmp") as cache:
        return subprocess.run([str(script), str(out)], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "GLM_INFRA_CACHE": cache})


@pytest.fixture
def host(tmp_path, repo) -> AptRoot:
    h = AptRoot(tmp_path, repo)
    h.stubs.add("nvidia-smi", NVIDIA_SMI)
    h.stubs.add("systemctl", DRIVER_SYSTEMCTL)
    h.stubs.add("modprobe", MODPROBE)
    # The RDMA step's checks of the NICs, which the stand-ins' tools answer elsewhere (tests/standins).
    hostcheck = in_root(tmp_path, HOSTCHECK)
    hostcheck.parent.mkdir(parents=True, exist_ok=True)
    hostcheck.write_text("print('rdma: healthy (stubbed)')\n")
    return h


def on(repo: Path, version: str = "580.159.04"):
    """prod-b300 with the stand-in repository as NVIDIA's CUDA and DOCA repositories (model_copy: file:// URLs)."""
    d = PROD.drivers.model_copy(update={"version": version, "apt_repository": f"file://{repo}/",
                                        "apt_keyring_url": f"file://{repo}/glm-sim-archive.pub"})
    r = PROD.rdma.model_copy(update={"doca_repository": f"file://{repo}/doca/",
                                     "doca_keyring_url": f"file://{repo}/glm-sim-archive.pub"})
    return PROD.model_copy(update={"drivers": d, "rdma": r})


def f176da7(name: str, repo: Path) -> str:
    """f176da7's rendered step, its repository lines pointing at the stand-in repository."""
    text = (F176DA7 / name).read_text()
    for key, url in (("repo", f"file://{repo}/"), ("keyring_url", f"file://{repo}/glm-sim-archive.pub"),
                     ("doca_repo", f"file://{repo}/doca/"), ("doca_keyring_url", f"file://{repo}/glm-sim-archive.pub")):
        text = re.sub(rf"^{key}=.*$", f"{key}={url}", text, flags=re.M)
    return text


def pins(h: AptRoot) -> list[str]:
    return sorted(p for p in h.installed() if p.startswith("nvidia-driver-pinning"))


def dpkg_root(tmp: Path) -> tuple[Path, dict]:
    """An empty dpkg root whose packages' maintainer scripts run without chroot, on GLM_SIM_ROOT = that root."""
    root = tmp / "root"
    for d in ("var/lib/dpkg/info", "var/lib/dpkg/updates", "var/lib/dpkg/triggers", f"lib/modules/{KERNEL}/build", "bin"):
        (root / d).mkdir(parents=True)
    for f in ("var/lib/dpkg/status", "var/lib/dpkg/available"):
        (root / f).touch()
    (root / "bin/systemctl").write_text("#!/bin/sh\nexit 0\n")
    (root / "bin/systemctl").chmod(0o755)
    return root, {**os.environ, "GLM_SIM_ROOT": str(root), "PATH": f"{root / 'bin'}:{os.environ['PATH']}"}


def test_a_host_with_the_earlier_stand_ins_upgrades_to_these_in_one_run(repo, tmp_path):
    """Hosts f176da7 deployed (the upgrade test, a module after it in one cluster) carry the earlier stand-ins,
    whose driver package held nvidia-smi, the persistence daemon and the module: the family that holds them
    now takes them over in one dpkg run (Replaces), as apt upgrades the driver there."""
    if os.geteuid() != 0:
        pytest.fail("needs root", pytrace=False)
    old = tmp_path / "f176da7"
    old.mkdir()
    subprocess.run(f"git -C {ROOT} archive f176da7 testbed/standins glm_infra/spec | tar -x -C {old}", shell=True,
                   check=True)
    r = build_apt_repo(old / "testbed/standins/build-apt-repo", old / "apt")
    assert r.returncode == 0, r.stderr
    root, env = dpkg_root(tmp_path)

    def dpkg(*debs: Path) -> subprocess.CompletedProcess:
        return subprocess.run(["dpkg", f"--root={root}", "--force-script-chrootless", "--force-depends", "-i", *map(str, debs)],
                              capture_output=True, text=True, timeout=120, env=env)

    first = dpkg(old / "apt/glm-sim-hardware_1.2-1_all.deb", old / "apt/nvidia-driver-580-open_580.159.04-0ubuntu1_all.deb")
    assert first.returncode == 0, first.stderr
    new = [repo / "glm-sim-hardware_1.4-1_all.deb", *(repo / f"{p}_580.172.08-1ubuntu1_all.deb" for p in FAMILY_580),
           repo / "nvidia-driver-580-open_580.172.08-1ubuntu1_all.deb"]
    r = dpkg(*new)
    assert r.returncode == 0, r.stderr
    owners = subprocess.run(["dpkg", f"--root={root}", "-S", "/usr/bin/nvidia-smi",
                             "/lib/systemd/system/nvidia-persistenced.service", "/usr/share/glm-sim/driver-version"],
                            capture_output=True, text=True).stdout
    assert owners.split() == ["nvidia-utils-580:", "/usr/bin/nvidia-smi", "nvidia-compute-utils-580:",
                              "/lib/systemd/system/nvidia-persistenced.service", "nvidia-dkms-580-open:",
                              "/usr/share/glm-sim/driver-version"]
    assert (root / "usr/share/glm-sim/driver-version").read_text().strip() == "580.172.08"


def test_the_repository_serves_a_newer_release_than_the_stacks_pin(repo):
    index = (repo / "Packages").read_text() + (repo / "doca" / "Packages").read_text()
    for name, newer in (("nvidia-utils-580", "580.999.01-1ubuntu1"), ("nvidia-utils", "595.999.01-1ubuntu1"),
                        ("nvidia-fabricmanager", "580.999.01-1"), ("doca-ofed", "3.99.0-999000"),
                        ("infiniband-diags", "2599mlnx99-1")):
        assert f"Package: {name}\nVersion: {newer}\n" in index, name


def test_f176da7s_driver_step_fails_on_packages_with_nvidias_relations(host, repo):
    """Both pinning packages in one install (they conflict), in the same transaction as the driver (whose family
    apt then takes at the newest release): apt refuses."""
    r = host.run(f176da7("drivers.sh", repo), ["apply"], DIRS)
    assert r.returncode != 0
    assert "nvidia-driver-pinning-580 : Conflicts: nvidia-driver-pinning" in r.stderr, r.stderr
    assert re.search(r"Depends: nvidia-\S+-580\S* \(= 580\.159\.04-1ubuntu1\) but 580\.999\.01-1ubuntu1 is to be installed",
                     r.stderr), r.stderr
    assert not [p for p in host.installed() if p.startswith("nvidia-driver")]


def test_the_driver_installs_in_nvidias_order_and_stays(host, repo):
    r = host.run(drivers_role.drivers_script(on(repo), HOST), ["apply"], DIRS)
    assert r.returncode == 0, r.stderr
    got = host.installed()
    assert pins(host) == ["nvidia-driver-pinning-580.159.04"]
    for p in ("nvidia-driver-580-open", *FAMILY_580):
        assert got[p] == "580.159.04-1ubuntu1", p
    assert got["nvidia-fabricmanager"] == got["libnvidia-nscq"] == got["libnvsdm"] == "580.159.04-1"
    assert got["infiniband-diags"] == got["libibnetdisc5t64"] == packages.UBUNTU_RDMA_VERSION  # Ubuntu's, not DOCA's
    assert f"linux-headers-{KERNEL}" in got and f"linux-modules-extra-{KERNEL}" in got
    # The pinning package's own preferences, read by every apt run after it.
    assert in_root(host.tmp, "/etc/apt/preferences.d/nvidia-driver-pinning-580.159.04.pref").is_file()
    assert {"nvidia-driver-580-open", "nvidia-driver-pinning-580.159.04", "nvidia-fabricmanager", *FAMILY_580,
            "infiniband-diags"} <= host.held()
    assert (host.stubs.state / "active" / "nvidia-fabricmanager").exists()
    again = host.run(drivers_role.drivers_script(on(repo), HOST), ["apply"], DIRS)
    assert again.returncode == 0, again.stderr
    assert not again.called("apt-get install") and "packages already at 580.159.04" in again.stdout
    check = host.run(drivers_role.drivers_script(on(repo), HOST), ["check"], DIRS)
    assert check.returncode == 0, check.stderr


def test_an_upgrade_within_the_branch_takes_exactly_the_new_release(host, repo):
    assert host.run(drivers_role.drivers_script(on(repo), HOST), ["apply"], DIRS).returncode == 0
    r = host.run(drivers_role.drivers_script(on(repo, "580.172.08"), HOST), ["apply"], DIRS)
    assert r.returncode == 0, r.stderr
    got = host.installed()
    assert pins(host) == ["nvidia-driver-pinning-580.172.08"]
    for p in ("nvidia-driver-580-open", *FAMILY_580):
        assert got[p] == "580.172.08-1ubuntu1", p  # not 580.999.01, the repository's newest
    assert got["nvidia-fabricmanager"] == "580.172.08-1"
    assert "the loaded kernel module is not 580.172.08: reboot required" in r.stdout
    assert not in_root(host.tmp, "/etc/apt/preferences.d/nvidia-driver-pinning-580.159.04.pref").exists()


def test_the_driver_moves_across_the_590_rename(host, repo):
    """580 -> 595: NVIDIA's names lose the branch at 590. The 580 tree goes, the 595 one comes at exactly
    595.71.05 (the repository also has 595.999.01), one pinning package stays."""
    assert host.run(drivers_role.drivers_script(on(repo), HOST), ["apply"], DIRS).returncode == 0
    r = host.run(drivers_role.drivers_script(on(repo, "595.71.05"), HOST), ["apply"], DIRS)
    assert r.returncode == 0, r.stderr
    got = host.installed()
    assert not set(got) & {"nvidia-driver-580-open", *FAMILY_580}
    for p in ("nvidia-driver-open", *FAMILY_595, "nvidia-fabricmanager", "libnvidia-nscq", "libnvsdm"):
        assert got[p] == "595.71.05-1ubuntu1", p
    assert pins(host) == ["nvidia-driver-pinning-595.71.05"]
    assert "removing the driver tree of another branch first" in r.stdout
    assert in_root(host.tmp, "/run/glm-infra/reboot-required").exists()
    assert host.run(drivers_role.drivers_script(on(repo, "595.71.05"), HOST), ["check"], DIRS).returncode == 0


def test_f176da7s_rdma_step_fails_and_this_one_replaces_the_held_infiniband_diags(host, repo):
    """The driver step holds Ubuntu's infiniband-diags; DOCA brings its own build, and the repository also has a
    newer DOCA: f176da7's RDMA step (doca-ofed alone, held packages untouched) fails, this one installs DOCA's
    release with its exact dependencies and holds infiniband-diags again."""
    assert host.run(drivers_role.drivers_script(on(repo), HOST), ["apply"], DIRS).returncode == 0
    old = host.run(f176da7("rdma.sh", repo), ["apply"], DIRS)
    assert old.returncode != 0
    # The newer DOCA's builds are the candidates, and the held Ubuntu build stays where it is.
    assert "Depends: rdma-core (= 2507mlnx56-1) but 2599mlnx99-1 is to be installed" in old.stderr, old.stderr
    assert "Depends: infiniband-diags (= 2507mlnx56-1) but 50.0-2ubuntu0.2 is to be installed" in old.stderr, old.stderr
    assert "doca-ofed" not in host.installed()
    r = host.run(rdma_role.rdma_script(on(repo), HOST), ["apply"], DIRS)
    assert r.returncode == 0, r.stderr
    got = host.installed()
    assert got["doca-ofed"] == "3.1.0-091000"
    assert got["infiniband-diags"] == got["rdma-core"] == got["ibverbs-utils"] == "2507mlnx56-1"
    assert "infiniband-diags" in host.held()
    assert "DOCA 3.1.0 replaces the held infiniband-diags with its own build" in r.stdout
    assert host.run(rdma_role.rdma_script(on(repo), HOST), ["check"], DIRS).returncode == 0
    # The driver step, again: its tools are installed (DOCA's infiniband-diags), nothing to do.
    again = host.run(drivers_role.drivers_script(on(repo), HOST), ["apply"], DIRS)
    assert again.returncode == 0 and not again.called("apt-get install"), again.stderr
