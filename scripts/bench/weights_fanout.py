"""Weights staging at fleet size: the relay tree (topology.weights_relay, what ModelWeights deploys)
against the star of before (every peer copies from the seed), on 1, 4 and 16 simulated hosts of
``scripts/sim fleet`` (lighter hosts: booted, never deployed; only the weights are staged on them).
Every host's link is throttled alike with tc, both directions (egress of host0 inside the container,
entered with nsenter, and of its vb-NAME side on the machine); the model source (the machine's mirror
on :8089) to a fraction of one host link. Each host runs the exact weights-stage command the
per-host plan produces for it (the star: the same plan with RELAY_DEGREE = N - 1). Goal: 16 hosts
within 1.2 × one host.

    venv/bin/python scripts/bench/weights_fanout.py --hosts 1,4,16 --runs 3 --subnet 10.90.0.0/24
        [--link-mbit 200] [--source-mbit 50] [--shards 24] [--shard-mb 16] [--modes relay,star]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ipaddress
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _repo  # noqa: F401  (the repository on sys.path)
import yaml

from glm_infra.plan import topology  # noqa: E402
from glm_infra.render import weights_source  # noqa: E402
from glm_infra.roles import weights
from glm_infra.stack import load_dict, unprefixed  # noqa: E402
from testbed import STANDINS
from testbed import cluster as simcluster
from testbed.bench.common import median, sim, sim_config

REVISION = "bench0000000000000000000000000000000000"
PATH = "/mnt/model/bench/GLM-5.2-NVFP4"
PREFIX = "wb"


def ssh(address: str, cmd: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(["ssh", "-i", str(simcluster.ssh_key()), *simcluster.SSH_OPTS, f"root@{address}", cmd],
                       input=stdin, text=True, capture_output=True, timeout=3600)
    if check and p.returncode != 0:
        raise RuntimeError(f"{address}: {cmd[:200]}: {p.stdout[-1500:]}{p.stderr[-1500:]}")
    return p


def stage_commands(cfg: dict, n: int, star: bool) -> dict[str, tuple[str, str]]:
    """Host → (address, its weights-stage command) for the first n hosts, from the per-host plan (a
    Hosts plan: every host provisioned, the first the seed)."""
    raw = unprefixed(cfg)
    raw["hosts"] = raw["hosts"][:n]
    raw["model"] = {**raw["model"], "revision": REVISION, "path": PATH, "diskMarginGb": 1, "source": "mirror"}
    for pool in ("prefill", "decode", "colocated", "router"):
        raw.pop(pool, None)
    stack = load_dict(raw, "weights bench", serve=False).config
    plan = topology.plan(stack, serve=False)
    degree = topology.RELAY_DEGREE
    topology.RELAY_DEGREE = max(n - 1, 1) if star else degree
    try:
        return {h.name: (h.address, next(s for s in weights.weights_steps(stack, plan, h)
                                         if s.name == "weights-stage").create) for h in plan.hosts}
    finally:
        topology.RELAY_DEGREE = degree


def stage(cmds: dict[str, tuple[str, str]]) -> float:
    """Seconds until every host has the checkpoint verified, all started at once."""
    src = weights_source()
    clean = f"rm -rf {PATH} {PATH}.revisions"
    with concurrent.futures.ThreadPoolExecutor(len(cmds)) as ex:
        list(ex.map(lambda a: ssh(a[0], clean), cmds.values()))
        t0 = time.monotonic()
        results = list(ex.map(lambda a: ssh(a[0], a[1], stdin=src), cmds.values()))
        elapsed = time.monotonic() - t0
        list(ex.map(lambda a: ssh(a[0], clean), cmds.values()))
    for r in results:
        assert "verified at" in r.stdout, r.stdout
    return elapsed


def leader_pid(host: simcluster.SimHost) -> int:
    """The container's init (its network namespace), below the launcher's systemd-nspawn."""
    launcher = int((host.dir / "launcher.pid").read_text())
    nspawn = subprocess.run(["pgrep", "-P", str(launcher), "-x", "systemd-nspawn"], capture_output=True,
                            text=True).stdout.split()
    init = subprocess.run(["pgrep", "-P", nspawn[0]], capture_output=True, text=True).stdout.split()
    return int(init[0])


def shape(dev: str, mbit: float | None, netns_pid: int | None = None) -> None:
    pre = ["nsenter", "-t", str(netns_pid), "-n"] if netns_pid else []
    subprocess.run([*pre, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
    if mbit is not None:
        subprocess.run([*pre, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit:g}mbit",
                        "burst", "256kb", "latency", "100ms"], check=True)


def shape_source(bridge: str, mbit: float | None) -> None:
    """Only what the mirror (:8089) sends onto the bridge: host-to-host traffic is bridged port to port."""
    subprocess.run(["tc", "qdisc", "del", "dev", bridge, "root"], capture_output=True)
    if mbit is None:
        return
    for cmd in (
        f"qdisc add dev {bridge} root handle 1: htb default 10",
        f"class add dev {bridge} parent 1: classid 1:10 htb rate 100gbit",
        f"class add dev {bridge} parent 1: classid 1:20 htb rate {mbit:g}mbit ceil {mbit:g}mbit",
        f"filter add dev {bridge} protocol ip parent 1: prio 1 u32 match ip sport {simcluster.MODEL_PORT} 0xffff "
        "flowid 1:20",
    ):
        subprocess.run(["tc", *cmd.split()], check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", default="1,4,16")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--subnet", default="10.90.0.0/24")
    ap.add_argument("--link-mbit", type=float, default=200)
    ap.add_argument("--source-mbit", type=float, default=50)
    ap.add_argument("--shards", type=int, default=24)
    ap.add_argument("--shard-mb", type=int, default=16)
    ap.add_argument("--modes", default="relay,star", help="relay, star or both")
    args = ap.parse_args()
    counts = sorted({int(x) for x in args.hosts.split(",")})
    modes = [m for m in args.modes.split(",") if m]
    net = ipaddress.ip_network(args.subnet)
    simcluster.use_network(net)
    cfg = sim_config(max(counts), args.subnet, PREFIX)
    model_dir = Path(cfg["glm-infra:model"]["mirrorUrl"].rstrip("/")).name
    subprocess.run([sys.executable, str(STANDINS / "make-checkpoint"), str(simcluster.SIM / "models" / model_dir),
                    "--revision", REVISION, "--shards", str(args.shards), "--shard-mb", str(args.shard_mb)], check=True)
    stack_file = Path(tempfile.mkdtemp(prefix="glm-bench-weights-")) / "Pulumi.weights.yaml"
    stack_file.write_text(yaml.safe_dump({"config": cfg}, sort_keys=False))
    hosts = [simcluster.SimHost(h["name"], h["address"]) for h in cfg["glm-infra:hosts"]]
    times: dict[tuple[str, int], list[float]] = {}
    t_up = time.monotonic()
    sim("up", stack_file)
    print(f"{len(hosts)} hosts up in {time.monotonic() - t_up:.0f} s on {net}; links {args.link_mbit:g} Mbit/s "
          f"each way, source {args.source_mbit:g} Mbit/s; checkpoint {args.shards} × {args.shard_mb} MiB", flush=True)
    try:
        for h in hosts:
            shape(f"vb-{h.name}", args.link_mbit)  # into the host
            shape("host0", args.link_mbit, leader_pid(h))  # out of the host
        shape_source(simcluster.BRIDGE, args.source_mbit)
        for run in range(args.runs):
            for n in counts:
                for mode in (modes if n > 1 else modes[:1]):
                    secs = stage(stage_commands(cfg, n, star=mode == "star"))
                    times.setdefault((mode, n), []).append(secs)
                    print(f"  run {run + 1}: {n:2d} hosts, {mode}: {secs:.1f} s", flush=True)
    finally:
        shape_source(simcluster.BRIDGE, None)
        sim("down", stack_file)  # nothing left running, nothing left on the bridge
    one = median(times[(modes[0], counts[0])])
    print(f"\nmedians over {args.runs} runs (shared 2-core machine: every host's hashing and copying on the same CPUs)")
    print("| hosts | " + " | ".join(f"{m} | {m} ratio to 1 host" for m in modes) + " |")
    print("| --- |" + " --- | --- |" * len(modes))
    for n in counts:
        cells = []
        for m in modes:
            xs = times.get((m, n)) or times.get((modes[0], n))
            cells += [f"{median(xs):.1f} s", f"{median(xs) / one:.2f}"]
        print(f"| {n} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
