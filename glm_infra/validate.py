"""Cross-field rules of a stack that a single pydantic model cannot see.

Each rule returns ``Problem`` entries naming the key path, so the CLI and ``pulumi up`` print the
same messages. Rules run only on a stack whose individual keys already parsed.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from .config import StackConfig
from .topology import allocate, seed_host


@dataclass(frozen=True)
class Problem:
    path: str  # e.g. "glm-infra:prefill.hosts[1]"
    message: str


def _key(top: str, rest: str = "") -> str:
    return f"glm-infra:{top}{rest}"


def check(stack: StackConfig, serve: bool = True) -> list[Problem]:
    """Every cross-field problem of a stack. ``serve=False``: hosts provisioned without pools (the
    pools, the router and their ports are not judged)."""
    problems: list[Problem] = []
    problems += _hosts_unique(stack)
    if serve:
        problems += _pool_shape(stack)
    problems += _host_references(stack, serve)
    if problems:
        return problems  # budgets and ports are meaningless with unknown hosts
    if serve:
        problems += _gpu_budget(stack)
        problems += _kv_nics(stack)
    problems += _port_collisions(stack, serve)
    return problems


def _hosts_unique(stack: StackConfig) -> list[Problem]:
    out = []
    seen_name: dict[str, int] = {}
    seen_addr: dict[str, int] = {}
    for i, h in enumerate(stack.hosts):
        if h.name in seen_name:
            out.append(Problem(_key("hosts", f"[{i}].name"), f"duplicate host name {h.name!r} (also hosts[{seen_name[h.name]}])"))
        else:
            seen_name[h.name] = i
        addr = h.address.lower()
        if addr in seen_addr:
            out.append(
                Problem(_key("hosts", f"[{i}].address"), f"duplicate address {h.address!r} (also hosts[{seen_addr[addr]}])")
            )
        else:
            seen_addr[addr] = i
    return out


def _pool_shape(stack: StackConfig) -> list[Problem]:
    out = []
    has_p, has_d, has_c = stack.prefill is not None, stack.decode is not None, stack.colocated is not None
    if has_c and (has_p or has_d):
        out.append(Problem(_key("colocated"), "a colocated pool cannot be combined with prefill/decode pools"))
    elif has_p != has_d:  # (with no pool at all, the stack model lays out the BRIEF's)
        present, missing = ("prefill", "decode") if has_p else ("decode", "prefill")
        out.append(Problem(_key(missing), f"P/D needs both pools: {present} is set but {missing} is missing"))
    if stack.disaggregated and stack.router is None:
        out.append(Problem(_key("router"), "P/D needs a router in front of the prefill and decode pools"))
    for role, pool in stack.pools():
        if pool.gpus_per_instance > 16:
            out.append(Problem(_key(role, ".dp"), f"tp×dp = {pool.gpus_per_instance} GPUs, more than one host has"))
    if stack.prefill is not None and stack.decode is not None:
        # P and D must agree on the MTP method; only the token count may differ.
        if (stack.prefill.speculative_tokens == 0) != (stack.decode.speculative_tokens == 0):
            out.append(
                Problem(_key("decode", ".speculativeTokens"), "prefill and decode must both use MTP or both not")
            )
    return out


def _host_references(stack: StackConfig, serve: bool = True) -> list[Problem]:
    names = [h.name for h in stack.hosts]
    known = ", ".join(names)
    out = []
    if not serve:
        seed = stack.model.seed_host
        if seed is not None and seed not in names:
            out.append(Problem(_key("model", ".seedHost"), f"unknown host {seed!r} (hosts are: {known})"))
        return out
    for role, pool in stack.pools():
        for i, h in enumerate(pool.hosts):
            if h not in names:
                out.append(Problem(_key(role, f".hosts[{i}]"), f"unknown host {h!r} (hosts are: {known})"))
    if stack.router is not None and stack.router.host not in names:
        out.append(Problem(_key("router", ".host"), f"unknown host {stack.router.host!r} (hosts are: {known})"))
    mon = stack.monitoring.host
    if stack.monitoring.enabled and mon is not None and mon not in names:
        out.append(Problem(_key("monitoring", ".host"), f"unknown host {mon!r} (hosts are: {known})"))
    seed = stack.model.seed_host
    serving = [h for _, pool in stack.pools() for h in pool.hosts]
    if seed is not None and seed not in serving:
        out.append(Problem(_key("model", ".seedHost"), f"{seed!r} runs no vLLM instance (serving hosts: {', '.join(dict.fromkeys(serving))})"))
    return out


def _kv_nics(stack: StackConfig) -> list[Problem]:
    """P/D moves the KV cache over RDMA: every prefill and decode host names its compute NICs."""
    kv_hosts = {h for role in ("prefill", "decode") if (pool := getattr(stack, role)) for h in pool.hosts}
    return [Problem(_key("hosts", f"[{i}].computeNics"),
                    f"host {h.name} runs prefill/decode instances, which move the KV cache over RDMA: list its "
                    "compute NICs (never the NVSwitch-management ConnectX)")
            for i, h in enumerate(stack.hosts) if h.name in kv_hosts and not h.compute_nics]


def _gpu_budget(stack: StackConfig) -> list[Problem]:
    used: dict[str, list[str]] = defaultdict(list)
    count: dict[str, int] = defaultdict(int)
    for role, pool in stack.pools():
        for h in pool.hosts:
            used[h].append(f"{role} {pool.instances_per_host}×{pool.gpus_per_instance}")
            count[h] += pool.instances_per_host * pool.gpus_per_instance
    out = []
    for i, h in enumerate(stack.hosts):
        if count[h.name] > h.gpus:
            out.append(
                Problem(
                    _key("hosts", f"[{i}].gpus"),
                    f"host {h.name} is over-subscribed: {' + '.join(used[h.name])} = {count[h.name]} GPUs, "
                    f"the host has {h.gpus}",
                )
            )
    return out


def _port_collisions(stack: StackConfig, serve: bool = True) -> list[Problem]:
    owners: dict[tuple[str, int], str] = {}
    clashes: dict[tuple[str, str, str, str], list[int]] = defaultdict(list)
    out: list[Problem] = []

    def claim(host: str, port: int, owner: str, path: str) -> None:
        if port > 65535:
            out.append(Problem(path, f"{owner} on {host} would need port {port}, above 65535"))
            return
        prev = owners.setdefault((host, port), owner)
        if prev != owner:
            clashes[(path, host, prev, owner)].append(port)

    port_key = {"http": ".httpPort", "dp-rpc": ".dpRpcPort", "nixl": ".nixlSideChannelPort"}
    for inst in allocate(stack) if serve else ():
        for kind, port in inst.ports():
            claim(inst.host, port, f"{inst.name} {kind}", _key(inst.role, port_key[kind]))
    seed = seed_host(stack, serve)
    if seed is not None and stack.model.source != "local":
        claim(seed, stack.model.fanout_port, "weights fan-out", _key("model", ".fanoutPort"))
    if stack.router is not None and serve:
        claim(stack.router.host, stack.router.port, "router http", _key("router", ".port"))
        claim(stack.router.host, stack.router.metrics_port, "router metrics", _key("router", ".metricsPort"))
        claim(stack.router.host, stack.router.internal_port, "router internal", _key("router", ".internalPort"))
    m = stack.monitoring
    if m.enabled and serve:
        serving = {i.host for i in allocate(stack)}
        for h in stack.hosts:
            claim(h.name, m.node_exporter_port, "node exporter", _key("monitoring", ".nodeExporterPort"))
            if h.name in serving and m.dcgm_exporter_package is not None and stack.drivers.mode == "install":
                claim(h.name, m.dcgm_exporter_port, "DCGM exporter", _key("monitoring", ".dcgmExporterPort"))
        mon = stack.monitoring_host
        assert mon is not None
        claim(mon, m.prometheus_port, "prometheus", _key("monitoring", ".prometheusPort"))
        claim(mon, m.alertmanager_port, "alertmanager", _key("monitoring", ".alertmanagerPort"))
    for (path, host, prev, owner), ports in clashes.items():
        span = str(ports[0]) if len(ports) == 1 else f"{ports[0]}-{ports[-1]}"
        word = "port" if len(ports) == 1 else "ports"
        out.append(Problem(path, f"{word} {span} on {host} used twice: {prev} and {owner}"))
    return out
