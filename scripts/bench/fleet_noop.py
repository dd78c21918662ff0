"""A fleet-sized stack against stand-in hosts: the first `pulumi up`, a no-op `pulumi up` (0 changes
asserted) and `pulumi preview` of the deployed stack (what a pull request's review runs), medians
over --runs, for prod-b300's settings on N hosts (testbed.bench.common.b300_fleet: two thirds prefill, the rest
decode, the router on the first decode host).

    venv/bin/python scripts/bench/fleet_noop.py [--hosts 96] [--runs 3] [--first-runs 1]
                                                [--first-up-skip-checkpoints] [--json FILE]

The hosts are stand-ins, local only: one throwaway container (systemd-nspawn, the simulated hosts'
read-only image, the machine's network) runs sshd on loopback addresses 127.77.x.y, one port, with
a host key and an authorized key the benchmark makes. Its ForceCommand, testbed/bench/standin-host.sh,
takes the place of every command glm-infra sends: it runs none of them, discards their stdin and
answers only what the program reads to go on ("no-reboot" to the reboot step, "{}" as facts). So the
first `up` measures the engine, the program and the provider making every resource over SSH, not
the steps' work (that is fleet_up.py's, on simulated hosts). sshd allows 16 listening sockets a
process: one sshd per 16 hosts, all in the one container, which is killed at the end (also on
failure) and its files removed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import _repo  # noqa: F401  (the repository on sys.path)

from testbed.bench.common import Project, median, parallel_for
from testbed.bench.fleet import STANDIN_SCRIPT, standin_address, standin_config
from testbed.cluster import rootfs  # the simulated hosts' image: it has sshd

SOCKETS_PER_SSHD = 16  # sshd's MAX_LISTEN_SOCKS
MOUNT = "/srv"  # where the container sees the stand-in's folder (an empty folder of the image)


def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def machine_busy() -> float:
    """CPU seconds the whole machine spent busy (every user of it)."""
    f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class StandinHosts:
    """n stand-in hosts on loopback (see the module's docstring); ``key`` logs in to each."""

    def __init__(self, folder: Path, n: int) -> None:
        self.dir = folder
        self.addresses = [standin_address(i) for i in range(n)]
        self.port = free_port(self.addresses[0])
        self.key = folder / "client_ed25519"
        self.log = folder / "commands.log"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> StandinHosts:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _start(self) -> None:
        d = self.dir
        d.mkdir(parents=True)
        for name in ("host_ed25519", "client_ed25519"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"glm-bench-{name}",
                            "-f", str(d / name)], check=True)
        shutil.copy(d / "client_ed25519.pub", d / "authorized_keys")
        shutil.copy(STANDIN_SCRIPT, d / "standin-host.sh")
        (d / "standin-host.sh").chmod(0o755)
        self.log.write_text("")
        common = "\n".join([
            f"HostKey {MOUNT}/host_ed25519", f"AuthorizedKeysFile {MOUNT}/authorized_keys",
            "PermitRootLogin prohibit-password", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "UsePAM no", "StrictModes no", "UseDNS no", "PermitTTY no", "AllowTcpForwarding no",
            "X11Forwarding no", "PrintMotd no", "LogLevel ERROR",
            # pulumi opens one connection per step, many at once.
            "MaxStartups 1000", "MaxSessions 1000",
            f"ForceCommand {MOUNT}/standin-host.sh", f"SetEnv GLM_STANDIN_LOG={MOUNT}/commands.log",
        ])
        for k in range(0, len(self.addresses), SOCKETS_PER_SSHD):
            listen = "".join(f"ListenAddress {a}:{self.port}\n" for a in self.addresses[k:k + SOCKETS_PER_SSHD])
            (d / f"sshd-{k // SOCKETS_PER_SSHD:02d}.conf").write_text(listen + common + "\n")
        (d / "serve.sh").write_text(
            "mkdir -p /run/sshd\n"
            f"for c in {MOUNT}/sshd-*.conf; do /usr/sbin/sshd -D -e -f \"$c\" & done\n"
            "wait\n")
        out = open(d / "container.log", "wb")
        # Not booted (no --boot): SIGTERM to nspawn kills everything in the container.
        self.proc = subprocess.Popen(
            ["systemd-nspawn", "--quiet", "--register=no", "--keep-unit", "--read-only", "-D", str(rootfs()),
             f"--bind={d}:{MOUNT}", "/bin/bash", f"{MOUNT}/serve.sh"],
            stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
        out.close()
        deadline = time.monotonic() + 60
        for a in self.addresses:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"stand-in container exited {self.proc.returncode}:\n"
                                       f"{(d / 'container.log').read_text(errors='replace')[-2000:]}")
                try:
                    socket.create_connection((a, self.port), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"stand-in {a}:{self.port} does not answer:\n"
                                           f"{(d / 'container.log').read_text(errors='replace')[-2000:]}") from None
                    time.sleep(0.2)
        # One real login, to the last host: the stand-in answers a facts read with "{}".
        p = subprocess.run(["ssh", "-i", str(self.key), "-p", str(self.port), "-o", "BatchMode=yes",
                            "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                            "-o", "LogLevel=ERROR", f"root@{self.addresses[-1]}",
                            "/opt/glm-infra/libexec/hostcheck.py facts"],
                           input="", capture_output=True, text=True, timeout=30)
        if p.returncode != 0 or p.stdout.strip() != "{}":
            raise RuntimeError(f"stand-in login failed ({p.returncode}): {p.stdout!r} {p.stderr!r}")
        self.log.write_text("")

    def commands(self) -> int:
        """Commands the stand-ins were sent so far."""
        return len(self.log.read_text().splitlines())

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(timeout=20)
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)


