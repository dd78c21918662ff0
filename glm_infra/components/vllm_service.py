"""One vLLM instance: its systemd unit, started and gated on ``/health``, restarted one instance of a
pool at a time, stopped in order on destroy; and each pool's warm-cache relay around its restarts. The
steps come from the per-host plan (vllm.instance_steps, vllm.warm_cache_steps)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pulumi
import pulumi_command.remote as remote

from glm_infra.plan import startup
from glm_infra.steps import Step

from .remote_step import inherited, run_step


@dataclass
class VllmServiceArgs:
    instance: str
    """Instance name (prefill-0)."""
    connection: remote.ConnectionArgs
    """SSH connection to its host."""
    steps: Mapping[str, Step]
    """Its steps: <instance>-unit, -service (start and gate on /health), -rollout (restart on change),
    -stop (on destroy)."""
    health_url: pulumi.Input[str]
    """URL that answers 200 once the instance serves (a stack output)."""
    restart_triggers: Sequence[pulumi.Input[str]] = field(default_factory=list)
    """Values besides the plan's whose change restarts the instance (its secrets file)."""
    stop_after: Sequence[pulumi.Resource] = field(default_factory=list)
    """On destroy, stop this instance before these (their ``stopper``): decode before prefill."""
    rollout_after: Sequence[pulumi.Resource] = field(default_factory=list)
    """Restart only after these have (the previous instance's ``rollout``): one at a time."""
    live: Mapping[str, pulumi.Output[Step]] = field(default_factory=dict)
    """The steps as resolved at deploy time (the unit names the instance's address)."""


class VllmService(pulumi.ComponentResource):
    def __init__(self, name: str, args: VllmServiceArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("glm-infra:index:VllmService", name, None, opts)
        i, s, live = args.instance, args.steps, args.live
        self.unit_file = run_step(f"{name}-unit", s[f"{i}-unit"], args.connection, self, live=live.get(f"{i}-unit"),
                                  depends_on=inherited(opts))
        # Two steps, so a first deploy starts every instance at once while a change restarts them
        # one at a time: "service" only starts the unit; "rollout" restarts it when the unit or
        # what it reads changes, after the previous instance's rollout.
        self.service = run_step(f"{name}-service", s[f"{i}-service"], args.connection, self,
                                live=live.get(f"{i}-service"), depends_on=[self.unit_file, *inherited(opts)])
        self.rollout = run_step(f"{name}-rollout", s[f"{i}-rollout"], args.connection, self,
                                live=live.get(f"{i}-rollout"), triggers=list(args.restart_triggers),
                                depends_on=[self.service, *args.rollout_after])
        # Stopping is its own resource, so destroy can order it (router, then decode, then prefill)
        # without making the instances start one after another. Not on the rollout: its chain through
        # the whole pool would make every dependency check on a stopper walk that chain.
        self.stopper = run_step(f"{name}-stop", s[f"{i}-stop"], args.connection, self, live=live.get(f"{i}-stop"),
                                depends_on=[self.service, *args.stop_after])
        self.health_url = pulumi.Output.from_input(args.health_url)
        self.register_outputs({"healthUrl": self.health_url})


class WarmCacheRelays:
    """Each pool's ``<pool>-warm-cache`` steps (roles/vllm.warm_cache_steps), wired around the pool's
    restarts: the pool's first host's step once its instances there serve (their rollout: a change restarts
    them first, cold); every other host's after it (a failed first host fails them, not a wait), and that
    host's instances of the pool start (a host joining, a first deploy) and restart only after it, so they
    start warm instead of racing the copy."""

    def __init__(self, deployment, name: str, ready: Mapping[str, Sequence[pulumi.Resource]]) -> None:
        """``ready``: by host, what its steps wait for first (its provisioning chain)."""
        self.d, self.name, self.ready = deployment, name, ready
        self.relays = startup.warm_cache_relays(deployment.stack)
        self.seeds: dict[str, list[pulumi.Resource]] = {}
        self.peers: dict[tuple[str, str], pulumi.Resource] = {}

    def before_rollout(self, role: str, host: str, services: Mapping[str, VllmService]) -> list[pulumi.Resource]:
        """What an instance of ``role`` on ``host`` restarts after: its host's copy of the pool's caches."""
        relay = self.relays.get(role, {}).get(host)
        if relay is None or relay.parent is None:
            return []
        seed = self.seed(role, services)
        if not seed:  # the pool's first host is another stack's (only_hosts): nothing serves its caches in this run
            return []
        if (role, host) not in self.peers:
            self.peers[(role, host)] = self._step(host, role, [*self.ready[host], *seed])
        return [self.peers[(role, host)]]

    def seed(self, role: str, services: Mapping[str, VllmService]) -> list[pulumi.Resource]:
        """The pool's first host's step (none when another stack deploys that host: then the pool's other hosts
        here copy nothing and their instances start cold)."""
        if role not in self.seeds:
            host = next(h for h, r in self.relays[role].items() if r.parent is None)
            self.seeds[role] = []
            if self.d.mine(host):
                mine = [i.name for i in self.d.plan.instances if i.host == host and i.role == role]
                assert all(n in services for n in mine), "a pool's first host's instances are registered first"
                self.seeds[role] = [self._step(host, role, [*self.ready[host],
                                                            *(services[n].rollout for n in mine)])]
        return self.seeds[role]

    def finish(self, services: Mapping[str, VllmService]) -> None:
        for role in self.relays:
            self.seed(role, services)

    def _step(self, host: str, role: str, after: list[pulumi.Resource]) -> pulumi.Resource:
        key = f"{role}-warm-cache"
        return run_step(f"{self.name}-{host}-{key}", self.d.steps[host].steps[key], self.d.hosts[host].connection,
                        self.d, live=self.d.live(host, key), depends_on=after)
