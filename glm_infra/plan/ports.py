"""Every port glm-infra makes a host listen on, with what it is, the stack key that sets it and who may
reach it: one list, from which ``validate`` finds collisions and the firewall opens what it must.

Audiences: ``peers`` (the stack's hosts only: vLLM HTTP, DP RPC, NIXL side channels, the weights
relay and each pool's warm-cache relay on the hosts that have relay children, the exporters, the
router's metrics), ``router`` (the public port: the stack's hosts and ``router.allowedCidrs``),
``operators`` (Prometheus and Alertmanager: the stack's hosts and ``monitoring.allowedCidrs``),
``loopback`` (vllm-router's own port, which serves its admin API without a credential, and its gates:
the router's host only).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from glm_infra.spec.config import StackConfig

from .startup import relay_port, warm_cache_relays
from .topology import allocate, gates, weights_relay

PEERS, ROUTER, OPERATORS = "peers", "router", "operators"
LOOPBACK = "loopback"  # the host itself only: the firewall opens nothing for it
_INSTANCE_KEYS = {"http": ".httpPort", "dp-rpc": ".dpRpcPort", "nixl": ".nixlSideChannelPort"}


@dataclass(frozen=True)
class Listener:
    host: str
    port: int
    owner: str  # "prefill-0 http", "router metrics", …
    key: str  # the stack key that sets it: "glm-infra:prefill.httpPort"
    audience: str


def _key(top: str, rest: str) -> str:
    return f"glm-infra:{top}{rest}"


def listeners(stack: StackConfig, serve: bool = True) -> list[Listener]:
    """Every listener of every host. ``serve=False``: hosts provisioned without pools (Hosts)."""
    out: list[Listener] = []
    for inst in allocate(stack) if serve else ():
        for kind, port in inst.ports():
            out.append(Listener(inst.host, port, f"{inst.name} {kind}", _key(inst.role, _INSTANCE_KEYS[kind]), PEERS))
    for relay in weights_relay(stack, serve).values():  # hosts that serve relay children while they stage
        if relay.children:
            out.append(Listener(relay.host, stack.model.fanout_port, "weights relay", _key("model", ".fanoutPort"),
                                PEERS))
    if serve:  # each pool's warm-cache relay (plan/startup.py), on the hosts that have relay children
        for role, relays in warm_cache_relays(stack).items():
            for relay in relays.values():
                if relay.children:
                    out.append(Listener(relay.host, relay_port(stack, role), f"{role} warm-cache relay",
                                        _key("startup", ".relayPort"), PEERS))
    r = stack.router
    if r is not None and serve:
        out.append(Listener(r.host, r.port, "router http", _key("router", ".port"), ROUTER))
        out.append(Listener(r.host, r.metrics_port, "router metrics", _key("router", ".metricsPort"), PEERS))
        out.append(Listener(r.host, r.internal_port, "router internal", _key("router", ".internalPort"), LOOPBACK))
        for g in gates(stack, allocate(stack)):
            out.append(Listener(r.host, g.port, f"router gate of {g.instance}", _key("router", ".gatePort"), LOOPBACK))
    m = stack.monitoring
    if m.enabled:  # Hosts (serve=False) monitor too: every host is provisioned there
        provisioned = {i.host for i in allocate(stack)} if serve else {h.name for h in stack.hosts}
        for h in stack.hosts:
            out.append(Listener(h.name, m.node_exporter_port, "node exporter", _key("monitoring", ".nodeExporterPort"),
                                PEERS))
            if h.name in provisioned and m.dcgm_exporter_package is not None and stack.drivers.mode == "install":
                out.append(Listener(h.name, m.dcgm_exporter_port, "DCGM exporter",
                                    _key("monitoring", ".dcgmExporterPort"), PEERS))
        mon = stack.monitoring_host
        assert mon is not None
        out.append(Listener(mon, m.prometheus_port, "prometheus", _key("monitoring", ".prometheusPort"), OPERATORS))
        out.append(Listener(mon, m.alertmanager_port, "alertmanager", _key("monitoring", ".alertmanagerPort"),
                            OPERATORS))
    return out


def network(value: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    """``value`` as a network (an address as its /32 or /128); None for a DNS name."""
    try:
        return ipaddress.ip_network(value)  # an address, or a network as config's Cidr writes it
    except ValueError:
        return None


def firewall_problems(stack: StackConfig) -> list[tuple[str, str]]:
    """(key path, message) for every host address the firewall cannot use: a DNS name."""
    if not stack.firewall.enabled:
        return []
    return [(f"glm-infra:hosts[{i}].address",
             f"{h.address!r} is a DNS name; with the firewall on (glm-infra:firewall.enabled) a host's address must "
             "be an IP address: nft resolves names when it loads the table, at boot before the network is up, so "
             "the table would not load")
            for i, h in enumerate(stack.hosts) if network(h.address) is None]
