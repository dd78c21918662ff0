"""Pure planning of the router: its gates (one per instance) and its hosts. One router host, or several
behind a virtual address that keepalived (VRRP) keeps on one of them: each runs vllm-router and its front,
hot, and a front passes a request its own router cannot take to another router host's front."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from glm_infra.spec.config import StackConfig
from glm_infra.spec.paths import url_host


class Instance(Protocol):  # topology.Instance, as the gates read it (topology imports this module)
    @property
    def name(self) -> str: ...
    role: str

    @property
    def url(self) -> str: ...


@dataclass(frozen=True)
class Gate:
    """How the router reaches one instance: a loopback port of nginx on the router's host that passes
    everything to the instance and answers ``/health`` 503 while the instance's canary fails (vllm-router
    0.1.17 in P/D mode cannot take a worker out and back over HTTP; its health checks can)."""

    instance: str  # the instance's name
    role: str
    port: int
    upstream: str  # the instance's own URL
    requests: int  # canaries per run: one per DP rank

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass(frozen=True)
class RouterHost:
    """One host that runs the router and its front."""

    name: str
    address: str  # its own address: VRRP, the router's metrics, its front besides the virtual address
    priority: int  # keepalived's: the first router host the highest; the address stays where it is (nopreempt)


@dataclass(frozen=True)
class RouterPlan:
    host: str  # the first router host (router.host)
    address: str  # the address clients use: router.virtualAddress, else the router host's own
    port: int
    gates: tuple[Gate, ...]  # one per instance, in plan order
    hosts: tuple[RouterHost, ...]  # every router host, router.host first
    virtual: bool = False  # address is router.virtualAddress (keepalived runs on every router host)

    def _urls(self, role: str) -> tuple[str, ...]:
        return tuple(g.url for g in self.gates if g.role == role)

    @property
    def prefill_urls(self) -> tuple[str, ...]:
        return self._urls("prefill")

    @property
    def decode_urls(self) -> tuple[str, ...]:
        return self._urls("decode")

    @property
    def worker_urls(self) -> tuple[str, ...]:  # colocated mode
        return self._urls("colocated")

    def worker_url(self, instance: str) -> str:
        """The URL the router knows ``instance`` by (its series carry it as ``worker``)."""
        return next(g.url for g in self.gates if g.instance == instance)

    @property
    def url(self) -> str:
        """The public URL: the front always speaks TLS."""
        return f"https://{url_host(self.address)}:{self.port}"

    @property
    def unit(self) -> str:
        return "glm-vllm-router.service"

    @property
    def host_names(self) -> tuple[str, ...]:
        """Every router host, router.host first."""
        return tuple(h.name for h in self.hosts)

    def on(self, host: str) -> RouterHost:
        return next(h for h in self.hosts if h.name == host)

    def own_address(self, host: str) -> str:
        """``host``'s own address (the router's metrics, its front besides the virtual address)."""
        return self.on(host).address

    def peers(self, host: str) -> tuple[RouterHost, ...]:
        """The other router hosts, whose fronts take what ``host``'s router cannot."""
        return tuple(h for h in self.hosts if h.name != host)

    def roll_order(self) -> tuple[str, ...]:
        """The order a router change restarts them in, one at a time: router.host (whose generated CA the others
        take), then the standbys. Which one holds the virtual address does not matter: a restart never moves
        it (each front passes its requests to another's while its router restarts)."""
        return self.host_names


def gates(stack: StackConfig, instances: Sequence[Instance]) -> tuple[Gate, ...]:
    """The router's gate of each instance: router.gatePort and on, in plan order."""
    assert stack.router is not None
    dp = {role: pool.dp for role, pool in stack.pools()}
    return tuple(Gate(i.name, i.role, stack.router.gate_port + n, i.url, dp[i.role]) for n, i in enumerate(instances))


def router_plan(stack: StackConfig, instances: Sequence[Instance]) -> RouterPlan | None:
    r = stack.router
    if r is None:
        return None
    names = [r.host, *r.standby_hosts]
    hosts = tuple(RouterHost(n, stack.host(n).address, 150 - 10 * k) for k, n in enumerate(names))
    address = str(r.virtual_address) if r.virtual_address is not None else hosts[0].address
    return RouterPlan(host=r.host, address=address, port=r.port, gates=gates(stack, instances), hosts=hosts,
                      virtual=r.virtual_address is not None)
