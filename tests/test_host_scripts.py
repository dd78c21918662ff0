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
from stubs import BOOT, StubPath, in_root, isolated, shellcheck

from glm_infra import hostplan, render
from glm_infra.plan.topology import plan
from glm_infra.roles import drivers as drivers_role
from glm_infra.roles import fabric, rdma, runtime
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
    for host, hs in hostplan.plan_all(cfg, plan(cfg), stack_name=stack).items():
        scripts = {path: f.content for path, f in hs.files().items() if path.endswith(".sh")}
        # And the scripts steps run from stdin (reboot, wait for the reboot, back on a new boot).
        scripts.update({f"step {k}": st.stdin for k, st in hs.steps.items()
                        if "bash -s" in (st.create, (st.update or "").rsplit(" ", 2)[0])})
        assert any(k.startswith("step ") for k in scripts) == bool(hs.host.instances)
        for path, text in scripts.items():
            r = shellcheck(text, tmp_path)
            assert r.returncode == 0, f"{host}:{path}\n{r.stdout}"


@pytest.fixture(autouse=True)
def _needs_root():
    if os.geteuid() != 0:
        pytest.fail("host-script tests need root (unshare --mount), as CI runs them", pytrace=False)


# --- drivers.sh ----------------------------------------------------------------------------------

# NVIDIA's names and version schemes for branch 580 (glm_infra/spec/packages.py cites each): the branch's
# pinning package is versioned by branch, the exact version has a pinning package of its own.
REPO_VERSIONS = {
    "nvidia-driver-pinning-580": "580-5", "nvidia-driver-pinning-580.159.04": "580.159.04-1",
    "nvidia-driver-580-open": "580.159.04-0ubuntu1", "libnvidia-nscq": "580.159.04-1",
    "nvidia-fabricmanager": "580.159.04-1", "libnvsdm": "580.159.04-1",
    "datacenter-gpu-manager-4-cuda13": "1:4.4.1-1", "nvlsm": "2025.06.5-1", "infiniband-diags": "2507mlnx56-1",
}


@pytest.fixture
def apt_stubs(tmp_path):
    s = StubPath(tmp_path / "stubs")
    for pkg, ver in REPO_VERSIONS.items():
        (s.state / "repo").mkdir(exist_ok=True)
        (s.state / "repo" / pkg).write_text(ver)
    for d in ("installed", "held", "enabled"):
        (s.state / d).mkdir()
    # dpkg-query -W PACKAGE: "installed VERSION"; without a package, every installed one ("installed NAME").
    s.add("dpkg-query", '''case "${!#}" in -f*) for f in "$STATE"/installed/*; do [ -e "$f" ] && echo "installed ${f##*/}"; done; exit 0 ;; esac
v=$(cat "$STATE/installed/${!#}" 2>/dev/null) && echo "installed $v" || exit 1''')
    s.add("apt-cache", 'p=${!#}; [ -e "$STATE/repo/$p" ] && echo " $p | $(cat "$STATE/repo/$p") | http://repo ./ Packages"; exit 0')
    s.add("apt-get", '''[ "$1" = install ] || exit 0
for a in "$@"; do case "$a" in -*|install) ;; *=*) echo "${a#*=}" > "$STATE/installed/${a%%=*}" ;;
  *-) rm -f "$STATE/installed/${a%-}" ;; *) cat "$STATE/repo/$a" > "$STATE/installed/$a" ;; esac; done''')
    s.add("apt-mark", '''case "$1" in showhold) ls "$STATE/held" ;; hold) shift; for p; do touch "$STATE/held/$p"; done ;;
  unhold) shift; for p; do rm -f "$STATE/held/$p"; done ;; esac''')
    s.add("curl", 'while [ $# -gt 1 ]; do [ "$1" = -o ] && { echo "PUBLIC KEY" > "$2"; exit 0; }; shift; done')
    # As gpg does: with a FILE and no --output it writes FILE.gpg, not stdout (an empty keyring otherwise).
    s.add("gpg", 'out=; prev=; for a; do [ "$prev" = --output ] && out=$a; prev=$a; f=$a; done; '
                 'if [ "$out" = - ]; then cat "$f"; else cat "$f" > "${out:-$f.gpg}"; fi')
    s.add("nvidia-smi", '[ -e "$STATE/mismatch" ] && { echo "Failed to initialize NVML: Driver/library version mismatch"; exit 18; }; '
                        'cat "$STATE/loaded" 2>/dev/null || echo 580.159.04')
    s.add("systemctl", '''case "$1" in list-unit-files) exit 0 ;; is-enabled|is-active) [ -e "$STATE/enabled/${!#}" ] ;;
  enable) for u; do case "$u" in -*|enable) ;; *) touch "$STATE/enabled/$u" ;; esac; done ;; esac''')
    s.add("modprobe", "exit 1")
    s.add("systemd-detect-virt", 'for a; do [ "$a" = --quiet ] && exit 0; done; echo systemd-nspawn')
    return s


