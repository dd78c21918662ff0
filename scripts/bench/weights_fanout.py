"""Weights staging on the simulated cluster: a synthetic checkpoint served by a source throttled to a
quarter of the host-to-host bandwidth (tc on the bridge, like a shared uplink), staged to 1 host and
to 3 hosts with the commands the ModelWeights component sends. Goal: 3 hosts ≤ 1.3 × 1 host; a
naive per-host download (every host from the source) is measured beside it.

    venv/bin/python scripts/bench/weights_fanout.py [--runs 3] [--shards 24] [--shard-mb 128]
"""

from __future__ import annotations

import argparse
import os
import concurrent.futures
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

from benchlib import ROOT, SIM_STACK, median, sim

sys.path.insert(0, str(ROOT))
from glm_infra import hostplan, topology  # noqa: E402
from glm_infra.config import ModelConfig  # noqa: E402
from glm_infra.render import WEIGHTS, weights_source  # noqa: E402
from glm_infra.stack import load_file  # noqa: E402

CACHE = Path(os.environ.get("GLM_INFRA_CACHE", Path.home() / ".cache/glm-infra")) / "sim"
BRIDGE = "br-glmsim"
HOSTS = [("sim-1", "10.88.0.11"), ("sim-2", "10.88.0.12"), ("sim-3", "10.88.0.13")]
REVISION = "bench0000000000000000000000000000000000"


