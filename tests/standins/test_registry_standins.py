"""The stand-in packages against the registry of real names (glm_infra/spec/packages.py): each is built with
the real name, version scheme, virtual packages and repository, and ships the units the real package
ships and no other; the fabric manager's unit starts NVLSM through its start wrapper, as the real one."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from glm_infra.spec import packages
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
    out = run(["dpkg-deb", "-f", deb, "Package", "Version", "Provides", "Depends"]).stdout
    return dict(line.split(": ", 1) for line in out.splitlines())


def units(deb: Path) -> set[str]:
    listing = run(["dpkg-deb", "--contents", deb]).stdout
    return set(re.findall(r"/lib/systemd/system/([\w@.-]+\.service)$", listing, re.M))


def test_stand_ins_have_the_real_names_versions_provides_and_repository(repo):
    builds = packages.standin_builds()
    assert builds, "the registry lists stand-ins"
    for _, name, version, provides, _, folder in builds:
        deb = repo / folder / f"{name}_{version.split(':')[-1]}_all.deb"
        assert deb.is_file(), deb
        f = fields(deb)
        assert (f["Package"], f["Version"], f.get("Provides", "")) == (name, version, provides), deb.name
    # The schemes themselves, written out: NVIDIA's branch pin by branch, the rest by driver version.
    debs = {p.relative_to(repo).as_posix() for p in repo.rglob("*.deb")}
    for expected in ("nvidia-driver-pinning-580_580-5_all.deb", "nvidia-driver-pinning-580.159.04_580.159.04-1_all.deb",
                     "nvidia-driver-pinning-580.172.08_580.172.08-1_all.deb", "libnvidia-nscq_580.159.04-1_all.deb",
                     "nvidia-driver-580-open_580.172.08-0ubuntu1_all.deb", "nvidia-fabricmanager_580.172.08-1_all.deb",
                     "doca/doca-ofed_3.1.0-091000_all.deb"):
        assert expected in debs, expected
    assert not [d for d in debs if re.match(r"(libnvidia-nscq|nvidia-fabricmanager|libnvsdm)-580_", d)]
    assert "doca-ofed_3.1.0-091000_all.deb" not in debs  # only NVIDIA's DOCA repository has it
    assert fields(repo / "nvidia-fabricmanager_580.159.04-1_all.deb")["Provides"] == "nvidia-fabricmanager-580"
    assert fields(repo / "datacenter-gpu-manager-4-cuda13_4.4.1-1_all.deb")["Depends"].startswith(
        "datacenter-gpu-manager-4-core (= 1:4.4.1-1)")


def test_stand_ins_ship_only_the_units_the_real_packages_ship(repo):
    by_dir = {p.standin: p for p in packages.PACKAGES}
    for standin, name, version, _, _, folder in packages.standin_builds():
        p = by_dir[standin]
        shipped = units(repo / folder / f"{name}_{version.split(':')[-1]}_all.deb")
        assert shipped - SIM_ONLY_UNITS == set(p.units), name
    every = {u for d in repo.rglob("*.deb") for u in units(d)}
    assert "nvlsm.service" not in every and "nvidia-dcgm.service" in every


def unit_lines(path: str) -> list[str]:
    return [l for l in (DEBS / path).read_text().splitlines() if l and not l.startswith("#")]


def test_the_dcgm_host_engine_unit_is_the_real_one():
    lines = unit_lines("datacenter-gpu-manager-4-core/lib/systemd/system/nvidia-dcgm.service")
    assert "ExecStart=/usr/bin/nv-hostengine -n --service-account nvidia-dcgm" in lines
    assert "Alias=dcgm.service" in lines and "WantedBy=multi-user.target" in lines


def test_the_fabric_manager_unit_starts_nvlsm_through_the_wrapper():
    exec_start = next(l for l in unit_lines("nvidia-fabricmanager/lib/systemd/system/nvidia-fabricmanager.service")
                      if l.startswith("ExecStart="))
    assert exec_start.startswith("ExecStart=/usr/bin/nvidia-fabricmanager-start.sh --mode start ")
    assert "--nvlsm-config-file /usr/share/nvidia/nvlsm/nvlsm.conf" in exec_start
    assert "--nvlsm-pid-file /var/run/nvidia-fabricmanager/nvlsm.pid" in exec_start


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