def drivers(stack=PROD) -> str:
    return drivers_role.drivers_script(stack, HOST)


def test_drivers_install_pins_holds_and_enables(apt_stubs, tmp_path):
    r = isolated(apt_stubs, drivers(), ["apply"], DRIVER_DIRS, tmp_path)
    assert r.returncode == 0, r.stderr
    install = next(c for c in r.calls if c.startswith("apt-get install"))
    for pkg in ("nvidia-driver-580-open=580.159.04-0ubuntu1", "nvidia-fabricmanager=580.159.04-1",
                "libnvidia-nscq=580.159.04-1", "nvidia-driver-pinning-580=580-5",
                "nvidia-driver-pinning-580.159.04=580.159.04-1", "nvlsm"):
        assert pkg in install.split(), pkg
    assert sorted(p.name for p in (apt_stubs.state / "held").iterdir()) == sorted(REPO_VERSIONS)
    # NVLSM has no unit: the fabric manager's starts it. DCGM's host engine serves the exporter.
    enabled = {p.name for p in (apt_stubs.state / "enabled").iterdir()}
    assert enabled == {"nvidia-persistenced", "nvidia-fabricmanager", "nvidia-dcgm"}, enabled
    prefs = in_root(tmp_path, "/etc/apt/preferences.d/glm-infra-nvidia").read_text()
    assert "Package: nvidia-fabricmanager\nPin: version 580.159.04-*\nPin-Priority: 1001" in prefs
    assert "Package: nvidia-driver-pinning-580\nPin: version 580-*\nPin-Priority: 1001" in prefs
    sources = in_root(tmp_path, "/etc/apt/sources.list.d/glm-infra-nvidia.list").read_text()
    assert sources.startswith("deb [signed-by=/usr/share/keyrings/glm-infra-nvidia.gpg] https://developer.download.nvidia.com/")
    # The key the repository is signed with, dearmored into the keyring (not an empty file).
    assert in_root(tmp_path, "/usr/share/keyrings/glm-infra-nvidia.gpg").read_text() == "PUBLIC KEY\n"
    assert '"nvidia-fabricmanager";' in in_root(tmp_path, "/etc/apt/apt.conf.d/51glm-infra-nvidia-hold").read_text()
    assert "ib_umad" in in_root(tmp_path, "/etc/modules-load.d/glm-infra-nvlink.conf").read_text()
    assert "not loadable in a container" in r.stdout  # modprobe fails, tolerated in a container

    again = isolated(apt_stubs, drivers(), ["apply"], DRIVER_DIRS, tmp_path)
    assert again.returncode == 0, again.stderr
    assert not again.called("apt-get install") and not again.called("apt-mark hold")
    assert not again.called("apt-get update") and not again.called("systemctl enable")
    assert "wrote" not in again.stdout and "packages already at 580.159.04" in again.stdout
    check = isolated(apt_stubs, drivers(), ["check"], DRIVER_DIRS, tmp_path)
    assert check.returncode == 0 and f"{HOST}: drivers: packages at 580.159.04 and held" in check.stdout, check.stderr


def test_drivers_new_version_replaces_the_old_versions_pinning_package(apt_stubs, tmp_path):
    for pkg, ver in REPO_VERSIONS.items():
        (apt_stubs.state / "installed" / pkg).write_text(ver)
        (apt_stubs.state / "held" / pkg).touch()
    (apt_stubs.state / "installed" / "nvidia-driver-pinning-580.159.04").rename(
        apt_stubs.state / "installed" / "nvidia-driver-pinning-580.126.09")
    r = isolated(apt_stubs, drivers(), ["check"], DRIVER_DIRS, tmp_path)
    assert r.returncode == 1
    assert "nvidia-driver-pinning-580.126.09 is installed: it pins another driver version than 580.159.04" in r.stderr
    r = isolated(apt_stubs, drivers(), ["apply"], DRIVER_DIRS, tmp_path)
    assert r.returncode == 0, r.stderr
    install = next(c for c in r.calls if c.startswith("apt-get install")).split()
    assert "nvidia-driver-pinning-580.159.04=580.159.04-1" in install and "nvidia-driver-pinning-580.126.09-" in install
    assert not (apt_stubs.state / "installed" / "nvidia-driver-pinning-580.126.09").exists()
    assert isolated(apt_stubs, drivers(), ["check"], DRIVER_DIRS, tmp_path).returncode == 0


