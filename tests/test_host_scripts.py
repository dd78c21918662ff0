"""Host scripts against a stub PATH, in a private mount namespace whose system folders are bind
mounts of temporary ones: the scripts write their real paths, this machine stays untouched. Each
case checks the commands issued, that a second run changes nothing, and the failure messages.
Needs root (unshare, mount), as CI runs."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import STACKS, stack_file
from stubs import BOOT, DRIVER_SYSTEMCTL, StubPath, in_root, isolated, shellcheck_each

from glm_infra import hostplan, render
from glm_infra.plan.topology import plan
from glm_infra.roles import drivers as drivers_role
from glm_infra.roles import health_gate, rdma, runtime
from glm_infra.roles import router as router_role
from glm_infra.roles import vllm as vllm_role
from glm_infra.stack import load_file

PROD = load_file(stack_file("prod-b300")).config
HOST = "b300-1"

# System folders the scripts write, each replaced by a temporary folder of the test.
DRIVER_DIRS = ["/etc/apt/sources.list.d", "/etc/apt/preferences.d", "/etc/apt/apt.conf.d", "/usr/share/keyrings",
               "/etc/modules-load.d", "/run/glm-infra"]
RDMA_DIRS = ["/etc/modprobe.d", "/etc/modules-load.d", "/etc/security/limits.d", "/var/lib/glm-infra",
             "/usr/local/libexec/glm-infra", "/etc/apt/sources.list.d", "/usr/share/keyrings"]
RUNTIME_DIRS = ["/opt", "/var/lib/glm-infra"]


@pytest.mark.parametrize("stack", STACKS)
def test_every_rendered_host_script_is_shellcheck_clean(stack, tmp_path):
    cfg = load_file(stack_file(stack)).config
    every: dict[str, str] = {}
    for host, hs in hostplan.plan_all(cfg, plan(cfg), stack_name=stack).items():
        scripts = {path: f.content for path, f in hs.files().items() if path.endswith(".sh")}
        # And the scripts steps run from stdin (reboot, wait for the reboot, back on a new boot).
        scripts.update({f"step {k}": st.stdin for k, st in hs.steps.items()
                        if "bash -s" in (st.create, (st.update or "").rsplit(" ", 2)[0])})
        assert any(k.startswith("step ") for k in scripts) == bool(hs.host.instances)
        every.update({f"{host}:{path}": text for path, text in scripts.items()})
    found = shellcheck_each(every, tmp_path)
    assert not found, "\n".join(f"{where}\n{lines}" for where, lines in found.items())


@pytest.fixture(autouse=True)
def _needs_root():
    if os.geteuid() != 0:
        pytest.fail("host-script tests need root (unshare --mount), as CI runs them", pytrace=False)


# --- drivers.sh ----------------------------------------------------------------------------------

KERNEL = os.uname().release  # what uname -r says in the script
# NVIDIA's names and version schemes for branch 580 (glm_infra/spec/packages.py cites each): one pinning
# package, of the exact version; the driver and its family at <version>-1ubuntu1, the rest at <version>-1.
FAMILY = ["nvidia-utils-580", "nvidia-compute-utils-580", "nvidia-dkms-580-open", "nvidia-kernel-common-580",
          "libnvidia-compute-580"]
REPO_VERSIONS = {
    "nvidia-driver-pinning-580.159.04": "580.159.04-1", "nvidia-driver-580-open": "580.159.04-1ubuntu1",
    **{f: "580.159.04-1ubuntu1" for f in FAMILY},
    "libnvidia-nscq": "580.159.04-1", "nvidia-fabricmanager": "580.159.04-1", "libnvsdm": "580.159.04-1",
    "datacenter-gpu-manager-4-cuda13": "1:4.4.1-1", "nvlsm": "2025.06.5-1", "infiniband-diags": "50.0-2ubuntu0.2",
}
KERNEL_PACKAGES = {f"linux-headers-{KERNEL}": "1.0-1", f"linux-modules-extra-{KERNEL}": "1.0-1"}
DRIVER_DIRS = [*DRIVER_DIRS, "/etc/systemd/system"]

# dpkg-query -W PACKAGE: "installed VERSION"; without a package, every installed one ("installed NAME").
DPKG_QUERY = """case "${!#}" in -f*) for f in "$STATE"/installed/*; do [ -e "$f" ] && echo "installed ${f##*/}"; done; exit 0 ;; esac
v=$(cat "$STATE/installed/${!#}" 2>/dev/null) && echo "installed $v" || exit 1"""
APT_CACHE = """case "$1" in
  madison) p=${!#}; [ -e "$STATE/repo/$p" ] && echo " $p | $(cat "$STATE/repo/$p") | http://repo ./ Packages"; exit 0 ;;
  show) p=${2%%=*}; echo "Package: $p"; echo "Version: ${2#*=}"
        [ -e "$STATE/depends/$p" ] && echo "Depends: $(cat "$STATE/depends/$p")"; exit 0 ;;
esac"""
# apt refuses to change a held package it is given, as apt-get does without --allow-change-held-packages.
APT_GET = """for a; do [ "$a" = -s ] && exit 0; done
case "$1" in
  install) ;;
  remove) shift; for a; do case "$a" in -*) ;; *) rm -f "$STATE/installed/$a" ;; esac; done; exit 0 ;;
  *) exit 0 ;;
esac
for a in "$@"; do case "$a" in -*|install) ;; *) if [ -e "$STATE/held/${a%%=*}" ]; then
  echo "E: Held packages were changed and -y was used without --allow-change-held-packages." >&2; exit 100; fi ;; esac; done
for a in "$@"; do case "$a" in -*|install) ;; *=*) echo "${a#*=}" > "$STATE/installed/${a%%=*}" ;;
  *-) rm -f "$STATE/installed/${a%-}" ;; *) cat "$STATE/repo/$a" > "$STATE/installed/$a" ;; esac; done"""
APT_MARK = """case "$1" in showhold) ls "$STATE/held" ;; hold) shift; for p; do touch "$STATE/held/$p"; done ;;
  unhold) shift; for p; do rm -f "$STATE/held/$p"; done ;; esac"""
# The driver's tool: exit 9 without a loaded module, 18 when the loaded module is not the installed one.
NVIDIA_SMI = """[ -e "$STATE/unloaded" ] && { echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."; exit 9; }
[ -e "$STATE/mismatch" ] && { echo "Failed to initialize NVML: Driver/library version mismatch"; exit 18; }
case "$*" in
  "-pm 1") touch "$STATE/persistence"; echo "All done." ;;
  *persistence_mode*) for i in 0 1 2 3 4 5 6 7; do if [ -e "$STATE/persistence" ]; then echo Enabled; else echo Disabled; fi; done ;;
  *) cat "$STATE/loaded" 2>/dev/null || echo 580.159.04 ;;
