"""Pure planning: vLLM instances → hosts, GPU sets, ports and NIXL side-channel ranges.

No Pulumi here. ``allocate`` lays instances out without judging them; ``validate`` checks what it
produced (GPU budgets, port collisions); ``plan`` is what components consume once a stack is valid.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from glm_infra.spec.config import PoolConfig, StackConfig
from glm_infra.spec.paths import url_host

from .routing import Gate, RouterHost, RouterPlan, gates, router_plan

ROLES = ("prefill", "decode", "colocated")
KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}


@dataclass(frozen=True)
class Instance:
    """One ``vllm serve`` process: a systemd unit on one host."""

    role: str  # prefill | decode | colocated
    index: int  # index within its pool, across hosts (prefill-0, prefill-1, ...)
    host: str
    address: str
    slot: int  # index of this instance among its pool's instances on this host
    gpus: tuple[int, ...]
    http_port: int
    dp_rpc_port: int
    nixl_host: str
    nixl_port_base: int
    nixl_port_count: int

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def unit(self) -> str:
        return f"glm-vllm-{self.name}.service"

    @property
    def cuda_visible_devices(self) -> str:
        return ",".join(str(g) for g in self.gpus)

    @property
    def nixl_ports(self) -> range:
        return range(self.nixl_port_base, self.nixl_port_base + self.nixl_port_count)

    @property
    def url(self) -> str:
        return f"http://{url_host(self.address)}:{self.http_port}"

    def ports(self) -> list[tuple[str, int]]:
        """Every port this instance listens on, with what it is for."""
        out = [("http", self.http_port), ("dp-rpc", self.dp_rpc_port)]
        if self.role in KV_ROLE:
            out += [("nixl", p) for p in self.nixl_ports]
        return out


@dataclass(frozen=True)
class HostPlan:
    name: str
    address: str
    gpus: int
    instances: tuple[Instance, ...]
    runs_router: bool
    provision_only: bool = False  # provisioned (driver … weights) without serving: Hosts, not Cluster
    runtime: bool = False  # gets glm-infra's Python runtime even without serving (Hosts(install_runtime=True))

    @property
    def gpus_used(self) -> int:
        return sum(len(i.gpus) for i in self.instances)

    @property
    def provisioned(self) -> bool:
        """A host that serves gets the whole chain (driver … NIXL); the others only what they run."""
        return bool(self.instances) or self.provision_only


@dataclass(frozen=True)
class Plan:
    hosts: tuple[HostPlan, ...]
    instances: tuple[Instance, ...]
    router: RouterPlan | None
    disaggregated: bool = field(default=False)

    @property
    def serve(self) -> bool:
        return not any(h.provision_only for h in self.hosts)

    def host(self, name: str) -> HostPlan:
        return next(h for h in self.hosts if h.name == name)

    def by_role(self, role: str) -> tuple[Instance, ...]:
        return tuple(i for i in self.instances if i.role == role)

    @property
    def serving_hosts(self) -> tuple[HostPlan, ...]:
        """Hosts that run at least one vLLM instance (they need the runtime and the weights)."""
        return tuple(h for h in self.hosts if h.instances)


def allocate(stack: StackConfig) -> list[Instance]:
    """Lay every pool's instances out on their hosts.

    GPUs are handed out in pool order (prefill, decode, colocated) from GPU 0 up on each host, so a
    host shared by two pools gets disjoint sets. GPU indices past the host's count are allowed here
    and reported by ``validate``. Ports start at the pool's base on each host and step by one per
    instance (HTTP, DP RPC) or by ``dp`` (NIXL side channel: one port per DP rank).
    """
    addresses = {h.name: h.address for h in stack.hosts}
    next_gpu: dict[str, int] = {}
    out: list[Instance] = []
    for role, pool in stack.pools():
        index = 0
        for host in pool.hosts:
            for slot in range(pool.instances_per_host):
                first = next_gpu.get(host, 0)
                n = pool.gpus_per_instance
                next_gpu[host] = first + n
                out.append(
                    Instance(
                        role=role,
                        index=index,
                        host=host,
                        address=addresses.get(host, ""),
                        slot=slot,
                        gpus=tuple(range(first, first + n)),
                        http_port=pool.http_port + slot,
                        dp_rpc_port=pool.dp_rpc_port + slot,
                        nixl_host=addresses.get(host, ""),
                        nixl_port_base=pool.nixl_side_channel_port + slot * pool.dp,
                        nixl_port_count=pool.dp,
                    )
                )
                index += 1
    return out


def pool_of(stack: StackConfig, role: str) -> PoolConfig:
    pool = getattr(stack, role)
    if pool is None:
        raise KeyError(role)
    return pool


def seed_host(stack: StackConfig, serve: bool = True) -> str | None:
    """The host that downloads the weights from the source: the stack's choice or the first serving host
    (the first host when nothing is served)."""
    if stack.model.seed_host:
        return stack.model.seed_host
    if not serve:
        return stack.hosts[0].name
    for _, pool in stack.pools():
        return pool.hosts[0]
    return None


RELAY_DEGREE = 2  # children per host in the weights relay: each sends at most 2 copies, ≥ half its uplink each


@dataclass(frozen=True)
class Relay:
    """One host's place in the weights relay tree."""

    host: str
    parent: str | None  # None: the seed (it reads the source)
    ancestors: tuple[str, ...]  # parent first, seed last: where it copies from, in failover order
    children: tuple[str, ...]  # the hosts that copy from it (it serves them while it stages)