def test_drivers_enable_dcgms_host_engine_only_for_the_gate_or_the_exporter(apt_stubs, tmp_path):
    quiet = PROD.model_copy(update={"monitoring": PROD.monitoring.model_copy(update={"enabled": False})})
    assert PROD.drivers.dcgm_diag_level == 0
    r = isolated(apt_stubs, drivers(quiet), ["apply"], DRIVER_DIRS, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "nvidia-dcgm" not in {p.name for p in (apt_stubs.state / "enabled").iterdir()}
    gate = quiet.model_copy(update={"drivers": quiet.drivers.model_copy(update={"dcgm_diag_level": 2})})
    r = isolated(apt_stubs, drivers(gate), ["apply"], DRIVER_DIRS, tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.called("systemctl enable --now --quiet nvidia-dcgm")


def test_drivers_version_missing_from_the_repository(apt_stubs, tmp_path):
    (apt_stubs.state / "repo" / "nvidia-fabricmanager").write_text("580.172.08-1")
    r = isolated(apt_stubs, drivers(), ["apply"], DRIVER_DIRS, tmp_path)
    assert r.returncode == 1
    assert f"{HOST}: drivers: nvidia-fabricmanager 580.159.04 is not in https://developer.download.nvidia.com" in r.stderr
    assert not r.called("apt-get install")


def test_drivers_changed_module_asks_for_a_reboot(apt_stubs, tmp_path):
    (apt_stubs.state / "mismatch").touch()  # new userspace, old kernel module
    r = isolated(apt_stubs, drivers(), ["apply"], DRIVER_DIRS, tmp_path)
    assert r.returncode == 0, r.stderr
    assert in_root(tmp_path, "/run/glm-infra/reboot-required").exists()
    assert "reboot required" in r.stdout
    # Services start with the new module after the reboot: enabled, not started now.
    assert any(c.startswith("systemctl enable --quiet") for c in r.calls)
    assert not any("--now" in c for c in r.calls if c.startswith("systemctl enable"))


def test_drivers_verify_mode_changes_nothing_and_names_the_mismatch(apt_stubs, tmp_path):
    stack = PROD.model_copy(update={"drivers": PROD.drivers.model_copy(update={"mode": "verify"})})
    for pkg, ver in REPO_VERSIONS.items():
        (apt_stubs.state / "installed" / pkg).write_text(ver)
    (apt_stubs.state / "installed" / "nvidia-driver-580-open").write_text("580.126.09-0ubuntu1")
    r = isolated(apt_stubs, drivers(stack), ["apply"], DRIVER_DIRS, tmp_path)
    assert r.returncode == 1
    assert "mode verify: nvidia-driver-580-open is 580.126.09-0ubuntu1, stack pins 580.159.04" in r.stderr
    assert not any(c.startswith(("apt-get", "apt-mark hold", "systemctl enable")) for c in r.calls)
    assert not any(any(in_root(tmp_path, d).iterdir()) for d in DRIVER_DIRS[:4])


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


@pytest.fixture
def rdma_stubs(tmp_path):
    s = StubPath(tmp_path / "stubs")
    (s.state / "installed").mkdir()
    s.add("dpkg-query", 'v=$(cat "$STATE/installed/${!#}" 2>/dev/null) && echo "installed $v" || exit 1')
    s.add("apt-get", '[ "$1" = install ] && for a; do case "$a" in -*|install) ;; *=*) echo "${a#*=}" > "$STATE/installed/${a%%=*}" ;; '
                     '*) echo 50.0-2 > "$STATE/installed/$a" ;; esac; done; exit 0')
    # NVIDIA's DOCA repository (doca-ofed at the DOCA release's build), its key.
    s.add("apt-cache", '[ "${!#}" = doca-ofed ] && echo " doca-ofed | 3.1.0-091000 | https://linux.mellanox.com ./ Packages"; exit 0')
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
    script = fabric.health_script(PROD, HOST)
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
    script = fabric.health_script(cfg, HOST)
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
    assert "is not for IP:10.0.0.13,DNS:llm.example.com" in renamed.stderr
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
