"""Simulated B300 hosts on one Linux machine: systemd-nspawn containers with real systemd and sshd.

Each host of a stack file becomes a container booted from a cached ``debootstrap`` root file system
(one overlay per host) on a bridge, with the stack's address. The machine serves the stand-in apt
repository and wheels to the hosts from the bridge address. Only these hosts and loopback are ever
targeted: addresses outside the bridge's private /24 are refused.

    sim up [--stack sim]      build or reuse the image, boot every host, wait for SSH
    sim prepare [--stack sim] build what up and the SLA gate take from the network, boot nothing
    sim down [--stack sim]    stop every host and remove what ``up`` created
    sim status [--stack sim]  one line per host
    sim inventory [--stack sim]  the running hosts as JSON {name: address}
    sim ssh HOST [CMD...]     log in (or run CMD) as root
    sim fleet N [--subnet 10.89.0.0/24] [--out FILE]
                              write a stack file of N hosts fleet-1..N on the subnet (the sim stack's
                              settings, one colocated DP8 instance per host, the router on fleet-1);
                              then ``sim --stack FILE up|down``
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import fcntl
import hashlib
import ipaddress
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from testbed import ROOT as REPO
from testbed import STANDINS

CACHE = Path(os.environ.get("GLM_INFRA_CACHE", Path.home() / ".cache" / "glm-infra"))
SIM = CACHE / "sim"
DEFAULT_NET = ipaddress.ip_network("10.88.0.0/24")  # the sim stack's, the end-to-end suite's
RUN = Path(os.environ.get("GLM_SIM_RUN", "/run/glm-infra-sim"))
BRIDGE = "br-glmsim"
HTTP_PORT = 8088
MODEL_PORT = 8089  # the model mirror: its own server, so benchmarks can throttle it alone
SUITE = "bookworm"
MIRROR = os.environ.get("GLM_SIM_MIRROR", "http://deb.debian.org/debian")
# What every simulated host has before glm-infra touches it (an Ubuntu server image has these too).
PACKAGES = [
    "systemd", "systemd-sysv", "dbus", "openssh-server", "python3", "python3-venv", "iproute2",
    "ca-certificates", "curl", "gnupg", "kmod", "procps", "less", "iputils-ping", "netbase",
]
SSH_OPTS = [
    "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
    "-o", "LogLevel=ERROR", "-o", "ConnectTimeout=5",
]


def say(msg: str) -> None:
    print(f"==> {msg}", file=sys.stderr, flush=True)


class SimError(Exception):
    pass


@dataclass(frozen=True)
class SimHost:
    name: str
    address: str

    @property
    def dir(self) -> Path:
        return RUN / self.name


def hosts_of(stack: str) -> tuple[list[SimHost], ipaddress.IPv4Interface]:
    path = Path(stack) if stack.endswith((".yaml", ".yml")) else REPO / "stacks" / f"Pulumi.{stack}.yaml"
    cfg = yaml.safe_load(path.read_text())["config"]
    hosts = [SimHost(h["name"], h["address"]) for h in cfg["glm-infra:hosts"]]
    net = ipaddress.ip_network(f"{hosts[0].address}/24", strict=False)
    if not net.is_private:
        raise SimError(f"{path}: {net} is not a private network; simulated hosts only live on a private bridge")
    for h in hosts:
        if ipaddress.ip_address(h.address) not in net or h.address.endswith(".1"):
            raise SimError(f"{path}: {h.name} {h.address} is not a host address in {net}")
    gateway = ipaddress.IPv4Interface(f"{next(net.hosts())}/24")
    use_network(net)
    return hosts, gateway


def use_network(net: ipaddress.IPv4Network) -> None:
    """A cluster on another /24 than the sim stack's gets a bridge and a run folder of its own, so a
    benchmark's fleet (10.89.0.0/24, say) can run beside the end-to-end suite's hosts."""
    global RUN, BRIDGE
    if net == DEFAULT_NET or "GLM_SIM_RUN" in os.environ:
        return
    RUN, BRIDGE = network_home(net)


def network_home(net: ipaddress.IPv4Network) -> tuple[Path, str]:
    """The run folder and bridge of a cluster on ``net`` (not the sim stack's): named by the whole /24,
    so 10.89.0.0/24 and 10.90.0.0/24 never share a bridge or an HTTP server (a bridge name holds 15
    characters: the /24 in hex)."""
    prefix = int(net.network_address) >> 8
    return Path(f"/run/glm-infra-sim-{str(net.network_address).rsplit('.', 1)[0]}"), f"br-glmsim{prefix:06x}"


def host_cgroup(root: Path, run_folder: Path, host: str) -> Path:
    """The cgroup LAUNCHER gives a simulated host under a cgroup hierarchy's root: named by its cluster's run
    folder and its name, as two clusters may both have a b300-1."""
    return root / "glm-sim" / f"{run_folder.name}-{host}"


def run(cmd: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, text=True, **kw)


def ssh_key() -> Path:
    key = SIM / "ssh" / "id_ed25519"
    if not key.exists():
        key.parent.mkdir(parents=True, exist_ok=True)
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "glm-infra-sim", "-f", str(key)])
    return key


# --- the image -----------------------------------------------------------------------------------


def rootfs() -> Path:
    """The cached Debian root file system every host overlays (built once per package list)."""
    tag = hashlib.sha256(" ".join([SUITE, *PACKAGES]).encode()).hexdigest()[:10]
    target = SIM / f"rootfs-{SUITE}-{tag}"
    if (target / ".complete").exists():
        return target
    for tool in ("debootstrap", "systemd-nspawn"):
        if shutil.which(tool) is None:
            raise SimError(f"{tool} is missing: apt-get install debootstrap systemd-container")
    tmp = target.with_name(target.name + ".tmp")
    discard_partial_image(tmp)
    say(f"building the host image with debootstrap ({SUITE}, about a minute; cached in {target})")
    run(["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE, str(tmp), MIRROR],
        stdout=subprocess.DEVNULL)
    # No route beyond the bridge: hosts install only from the machine's stand-in repository.
    (tmp / "etc/apt/sources.list").write_text("")
    (tmp / "etc/machine-id").write_text("")  # each container gets its own at boot
    for unit in ("systemd-networkd.service", "ssh.service"):
        run(["chroot", str(tmp), "systemctl", "enable", unit], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # Timers that would touch apt behind glm-infra's back, and utmp bookkeeping that fails in a
    # container (it would leave every host "degraded").
    for unit in ("apt-daily.timer", "apt-daily-upgrade.timer", "e2scrub_all.timer", "fstrim.timer",
                 "systemd-update-utmp.service", "systemd-update-utmp-runlevel.service"):
        run(["chroot", str(tmp), "systemctl", "mask", unit], check=False,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    (tmp / "etc/ssh/sshd_config.d").mkdir(parents=True, exist_ok=True)
    (tmp / "etc/ssh/sshd_config.d/glm-sim.conf").write_text("PermitRootLogin prohibit-password\nUseDNS no\n")
    (tmp / ".complete").write_text(time.strftime("%Y-%m-%dT%H:%M:%SZ\n", time.gmtime()))
    tmp.rename(target)
    return target


def discard_partial_image(tmp: Path) -> None:
    """Remove an image build that was interrupted. debootstrap mounts /proc (and may mount /sys)
    inside it: unmount those first and never cross into another file system, or ``rm`` would walk
    into the machine's own /proc and /sys."""
    prefix = str(tmp) + "/"
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    for point in sorted((m for m in mounts if m.startswith(prefix)), key=len, reverse=True):
        run(["umount", "-l", point], check=False)
    if tmp.exists():
        run(["rm", "-rf", "--one-file-system", str(tmp)])


# --- the machine's side: bridge, nspawn propagation dir, HTTP server -----------------------------


@contextlib.contextmanager
def machine_lock():
    """Held while the cache (image, stand-ins, SSH key) and the machine's settings are made: what every
    cluster on this machine shares. Clusters in network namespaces of their own boot side by side."""
    SIM.mkdir(parents=True, exist_ok=True)
    with open(SIM / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def build_standins(stack: str) -> None:
    """The stand-in apt repository, wheels and model checkpoint the hosts install from (rebuilt
    only when changed)."""
    www = SIM / "www"
    run([str(STANDINS / "fetch-debian-debs"), str(SIM / "debian-debs")])
    run([str(STANDINS / "build-apt-repo"), str(www / "apt"), str(SIM / "debian-debs")])
    run([str(STANDINS / "build-wheels"), str(www / "wheels")])
    model = model_of(stack)
    if model.get("source") == "mirror":
        name = model["mirrorUrl"].rstrip("/").rsplit("/", 1)[-1]
        shards, shard_mb = os.environ.get("GLM_SIM_MODEL_SHARDS", "8"), os.environ.get("GLM_SIM_MODEL_SHARD_MB", "16")
        run([sys.executable, str(STANDINS / "make-checkpoint"), str(SIM / "models" / name),
             "--revision", str(model["revision"]), "--shards", shards, "--shard-mb", shard_mb])


def model_of(stack: str) -> dict:
    path = Path(stack) if stack.endswith((".yaml", ".yml")) else REPO / "stacks" / f"Pulumi.{stack}.yaml"
    return yaml.safe_load(path.read_text())["config"].get("glm-infra:model", {})


def ensure_nspawn_tmpfs() -> None:
    d = Path("/run/systemd/nspawn")
    d.mkdir(parents=True, exist_ok=True)
    fstype = run(["stat", "-f", "-c", "%T", str(d)], capture_output=True).stdout.strip()
    if fstype != "tmpfs":  # nspawn aborts otherwise (SIM-NOTES)
        run(["mount", "-t", "tmpfs", "tmpfs", str(d)])


# Each host's systemd takes a few dozen inotify instances (all of root's, shared by every container):
# at the kernel's default 128, a sixth or so of 16 hosts booting at once fail "Too many open files"
# and exit (and a running host's next unit may fail). Raised only, never lowered.
INOTIFY_MIN = {"max_user_instances": 8192, "max_user_watches": 1048576}


def ensure_inotify() -> None:
    for key, least in INOTIFY_MIN.items():
        f = Path("/proc/sys/fs/inotify") / key
        if int(f.read_text()) < least:
            say(f"fs.inotify.{key}: {f.read_text().strip()} → {least} (enough for many hosts' systemd)")
            f.write_text(str(least))


def ensure_bridge(gateway: ipaddress.IPv4Interface) -> None:
    if run(["ip", "link", "show", BRIDGE], check=False, capture_output=True).returncode != 0:
        run(["ip", "link", "add", BRIDGE, "type", "bridge"])
    addrs = run(["ip", "-o", "-4", "addr", "show", "dev", BRIDGE], capture_output=True).stdout
    if str(gateway) not in addrs:
        run(["ip", "addr", "add", str(gateway), "dev", BRIDGE])
    run(["ip", "link", "set", BRIDGE, "up"])


def start_http(gateway: ipaddress.IPv4Interface) -> None:
    """Serve the repository and wheels on :8088 and the model mirror on :8089 (with range requests,
    as a real mirror), from the bridge address only."""
    (SIM / "www").mkdir(parents=True, exist_ok=True)
    (SIM / "models").mkdir(parents=True, exist_ok=True)
    servers = {
        "http": [sys.executable, "-m", "http.server", "--bind", str(gateway.ip), str(HTTP_PORT),
                 "--directory", str(SIM / "www")],
        # weights' own file server (agent/weights/, run from this checkout: cwd below)
        "models": [sys.executable, "-m", "glm_infra.agent.weights", "serve", "--dir", str(SIM / "models"),
                   "--bind", f"{gateway.ip}:{MODEL_PORT}"],
    }
    for name, argv in servers.items():
        pidfile = RUN / f"{name}.pid"
        if _alive(pidfile):
            continue
        log = open(RUN / f"{name}.log", "ab")
        p = subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True, cwd=REPO)
        pidfile.write_text(str(p.pid))


def _alive(pidfile: Path) -> bool:
    try:
        os.kill(int(pidfile.read_text()), 0)
        return True
    except (OSError, ValueError):
        return False


# --- hosts ---------------------------------------------------------------------------------------

LAUNCHER = r"""#!/bin/bash
# Keep one simulated host running: nspawn exits with 133 when the host reboots; boot it again.
dir=$1; shift
# A cgroup of its own for each host: without a systemd on the machine, nspawn nests the host's
# systemd under the launcher's cgroup, and hosts sharing one would share every unit's cgroup
# (a unit stopped on one host would kill its namesake on another). Named by run folder and host:
# two clusters (each in a network namespace of its own) may both have a b300-1.
cg_name="$(basename "$(dirname "$dir")")-$(basename "$dir")"
for root in /sys/fs/cgroup/systemd /sys/fs/cgroup/unified /sys/fs/cgroup; do
  [ -e "$root/cgroup.procs" ] || continue
  [ "$root" = /sys/fs/cgroup ] && [ -d /sys/fs/cgroup/systemd ] && continue
  mkdir -p "$root/glm-sim/$cg_name" && echo $$ > "$root/glm-sim/$cg_name/cgroup.procs"
done
trap 'touch "$dir/stop"; kill -TERM "$(cat "$dir/nspawn.pid")" 2>/dev/null' TERM INT
while :; do
  systemd-nspawn "$@" &
  echo $! > "$dir/nspawn.pid"
  wait $!; rc=$?
  while kill -0 "$(cat "$dir/nspawn.pid")" 2>/dev/null; do wait "$(cat "$dir/nspawn.pid")"; rc=$?; done
  [ -e "$dir/stop" ] && exit 0
  [ "$rc" -eq 133 ] || { echo "launcher: $(date -u +%FT%TZ) systemd-nspawn exited $rc" >&2; exit "$rc"; }
  echo "launcher: $(date -u +%FT%TZ) host rebooted" >&2
  # A server spends minutes in firmware before it boots again; a container would be back in a second
  # or two, sooner than anything waiting for a real reboot could count on seeing it gone.
  sleep 5 & wait $!
  [ -e "$dir/stop" ] && exit 0
done
"""


def boot(h: SimHost, image: Path, hosts: list[SimHost], key: Path) -> None:
    d = h.dir
    if _alive(d / "launcher.pid"):
        return
    for sub in ("upper", "work", "merged"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    merged = d / "merged"
    if not os.path.ismount(merged):
        run(["mount", "-t", "overlay", "overlay", "-o",
             f"lowerdir={image},upperdir={d / 'upper'},workdir={d / 'work'}", str(merged)])
    (merged / "etc/hostname").write_text(h.name + "\n")
    etc_hosts = "127.0.0.1 localhost\n" + "".join(f"{x.address} {x.name}\n" for x in hosts)
    (merged / "etc/hosts").write_text(etc_hosts)
    # Sorts before the stock 80-container-host0.network, which would win otherwise (SIM-NOTES).
    (merged / "etc/systemd/network/10-host0.network").write_text(
        f"[Match]\nName=host0\n\n[Network]\nAddress={h.address}/24\nLinkLocalAddressing=no\n"
    )
    # pulumi opens one SSH connection per step: many at once on one host (a destroy) must not meet
    # sshd's default MaxStartups (10:30:100), which drops some of them (EOF).
    sshd = merged / "etc/ssh/sshd_config.d/glm-sim.conf"
    sshd.write_text("PermitRootLogin prohibit-password\nUseDNS no\nMaxStartups 200\nMaxSessions 200\n")
    ssh_dir = merged / "root/.ssh"
    ssh_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    (ssh_dir / "authorized_keys").write_text(Path(str(key) + ".pub").read_text())
    (ssh_dir / "authorized_keys").chmod(0o600)
    (d / "stop").unlink(missing_ok=True)
    launcher = RUN / "launcher.sh"
    launcher.write_text(LAUNCHER)
    launcher.chmod(0o755)
    log = open(d / "console.log", "ab")
    p = subprocess.Popen(
        [str(launcher), str(d), "--quiet", "--register=no", "--keep-unit", "-D", str(merged), "-M", h.name,
         "-b", f"--network-bridge={BRIDGE}"],
        stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
    )
    (d / "launcher.pid").write_text(str(p.pid))


def ssh_cmd(h: SimHost, key: Path, *cmd: str) -> list[str]:
    return ["ssh", "-i", str(key), *SSH_OPTS, f"root@{h.address}", *cmd]


def wait_ready(hosts: list[SimHost], key: Path, reboot, timeout: float = 120) -> None:
    """Wait until every host's systemd runs. A container that exits while booting is booted once
    more (seen rarely right after another cluster went down); a second exit is an error."""
    deadline = time.monotonic() + timeout
    pending = list(hosts)
    retried: set[str] = set()
    while pending:
        h = pending[0]
        r = run(ssh_cmd(h, key, "systemctl", "is-system-running", "--wait"), check=False, capture_output=True)
        if r.stdout.strip() in ("running", "degraded"):
            pending.pop(0)
            continue
        if not _alive(h.dir / "launcher.pid"):
            tail = (h.dir / "console.log").read_text(errors="replace")[-2000:]
            if h.name not in retried:
                retried.add(h.name)
                say(f"{h.name}: the container exited while booting; booting it again\n{tail}")
                reboot(h)
                continue
            raise SimError(f"{h.name}: the container exited while booting, twice:\n{tail}")
        if time.monotonic() > deadline:
            raise SimError(f"{h.name} ({h.address}): no SSH after {timeout:.0f}s; see {h.dir / 'console.log'}")
        time.sleep(1)


def stop(h: SimHost) -> None:
    d = h.dir
    if d.exists():
        (d / "stop").touch()
        for pidfile in (d / "nspawn.pid", d / "launcher.pid"):
            if _alive(pidfile):
                try:
                    os.kill(int(pidfile.read_text()), signal.SIGTERM)
                except OSError:
                    pass
        deadline = time.monotonic() + 30
        while _alive(d / "launcher.pid") and time.monotonic() < deadline:
            time.sleep(0.5)
        if _alive(d / "launcher.pid"):
            os.killpg(int((d / "launcher.pid").read_text()), signal.SIGKILL)
        for root in ("/sys/fs/cgroup/systemd", "/sys/fs/cgroup/unified", "/sys/fs/cgroup"):
            cg = host_cgroup(Path(root), RUN, h.name)
            if cg.is_dir():  # empty now: remove the host's cgroups, deepest first
                run(["find", str(cg), "-depth", "-type", "d", "-exec", "rmdir", "{}", ";"], check=False,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        merged = d / "merged"
        if os.path.ismount(merged):
            run(["umount", str(merged)], check=False)
            if os.path.ismount(merged):
                run(["umount", "-l", str(merged)], check=False)
        shutil.rmtree(d, ignore_errors=True)


# --- a generated fleet -----------------------------------------------------------------------------

FLEET_NET = ipaddress.ip_network("10.89.0.0/24")  # the default subnet of `sim fleet`
FIRST_HOST = 11  # host addresses from .11 up, as the sim stack's (.1 is the machine's bridge)


def fleet_addresses(n: int, net: ipaddress.IPv4Network) -> list[str]:
    """n host addresses on a private /24, .11 up; a clear refusal for anything else."""
    if net.version != 4 or net.prefixlen != 24:
        raise SimError(f"{net}: a simulated cluster lives on one /24 (its bridge is the .1 address)")
    if not net.is_private:
        raise SimError(f"{net} is not a private network; simulated hosts only live on a private bridge")
    room = 254 - FIRST_HOST + 1
    if not 1 <= n <= room:
        raise SimError(f"{n} hosts do not fit {net}: its host addresses .{FIRST_HOST}–.254 hold 1 to {room}")
    return [str(net.network_address + FIRST_HOST + i) for i in range(n)]


def fleet_config(n: int, net: ipaddress.IPv4Network = FLEET_NET, prefix: str = "fleet") -> dict:
    """The sim stack's settings on n hosts PREFIX-1..n of ``net``: one colocated DP8 instance per host
    (the same work on every host), the router on the first, and every address of the machine's
    bridge (apt repository, wheels, model mirror, allowed CIDRs) moved to ``net``'s .1."""
    addresses = fleet_addresses(n, net)
    doc = yaml.safe_load((REPO / "stacks" / "Pulumi.sim.yaml").read_text())
    cfg = doc["config"]
    template = cfg["glm-infra:hosts"][0]
    hosts = [{**copy.deepcopy(template), "name": f"{prefix}-{i + 1}", "address": a} for i, a in enumerate(addresses)]
    cfg["glm-infra:hosts"] = hosts
    for key in ("glm-infra:prefill", "glm-infra:decode"):
        cfg.pop(key, None)
    cfg["glm-infra:colocated"] = {
        "hosts": [h["name"] for h in hosts], "tp": 1, "dp": 8, "speculativeTokens": 3, "gpuMemoryUtilization": 0.9,
    }
    cfg["glm-infra:router"]["host"] = hosts[0]["name"]
    doc["config"] = moved(cfg, str(DEFAULT_NET.network_address + 1), str(net.network_address + 1))
    return doc


def moved(value, old: str, new: str):
    """``value`` with the machine's address ``old`` (in URLs and CIDRs: ``old:``, ``old/``) as ``new``."""
    if isinstance(value, dict):
        return {k: moved(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [moved(v, old, new) for v in value]
    if isinstance(value, str):
        return value.replace(f"{old}:", f"{new}:").replace(f"{old}/", f"{new}/")
    return value


def cmd_fleet(args: argparse.Namespace) -> int:
    try:
        net = ipaddress.ip_network(args.subnet)
    except ValueError as e:
        raise SimError(f"--subnet {args.subnet}: {e}") from None
    doc = fleet_config(args.n, net)
    header = (f"# {args.n} simulated hosts on {net}, generated by `scripts/sim fleet {args.n} --subnet {net}`:\n"
              "# the sim stack's settings, one colocated DP8 instance per host, the router on fleet-1.\n")
    text = header + yaml.safe_dump(doc, sort_keys=False)
    if args.out:
        Path(args.out).write_text(text)
        say(f"{args.out}: {args.n} hosts on {net} (boot them: scripts/sim --stack {args.out} up)")
    else:
        sys.stdout.write(text)
    return 0


# --- commands ------------------------------------------------------------------------------------


def cmd_up(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        raise SimError("the simulated cluster needs root (mounts, bridges, containers)")
    hosts, gateway = hosts_of(args.stack)
    RUN.mkdir(parents=True, exist_ok=True)
    with machine_lock():  # two clusters booting at once (the suite's two lanes) build the cache once
        key = ssh_key()
        image = rootfs()
        build_standins(args.stack)
        ensure_nspawn_tmpfs()
        ensure_inotify()
    ensure_bridge(gateway)
    start_http(gateway)
    t0 = time.monotonic()
    for h in hosts:
        boot(h, image, hosts, key)
    wait_ready(hosts, key, lambda h: boot(h, image, hosts, key))
    say(f"{len(hosts)} simulated hosts up in {time.monotonic() - t0:.0f}s "
        f"(repository http://{gateway.ip}:{HTTP_PORT}/, key {key})")
    return cmd_status(args)


def cmd_prepare(args: argparse.Namespace) -> int:
    """Make now what the stack's clusters take from the network: the SSH key, the host image
    (debootstrap), the stand-in repository, wheels and checkpoint, and the SLA client with the sim
    stack's tokenizer. ``up`` makes what is missing too; the test suite runs this before its lanes
    leave the machine's network for namespaces of their own."""
    if os.geteuid() != 0:
        raise SimError("the simulated cluster needs root (mounts, bridges, containers)")
    hosts_of(args.stack)
    with machine_lock():
        ssh_key()
        rootfs()
        build_standins(args.stack)
    return cmd_tokenizer(args)


def cmd_down(args: argparse.Namespace) -> int:
    hosts, gateway = hosts_of(args.stack)
    for h in hosts:
        stop(h)
    others = [p for p in RUN.glob("*/launcher.pid")] if RUN.exists() else []
    if not others:
        for name in ("http", "models"):
            if _alive(RUN / f"{name}.pid"):
                os.kill(int((RUN / f"{name}.pid").read_text()), signal.SIGTERM)
            (RUN / f"{name}.pid").unlink(missing_ok=True)
        run(["ip", "link", "del", BRIDGE], check=False, stderr=subprocess.DEVNULL)
        shutil.rmtree(RUN, ignore_errors=True)  # server logs too: each cluster starts with empty ones
    say(f"{len(hosts)} simulated hosts down")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    hosts, _ = hosts_of(args.stack)
    key = SIM / "ssh" / "id_ed25519"
    down = 0
    for h in hosts:
        if not _alive(h.dir / "launcher.pid"):
            print(f"{h.name:12} {h.address:15} stopped")
            down += 1
            continue
        r = run(ssh_cmd(h, key, "systemctl", "is-system-running"), check=False, capture_output=True)
        state = r.stdout.strip() or f"no ssh ({r.stderr.strip()[:60]})"
        print(f"{h.name:12} {h.address:15} running  systemd: {state}")
    return 1 if down else 0


def cmd_inventory(args: argparse.Namespace) -> int:
    """The running hosts as JSON {name: address}: an inventory for programs that learn addresses at
    deploy time (examples/cluster-from-inventory)."""
    import json

    hosts, _ = hosts_of(args.stack)
    print(json.dumps({h.name: h.address for h in hosts if _alive(h.dir / "launcher.pid")}, sort_keys=True))
    return 0


def cmd_tokenizer(args: argparse.Namespace) -> int:
    """The tokenizer the sim stack's SLA gate builds prompts with (sla.tokenizer), made with the SLA
    client's own environment (glm-infra sla makes it once)."""
    from glm_infra.tools.sla import client_env

    python = client_env()
    run([str(python), str(STANDINS / "make-tokenizer"), str(SIM / "tokenizer")])
    print(SIM / "tokenizer")
    return 0


def cmd_ssh(args: argparse.Namespace) -> int:
    hosts, _ = hosts_of(args.stack)
    match = [h for h in hosts if h.name == args.host]
    if not match:
        raise SimError(f"no simulated host {args.host!r} (hosts: {', '.join(h.name for h in hosts)})")
    argv = ssh_cmd(match[0], SIM / "ssh" / "id_ed25519", *args.cmd)
    if not args.cmd:
        argv.insert(1, "-t")
    os.execvp(argv[0], argv)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sim", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stack", default="sim", help="stack name or file whose hosts to simulate (default: sim)")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("up").set_defaults(func=cmd_up)
    sub.add_parser("prepare", help="make the image, stand-ins and SLA client now (what needs the network)").set_defaults(
        func=cmd_prepare)
    sub.add_parser("down").set_defaults(func=cmd_down)
    sub.add_parser("status").set_defaults(func=cmd_status)
    sub.add_parser("inventory").set_defaults(func=cmd_inventory)
    sub.add_parser("tokenizer").set_defaults(func=cmd_tokenizer)
    f = sub.add_parser("fleet", help="write a stack file of N simulated hosts")
    f.add_argument("n", type=int, metavar="N")
    f.add_argument("--subnet", default=str(FLEET_NET), help=f"a private /24 (default {FLEET_NET})")
    f.add_argument("--out", metavar="FILE", help="where to write it (default: standard output)")
    f.set_defaults(func=cmd_fleet)
    s = sub.add_parser("ssh")
    s.add_argument("host")
    s.add_argument("cmd", nargs=argparse.REMAINDER)
    s.set_defaults(func=cmd_ssh)
    args = ap.parse_args(argv)
    # Started outside a test session, sim and what it leaves running (they inherit this) carry a session
    # of their own, so a test session running meanwhile never takes them for its leftovers.
    os.environ.setdefault("GLM_INFRA_TEST_SESSION", f"sim-by-hand-{os.getpid()}")
    try:
        return args.func(args)
    except SimError as e:
        print(f"sim: {e}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as e:
        print(f"sim: {' '.join(map(str, e.cmd))} failed with exit {e.returncode}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