def summary_counts(stdout: str) -> dict[str, int]:
    """The counts of pulumi's "Resources:" summary (created, updated, …, unchanged)."""
    summary = stdout.split("Resources:")[-1]
    out = {k: 0 for k in ("created", "updated", "replaced", "deleted", "unchanged")}
    for n, k in re.findall(r"(\d+) (created|updated|replaced|deleted|unchanged)", summary):
        out[k] += int(n)
    out["changes"] = out["created"] + out["updated"] + out["replaced"] + out["deleted"]
    return out


def timed(project: Project, args: str, standins: StandinHosts, env_prefix: str = "") -> dict:
    sent0, busy0, cpu0 = standins.commands(), machine_busy(), children_cpu()
    t, p = project.pulumi(args, env_prefix=env_prefix)
    busy, cpu = machine_busy() - busy0, children_cpu() - cpu0
    return {"s": t, **summary_counts(p.stdout), "ssh_commands": standins.commands() - sent0,
            "pulumi_cpu_s": cpu, "machine_busy_of_2_cores": busy / (2 * t)}


def bench(n: int, runs: int, first_runs: int, first_env: str = "") -> dict:
    project = Project()
    stack = f"b300-{n}h-standin"
    out: dict = {"hosts": n, "first": [], "noop": [], "preview": []}
    try:
        with StandinHosts(project.dir / "standin", n) as standins:
            cfg = standin_config(n, standins.port, str(standins.key))
            project.write_stack(stack, cfg)
            project.init(stack)
            # (--parallel: the stand-ins answer at once, yet `up` refuses less than the stack needs)
            up = f"up -s {stack} --yes --skip-preview --non-interactive --parallel {parallel_for(cfg)}"
            for run in range(first_runs):
                if run:
                    project.pulumi(f"destroy -s {stack} --yes --skip-preview --non-interactive")
                r = timed(project, up, standins, first_env)
                out["first"].append(r)
                print(f"  {n} hosts, {first_env}first up {run + 1}: {r['s']:.1f}s, {r['created']} created, "
                      f"{r['ssh_commands']} SSH commands, pulumi CPU {r['pulumi_cpu_s']:.0f}s, "
                      f"machine busy {r['machine_busy_of_2_cores']:.0%} of 2 cores", flush=True)
            # Alternated, so a run cut short still has figures of both.
            for run in range(runs):
                for kind, cmd in (("noop", up), ("preview", f"preview -s {stack} --non-interactive")):
                    r = timed(project, cmd, standins)
                    out[kind].append(r)
                    print(f"  {n} hosts, {'no-op up' if kind == 'noop' else 'preview'} {run + 1}: {r['s']:.1f}s, "
                          f"{r['changes']} changes, {r['unchanged']} unchanged, {r['ssh_commands']} SSH commands, "
                          f"pulumi CPU {r['pulumi_cpu_s']:.0f}s, machine busy {r['machine_busy_of_2_cores']:.0%}",
                          flush=True)
                    if r["changes"]:
                        raise RuntimeError(f"{n} hosts: a {kind} after the first up has {r['changes']} changes")
            out["resources"] = out["noop"][0]["unchanged"] if out["noop"] else out["first"][0]["created"]
            # No destroy: the stand-ins hold nothing, and the state goes with the project.
    finally:
        project.cleanup()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", default="96", help="fleet sizes, comma-separated (e.g. 16,96)")
    ap.add_argument("--runs", type=int, default=3, help="runs of the no-op up and of the preview")
    ap.add_argument("--first-runs", type=int, default=1, help="runs of the first up (each after a destroy)")
    ap.add_argument("--first-up-skip-checkpoints", action="store_true",
                    help="the first up with PULUMI_SKIP_CHECKPOINTS=true: the engine writes the whole state after "
                         "every step, which grows with the square of the resources (a 96-host first up: hours "
                         "here); the no-op up and the preview are always plain")
    ap.add_argument("--json", metavar="FILE", help="also write every run's figures here")
    args = ap.parse_args()
    # A SIGTERM unwinds like Ctrl-C: the stand-ins' container is killed and the project removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sizes = [int(x) for x in args.hosts.split(",")]
    if any(n < 2 for n in sizes):
        ap.error("--hosts: a P/D stack needs at least 2 hosts")
    print(f"load average at start {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores "
          "(the machine is shared with other work: noisy figures)", flush=True)
    results = []
    for n in sizes:
        results.append(bench(n, args.runs, args.first_runs,
                             "PULUMI_SKIP_CHECKPOINTS=true " if args.first_up_skip_checkpoints else ""))
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"\nstand-in hosts (loopback sshd, no command run); medians over {args.first_runs} first up(s) and "
          f"{args.runs} run(s) of the rest; machine busy = every user of the 2 cores"
          + ("; the first up with PULUMI_SKIP_CHECKPOINTS=true" if args.first_up_skip_checkpoints else ""))
    print("| hosts | resources (per host) | first `pulumi up` | no-op `pulumi up` | `pulumi preview` (deployed) "
          "| changes | SSH commands: first / no-op / preview |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        def med(kind: str, key: str = "s") -> float:
            return median([x[key] for x in r[kind]]) if r[kind] else float("nan")
        changes = max(x["changes"] for x in r["noop"] + r["preview"]) if r["noop"] + r["preview"] else 0
        print(f"| {r['hosts']} | {r['resources']} ({r['resources'] / r['hosts']:.1f}) "
              f"| {med('first'):.1f} s ({med('first', 'machine_busy_of_2_cores'):.0%} busy) "
              f"| {med('noop'):.1f} s ({med('noop', 'machine_busy_of_2_cores'):.0%} busy) "
              f"| {med('preview'):.1f} s ({med('preview', 'machine_busy_of_2_cores'):.0%} busy) | {changes} "
              f"| {med('first', 'ssh_commands'):.0f} / {med('noop', 'ssh_commands'):.0f} / "
              f"{med('preview', 'ssh_commands'):.0f} |")
    print("\npulumi CPU seconds (engine + language host + provider), medians")
    print("| hosts | first up | no-op up | preview |\n| --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['hosts']} | " + " | ".join(
            f"{median([x['pulumi_cpu_s'] for x in r[k]]):.0f}" if r[k] else "-" for k in ("first", "noop", "preview"))
            + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
