"""The stand-in packages against the registry of real names (glm_infra/spec/packages.py): each is built with
the real name, version scheme, virtual packages, relations (Depends at exact versions, Conflicts, Replaces) and
repository, and ships the units the real package ships and no other; the fabric manager's unit checks for
ib_umad before it starts and starts NVLSM through its start wrapper, as the real one."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from glm_infra.spec import packages, standins
from testbed import STANDINS
from testbed.hardware import DEBS

SIM_ONLY_UNITS = {"nvidia-sim-module.service"}  # loads the simulated kernel module at boot; no script names it


def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=120, **kw)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    missing = [t for t in ("dpkg-deb", "dpkg-scanpackages", "gpg") if not shutil.which(t)]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    base = tmp_path_factory.mktemp("registry-repo")
    r = run([STANDINS / "build-apt-repo", base / "apt"], env={**os.environ, "GLM_INFRA_CACHE": str(base / "cache")})
    assert r.returncode == 0, r.stderr
    return base / "apt"


def fields(deb: Path) -> dict[str, str]:
    out = run(["dpkg-deb", "-f", deb, "Package", "Version", "Provides", "Depends", "Conflicts", "Replaces"]).stdout
    return dict(line.split(": ", 1) for line in out.splitlines())


def units(deb: Path) -> set[str]:
    listing = run(["dpkg-deb", "--contents", deb]).stdout
    return set(re.findall(r"/lib/systemd/system/([\w@.-]+\.service)$", listing, re.M))


KERNEL = os.uname().release  # build-apt-repo builds the running kernel's stand-ins for the machine's kernel


def built(repo: Path, b: standins.StandinBuild) -> Path:
    return repo / b.repository / f"{b.package}_{b.version.split(':')[-1]}_all.deb"


def test_stand_ins_have_the_real_names_versions_relations_and_repository(repo):
    builds = standins.standin_builds(kernel=KERNEL)
    assert builds, "the registry lists stand-ins"
    for b in builds:
        deb = built(repo, b)
        assert deb.is_file(), deb
        f = fields(deb)
        assert (f["Package"], f["Version"], f.get("Provides", ""), f.get("Conflicts", "")) == \
            (b.package, b.version, b.provides, b.conflicts), deb.name
        # The registry's relations first; a stand-in adds its own (glm-sim-hardware; the earlier stand-ins' files).
        assert f.get("Depends", "").startswith(b.depends) and f.get("Replaces", "").startswith(b.replaces), deb.name
    # The schemes themselves, written out: NVIDIA's branch pin by branch, the rest by driver version; 590 and
    # later without the branch in the names and at -1ubuntu1; DOCA's own builds in the DOCA repository only.
    debs = {p.relative_to(repo).as_posix() for p in repo.rglob("*.deb")}
    for expected in ("nvidia-driver-pinning-580_580-5_all.deb", "nvidia-driver-pinning-580.159.04_580.159.04-1_all.deb",
                     "nvidia-driver-pinning-580.172.08_580.172.08-1_all.deb", "libnvidia-nscq_580.159.04-1_all.deb",
                     "nvidia-driver-580-open_580.159.04-1ubuntu1_all.deb", "nvidia-dkms-580-open_580.172.08-1ubuntu1_all.deb",
                     "nvidia-fabricmanager_580.172.08-1_all.deb", "nvidia-driver-open_595.71.05-1ubuntu1_all.deb",
                     "nvidia-fabricmanager_595.71.05-1ubuntu1_all.deb", "nvidia-driver-pinning-595.71.05_595.71.05-1ubuntu1_all.deb",
                     "infiniband-diags_50.0-2ubuntu0.2_all.deb", "doca/infiniband-diags_2507mlnx56-1_all.deb",
                     "doca/doca-ofed_3.1.0-091000_all.deb", "doca/doca-ofed_3.99.0-999000_all.deb",
                     f"linux-headers-{KERNEL}_1.0-1_all.deb", f"linux-modules-extra-{KERNEL}_1.0-1_all.deb",
                     "datacenter-gpu-manager-exporter_4.5.2.001-1_all.deb"):
        assert expected in debs, expected
    assert not [d for d in debs if re.match(r"(libnvidia-nscq|nvidia-fabricmanager|libnvsdm)-5[89][05]_", d)]
    assert not [d for d in debs if "mlnx" in d and not d.startswith("doca/")]
    assert fields(repo / "nvidia-fabricmanager_580.159.04-1_all.deb")["Provides"] == "nvidia-fabricmanager-580"
    assert "Provides" not in fields(repo / "nvidia-fabricmanager_595.71.05-1ubuntu1_all.deb")
    assert fields(repo / "datacenter-gpu-manager-4-cuda13_4.4.1-1_all.deb")["Depends"].startswith(
        "datacenter-gpu-manager-4-core (= 1:4.4.1-1)")
    # Only one pinning package at a time; the driver wants its family at exactly its version.
    for pin in ("nvidia-driver-pinning-580_580-5_all.deb", "nvidia-driver-pinning-580.159.04_580.159.04-1_all.deb"):
        f = fields(repo / pin)
        assert f["Provides"] == f["Conflicts"] == f["Replaces"] == "nvidia-driver-pinning", pin
    assert fields(repo / "nvidia-driver-580-open_580.159.04-1ubuntu1_all.deb")["Depends"].startswith(
        "nvidia-utils-580 (= 580.159.04-1ubuntu1), nvidia-compute-utils-580 (= 580.159.04-1ubuntu1), "
        "nvidia-dkms-580-open (= 580.159.04-1ubuntu1), nvidia-kernel-common-580 (= 580.159.04-1ubuntu1), "
        "libnvidia-compute-580 (= 580.159.04-1ubuntu1)")
    assert fields(repo / "infiniband-diags_50.0-2ubuntu0.2_all.deb")["Depends"].startswith(
        "libibnetdisc5t64 (= 50.0-2ubuntu0.2)")
    assert fields(repo / "doca/doca-ofed_3.1.0-091000_all.deb")["Depends"].startswith(
        "rdma-core (= 2507mlnx56-1), ibverbs-utils (= 2507mlnx56-1), infiniband-diags (= 2507mlnx56-1)")
    assert "datacenter-gpu-manager" not in fields(repo / "datacenter-gpu-manager-exporter_4.5.2.001-1_all.deb")["Depends"]


def test_the_pinning_packages_pin_the_driver_tree_to_their_release(repo, tmp_path):
    for deb, pin in (("nvidia-driver-pinning-580.159.04_580.159.04-1_all.deb", "Pin: version 580.159.04-*"),
                     ("nvidia-driver-pinning-580_580-5_all.deb", "Pin: version 580.*")):
        out = tmp_path / deb
        run(["dpkg-deb", "-x", repo / deb, out])
        (prefs,) = (out / "etc/apt/preferences.d").iterdir()
        assert prefs.suffix == ".pref"  # apt ignores a preferences file with another extension
        assert f"Package: *nvidia* libnvsdm*\n{pin}\nPin-Priority: 1000" in prefs.read_text()


def test_stand_ins_ship_only_the_units_the_real_packages_ship(repo):
    by_dir = {p.standin: p for p in packages.PACKAGES}
    for b in standins.standin_builds(kernel=KERNEL):
        shipped = units(built(repo, b))
        assert shipped - SIM_ONLY_UNITS == set(by_dir[b.dir].units), b.package
    every = {u for d in repo.rglob("*.deb") for u in units(d)}
    assert "nvlsm.service" not in every and "nvidia-dcgm.service" in every


def unit_lines(path: str) -> list[str]:
    return [l for l in (DEBS / path).read_text().splitlines() if l and not l.startswith("#")]


def test_the_dcgm_host_engine_unit_is_the_real_one():
    lines = unit_lines("datacenter-gpu-manager-4-core/lib/systemd/system/nvidia-dcgm.service")
    assert "ExecStart=/usr/bin/nv-hostengine -n --service-account nvidia-dcgm" in lines
    assert "Alias=dcgm.service" in lines and "WantedBy=multi-user.target" in lines


def test_the_fabric_manager_unit_checks_then_starts_nvlsm_through_the_wrapper():
    lines = unit_lines("nvidia-fabricmanager/lib/systemd/system/nvidia-fabricmanager.service")
    assert "ExecStartPre=/usr/bin/nvidia-fabricmanager-start.sh --mode precheck" in lines
    assert "ExecStart=/usr/bin/nvidia-fabricmanager-start.sh --mode start" in lines


WRAPPER = ["--mode", "start", "--fm-config-file", "/usr/share/nvidia/nvswitch/fabricmanager.cfg",
           "--nvlsm-config-file", "/usr/share/nvidia/nvlsm/nvlsm.conf",
           "--nvlsm-pid-file", "/var/run/nvidia-fabricmanager/nvlsm.pid"]


@pytest.fixture
def fm_root(tmp_path):
    """A GLM_SIM_ROOT with the fabric manager at the loaded driver's version, nvlsm installed and a PATH
    with ibstat."""
    root = tmp_path / "root"
    for rel in ("usr/bin/nv-fabricmanager", "usr/bin/nvidia-fabricmanager-start.sh"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(DEBS / "nvidia-fabricmanager" / rel, root / rel)
    (root / "opt/nvidia/nvlsm/sbin").mkdir(parents=True)
    shutil.copy(DEBS / "nvlsm/opt/nvidia/nvlsm/sbin/nvlsm", root / "opt/nvidia/nvlsm/sbin/nvlsm")
    for d in ("usr/share/glm-sim", "run/glm-sim"):
        (root / d).mkdir(parents=True)
    (root / "usr/share/glm-sim/fabricmanager-version").write_text("580.159.04\n")
    (root / "run/glm-sim/modules").mkdir()
    (root / "run/glm-sim/modules/ib_umad").touch()  # loaded
    (root / "run/glm-sim/loaded-driver-version").write_text("580.159.04\n")
    for f in (root / "usr/bin").iterdir():
        f.chmod(0o755)
    (root / "opt/nvidia/nvlsm/sbin/nvlsm").chmod(0o755)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "ibstat").write_text("#!/bin/sh\nexit 0\n")
    (bin_ / "ibstat").chmod(0o755)
    env = {"PATH": f"{bin_}:/usr/bin:/bin", "GLM_SIM_ROOT": str(root)}
    return root, env


def test_the_wrapper_starts_nvlsm_then_stays_up_as_the_fabric_manager(fm_root):
    root, env = fm_root
    p = subprocess.Popen(["sh", str(root / "usr/bin/nvidia-fabricmanager-start.sh"), *WRAPPER], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        pid_file = root / "var/run/nvidia-fabricmanager/nvlsm.pid"
        for _ in range(100):
            if pid_file.is_file() and pid_file.read_text().strip():
                break
            time.sleep(0.05)
        nvlsm = int(pid_file.read_text())
        os.kill(nvlsm, 0)  # NVLSM runs
        time.sleep(0.3)
        assert p.poll() is None  # and so does the fabric manager, in the wrapper's place
    finally:
        os.killpg(p.pid, signal.SIGKILL)  # the unit's cgroup: the fabric manager and NVLSM
        p.wait(timeout=10)
    for _ in range(100):
        try:
            os.kill(nvlsm, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("nvlsm outlived its process group")


def test_the_wrapper_fails_without_nvlsm_or_ibstat(fm_root, tmp_path):
    root, env = fm_root
    wrapper = root / "usr/bin/nvidia-fabricmanager-start.sh"
    r = run(["sh", wrapper, *WRAPPER], env={**env, "PATH": "/usr/bin:/bin"})
    assert r.returncode == 1 and "install the infiniband-diags package" in r.stderr
    (root / "opt/nvidia/nvlsm/sbin/nvlsm").unlink()
    r = run(["sh", wrapper, *WRAPPER], env=env)
    assert r.returncode == 1 and '"/opt/nvidia/nvlsm/sbin/nvlsm" does not exist' in r.stderr


def test_the_precheck_refuses_without_ib_umad_as_the_real_one(fm_root):
    root, env = fm_root
    wrapper = root / "usr/bin/nvidia-fabricmanager-start.sh"
    r = run(["sh", wrapper, "--mode", "precheck"], env=env)
    assert r.returncode == 0 and "Detected NVL5+ system" in r.stdout, r.stderr
    (root / "run/glm-sim/modules/ib_umad").unlink()
    for mode in (["--mode", "precheck"], WRAPPER):
        r = run(["sh", wrapper, *mode], env=env)
        assert r.returncode == 1
        assert 'Kernel module "ib_umad" has not been loaded, fabric manager cannot be started' in r.stderr
    assert not (root / "var/run/nvidia-fabricmanager/nvlsm.pid").exists()  # nothing started
