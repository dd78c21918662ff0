"""Every port glm-infra makes a host listen on, with what it is, the stack key that sets it and who may
reach it: one list, from which ``validate`` finds collisions and the firewall opens what it must.

Audiences: ``peers`` (the stack's hosts only: vLLM HTTP, DP RPC, NIXL side channels, the weights
relay and each pool's warm-cache relay on the hosts that have relay children, the exporters, the
router's metrics), ``router`` (the public port: the stack's hosts and ``router.allowedCidrs``),
``operators`` (Prometheus and Alertmanager: the stack's hosts and ``monitoring.allowedCidrs``),
``loopback`` (vllm-router's own port, which serves its admin API without a credential, and its gates:
the router's host only; DCGM's host engine on the hosts whose driver step runs it).

The lists of outsiders the firewall lets in (``allowlists``: SSH's ``firewall.adminCidrs``, the router's
``router.allowedCidrs``, the monitoring's ``monitoring.allowedCidrs``): validate refuses the first two
unset while the firewall is on (``unset_allowlists``), and the stack's warnings name one that opens a port
to every address or still holds a documentation network (``firewall_warnings``).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from glm_infra.spec import packages
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
        for host in [r.host, *r.standby_hosts]:  # every router host runs the router and its front
            out.append(Listener(host, r.port, "router http", _key("router", ".port"), ROUTER))
            out.append(Listener(host, r.metrics_port, "router metrics", _key("router", ".metricsPort"), PEERS))
            out.append(Listener(host, r.internal_port, "router internal", _key("router", ".internalPort"), LOOPBACK))
            for g in gates(stack, allocate(stack)):
                out.append(Listener(host, g.port, f"router gate of {g.instance}", _key("router", ".gatePort"), LOOPBACK))
            if r.standby_hosts:
                out.append(Listener(host, r.peer_port, "router front to the other fronts", _key("router", ".peerPort"),
                                    LOOPBACK))
    m, d = stack.monitoring, stack.drivers
    provisioned = {i.host for i in allocate(stack)} if serve else {h.name for h in stack.hosts}
    # The driver step runs DCGM's host engine (nvidia-dcgm) for the health gate's dcgmi diag or the exporter.
    if d.mode == "install" and (d.dcgm_diag_level > 0 or m.enabled and m.dcgm_exporter_package is not None):
        for h in stack.hosts:
            if h.name in provisioned:
                out.append(Listener(h.name, packages.DCGM_HOSTENGINE_PORT, "DCGM host engine",
                                    "nv-hostengine's default port", LOOPBACK))
    if m.enabled:  # Hosts (serve=False) monitor too: every host is provisioned there
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


# Networks reserved for documentation (RFC 5737, RFC 3849): no client or operator connects from one, so in
# a list of who may connect, one is a placeholder left in (the committed stacks carry them).
DOCUMENTATION_NETWORKS = tuple(ipaddress.ip_network(n) for n in (
    "192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "2001:db8::/32"))


@dataclass(frozen=True)
class Allowlist:
    """A list of outsiders the firewall lets in: its key, what it opens, who belongs in it and the networks
    given (None: unset). ``required``: glm-infra cannot guess it, open and closed are both wrong."""

    key: str
    opens: str
    who: str
    cidrs: list[str] | None
    required: bool


def allowlists(stack: StackConfig, serve: bool = True) -> list[Allowlist]:
    """Every list of outsiders the firewall of ``stack`` lets in (serve=False: no router, as Hosts)."""
    out = [Allowlist(_key("firewall", ".adminCidrs"), "SSH on every host",
                     "the networks you and the machine running pulumi connect from (a bastion, a VPN)",
                     stack.firewall.admin_cidrs, True)]
    r = stack.router
    if r is not None and serve:
        out.append(Allowlist(_key("router", ".allowedCidrs"), f"the router's public port ({r.port} on {r.host})",
                             "the networks your clients (or their load balancer) connect from", r.allowed_cidrs, True))
    if stack.monitoring.enabled:
        out.append(Allowlist(_key("monitoring", ".allowedCidrs"),
                             f"Prometheus and Alertmanager on {stack.monitoring_host} (they ask no credential)",
                             "the networks the SLA gate and your dashboards connect from",
                             stack.monitoring.allowed_cidrs, False))
    return out


def unset_allowlists(stack: StackConfig, serve: bool = True) -> list[tuple[str, str]]:
    """(key path, message) for each list of who may connect that the firewall needs and the stack leaves
    unset: SSH open to every address and the router's public port closed to every client, silently, are
    both wrong, and glm-infra cannot know which networks are right."""
    if not stack.firewall.enabled:
        return []
    return [(a.key, f"not set: list who besides the stack's hosts may reach {a.opens}: {a.who}, e.g. "
                    "[203.0.113.0/24], or 0.0.0.0/0 and ::/0 to open it to every address on purpose (glm-infra "
                    "will not guess: left open, any address could reach it; left closed, only the stack's hosts)")
            for a in allowlists(stack, serve) if a.required and a.cidrs is None]


def firewall_warnings(stack: StackConfig, serve: bool = True) -> list[str]:
    """What the firewall lets in that is likely not what was meant: nothing filtered (the firewall off),
    a list that opens a port to every address (0.0.0.0/0, ::/0, or networks that add up to one of them),
    a list still holding a documentation network (a placeholder)."""
    if not stack.firewall.enabled:
        front = "SSH, the router's public port" if serve and stack.router is not None else "SSH"
        rest = "vLLM, its relays" if serve else "the weights relay"
        return [f"{_key('firewall', '.enabled')} is false: nothing filters who reaches the hosts; {front} and every "
                f"port glm-infra opens ({rest}, the exporters, Prometheus, Alertmanager) answer every address that "
                "can route to them, and firewall.adminCidrs, router.allowedCidrs and monitoring.allowedCidrs are not "
                "applied"]
    out = []
    for a in allowlists(stack, serve):
        nets = [n for c in a.cidrs or () if (n := network(c)) is not None]
        everyone = [v for v, whole in ((4, "0.0.0.0/0"), (6, "::/0"))
                    if ipaddress.ip_network(whole) in ipaddress.collapse_addresses(n for n in nets if n.version == v)]
        if everyone:
            given = ", ".join(str(n) for n in nets if n.version in everyone)
            family = "IPv4 and IPv6" if len(everyone) == 2 else f"IPv{everyone[0]}"
            out.append(f"{a.key}: {given} lets every {family} address reach {a.opens}; list {a.who} unless that "
                       "is what you mean")
        placeholders = [str(n) for n in nets if any(n.version == d.version and n.subnet_of(d)
                                                    for d in DOCUMENTATION_NETWORKS)]
        if placeholders:
            what = "is a documentation network" if len(placeholders) == 1 else "are documentation networks"
            out.append(f"{a.key}: {', '.join(placeholders)} {what} (RFC 5737, RFC 3849), a placeholder nobody "
                       f"connects from: replace it with {a.who}")
    return out


def firewall_problems(stack: StackConfig) -> list[tuple[str, str]]:
    """(key path, message) for every host address the firewall cannot use: a DNS name."""
    if not stack.firewall.enabled:
        return []
    return [(f"glm-infra:hosts[{i}].address",
             f"{h.address!r} is a DNS name; with the firewall on (glm-infra:firewall.enabled) a host's address must "
             "be an IP address: nft resolves names when it loads the table, at boot before the network is up, so "
             "the table would not load")
            for i, h in enumerate(stack.hosts) if network(h.address) is None]
