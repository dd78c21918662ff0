"""An instance's start, planned: each pool's warm-cache relay (the pool's first host builds vLLM's warm-start
caches on its cold start; its other hosts copy them, verified, before they restart) and the time to ready
``plan`` expects of a cold and of a warm start (docs/research/vllm-0.33-compile-cache.md)."""

from __future__ import annotations

from dataclasses import dataclass

from glm_infra.spec.config import NAMESPACE, StackConfig

from .topology import Relay, relay_tree


def warm_cache_relays(stack: StackConfig) -> dict[str, dict[str, Relay]]:
    """Per pool on more than one host: the relay tree over its hosts in the stack's order, its first host
    (the one whose instances roll first) at the root. Empty when ``startup.warmCache`` is off."""
    if not stack.startup.warm_cache:
        return {}
    return {role: relay_tree(list(pool.hosts)) for role, pool in stack.pools() if len(pool.hosts) > 1}


def relay_port(stack: StackConfig, role: str) -> int:
    """prefill's (or colocated's) relay on ``startup.relayPort``, decode's on the next: a host in both pools
    may serve both at once."""
    return stack.startup.relay_port + (1 if role == "decode" else 0)


@dataclass(frozen=True)
class TimeToReady:
    """Seconds from an instance's start to its first 200 on /health, phase by phase."""

    weights: float
    warmup_cold: float
    warmup_warm: float
    graph_capture: float

    @property
    def cold(self) -> float:
        return self.weights + self.warmup_cold + self.graph_capture

    @property
    def warm(self) -> float:
        return self.weights + self.warmup_warm + self.graph_capture


def time_to_ready(stack: StackConfig) -> TimeToReady:
    s = stack.startup
    return TimeToReady(s.weight_load_seconds, s.kernel_warmup_cold_seconds, s.kernel_warmup_warm_seconds,
                       s.graph_capture_seconds)


def _minutes(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:g} s"
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


# What stops while a pool's only host is down, by role.
_STOPS = {"decode": "generation (every request needs a decode instance)",
          "prefill": "every new request (nothing prefills it)",
          "colocated": "serving"}
TWO_DECODE_HOSTS = "stacks/Pulumi.prod-b300-2decode.yaml"


def single_host_pools(stack: StackConfig) -> list[tuple[str, str]]:
    """(role, host) of each serving pool that runs on one host: that host's reboot stops the service."""
    return [(role, pool.hosts[0]) for role, pool in stack.pools() if len(pool.hosts) == 1]


def single_host_warnings(stack: StackConfig) -> list[str]:
    """validate's, preview's and up's word on each pool whose one host is the whole of it: what its reboot
    (a driver upgrade, a crash, maintenance) stops, and for how long at least."""
    t = time_to_ready(stack)
    return [f"{NAMESPACE}:{role}.hosts: {role} runs on one host, {host}: its reboot stops {_STOPS[role]} for its "
            f"boot and then about {_minutes(t.warm)} until its instances are ready ({_minutes(t.cold)} after a change "
            f"of vLLM, flags or revision; glm-infra plan shows the phases); a second {role} host keeps it serving "
            f"meanwhile{f' ({TWO_DECODE_HOSTS})' if role == 'decode' else ''}"
            for role, host in single_host_pools(stack)]


def format_time_to_ready(stack: StackConfig) -> str:
    """``plan``'s section: cold and warm, which hosts start warm after a change, and where the numbers come from."""
    t = time_to_ready(stack)
    lines = ["Time to ready (per instance, from start to /health 200; startup.* keys: assumptions unless measured)",
             f"  {'phase':<34}{'cold':>10}{'warm':>10}",
             f"  {'weights (startup.weightLoadSeconds)':<34}{_minutes(t.weights):>10}{_minutes(t.weights):>10}",
             f"  {'kernel warmup (autotune, JIT)':<34}{_minutes(t.warmup_cold):>10}{_minutes(t.warmup_warm):>10}",
             f"  {'CUDA-graph capture (never cached)':<34}{_minutes(t.graph_capture):>10}"
             f"{_minutes(t.graph_capture):>10}",
             f"  {'total':<34}{_minutes(t.cold):>10}{_minutes(t.warm):>10}"]
    relays = warm_cache_relays(stack)
    for role, pool in stack.pools():
        if role in relays:
            lines.append(f"  {role}: after a change of vLLM, flags or revision, {pool.hosts[0]} starts cold and "
                         f"{', '.join(pool.hosts[1:])} warm (caches relayed on port {relay_port(stack, role)})")
        else:
            why = "startup.warmCache is off" if not stack.startup.warm_cache else "one host"
            lines.append(f"  {role}: the first instance restarted on each host starts cold ({why})")
        if len(pool.hosts) == 1:
            lines.append(f"  {role}: its one host's reboot stops {_STOPS[role]} for the boot and then "
                         f"{_minutes(t.warm)} ({_minutes(t.cold)} after a change)")
    lines.append("  A restart with nothing changed starts warm: the caches stay in the services' home.")
    return "\n".join(lines)
