"""The simulated hosts themselves, and the product's host scripts run on them over SSH exactly as
the command provider runs them (the step's create command, the script on stdin), in chain order.
The same scripts go through the real engine in tests/e2e; this needs no command provider.
Needs root (mounts, bridge, containers), as CI runs."""

from __future__ import annotations

import copy
import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, stack_file

from glm_infra import hostplan
from glm_infra.plan.topology import plan as plan_of
from glm_infra.render import render_template
from glm_infra.spec import paths
from glm_infra.spec.config import StackConfig
from glm_infra.steps import Step

SIM = ROOT / "scripts" / "sim"
KEY = Path(os.environ.get("GLM_INFRA_CACHE", Path.home() / ".cache/glm-infra")) / "sim/ssh/id_ed25519"
HOSTS = {"simt-1": "10.88.0.21", "simt-2": "10.88.0.22"}


def sim(stack: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run([str(SIM), "--stack", str(stack), *args], capture_output=True, text=True, timeout=1800)
    assert not check or p.returncode == 0, p.stderr[-3000:]
    return p


def ssh(host: str, cmd: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["ssh", "-i", str(KEY), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
                           "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", f"root@{HOSTS[host]}", cmd],
                          input=stdin, capture_output=True, text=True, timeout=900)


def run_step(host: str, step: Step) -> subprocess.CompletedProcess:
    return ssh(host, step.create, step.stdin)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two simulated hosts of their own (names and addresses apart from the sim stack's)."""
    cfg = copy.deepcopy(yaml.safe_load(stack_file("sim").read_text())["config"])
    cfg["glm-infra:hosts"] = [{**cfg["glm-infra:hosts"][0], "name": n, "address": a} for n, a in HOSTS.items()]
    cfg["glm-infra:prefill"]["hosts"] = ["simt-1"]
    cfg["glm-infra:decode"]["hosts"] = ["simt-2"]
    cfg["glm-infra:router"] = {"host": "simt-2"}
    path = tmp_path_factory.mktemp("stack") / "Pulumi.simt.yaml"
    path.write_text(yaml.safe_dump({"config": cfg}))
    try:
        sim(path, "up")
        yield path, StackConfig.model_validate({k.split(":", 1)[1]: v for k, v in cfg.items()})
    finally:
        sim(path, "down", check=False)


def test_hosts_boot_with_systemd_and_sshd_on_their_addresses(cluster):
    path, _ = cluster
    status = sim(path, "status").stdout
    assert all(f"{n:12} {a:15} running" in status for n, a in HOSTS.items())
    for host, address in HOSTS.items():
        state = ssh(host, "systemctl is-system-running").stdout.strip()
        assert state in ("running", "degraded"), state
        assert f"inet {address}/24" in ssh(host, "ip -4 -o addr show dev host0").stdout
    other = HOSTS["simt-2"]
    assert ssh("simt-1", f"ping -c1 -W2 {other} >/dev/null && echo reached").stdout.strip() == "reached"
    # The machine's signed repository, reachable from the hosts; nothing beyond the bridge.
    assert ssh("simt-1", "curl -fsS -o /dev/null -w '%{http_code}' http://10.88.0.1:8088/apt/InRelease").stdout == "200"


def host_steps(stack: StackConfig, host: str) -> dict[str, Step]:
    """The steps the components run on ``host``, from the one per-host plan."""
    p = plan_of(stack)
    return hostplan.host_steps(stack, p, next(h for h in p.hosts if h.name == host), stack_name="sim").steps


def test_host_chain_on_a_real_host(cluster):
    """preflight → drivers → health gate → RDMA → runtime: the plan's own steps, as the components
    chain them (the reboot steps are tested through the engine in tests/e2e)."""
    _, stack = cluster
    host = "simt-1"
    steps = host_steps(stack, host)
    pre = run_step(host, steps["preflight"])
    assert pre.returncode == 0, pre.stderr
    assert '"os": "debian 12"' in pre.stdout and '"container": "systemd-nspawn"' in pre.stdout

    drivers = steps["drivers-install"]
    first = run_step(host, drivers)
    assert first.returncode == 0, first.stderr
    # NVIDIA's order: this version's pinning package alone, in an apt run of its own; then the tree, every
    # package at exactly 580.159.04 although the repository has a newer 580.
    pin_line = f"{host}: drivers: installing nvidia-driver-pinning-580.159.04=580.159.04-1 alone, first\n"
    assert pin_line in first.stdout, first.stdout
    tree = next((line for line in first.stdout.splitlines()
                 if line.startswith(f"{host}: drivers: installing ") and " nvidia-driver-580-open=" in f" {line}"), "")
    assert first.stdout.index(pin_line) < first.stdout.index(tree), first.stdout
    assert "nvidia-driver-580-open=580.159.04-1ubuntu1" in tree and "580.172.08" not in tree, tree
    second = run_step(host, drivers)
    assert second.returncode == 0 and "packages already at 580.159.04" in second.stdout
    assert "wrote" not in second.stdout and "installing" not in second.stdout

    health = run_step(host, steps["health-gate"])
    assert health.returncode == 0, health.stderr
    assert f"{host}: healthy (8 × NVIDIA B300 SXM6 AC, driver 580.159.04; fabric Completed on 8 GPUs; NVLink 18 of 18 links up on each of 8 GPUs; 0 pending row remaps on 8 GPUs)" in health.stdout

    rdma = run_step(host, steps["rdma"])
    assert rdma.returncode == 0, rdma.stderr
    assert ("RDMA mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7: 8 ports PORT_ACTIVE Ethernet active_mtu 4096, "
            "GID 3 RoCE v2 IPv4 on 8 NICs") in rdma.stdout

    runtime = steps["runtime"]
    r = run_step(host, runtime)
    assert r.returncode == 0, r.stderr
    assert ssh(host, "/opt/glm-infra/venv/bin/vllm --version").stdout.strip() == stack.runtime.vllm_version
    again = run_step(host, runtime)
    assert "venv already has" in again.stdout


def test_stand_in_faults_fail_the_gate_naming_host_and_check(cluster):
    host = "simt-1"
    gate = paths.script("health-gate")
    try:
        ssh(host, "echo GPU_COUNT=7 > /etc/glm-sim/hardware.conf.d/50-test.conf")
        r = ssh(host, f"{gate} check")
        assert r.returncode == 1 and f"{host}: gpus: 7 GPUs visible, stack expects 8" in r.stderr
        ssh(host, "echo 'REMAPPED_PENDING=2' > /etc/glm-sim/hardware.conf.d/50-test.conf")
        r = ssh(host, f"{gate} check")
        assert r.returncode == 1 and "GPU 2 (00000000:62:00.0) has a pending row remap" in r.stderr
    finally:
        ssh(host, "rm -f /etc/glm-sim/hardware.conf.d/50-test.conf")
    assert ssh(host, f"{gate} check").returncode == 0


def test_systemd_is_reloaded_only_when_a_unit_on_disk_is_newer_than_what_it_runs(cluster):
    """_systemd.sh.j2 on real systemd: reload_for reloads for a new unit, a changed unit and a changed
    drop-in, and for nothing else; enable_units enables once (systemctl enable reloads every time)."""
    host, unit = "simt-1", "glm-test-reload.service"
    path = f"{paths.UNIT_DIR}/{unit}"
    functions = render_template("_systemd.sh.j2")

    def run(body: str) -> tuple[str, int]:
        """BODY after the functions; its stdout and the reloads systemd logged while it ran."""
        r = ssh(host, "set -euo pipefail; before=$(journalctl -o cat _PID=1 | grep -c '^Reloading\\.$' || true)\n"
                f"{functions}\n{body}\n"
                "sleep 0.2; echo \"reloads=$(( $(journalctl -o cat _PID=1 | grep -c '^Reloading\\.$' || true) - before ))\"")
        assert r.returncode == 0, r.stderr
        out, _, count = r.stdout.rpartition("reloads=")
        return out, int(count)

    def write(description: str, dropin: str = "") -> str:
        return (f"printf '[Unit]\\nDescription={description}\\n[Service]\\nType=oneshot\\nRemainAfterExit=yes\\nExecStart=/bin/true\\n"
                f"[Install]\\nWantedBy=multi-user.target\\n' > {path}\n"
                + (f"mkdir -p {path}.d; printf '[Unit]\\nDocumentation={dropin}\\n' > {path}.d/glm-infra.conf\n"
                   if dropin else ""))

    show = f"systemctl show -p Description -p Documentation --value {unit}"
    try:
        out, reloads = run(write("first") + f"reload_for {unit}; {show}")
        assert out.split()[:1] == ["first"] and reloads <= 1  # a new unit: loaded, by a reload or on demand
        # Enabled and active, it stays loaded (an idle unit nothing refers to is dropped and read anew).
        out, reloads = run(f"enable_units {unit}; systemctl start {unit}; systemctl is-enabled {unit}")
        assert out.strip() == "enabled" and reloads == 1, (out, reloads)
        out, reloads = run(f"enable_units {unit}; reload_for {unit}; systemctl is-enabled {unit}")
        assert out.strip() == "enabled" and reloads == 0, "nothing changed: no reload, no second enable"
        out, reloads = run("sleep 0.01\n" + write("second") + f"reload_for {unit}; {show}")
        assert out.split()[:1] == ["second"] and reloads == 1, (out, reloads)
        out, reloads = run("sleep 0.01\n" + write("second", "https://example.invalid/a") + f"reload_for {unit}; {show}")
        assert "https://example.invalid/a" in out and reloads == 1, (out, reloads)
    finally:
        ssh(host, f"systemctl disable --quiet {unit} 2>/dev/null; rm -rf {path} {path}.d; systemctl daemon-reload")


def test_a_host_reboots_like_a_server(cluster):
    before = ssh("simt-2", "cat /proc/sys/kernel/random/boot_id; touch /run/before-reboot").stdout.strip()
    ssh("simt-2", "systemctl reboot")
    deadline = time.monotonic() + 120
    while True:
        r = ssh("simt-2", "cat /proc/sys/kernel/random/boot_id; test -e /run/before-reboot && echo stale || true")
        if r.returncode == 0 and r.stdout.split() and r.stdout.split()[0] != before:
            break
        assert time.monotonic() < deadline, "the host came back"
        time.sleep(1)
    assert "stale" not in r.stdout, "/run is empty after a reboot"


def test_an_interrupted_image_build_is_discarded_without_touching_the_machine(tmp_path):
    """debootstrap killed midway leaves /proc mounted in the half-built image; discarding it must
    unmount first and never walk into the machine's own /proc."""
    from testbed.cluster import discard_partial_image

    partial = tmp_path / "rootfs-bookworm-x.tmp"
    (partial / "proc").mkdir(parents=True)
    (partial / "etc").mkdir()
    (partial / "etc/os-release").write_text("ID=debian\n")
    subprocess.run(["mount", "-t", "proc", "proc", str(partial / "proc")], check=True)
    try:
        discard_partial_image(partial)
    finally:
        subprocess.run(["umount", "-l", str(partial / "proc")], capture_output=True)
    assert not partial.exists()
    assert str(partial) not in Path("/proc/self/mountinfo").read_text()
    assert Path("/proc/self/status").read_text().startswith("Name:")
