"""The fleet benchmarks' helpers that the tests check: the engine's event log read as step durations
(scripts/bench/fleet_up.py), the examples' hosts-only stack on a fleet, and the addresses and script of
the no-op benchmark's stand-in hosts (scripts/bench/fleet_noop.py)."""

from __future__ import annotations

import ipaddress
import json
import os
import re
from collections import defaultdict

import yaml

from testbed import ROOT
from testbed.bench.common import b300_fleet
from testbed.cluster import DEFAULT_NET, fleet_addresses, moved

STANDIN_SCRIPT = ROOT / "testbed" / "bench" / "standin-host.sh"
STANDIN_NET = ipaddress.ip_network("127.77.0.0/16")  # loopback only


def standin_address(i: int) -> str:
    return str(STANDIN_NET.network_address + (i // 200) * 256 + i % 200 + 10)


def events(stdout: str) -> list[dict]:
    """The engine events `pulumi up --json` streams, one JSON object a line."""
    out = []
    for line in stdout.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def step_durations(evs: list[dict]) -> dict[str, float]:
    """Seconds from a resource's pre-event to its outputs event, by resource name (the engine's
    timestamps are whole seconds)."""
    pre: dict[str, int] = {}
    out: dict[str, float] = {}
    for ev in evs:
        for kind in ("resourcePreEvent", "resOutputsEvent"):
            if kind in ev:
                meta = ev[kind]["metadata"]
                if not meta.get("type", "").startswith("command:"):
                    continue  # a component: its span is its children's
                name = meta["urn"].rsplit("::", 1)[-1]
                if kind == "resourcePreEvent":
                    pre[name] = ev["timestamp"]
                elif name in pre:
                    out[name] = ev["timestamp"] - pre[name]
    return out


def by_step(durations: dict[str, float], hosts: list[str]) -> dict[str, list[float]]:
    """Durations grouped by step: the host's name taken out of each resource name."""
    out: dict[str, list[float]] = defaultdict(list)
    pat = re.compile(r"(^|-)(" + "|".join(map(re.escape, sorted(hosts, key=len, reverse=True))) + r")(-|$)")
    for name, d in durations.items():
        out[pat.sub(r"\1HOST\3", name, count=1)].append(d)
    return dict(out)


def standin_config(n: int, port: int, key: str) -> dict:
    """The no-op benchmark's stack: prod-b300's settings on n stand-in hosts (``b300_fleet``) that answer SSH
    on ``port`` of their loopback addresses with ``key``. The hosts are throwaway, so the stack may keep its
    state in the benchmark's own folder (stateInCheckout: `up` refuses that for real hosts)."""
    cfg = b300_fleet(n, standin_address)
    for h in cfg["glm-infra:hosts"]:
        h["sshPort"] = port
    cfg["glm-infra:ssh"]["privateKeyPath"] = key
    cfg["glm-infra:stateInCheckout"] = True
    return cfg


def hosts_only_config(n: int, net: ipaddress.IPv4Network) -> dict:
    """examples/hosts-only's sim stack on the fleet's n hosts (the machine's address moved to net's .1)."""
    cfg = yaml.safe_load((ROOT / "examples/hosts-only/Pulumi.sim.yaml").read_text())["config"]
    hosts = cfg["glm-example:hosts"]
    nics = hosts["hosts"][0]["compute_nics"]
    hosts["hosts"] = [{"name": f"fleet-{i + 1}", "address": a, "compute_nics": nics}
                      for i, a in enumerate(fleet_addresses(n, net))]
    hosts["ssh"]["private_key_path"] = os.path.expanduser(hosts["ssh"]["private_key_path"])
    return moved(cfg, str(DEFAULT_NET.network_address + 1), str(net.network_address + 1))