def ssh(host: str, cmd: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    addr = dict(HOSTS)[host]
    p = subprocess.run(["ssh", "-i", str(CACHE / "ssh/id_ed25519"), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
                        "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", f"root@{addr}", cmd],
                       input=stdin, text=True, capture_output=True, timeout=3600)
    if check and p.returncode != 0:
        raise RuntimeError(f"{host}: {cmd}: {p.stderr[-2000:]}")
    return p


def model(path: str) -> ModelConfig:
    cfg = yaml.safe_load(SIM_STACK.read_text())["config"]["glm-infra:model"]
    return ModelConfig.model_validate({**cfg, "revision": REVISION, "path": path, "diskMarginGb": 1})


def stage_commands(hosts: list[tuple[str, str]], path: str) -> dict[str, str]:
    """Host → its weights-stage command, from the per-host plan the components deploy (the sim stack
    with these hosts, provisioned without serving, the first one the seed)."""
    base = load_file(SIM_STACK).config
    stack = base.model_copy(update={
        "hosts": [base.hosts[0].model_copy(update={"name": n, "address": a}) for n, a in hosts],
        "model": model(path).model_copy(update={"seed_host": hosts[0][0]}),
    })
    plan = topology.plan(stack, serve=False)
    return {h.name: next(s for s in hostplan.weights_steps(stack, plan, h) if s.name == "weights-stage").create
            for h in plan.hosts}


def stage(hosts: list[tuple[str, str]], path: str, naive: bool = False) -> float:
    """Seconds until every host has the checkpoint, as the component stages it (or naively)."""
    m = model(path)
    cmds = stage_commands(hosts, path)
    if naive:  # every host a seed of its own: each downloads the whole checkpoint from the source
        cmds = {n: cmds[hosts[0][0]] for n, _ in hosts}
    src = weights_source()
    for n, _ in hosts:
        ssh(n, f"{WEIGHTS} remove --path {path} >/dev/null 2>&1 || true; rm -rf {path}.revisions")
    t0 = time.monotonic()
    if not naive:
        ssh(hosts[0][0], f"install -D -m 0755 /dev/stdin {WEIGHTS} && {WEIGHTS} fanout-start --revision {REVISION} "
                         f"--path {path} --bind {hosts[0][1]}:{m.fanout_port}", stdin=src)
    with concurrent.futures.ThreadPoolExecutor(len(hosts)) as ex:
        results = list(ex.map(lambda h: ssh(h[0], cmds[h[0]], stdin=src), hosts))
    elapsed = time.monotonic() - t0
    if not naive:
        ssh(hosts[0][0], f"{WEIGHTS} fanout-stop")
    for r in results:
        assert "verified at" in r.stdout, r.stdout
    return elapsed


def throttle(rate_mbit: float | None) -> None:
    """Shape only what the machine's model source (port 8089) sends onto the bridge."""
    subprocess.run(["tc", "qdisc", "del", "dev", BRIDGE, "root"], capture_output=True)
    if rate_mbit is None:
        return
    for cmd in (
        f"qdisc add dev {BRIDGE} root handle 1: htb default 10",
        f"class add dev {BRIDGE} parent 1: classid 1:10 htb rate 100gbit",
        f"class add dev {BRIDGE} parent 1: classid 1:20 htb rate {rate_mbit:.0f}mbit ceil {rate_mbit:.0f}mbit",
        f"filter add dev {BRIDGE} protocol ip parent 1: prio 1 u32 match ip sport 8089 0xffff flowid 1:20",
    ):
        subprocess.run(["tc", *cmd.split()], check=True)


def host_to_host_mbit(path: str) -> float:
    """What one host copies from another with the same tools (weights.py serve + fetch)."""
    one = stage(HOSTS[:1], path)  # sim-1 holds the checkpoint now; serve it to sim-2
    del one
    m = model(path)
    ssh("sim-1", f"{WEIGHTS} fanout-start --revision {REVISION} --path {path} --bind {HOSTS[0][1]}:{m.fanout_port}")
    ssh("sim-2", f"rm -rf {path} {path}.revisions")
    size = int(ssh("sim-1", f"du -sb {path}.revisions/{REVISION} | cut -f1").stdout)
    t0 = time.monotonic()
    ssh("sim-2", stage_commands(HOSTS[:2], path)["sim-2"], stdin=weights_source())
    secs = time.monotonic() - t0
    ssh("sim-1", f"{WEIGHTS} fanout-stop")
    return size * 8 / 1e6 / secs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--shards", type=int, default=24)
    ap.add_argument("--shard-mb", type=int, default=128)
    args = ap.parse_args()
    subprocess.run([sys.executable, str(ROOT / "scripts/standins/make-checkpoint"), str(CACHE / "models/GLM-5.2-NVFP4"),
                    "--revision", REVISION, "--shards", str(args.shards), "--shard-mb", str(args.shard_mb)], check=True)
    sim("down", SIM_STACK)  # fresh hosts, and a model server whose log is this run's
    sim("up", SIM_STACK)
    path = "/mnt/model/bench/GLM-5.2-NVFP4"
    try:
        throttle(None)
        h2h = host_to_host_mbit(path)
        source = h2h / 4
        print(f"host-to-host {h2h:.0f} Mbit/s; source throttled to {source:.0f} Mbit/s "
              f"({args.shards} × {args.shard_mb} MiB)", flush=True)
        throttle(source)
        one, three = [], []
        for run in range(args.runs):
            one.append(stage(HOSTS[:1], path))
            three.append(stage(HOSTS, path))
            print(f"  run {run + 1}: 1 host {one[-1]:.1f}s, 3 hosts {three[-1]:.1f}s", flush=True)
        naive = stage(HOSTS, path, naive=True)
        print(f"  naive (every host from the source): {naive:.1f}s", flush=True)
    finally:
        throttle(None)
        sim("down", SIM_STACK)  # leaves nothing running for the next user of the simulated cluster
    print(f"\nmedians over {args.runs} runs")
    print("| staging | median | ratio to 1 host |\n| --- | --- | --- |")
    print(f"| 1 host (seed from the source) | {median(one):.1f} s | 1.00 |")
    print(f"| 3 hosts (seed + fan-out) | {median(three):.1f} s | {median(three) / median(one):.2f} (goal ≤ 1.3) |")
    print(f"| 3 hosts, naive per-host download (1 run) | {naive:.1f} s | {naive / median(one):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