esac"""
# With modules-need-extra, a stock noble kernel: ib_umad and mlx5_ib only with linux-modules-extra installed.
MODPROBE = """m=${!#}; m=${m//-/_}
if [ -e "$STATE/modules-need-extra" ] && [ ! -e "$STATE/installed/linux-modules-extra-$(uname -r)" ]; then
  echo "modprobe: FATAL: Module $m not found in directory /lib/modules/$(uname -r)" >&2; exit 1; fi
touch "$STATE/modules/$m"
"""


@pytest.fixture
def apt_stubs(tmp_path):
    s = StubPath(tmp_path / "stubs")
    for d in ("repo", "installed", "held", "enabled", "active", "modules", "depends"):
        (s.state / d).mkdir()
    for pkg, ver in {**REPO_VERSIONS, **KERNEL_PACKAGES}.items():
        (s.state / "repo" / pkg).write_text(ver)
    # The driver depends on its family at exactly its own version (apt-cache show's Depends).
    (s.state / "depends" / "nvidia-driver-580-open").write_text(
        ", ".join(f"{f} (= 580.159.04-1ubuntu1)" for f in FAMILY) + ", glm-sim-hardware")
    for name, body in (("dpkg-query", DPKG_QUERY), ("apt-cache", APT_CACHE), ("apt-get", APT_GET),
                       ("apt-mark", APT_MARK), ("nvidia-smi", NVIDIA_SMI), ("systemctl", DRIVER_SYSTEMCTL),
                       ("modprobe", MODPROBE)):
        s.add(name, body)
    s.add("curl", 'while [ $# -gt 1 ]; do [ "$1" = -o ] && { echo "PUBLIC KEY" > "$2"; exit 0; }; shift; done')
    # As gpg does: with a FILE and no --output it writes FILE.gpg, not stdout (an empty keyring otherwise).
    s.add("gpg", 'out=; prev=; for a; do [ "$prev" = --output ] && out=$a; prev=$a; f=$a; done; '
                 'if [ "$out" = - ]; then cat "$f"; else cat "$f" > "${out:-$f.gpg}"; fi')
    return s


def drivers(stack=PROD) -> str:
    return drivers_role.drivers_script(stack, HOST)


def installed(stubs: StubPath) -> dict[str, str]:
    return {p.name: p.read_text().strip() for p in (stubs.state / "installed").iterdir()}


def hold_all(stubs: StubPath, versions: dict[str, str]) -> None:
    for pkg, ver in versions.items():
        (stubs.state / "installed" / pkg).write_text(ver)
        (stubs.state / "held" / pkg).touch()


def test_drivers_install_the_pin_alone_first_then_the_family_pinned_then_hold_and_enable(apt_stubs, tmp_path):
    r = isolated(apt_stubs, drivers(), ["apply"], DRIVER_DIRS, tmp_path)
    assert r.returncode == 0, r.stderr
    installs = [[a for a in c.split()[2:] if not a.startswith("-")] for c in r.calls if c.startswith("apt-get install")]
    # NVIDIA's order: the pinning package alone (pinning packages conflict: one only, of the exact version) ...
    assert installs[0] == ["nvidia-driver-pinning-580.159.04=580.159.04-1"]
    assert not any(a.startswith("nvidia-driver-pinning-580=") for i in installs for a in i)
    # ... the headers DKMS builds the module against, then the driver with every exact sibling named at its version.
    assert installs[1] == [f"linux-headers-{KERNEL}"]
    for pkg in ("nvidia-driver-580-open=580.159.04-1ubuntu1", "nvidia-fabricmanager=580.159.04-1",
                "libnvidia-nscq=580.159.04-1", *(f"{f}=580.159.04-1ubuntu1" for f in FAMILY), "nvlsm"):
        assert pkg in installs[2], pkg
    assert not any("--allow-change-held-packages" in c for c in r.calls)
    assert sorted(p.name for p in (apt_stubs.state / "held").iterdir()) == sorted(REPO_VERSIONS)
    # NVLSM has no unit: the fabric manager's starts it. DCGM's host engine serves the exporter.
    enabled = {p.name for p in (apt_stubs.state / "enabled").iterdir()}
    assert enabled == {"nvidia-fabricmanager", "nvidia-dcgm"}, enabled
    # Ubuntu's nvidia-persistenced unit is static: wanted by multi-user.target, persistence mode on.
    assert in_root(tmp_path, "/etc/systemd/system/multi-user.target.wants/nvidia-persistenced.service").is_symlink()
    assert {p.name for p in (apt_stubs.state / "active").iterdir()} == {"nvidia-persistenced", "nvidia-fabricmanager",
                                                                       "nvidia-dcgm"}
    dropin = in_root(tmp_path, "/etc/systemd/system/nvidia-persistenced.service.d/glm-infra.conf").read_text()
    assert "ExecStart=\nExecStart=/usr/bin/nvidia-persistenced --user nvidia-persistenced --persistence-mode --verbose" \
        in dropin
    assert r.called("nvidia-smi -pm 1") and "persistence mode on" in r.stdout
    prefs = in_root(tmp_path, "/etc/apt/preferences.d/glm-infra-nvidia").read_text()
    for pkg in ("nvidia-fabricmanager", "nvidia-driver-pinning-580.159.04", *FAMILY):
        assert f"Package: {pkg}\nPin: version 580.159.04-*\nPin-Priority: 1001" in prefs, pkg
    sources = in_root(tmp_path, "/etc/apt/sources.list.d/glm-infra-nvidia.list").read_text()
    assert sources.startswith("deb [signed-by=/usr/share/keyrings/glm-infra-nvidia.gpg] https://developer.download.nvidia.com/")
    # The key the repository is signed with, dearmored into the keyring (not an empty file).
    assert in_root(tmp_path, "/usr/share/keyrings/glm-infra-nvidia.gpg").read_text() == "PUBLIC KEY\n"
    assert '"nvidia-fabricmanager";' in in_root(tmp_path, "/etc/apt/apt.conf.d/51glm-infra-nvidia-hold").read_text()
    assert in_root(tmp_path, "/etc/modules-load.d/glm-infra-nvlink.conf").read_text() == "ib_umad\nmlx5_ib\n"

    again = isolated(apt_stubs, drivers(), ["apply"], DRIVER_DIRS, tmp_path)
    assert again.returncode == 0, again.stderr
    assert not again.called("apt-get install") and not again.called("apt-mark hold")
    assert not again.called("apt-get update") and not again.called("systemctl enable") and not again.called("systemctl start")
    assert not again.called("nvidia-smi -pm")
    assert "wrote" not in again.stdout and "packages already at 580.159.04" in again.stdout
    check = isolated(apt_stubs, drivers(), ["check"], DRIVER_DIRS, tmp_path)
    assert check.returncode == 0 and f"{HOST}: drivers: packages at 580.159.04 and held" in check.stdout, check.stderr


def test_drivers_load_and_persist_ib_umad_before_the_fabric_manager_starts(apt_stubs, tmp_path):
    """The fabric manager's unit refuses without ib_umad (its precheck): on a stock kernel the module comes with
    linux-modules-extra, and it is loaded and written to modules-load.d before any unit starts."""
    (apt_stubs.state / "modules-need-extra").touch()
    r = isolated(apt_stubs, drivers(), ["apply"], DRIVER_DIRS, tmp_path)
    assert r.returncode == 0, r.stderr
    calls = r.calls
    extra = next(i for i, c in enumerate(calls) if c.startswith("apt-get install") and f"linux-modules-extra-{KERNEL}" in c)
    loaded = max(i for i, c in enumerate(calls) if c == "modprobe ib_umad")
    started = calls.index("systemctl start nvidia-fabricmanager")
    assert extra < loaded < started, calls
    assert in_root(tmp_path, "/etc/modules-load.d/glm-infra-nvlink.conf").read_text() == "ib_umad\nmlx5_ib\n"
    assert f"installing linux-modules-extra-{KERNEL} (ib_umad mlx5_ib)" in r.stdout
    # A kernel without the module and no package that has it: the step stops naming both, before the units.
    (apt_stubs.state / "repo" / f"linux-modules-extra-{KERNEL}").unlink()
    (apt_stubs.state / "installed" / f"linux-modules-extra-{KERNEL}").unlink()
    (apt_stubs.state / "active" / "nvidia-fabricmanager").unlink()
    r = isolated(apt_stubs, drivers(), ["apply"], DRIVER_DIRS, tmp_path)
    assert r.returncode == 1 and not r.called("systemctl start nvidia-fabricmanager")
    assert (f"{HOST}: drivers: cannot load ib_umad mlx5_ib (the fabric manager refuses to start without ib_umad) and "
            f"no repository has linux-modules-extra-{KERNEL}") in r.stderr


def test_drivers_new_version_replaces_the_old_versions_pinning_package_and_the_branch_pin(apt_stubs, tmp_path):
    hold_all(apt_stubs, REPO_VERSIONS)
    (apt_stubs.state / "installed" / "nvidia-driver-pinning-580.159.04").rename(
        apt_stubs.state / "installed" / "nvidia-driver-pinning-580.126.09")
    (apt_stubs.state / "installed" / "nvidia-driver-pinning-580").write_text("580-5")  # as f176da7 left it
    r = isolated(apt_stubs, drivers(), ["check"], DRIVER_DIRS, tmp_path)
    assert r.returncode == 1
    assert "nvidia-driver-pinning-580.126.09 is installed: pinning packages conflict" in r.stderr
    assert "nvidia-driver-pinning-580 is installed: pinning packages conflict" in r.stderr
    r = isolated(apt_stubs, drivers(), ["apply"], DRIVER_DIRS, tmp_path)
    assert r.returncode == 0, r.stderr
    (install,) = [c.split() for c in r.calls if c.startswith("apt-get install")]  # the pin alone: the tree is right
    assert "nvidia-driver-pinning-580.159.04=580.159.04-1" in install and "nvidia-driver-pinning-580.126.09-" in install
    assert "nvidia-driver-pinning-580-" in install
    assert sorted(p for p in installed(apt_stubs) if p.startswith("nvidia-driver-pinning")) == \
        ["nvidia-driver-pinning-580.159.04"]
    assert isolated(apt_stubs, drivers(), ["check"], DRIVER_DIRS, tmp_path).returncode == 0


def test_drivers_a_host_f176da7_left_is_right_without_reinstall_or_reboot(apt_stubs, tmp_path):
    """A host f176da7's driver step installed on the simulated cluster's earlier stand-ins: both pinning
    packages, the driver at -0ubuntu1 with no family, everything held, the module loaded. Only the branch pin
    goes; nothing is reinstalled and no reboot is asked for."""
    old = {p: v for p, v in REPO_VERSIONS.items() if p not in FAMILY}
    hold_all(apt_stubs, {**old, "nvidia-driver-pinning-580": "580-5", "nvidia-driver-580-open": "580.159.04-0ubuntu1",
                         "infiniband-diags": "2507mlnx56-1"})
    r = isolated(apt_stubs, drivers(), ["apply"], DRIVER_DIRS, tmp_path)
    assert r.returncode == 0, r.stderr
    assert [c for c in r.calls if c.startswith("apt-get install")] == [
        "apt-get install -y -q --allow-downgrades nvidia-driver-pinning-580.159.04=580.159.04-1 nvidia-driver-pinning-580- "
        "-oDPkg::Lock::Timeout=600"]
    assert installed(apt_stubs)["nvidia-driver-580-open"] == "580.159.04-0ubuntu1"
    assert not in_root(tmp_path, "/run/glm-infra/reboot-required").exists() and "reboot" not in r.stdout


def test_drivers_move_to_another_branch_removes_the_old_tree_first(apt_stubs, tmp_path):
    """580 -> 595 (NVIDIA renamed the tree at 590): the old names go in an apt run of their own, after a simulated
    run of the whole change, then the new names at exactly the new version."""
    hold_all(apt_stubs, REPO_VERSIONS)
    new = ["nvidia-utils", "nvidia-compute-utils", "nvidia-dkms-open", "nvidia-kernel-common", "libnvidia-compute"]
    for pkg in ("nvidia-driver-pinning-595.71.05", "libnvidia-nscq", "nvidia-fabricmanager", "libnvsdm",
                "nvidia-driver-open", *new):
        (apt_stubs.state / "repo" / pkg).write_text("595.71.05-1ubuntu1")
    (apt_stubs.state / "depends" / "nvidia-driver-open").write_text(", ".join(f"{f} (= 595.71.05-1ubuntu1)" for f in new))
    (apt_stubs.state / "mismatch").touch()  # the 580 module stays loaded until the reboot
    stack = PROD.model_copy(update={"drivers": PROD.drivers.model_copy(update={"version": "595.71.05"})})
    r = isolated(apt_stubs, drivers(stack), ["apply"], DRIVER_DIRS, tmp_path)
    assert r.returncode == 0, r.stderr
    acts = [c for c in r.calls if c.startswith(("apt-get install", "apt-get remove", "apt-get -s"))]
    assert acts[0].startswith("apt-get install -y -q --allow-downgrades nvidia-driver-pinning-595.71.05=595.71.05-1ubuntu1 "
                              "nvidia-driver-pinning-580.159.04-")
    simulated, removed, tree = acts[-3:]
    assert simulated.startswith("apt-get -s install") and "nvidia-driver-580-open-" in simulated
    assert removed.startswith("apt-get remove") and set(removed.split()) >= {"nvidia-driver-580-open", *FAMILY}
    assert "nvidia-driver-open=595.71.05-1ubuntu1" in tree and "nvidia-dkms-open=595.71.05-1ubuntu1" in tree
    now = installed(apt_stubs)
    assert not set(now) & {"nvidia-driver-580-open", *FAMILY, "nvidia-driver-pinning-580.159.04"}
    assert now["nvidia-fabricmanager"] == "595.71.05-1ubuntu1"
    assert in_root(tmp_path, "/run/glm-infra/reboot-required").exists()
    # The services start with the new module after the reboot, not now.
    assert not r.called("systemctl start") and not r.called("nvidia-smi -pm")


def test_drivers_enable_dcgms_host_engine_only_for_the_gate_or_the_exporter(apt_stubs, tmp_path):
    quiet = PROD.model_copy(update={"monitoring": PROD.monitoring.model_copy(update={"enabled": False})})
    assert PROD.drivers.dcgm_diag_level == 0
    r = isolated(apt_stubs, drivers(quiet), ["apply"], DRIVER_DIRS, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "nvidia-dcgm" not in {p.name for p in (apt_stubs.state / "enabled").iterdir()}
    gate = quiet.model_copy(update={"drivers": quiet.drivers.model_copy(update={"dcgm_diag_level": 2})})
    r = isolated(apt_stubs, drivers(gate), ["apply"], DRIVER_DIRS, tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.called("systemctl enable --quiet nvidia-dcgm") and r.called("systemctl start nvidia-dcgm")


def test_drivers_version_missing_from_the_repository(apt_stubs, tmp_path):
    (apt_stubs.state / "repo" / "nvidia-fabricmanager").write_text("580.172.08-1")
    r = isolated(apt_stubs, drivers(), ["apply"], DRIVER_DIRS, tmp_path)
    assert r.returncode == 1
    assert f"{HOST}: drivers: nvidia-fabricmanager 580.159.04 is not in https://developer.download.nvidia.com" in r.stderr
    assert not any(c.startswith("apt-get install") and "nvidia-fabricmanager" in c for c in r.calls)


def test_drivers_stop_before_anything_when_another_source_lists_the_repository(apt_stubs, tmp_path):
    """cuda-keyring's list for the same repository, with its own keyring: apt refuses the two Signed-By values."""
    other = in_root(tmp_path, "/etc/apt/sources.list.d/cuda-ubuntu2404-x86_64.list")
    other.parent.mkdir(parents=True, exist_ok=True)
    other.write_text("deb [signed-by=/usr/share/keyrings/cuda-archive-keyring.gpg] "
                     "https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2404/x86_64/ /\n")
    r = isolated(apt_stubs, drivers(), ["apply"], DRIVER_DIRS, tmp_path)
    assert r.returncode == 1 and not r.called("apt-get") and not r.called("curl")
    assert (f"{HOST}: drivers: the repository https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2404/x86_64/ "
            "is already configured in /etc/apt/sources.list.d/cuda-ubuntu2404-x86_64.list: apt refuses one repository "
            "listed twice with different Signed-By keyrings") in r.stderr
    assert not in_root(tmp_path, "/etc/apt/sources.list.d/glm-infra-nvidia.list").exists()
    other.write_text("# deb https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2404/x86_64/ /\n"
                     "deb https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2204/x86_64/ /\n")
    assert isolated(apt_stubs, drivers(), ["apply"], DRIVER_DIRS, tmp_path).returncode == 0  # commented, another URL


def test_drivers_changed_module_asks_for_a_reboot(apt_stubs, tmp_path):
    (apt_stubs.state / "mismatch").touch()  # new userspace, old kernel module
    r = isolated(apt_stubs, drivers(), ["apply"], DRIVER_DIRS, tmp_path)
    assert r.returncode == 0, r.stderr
    assert in_root(tmp_path, "/run/glm-infra/reboot-required").exists()
    assert "the loaded kernel module is not 580.159.04: reboot required" in r.stdout
    # Services start with the new module after the reboot: enabled, not started now.
    assert r.called("systemctl enable --quiet nvidia-fabricmanager")
    assert not r.called("systemctl start")


def test_drivers_no_module_loaded_after_the_install_asks_for_a_reboot_and_later_stops(apt_stubs, tmp_path):
    """nvidia-smi exits 9 when no NVIDIA module is loaded: right after a first install (the module loads at the
    boot), a reboot; on a host whose packages were already right and with no reboot pending, the module does
    not load, and the step says so."""
    (apt_stubs.state / "unloaded").touch()
    r = isolated(apt_stubs, drivers(), ["apply"], DRIVER_DIRS, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "no NVIDIA kernel module is loaded yet (nvidia-smi exit 9): 580.159.04 loads at the reboot" in r.stdout
    marker = in_root(tmp_path, "/run/glm-infra/reboot-required")
    assert marker.exists() and not r.called("systemctl start")
    assert isolated(apt_stubs, drivers(), ["apply"], DRIVER_DIRS, tmp_path).returncode == 0  # still pending: no reinstall
    marker.unlink()  # the boot came, and still no module
    r = isolated(apt_stubs, drivers(), ["apply"], DRIVER_DIRS, tmp_path)
    assert r.returncode == 1 and not r.called("apt-get install")
    assert (f"{HOST}: drivers: nvidia-smi finds no NVIDIA kernel module (exit 9) although the packages were already at "
            "580.159.04 and no reboot is pending: the module does not load") in r.stderr


def test_drivers_verify_mode_changes_nothing_and_names_the_mismatch(apt_stubs, tmp_path):
    stack = PROD.model_copy(update={"drivers": PROD.drivers.model_copy(update={"mode": "verify"})})
    for pkg, ver in REPO_VERSIONS.items():
        (apt_stubs.state / "installed" / pkg).write_text(ver)
    (apt_stubs.state / "installed" / "nvidia-driver-580-open").write_text("580.126.09-1ubuntu1")
    r = isolated(apt_stubs, drivers(stack), ["apply"], DRIVER_DIRS, tmp_path)
    assert r.returncode == 1
    assert "mode verify: nvidia-driver-580-open is 580.126.09-1ubuntu1, stack pins 580.159.04" in r.stderr
    assert not any(c.startswith(("apt-get", "apt-mark hold", "systemctl enable", "systemctl start")) for c in r.calls)
    assert not any(any(in_root(tmp_path, d).iterdir()) for d in DRIVER_DIRS[:5])


def test_drivers_remove_keeps_the_held_driver_by_default(apt_stubs, tmp_path):
    r = isolated(apt_stubs, drivers(), ["remove"], DRIVER_DIRS, tmp_path)
    assert r.returncode == 0
    assert "kept the driver 580.159.04" in r.stdout and not r.called("apt-get purge")
    stack = PROD.model_copy(update={"drivers": PROD.drivers.model_copy(update={"remove_on_destroy": True})})
    r = isolated(apt_stubs, drivers(stack), ["remove"], DRIVER_DIRS, tmp_path)
    assert r.called("apt-get purge") and r.called("apt-mark unhold")


# --- the reboot, the wait for it, the check after it --------------------------------------------

REBOOT_DIRS = ["/run/glm-infra", "/var/lib/glm-infra"]


@pytest.fixture
def boot_stubs(tmp_path):
    s = StubPath(tmp_path / "stubs")
    s.add("systemd-run")
    s.add("systemctl", 'case "$1" in list-jobs) cat "$STATE/jobs" 2>/dev/null ;;\n'
                       '  status) echo "glm-infra-reboot.timer - /usr/bin/systemctl reboot"; echo "  Active: inactive (dead)" ;; esac')
    return s


def test_reboot_schedules_a_named_reboot_only_when_the_driver_asked(boot_stubs, tmp_path):
    r = isolated(boot_stubs, drivers_role.reboot_script(HOST), [], REBOOT_DIRS, tmp_path)
    assert (r.returncode, r.stdout.strip(), r.calls) == (0, "no-reboot", []), r.stderr
    in_root(tmp_path, "/run/glm-infra/reboot-required").touch()
    r = isolated(boot_stubs, drivers_role.reboot_script(HOST), [], REBOOT_DIRS, tmp_path)
    assert (r.returncode, r.stdout.strip()) == (0, f"reboot {BOOT}"), r.stderr
    assert in_root(tmp_path, "/var/lib/glm-infra/boot-before-reboot").read_text().strip() == BOOT
    # A timer left from an earlier try goes first; the new one has the name the check after the boot reads.
    assert r.calls[0] == "systemctl stop glm-infra-reboot.timer"
    assert r.calls[-1] == ("systemd-run --quiet --unit=glm-infra-reboot --on-active=3 "
                           "--timer-property=AccuracySec=100ms systemctl reboot")


def test_back_fails_on_the_same_boot_and_says_why(boot_stubs, tmp_path):
    marker = in_root(tmp_path, "/var/lib/glm-infra/boot-before-reboot")
    marker.parent.mkdir(parents=True)
    marker.write_text(BOOT + "\n")
    r = isolated(boot_stubs, drivers_role.back_script(HOST), [], REBOOT_DIRS, tmp_path)
    assert r.returncode == 1 and f"{HOST}: host did not reboot (boot {BOOT})" in r.stderr
    assert "glm-infra-reboot.timer" in r.stderr and "inactive (dead)" in r.stderr  # what became of the timer
    (boot_stubs.state / "jobs").write_text("1 reboot.target start waiting\n")
    r = isolated(boot_stubs, drivers_role.back_script(HOST), [], REBOOT_DIRS, tmp_path)
    assert r.returncode == 1 and "a reboot is under way" in r.stderr and "inactive" not in r.stderr
    assert marker.exists()  # kept: a later try still knows the boot to leave
    marker.write_text("0f0f0f0f-0000-4000-8000-000000000000\n")
    r = isolated(boot_stubs, drivers_role.back_script(HOST), [], REBOOT_DIRS, tmp_path)
    assert (r.returncode, r.stdout.strip()) == (0, f"rebooted: boot {BOOT}") and not marker.exists()
    r = isolated(boot_stubs, drivers_role.back_script(HOST), [], REBOOT_DIRS, tmp_path)
    assert (r.returncode, r.stdout.strip()) == (0, "no reboot")


class FakeSshd:
    """A TCP listener on loopback standing in for a host's sshd: up, down (closed), up again."""

    def __init__(self) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.sock: socket.socket | None = None

    def up(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", self.port))
        self.sock.listen(16)

    def down(self) -> None:
        if self.sock:
            self.sock.close()
            self.sock = None


def run_wait(port: int, status: str, tmp: Path, down_timeout_s: int = 30, timeout_s: int = 60) -> subprocess.Popen:
    # The stack's bounds are minutes; the same template with seconds, to watch each way out.
    script = render.render_template("waitboot.sh.j2", host=HOST, address="127.0.0.1", port=port,
                                    down_timeout_s=down_timeout_s, timeout_s=timeout_s)
    (tmp / "wait.sh").write_text(script)
    return subprocess.Popen(["bash", str(tmp / "wait.sh")], env={"PATH": "/usr/bin:/bin", "REBOOT_STATUS": status},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_wait_sees_the_host_go_down_and_come_back(tmp_path):
    sshd = FakeSshd()
    sshd.up()
    try:
        p = run_wait(sshd.port, "reboot 1234", tmp_path)
        time.sleep(1.5)
        sshd.down()
        time.sleep(2)
        sshd.up()
        out, err = p.communicate(timeout=30)
    finally:
        sshd.down()
    assert p.returncode == 0, err
    assert f"{HOST}: down after" in out and f"{HOST}: SSH back after" in out


def test_wait_leaves_a_host_never_seen_down_to_the_boot_check(tmp_path):
    sshd = FakeSshd()
    sshd.up()
    try:  # rebooted before the wait began, or still draining: the boot check after it tells
        p = run_wait(sshd.port, "reboot 1234", tmp_path, down_timeout_s=2)
        out, err = p.communicate(timeout=30)
    finally:
        sshd.down()
    assert p.returncode == 0, err
    assert f"{HOST}: SSH never went down in 2s after the reboot was scheduled; the boot check decides" in out


def test_wait_fails_for_a_host_that_does_not_come_back(tmp_path):
    sshd = FakeSshd()  # never listening: down from the start, and it stays down
    p = run_wait(sshd.port, "reboot 1234", tmp_path, timeout_s=3)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 1 and f"{HOST}: not back after 3s" in err
    out, _ = run_wait(sshd.port, "no-reboot", tmp_path).communicate(timeout=10)
    assert out.strip() == f"{HOST}: no reboot needed"


# --- service.sh: a rollout restarts only when its triggers changed -------------------------------


@pytest.fixture
def unit_stubs(tmp_path):
    s = StubPath(tmp_path / "stubs")
    s.add("systemctl", 'case "$1" in is-active) [ -e "$STATE/active" ] ;; start|restart) touch "$STATE/active" ;;\n'
                       '  show) echo 0 ;; *) exit 0 ;; esac')
    s.add("curl", '[ -e "$STATE/active" ]')
    return s


def test_a_rollout_restarts_only_when_its_triggers_changed(unit_stubs, tmp_path):
    inst = plan(PROD).instances[0]
    script = vllm_role.vllm_service_script(PROD, inst)
    marker = in_root(tmp_path, f"/var/lib/glm-infra/rollout/{inst.unit}")
    run = lambda *args: isolated(unit_stubs, script, list(args), ["/var/lib/glm-infra"], tmp_path)  # noqa: E731
    assert run("start").returncode == 0
    r = run("record", "0123456789abcdef")  # created: the service step started it with these triggers
    assert r.returncode == 0 and marker.read_text().strip() == "0123456789abcdef"
    r = run("rollout", "0123456789abcdef")  # re-run for another reason (a new SSH key): nothing restarts
    assert r.returncode == 0 and not r.called("systemctl restart") and "not restarted" in r.stdout
    r = run("rollout", "fedcba9876543210")  # a trigger changed: restart, then note the new triggers
    assert r.returncode == 0 and f"systemctl restart {inst.unit}" in r.calls
    assert marker.read_text().strip() == "fedcba9876543210"
    (unit_stubs.state / "active").unlink()  # stopped behind glm-infra's back: the same triggers start it
    r = run("rollout", "fedcba9876543210")
    assert r.returncode == 0 and f"systemctl start {inst.unit}" in r.calls
    r = run("rollout", "not-a-digest")
    assert r.returncode == 2 and "16 hex digits" in r.stderr and marker.read_text().strip() == "fedcba9876543210"
    assert run("remove").returncode == 0 and not marker.exists() and not marker.parent.exists()


# --- rdma.sh -------------------------------------------------------------------------------------

DEVINFO_PORT = """hca_id:\t{dev}
\ttransport:\t\t\tInfiniBand (0)
\tphys_port_cnt:\t\t\t1
\t\tport:\t1
\t\t\tstate:\t\t\t{state} (4)
\t\t\tmax_mtu:\t\t4096 (5)
\t\t\tactive_mtu:\t\t4096 (5)
\t\t\tlink_layer:\t\tEthernet
"""


RDMA_APT_CACHE = """case "$1" in
  madison) [ "${!#}" = doca-ofed ] && echo " doca-ofed | 3.1.0-091000 | https://linux.mellanox.com ./ Packages"
           case "${!#}" in linux-headers-*) echo " ${!#} | 1.0-1 | http://archive.ubuntu.com ./ Packages" ;; esac ;;
  show) echo "Package: ${2%%=*}"; [ -e "$STATE/doca-depends" ] && echo "Depends: $(cat "$STATE/doca-depends")" ;;
esac
exit 0"""
RDMA_APT_MARK = """case "$1" in
  showhold) cat "$STATE/held" 2>/dev/null ;;
  unhold) shift; for p; do sed -i "/^$p\\$/d" "$STATE/held"; done ;;
  hold) shift; printf '%s\\n' "$@" >> "$STATE/held" ;;
esac"""


@pytest.fixture
def rdma_stubs(tmp_path):
    s = StubPath(tmp_path / "stubs")
    (s.state / "installed").mkdir()
    s.add("dpkg-query", 'v=$(cat "$STATE/installed/${!#}" 2>/dev/null) && echo "installed $v" || exit 1')
    s.add("apt-get", '[ "$1" = install ] && for a; do case "$a" in -*|install) ;; *=*) echo "${a#*=}" > "$STATE/installed/${a%%=*}" ;; '
                     '*) echo 50.0-2 > "$STATE/installed/$a" ;; esac; done; exit 0')
    # NVIDIA's DOCA repository (doca-ofed at the DOCA release's build, depending on DOCA's own builds of Ubuntu's
    # packages at exact versions: $STATE/doca-depends), its key; the running kernel's headers.
    s.add("apt-cache", RDMA_APT_CACHE)
    s.add("apt-mark", RDMA_APT_MARK)
    s.add("curl", 'while [ $# -gt 1 ]; do [ "$1" = -o ] && { echo "PUBLIC KEY" > "$2"; exit 0; }; shift; done')
    s.add("gpg", 'out=; prev=; for a; do [ "$prev" = --output ] && out=$a; prev=$a; f=$a; done; '
                 'if [ "$out" = - ]; then cat "$f"; else cat "$f" > "${out:-$f.gpg}"; fi')  # as gpg_stub above
    devinfo = "".join(DEVINFO_PORT.format(dev=f"mlx5_{i}", state="PORT_ACTIVE") for i in range(8))
    (s.state / "devinfo").write_text(devinfo)
    s.add("ibv_devinfo", 'cat "$STATE/devinfo"')
    gids = "".join(f"mlx5_{i}\t1\t3\t0000:0000:0000:0000:0000:ffff:0a64:000b\t10.100.0.11  \tv2\tens{i}np0\n" for i in range(8))
    (s.state / "gids").write_text("DEV\tPORT\tINDEX\tGID\t\t\t\t\tIPv4  \t\tVER\tDEV\n" + gids)
    s.add("show_gids", 'cat "$STATE/gids"')
    s.add("ibdev2netdev", 'for i in 0 1 2 3 4 5 6 7; do echo "mlx5_$i port 1 ==> ens${i}np0 (Up)"; done')
    s.add("modprobe", "exit 1")
    s.add("systemd-detect-virt", "exit 0")
    return s


def rdma_script() -> str:
    return rdma.rdma_script(PROD, HOST)


def test_rdma_installs_configures_and_checks(rdma_stubs, tmp_path):
    hostcheck = in_root(tmp_path, render.HOSTCHECK)
    hostcheck.parent.mkdir(parents=True, exist_ok=True)
    hostcheck.write_text(render.hostcheck_source())
    r = isolated(rdma_stubs, rdma_script(), ["apply"], RDMA_DIRS, tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.called("apt-get install -y -q --allow-downgrades doca-ofed=3.1.0-091000")
    assert in_root(tmp_path, "/etc/apt/sources.list.d/glm-infra-doca.list").read_text() == (
        "deb [signed-by=/usr/share/keyrings/glm-infra-doca.gpg] "
        "https://linux.mellanox.com/public/repo/doca/3.1.0/ubuntu24.04/x86_64/ ./\n")
    assert in_root(tmp_path, "/usr/share/keyrings/glm-infra-doca.gpg").read_text() == "PUBLIC KEY\n"
    assert r.called("curl -fsSL --retry 3 -o") and "https://linux.mellanox.com/public/repo/doca/GPG-KEY-Mellanox.pub" in \
        next(c for c in r.calls if c.startswith("curl"))
    assert "blacklist nvidia-peermem" in in_root(tmp_path, "/etc/modprobe.d/glm-infra-gpudirect.conf").read_text()
    assert "memlock    unlimited" in in_root(tmp_path, "/etc/security/limits.d/90-glm-infra-memlock.conf").read_text()
    assert (f"{HOST}: healthy (RDMA mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7: 8 ports PORT_ACTIVE Ethernet "
            "active_mtu 4096, GID 3 RoCE v2 IPv4 on 8 NICs)") in r.stdout
    again = isolated(rdma_stubs, rdma_script(), ["apply"], RDMA_DIRS, tmp_path)
    assert again.returncode == 0 and not again.called("apt-get") and "wrote" not in again.stdout


def test_rdma_lets_doca_replace_only_its_own_held_packages(rdma_stubs, tmp_path):
    """DOCA brings its own builds of Ubuntu's rdma packages, at exact versions: a held one of those (the driver
    step holds infiniband-diags) is unheld for the install and held again; any other held package stops the step."""
    hostcheck = in_root(tmp_path, render.HOSTCHECK)
    hostcheck.parent.mkdir(parents=True, exist_ok=True)
    hostcheck.write_text(render.hostcheck_source())
    (rdma_stubs.state / "doca-depends").write_text("infiniband-diags (= 2507mlnx56-1), libfoo (>= 1), glm-sim-rdma-tools")
    (rdma_stubs.state / "held").write_text("infiniband-diags\nnvidia-fabricmanager\n")
    r = isolated(rdma_stubs, rdma_script(), ["apply"], RDMA_DIRS, tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.called("apt-get install -y -q --allow-downgrades doca-ofed=3.1.0-091000 infiniband-diags=2507mlnx56-1")
    assert (rdma_stubs.state / "installed" / "infiniband-diags").read_text().strip() == "2507mlnx56-1"
    assert sorted((rdma_stubs.state / "held").read_text().split()) == ["infiniband-diags", "nvidia-fabricmanager"]
    assert f"{HOST}: rdma: DOCA 3.1.0 replaces the held infiniband-diags with its own build" in r.stdout
    (rdma_stubs.state / "installed" / "doca-ofed").unlink()
    (rdma_stubs.state / "doca-depends").write_text("nvidia-fabricmanager (= 580.1-1)")
    r = isolated(rdma_stubs, rdma_script(), ["apply"], RDMA_DIRS, tmp_path)
    assert r.returncode == 1 and not r.called("apt-get install")
    assert f"{HOST}: rdma: nvidia-fabricmanager is held at" in r.stderr and "DOCA 3.1.0 needs 580.1-1" in r.stderr


def test_rdma_names_why_nvidia_peermem_may_not_load_after_doca(rdma_stubs, tmp_path):
    stack = PROD.model_copy(update={"rdma": PROD.rdma.model_copy(update={"gpudirect": "peermem"})})
    (rdma_stubs.state / "installed" / "doca-ofed").write_text("3.1.0-091000")
    rdma_stubs.add("systemd-detect-virt", "exit 1")  # not a container: the host's own kernel
    r = isolated(rdma_stubs, rdma.rdma_script(stack, HOST), ["apply"], RDMA_DIRS, tmp_path)
    assert r.returncode == 1
    assert f"{HOST}: rdma: cannot load nvidia-peermem" in r.stderr and "rebuild them (dkms autoinstall) and reboot" in r.stderr


def test_rdma_check_names_a_doca_ofed_of_another_doca_release(rdma_stubs, tmp_path):
    (rdma_stubs.state / "installed" / "doca-ofed").write_text("2.10.0-093000")
    r = isolated(rdma_stubs, rdma_script(), ["check"], RDMA_DIRS, tmp_path)
    assert r.returncode == 1
    assert f"{HOST}: rdma: doca-ofed is 2.10.0-093000, stack pins DOCA 3.1.0" in r.stderr


def test_rdma_names_the_nic_that_is_down(rdma_stubs, tmp_path):
    hostcheck = in_root(tmp_path, render.HOSTCHECK)
    hostcheck.parent.mkdir(parents=True, exist_ok=True)
    hostcheck.write_text(render.hostcheck_source())
    (rdma_stubs.state / "installed" / "doca-ofed").write_text("3.1.0-091000")
    text = (rdma_stubs.state / "devinfo").read_text()
    (rdma_stubs.state / "devinfo").write_text(text.replace("PORT_ACTIVE", "PORT_DOWN", 4).replace("PORT_DOWN", "PORT_ACTIVE", 3))
    r = isolated(rdma_stubs, rdma_script(), ["check"], RDMA_DIRS, tmp_path)
    assert r.returncode == 1
    assert f"{HOST}: rdma: mlx5_3 port 1 is PORT_DOWN, expected PORT_ACTIVE" in r.stderr


# --- runtime.sh ----------------------------------------------------------------------------------


@pytest.fixture
def runtime_stubs(tmp_path):
    s = StubPath(tmp_path / "stubs")
    s.add("id", '[ -e "$STATE/user" ]')
    s.add("useradd", 'touch "$STATE/user"')
    s.add("userdel", 'rm -f "$STATE/user"')
    s.add("install", 'exit 0')  # ownership of the service home needs the real user
    return s


def fake_uv(tmp_path: Path) -> None:
    """A uv that "creates" the venv and "installs" pins. The venv's python answers runtime.sh's two
    questions from $STATE: the installed pins (``python - PIN...``) and the kernel problems
    (``python -``, no pins: the kernels match only after a download-kernels for the installed vllm);
    its vllm's download-kernels installs kernels for the installed vllm unless $STATE/kernels-broken."""
    uv = in_root(tmp_path, f"/opt/glm-infra/uv-{PROD.runtime.uv_version}/uv")
    uv.parent.mkdir(parents=True)
    python = r"""#!/bin/bash
shift
if [ $# -eq 0 ]; then
  [ "$(cat $STATE/kernels 2>/dev/null)" = "$(cat $STATE/pin-vllm 2>/dev/null)" ] || echo "flashinfer-cubin is not installed"
  exit 0
fi
for p; do echo "${p%%==*}==$(cat $STATE/pin-${p%%==*} 2>/dev/null || echo missing)"; done
"""
    vllm = r"""#!/bin/bash
echo "vllm $* PATH=$PATH" >> "$STUB_LOG"
[ -e "$STATE/kernels-broken" ] || cp "$STATE/pin-vllm" "$STATE/kernels"
"""
    uv.write_text(f"""#!/bin/bash
echo "uv $*" >> "$STUB_LOG"
if [ "$1" = venv ]; then
  mkdir -p "${{!#}}/bin"
  cat > "${{!#}}/bin/python" <<'PY'
{python}PY
  cat > "${{!#}}/bin/vllm" <<'VLLM'
{vllm}VLLM
  chmod +x "${{!#}}/bin/python" "${{!#}}/bin/vllm"
fi
if [ "$1" = pip ]; then for p; do case "$p" in *==*) echo "${{p#*==}}" > "$STATE/pin-${{p%%==*}}" ;; esac; done; fi
""")
    uv.chmod(0o755)


def test_runtime_reinstalls_only_when_a_pin_changes_and_downloads_kernels_after_each_install(runtime_stubs, tmp_path):
    rt = PROD.runtime
    fake_uv(tmp_path)
    script = runtime.runtime_script(PROD, HOST)
    r = isolated(runtime_stubs, script, ["apply"], RUNTIME_DIRS, tmp_path)
    assert r.returncode == 0, r.stderr + r.stdout
    assert r.called("useradd") and r.called("uv venv") and r.called("uv pip install")
    assert f"vllm=={rt.vllm_version}" in next(c for c in r.calls if c.startswith("uv pip install"))
    kernels = [c for c in r.calls if c.startswith("vllm download-kernels")]
    assert len(kernels) == 1 and f"PATH=/opt/glm-infra/uv-{rt.uv_version}:" in kernels[0], "FlashInfer finds the uv"
    assert "FlashInfer kernels installed" in r.stdout
    assert isolated(runtime_stubs, script, ["check"], RUNTIME_DIRS, tmp_path).returncode == 0

    again = isolated(runtime_stubs, script, ["apply"], RUNTIME_DIRS, tmp_path)
    assert again.returncode == 0 and not again.called("uv pip") and not again.called("useradd")
    assert not again.called("vllm download-kernels")
    assert "venv already has" in again.stdout and "FlashInfer kernels match" in again.stdout

    bumped = PROD.model_copy(update={"runtime": rt.model_copy(update={"vllm_version": "0.33.1"})})
    r = isolated(runtime_stubs, runtime.runtime_script(bumped, HOST), ["apply"], RUNTIME_DIRS, tmp_path)
    install = next(c for c in r.calls if c.startswith("uv pip install"))
    assert r.returncode == 0 and "vllm==0.33.1" in install
    assert " --refresh " in install, "the index is read again: the new pin's wheel is newer than uv's cached listing"
    assert r.called("vllm download-kernels"), "a new vLLM gets its kernels again"

    # Kernels gone behind glm-infra's back: check names them, apply downloads them without reinstalling.
    (runtime_stubs.state / "kernels").unlink()
    bumped_script = runtime.runtime_script(bumped, HOST)
    c = isolated(runtime_stubs, bumped_script, ["check"], RUNTIME_DIRS, tmp_path)
    assert c.returncode == 1 and "FlashInfer kernels: flashinfer-cubin is not installed" in c.stderr
    r = isolated(runtime_stubs, bumped_script, ["apply"], RUNTIME_DIRS, tmp_path)
    assert r.returncode == 0 and r.called("vllm download-kernels") and not r.called("uv pip")

    # A download that does not fix them fails the step, naming what is still wrong.
    (runtime_stubs.state / "kernels").unlink()
    (runtime_stubs.state / "kernels-broken").touch()
    r = isolated(runtime_stubs, bumped_script, ["apply"], RUNTIME_DIRS, tmp_path)
    assert r.returncode == 1
    assert f"{HOST}: runtime: after vllm download-kernels: flashinfer-cubin is not installed" in r.stderr

    r = isolated(runtime_stubs, script, ["remove"], RUNTIME_DIRS, tmp_path)
    assert r.returncode == 0 and r.called("userdel") and not in_root(tmp_path, rt.venv).exists()


# --- health gate ---------------------------------------------------------------------------------


def test_health_gate_waits_for_the_driver_after_a_boot_but_not_for_a_missing_gpu(tmp_path):
    s = StubPath(tmp_path / "stubs")
    # hostcheck stand-in: the driver answers from the third look on.
    s.add("python3", '''n=$(cat "$STATE/n" 2>/dev/null || echo 0); echo $((n + 1)) > "$STATE/n"
if [ -e "$STATE/missing-gpu" ]; then printf '%s\n' "b300-1: gpus: 7 GPUs visible, stack expects 8" \
  "b300-1: nvlink: nvidia-smi nvlink -s lists 7 GPUs, stack expects 8" >&2; exit 1; fi
if [ "$n" -lt 2 ]; then echo "b300-1: driver: nvidia-smi failed (exit 9): NVIDIA-SMI has failed" >&2; exit 1; fi
echo "b300-1: healthy (8 × B300, fabric Completed, NVLink up)"''')
    s.add("sleep", "exit 0")
    script = health_gate.health_script(PROD, HOST)
    r = s.run(script, "apply")
    assert r.returncode == 0 and "healthy" in r.stdout
    assert sum(c.startswith("python3") for c in r.calls) == 3
    (s.state / "n").write_text("5")
    (s.state / "missing-gpu").touch()
    r = s.run(script, "apply")
    assert r.returncode == 1 and "7 GPUs visible, stack expects 8" in r.stderr
    assert sum(c.startswith("python3") for c in r.calls) == 1, "a missing GPU (and so its links) fails at once"


def test_the_gate_before_each_vllm_start_skips_dcgm_diag(write_stack, prod_config, tmp_path):
    prod_config["glm-infra:drivers"] = {**prod_config.get("glm-infra:drivers", {}), "dcgmDiagLevel": 2}
    cfg = load_file(write_stack(prod_config)).config
    s = StubPath(tmp_path / "stubs")
    s.add("python3", 'echo "b300-1: healthy (8 × B300)"')
    s.add("dcgmi", "exit 0")
    script = health_gate.health_script(cfg, HOST)
    assert s.run(script, "apply").called("dcgmi diag -r 2"), "the gate step runs the diagnostic"
    # Before a start the host's other instances hold GPUs: the diagnostic would compete with them.
    r = s.run(script, "before-start")
    assert r.returncode == 0 and "healthy" in r.stdout and not r.called("dcgmi")
    s.add("python3", 'echo "b300-1: gpus: 7 GPUs visible, stack expects 8" >&2; exit 1')
    r = s.run(script, "before-start")
    assert r.returncode == 1 and "7 GPUs visible" in r.stderr


# --- the TLS certificate of the router's front, with the real openssl ---------------------------------

TLS_DIRS = ["/etc/glm-infra"]


def tls_script(write_stack, prod_config, **router) -> str:
    prod_config["glm-infra:router"].update(router)
    cfg = load_file(write_stack(prod_config)).config
    return hostplan.plan_all(cfg, plan(cfg), stack_name="prod")["b300-3"].steps["router-front-tls"].stdin


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def verify_like_a_client(ca_pem: str, cert: Path, host: str, tmp: Path) -> None:
    """What curl --cacert and Python's ssl check: the chain to the CA (strict X.509) and the name."""
    (tmp / "client-ca.pem").write_text(ca_pem)
    r = subprocess.run(["openssl", "verify", "-x509_strict", "-purpose", "sslserver", "-CAfile", str(tmp / "client-ca.pem"),
                        "-verify_ip" if host[0].isdigit() else "-verify_hostname", host, str(cert)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_generated_certificate_keeps_its_ca_and_follows_the_names(write_stack, prod_config, tmp_path):
    stubs = StubPath(tmp_path / "stubs")
    tls = lambda action, script: isolated(stubs, script, [action], TLS_DIRS, tmp_path)  # noqa: E731
    first = tls_script(write_stack, prod_config)
    one = tls("apply", first)
    assert one.returncode == 0, one.stderr
    cert = in_root(tmp_path, "/etc/glm-infra/tls/front.crt")
    ca_pem, issued = one.stdout, cert.read_bytes()
    assert ca_pem.startswith("-----BEGIN CERTIFICATE-----") and "made a CA" in one.stderr
    verify_like_a_client(ca_pem, cert, "10.0.0.10", tmp_path)  # the virtual address
    verify_like_a_client(ca_pem, cert, "10.0.0.13", tmp_path)
    assert oct(in_root(tmp_path, "/etc/glm-infra/tls/front.key").stat().st_mode)[-3:] == "600"
    assert oct(in_root(tmp_path, "/etc/glm-infra/tls/ca.key").stat().st_mode)[-3:] == "600"
    # Again: nothing new. Another name: a new certificate from the same CA.
    again = tls("apply", first)
    assert (again.returncode, again.stdout, cert.read_bytes()) == (0, ca_pem, issued) and "is in place" in again.stderr
    assert tls("check", first).returncode == 0
    named = tls_script(write_stack, prod_config, tlsNames=["llm.example.com"])
    renamed = tls("apply", named)
    assert renamed.returncode == 0 and renamed.stdout == ca_pem and cert.read_bytes() != issued
    assert "is not for IP:10.0.0.10,IP:10.0.0.13,IP:10.0.0.12,DNS:llm.example.com" in renamed.stderr
    verify_like_a_client(ca_pem, cert, "llm.example.com", tmp_path)
    # The check sees a certificate that no longer matches its key; apply repairs it.
    in_root(tmp_path, "/etc/glm-infra/tls/front.key").write_text("")
    broken = tls("check", named)
    assert broken.returncode == 1 and "/etc/glm-infra/tls/front.key is missing" in broken.stderr
    assert tls("apply", named).returncode == 0 and tls("check", named).returncode == 0
    assert tls("remove", named).returncode == 0 and not in_root(tmp_path, "/etc/glm-infra/tls").exists()


def test_a_given_certificate_is_checked_before_nginx_sees_it(write_stack, prod_config, tmp_path):
    stubs = StubPath(tmp_path / "stubs")
    script = tls_script(write_stack, prod_config, tlsCertificate={"secure": "v1:c"}, tlsKey={"secure": "v1:k"})
    for name in ("a", "b"):
        openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "30",
                "-subj", "/CN=llm.example.com", "-keyout", f"{name}.key", "-out", f"{name}.crt", cwd=tmp_path)
    given = in_root(tmp_path, "/etc/glm-infra/secrets/router-tls.pem")
    given.parent.mkdir(parents=True)
    crt, key = ((tmp_path / f"a.{x}").read_text() for x in ("crt", "key"))
    given.write_text(router_role.router_front_tls_given({"router_tls_certificate": crt, "router_tls_key": key}))
    ok = isolated(stubs, script, ["apply"], TLS_DIRS, tmp_path)
    assert ok.returncode == 0 and ok.stdout == "" and "installed the given certificate" in ok.stderr, ok.stderr
    assert in_root(tmp_path, "/etc/glm-infra/tls/front.crt").read_text().strip() == crt.strip()
    assert in_root(tmp_path, "/etc/glm-infra/tls/front.key").read_text().strip() == key.strip()
    assert "is in place" in isolated(stubs, script, ["apply"], TLS_DIRS, tmp_path).stderr
    # Another certificate's key: refused, and what nginx serves is left as it was.
    given.write_text(router_role.router_front_tls_given({"router_tls_certificate": crt,
                                                    "router_tls_key": (tmp_path / "b.key").read_text()}))
    bad = isolated(stubs, script, ["apply"], TLS_DIRS, tmp_path)
    assert bad.returncode == 1 and "router.tlsKey is not the key of router.tlsCertificate" in bad.stderr
    assert in_root(tmp_path, "/etc/glm-infra/tls/front.key").read_text().strip() == key.strip()
    given.write_text("not a certificate\n")
    assert "router.tlsCertificate holds no PEM certificate" in isolated(stubs, script, ["apply"], TLS_DIRS, tmp_path).stderr
    assert isolated(stubs, script, ["check"], TLS_DIRS, tmp_path).returncode == 0