def relay_tree(order: list[str], degree: int | None = None) -> dict[str, Relay]:
    """A complete ``degree``-ary tree (default RELAY_DEGREE) over ``order``, the first at the root: host
    i copies from host (i - 1) // degree. Depth ⌊log_degree N⌋ (binary); a host appended at the end
    only adds a leaf, so every other host keeps its parent, ancestors and children (its parent gains one)."""
    degree = degree or RELAY_DEGREE
    parent_of = {order[i]: (order[(i - 1) // degree] if i else None) for i in range(len(order))}
    children: dict[str, list[str]] = {h: [] for h in order}
    for h in order[1:]:
        children[parent_of[h]].append(h)  # type: ignore[index]
    out = {}
    for h in order:
        up, p = [], parent_of[h]
        while p is not None:
            up.append(p)
            p = parent_of[p]
        out[h] = Relay(h, parent_of[h], tuple(up), tuple(children[h]))
    return out


def weights_relay(stack: StackConfig, serve: bool = True) -> dict[str, Relay]:
    """The relay tree of the checkpoint over the hosts that stage it (in the stack's order, the seed at
    the root): the seed reads the source once, every other host copies from its parent as files are
    verified there, and from the next ancestor up when its parent fails. Empty for source local."""
    seed = seed_host(stack, serve)
    if seed is None or stack.model.source == "local":
        return {}
    serving = {i.host for i in allocate(stack)} if serve else None
    staged = [h.name for h in stack.hosts if serving is None or h.name in serving]
    return relay_tree([seed, *(h for h in staged if h != seed)])


def plan(stack: StackConfig, serve: bool = True, runtime: bool = False) -> Plan:
    """The plan of a validated stack. ``serve=False``: every host provisioned, nothing served (the
    pools and the router are left out), with the Python runtime only if ``runtime``."""
    if not serve:
        hosts = tuple(HostPlan(h.name, h.address, h.gpus, (), False, provision_only=True, runtime=runtime)
                      for h in stack.hosts)
        return Plan(hosts=hosts, instances=(), router=None)
    instances = tuple(allocate(stack))
    router = router_plan(stack, instances)
    hosts = tuple(
        HostPlan(
            name=h.name,
            address=h.address,
            gpus=h.gpus,
            instances=tuple(i for i in instances if i.host == h.name),
            runs_router=router is not None and h.name in router.host_names,
        )
        for h in stack.hosts
    )
    return Plan(hosts=hosts, instances=instances, router=router, disaggregated=stack.disaggregated)


def format_table(stack: StackConfig, p: Plan) -> str:
    """The plan as a table for PR review: one row per instance, grouped by host."""
    headers = ("host", "address", "instance", "unit", "GPUs (CUDA_VISIBLE_DEVICES)", "http", "dp-rpc", "nixl ports")
    rows: list[tuple[str, ...]] = []
    for h in p.hosts:
        if not h.instances and not h.runs_router:
            rows.append((h.name, h.address, "-", "-", f"0/{h.gpus} used", "-", "-", "-"))
        for i in h.instances:
            pool = pool_of(stack, i.role)
            label = f"{i.name} (tp{pool.tp} dp{pool.dp}{' ep' if pool.ep else ''})"
            nixl = f"{i.nixl_ports.start}-{i.nixl_ports.stop - 1}" if i.role in KV_ROLE else "-"
            rows.append(
                (h.name, h.address, label, i.unit, i.cuda_visible_devices, str(i.http_port), str(i.dp_rpc_port), nixl)
            )
        if h.runs_router and p.router is not None:
            rows.append((h.name, h.address, "router", p.router.unit, "-", str(p.router.port), "-", "-"))
    widths = [max(len(r[c]) for r in [headers, *rows]) for c in range(len(headers))]
    line = "  ".join("-" * w for w in widths)
    out = ["  ".join(v.ljust(w) for v, w in zip(headers, widths)).rstrip(), line]
    out += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    summary = []
    for h in p.hosts:
        summary.append(f"{h.name}: {h.gpus_used}/{h.gpus} GPUs")
    out.append("")
    out.append("GPU use: " + ", ".join(summary))
    if p.router is not None:
        mode = "P/D" if p.disaggregated else "round robin"
        out.append(f"router: {p.router.url} ({mode}; {len(p.instances)} workers)")
    notes = rolling_notes(stack, p)
    if notes:
        out += ["", "host changes (driver upgrade with reboot, RDMA):", *(f"  {n}" for n in notes)]
    return "\n".join(out)


# --- rolling host changes ----------------------------------------------------------------------


@dataclass(frozen=True)
class RollGroup:
    """How a disruptive host change (a driver upgrade with reboot, an RDMA change) rolls through one
    pool: its hosts in turns of ``max_unavailable``, each turn drained, changed and healthy again
    before the next starts."""

    pool: str  # role: prefill | decode | colocated
    hosts: tuple[str, ...]  # the pool's hosts, in the stack's order
    max_unavailable: int  # the pool's own, lowered to the strictest of any pool sharing one of its hosts
    own: int = 0  # the pool's own maxUnavailable (0: the same)

    @property
    def turns(self) -> tuple[tuple[str, ...], ...]:
        n = self.max_unavailable
        return tuple(self.hosts[i:i + n] for i in range(0, len(self.hosts), n))

    @property
    def interrupting(self) -> bool:
        """Whether the change takes the whole pool down at once (one host, or a turn as wide as the pool)."""
        return self.max_unavailable >= len(self.hosts)


def rolling(stack: StackConfig, p: Plan) -> tuple[RollGroup, ...]:
    """The roll groups of a plan, one per pool, in pool order. A host serving several pools rolls with
    the strictest ``max_unavailable`` among them, so every pool sharing it gets that limit."""
    serving = {h.name for h in p.hosts if h.instances and h.provisioned}
    pools = [(role, pool, tuple(h for h in pool.hosts if h in serving)) for role, pool in stack.pools()]
    pools = [(role, pool, hosts) for role, pool, hosts in pools if hosts]
    strictest: dict[str, int] = {}
    for _, pool, hosts in pools:
        for h in hosts:
            strictest[h] = min(strictest.get(h, pool.max_unavailable), pool.max_unavailable)
    return tuple(RollGroup(role, hosts, min(strictest[h] for h in hosts), pool.max_unavailable)
                 for role, pool, hosts in pools)


def roll_predecessors(groups: tuple[RollGroup, ...], host: str) -> tuple[str, ...]:
    """The hosts whose turn comes just before ``host``'s in any of its pools (its turn waits for theirs)."""
    out: list[str] = []
    for g in groups:
        turns = g.turns
        for k, turn in enumerate(turns):
            if host in turn and k > 0:
                out += [h for h in turns[k - 1] if h not in out]
    return tuple(out)


def parallel_needed(stack: StackConfig, p: Plan) -> int:
    """The resource operations `pulumi up` must be allowed at once (its --parallel) so that the steps that wait
    for another host's (a relay peer's weights staging waits for its parent's; a pool's turn for the host
    holding it) can never take every operation while what they wait for waits for one: a peer that starts
    before its parent would wait for it forever (seen: 16 simulated hosts at the default 8). Every host that
    stages the weights, one turn per pool, and one to spare."""
    return len(weights_relay(stack, bool(p.instances))) + len(rolling(stack, p)) + 1


def rolling_notes(stack: StackConfig, p: Plan, interrupting: bool = False) -> list[str]:
    """One line per pool saying how a disruptive host change rolls through it (``interrupting``: only
    the pools it interrupts)."""
    out = []
    for g in rolling(stack, p):
        n = len(g.hosts)
        hosts = ", ".join(g.hosts)
        if g.interrupting:
            what = (f"its only host, {hosts}, goes down" if n == 1 else
                    f"maxUnavailable {g.max_unavailable} ≥ its {n} hosts: {hosts} go down together")
            out.append(f"{g.pool}: interrupted: {what}; nothing serves {g.pool} until "
                       f"{'it is' if n == 1 else 'they are'} back")
        elif not interrupting:
            order = ", then ".join(" + ".join(t) for t in g.turns)
            limit = f"maxUnavailable {g.own}" + (f", {g.max_unavailable} on a host another pool shares"
                                                  if g.own and g.own != g.max_unavailable else "")
            out.append(f"{g.pool}: {n} hosts, {g.max_unavailable} at a time ({limit}), "
                       f"each drained and healthy again before the next: {order}")
    return out
