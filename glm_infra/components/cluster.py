"""The whole deployment (``Cluster``) and its provisioning part alone (``Hosts``), both built from the per-host
plan: per host preflight → driver → health gate → RDMA → NIXL → facts (→ runtime), the weights (read once from
the source, relayed host to host), then for a Cluster the vLLM instances (each pool one at a time) and the router.

The annotations are evaluated (no ``from __future__ import annotations``) and the class-level ones
of Cluster and Hosts are their outputs only: the component package (provider/) infers its schema
from them, for programs in other Pulumi languages."""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pulumi
import pulumi_command.remote as remote

from glm_infra import hostplan, inputs
from glm_infra.args import ClusterArgs, HostsArgs
from glm_infra.hostplan import HostSteps
from glm_infra.plan import topology
from glm_infra.plan.validate import Problem
from glm_infra.roles import roll, router as router_role, vllm
from glm_infra.spec import paths
from glm_infra.spec.config import SERVING_KEYS
from glm_infra.stack import StackError
from glm_infra.steps import Step, digest

from .drivers import driver_steps
from .engine_limits import check_parallel
from .host import Host, HostArgs
from .monitoring import STEP_KEYS, MonitoredHost, Monitoring, MonitoringArgs
from .remote_step import record_failures, relay_key, run_step, trigger_key
from .router import Router, RouterArgs
from .vllm_service import VllmService, VllmServiceArgs, WarmCacheRelays
from .weights import ModelWeights, stage_weights


class InvalidArgsError(pulumi.RunError):
    """Args that ``glm-infra validate`` would refuse, with the same messages; raised before any
    resource exists."""

    def __init__(self, error: StackError) -> None:
        super().__init__(str(error))
        self.problems: list[Problem] = error.problems


@dataclass
class _Chain:
    """What the provisioning of one host left: its component, what serving needs done first, its facts."""

    host: Host
    ready: list[pulumi.Resource] = field(default_factory=list)
    facts: pulumi.Output[dict] | None = None


class _Deployment(pulumi.ComponentResource):
    """What Cluster and Hosts share: validation of the Args, the plan, the per-host chains and the weights."""

    def __init__(self, type_: str, name: str, args: Mapping[str, Any], serve: bool,
                 opts: pulumi.ResourceOptions | None, runtime: bool = False,
                 only_hosts: Sequence[str] | None = None) -> None:
        source = f"{type_.rsplit(':', 1)[-1]} {name!r}"
        try:
            self._split, loaded = inputs.load(args, source, serve)
            if not serve and not runtime and loaded.config.model.source == "huggingface":
                raise StackError(source, [Problem("glm-infra:model.source", "huggingface downloads with the hf CLI, "
                                                  "which glm-infra's Python runtime installs: Hosts(..., "
                                                  "install_runtime=True), or source mirror or local")])
            unknown = [h for h in only_hosts or () if h not in {x.name for x in loaded.config.hosts}]
            if unknown:
                raise StackError(source, [Problem("(only_hosts)", f"unknown host {unknown[0]!r}")])
        except StackError as e:
            raise InvalidArgsError(e) from None
        super().__init__(type_, name, None, opts)
        trigger_key(f"{name}-trigger-key", self)  # keys the digests of secret triggers (remote_step)
        self._only = set(only_hosts) if only_hosts is not None else None
        for w in loaded.warnings:
            pulumi.log.warn(w, self)
        self.stack = loaded.config
        self.plan = topology.plan(self.stack, serve, runtime)
        check_parallel(self.stack, self.plan, self)
        self.steps = hostplan.plan_all(self.stack, self.plan, stack_name=pulumi.get_stack())
        # A step that fails in a run with turns tells the hosts of that run waiting for one (roll/runs.py).
        record_failures(name, roll.failure_folder(self.stack, {h: s.steps for h, s in self.steps.items() if self.mine(h)},
                                                  pulumi.get_stack()))
        resolved = inputs.resolve(loaded, self._split, source, serve, runtime)
        self._live = resolved.apply(lambda r: hostplan.plan_all(r.stack, r.plan, stack_name=pulumi.get_stack())) \
            if self._split.later else None
        self._resolved = resolved
        secrets = {k: inputs.checked_secret(k, v, source) for k, v in self._split.secrets.items() if k != "private_key"}
        self.secrets: dict[str, pulumi.Output[str]] = secrets
        """The secret values given (router_api_key, hf_token), as secret Outputs."""
        self._secret_values = pulumi.Output.secret(pulumi.Output.all(**secrets)) if secrets else pulumi.Output.from_input({})
        # The stack's relay key, for the hosts that relay (their relay-key file) and for nothing else: no other
        # step's inputs wait for it (a preview before it exists shows only those files as unknown).
        self._relay_key = relay_key(f"{name}-relay-key", self) if any(
            "relay-key" in hs.steps for h, hs in self.steps.items() if self.mine(h)) else None
        key = self._split.secrets.get("private_key")
        self._private_key = pulumi.Output.secret(key if key is not None else
                                                 _read_key(self._split.private_key_path or "", source))
        self.hosts: dict[str, Host] = {}
        self._roll_groups = topology.rolling(self.stack, self.plan)
        self._turns: dict[str, pulumi.Resource] = {}  # host → its turn-acquire
        self._drains: dict[str, pulumi.Resource] = {}
        self._warn_interrupting()
        # Registered in the order of the hosts' turns, so each turn-acquire can name the previous turn's.
        turn = {h: max((k for g in self._roll_groups for k, t in enumerate(g.turns) if h in t), default=0)
                for h in (x.name for x in self.plan.hosts)}
        made = {h.name: self._provision(name, self.steps[h.name])
                for h in sorted(self.plan.hosts, key=lambda x: turn[x.name]) if self.mine(h.name)}
        chains = {h.name: made[h.name] for h in self.plan.hosts if h.name in made}
        self.hosts = {n: c.host for n, c in chains.items()}
        self.weights: ModelWeights | None = stage_weights(self, name, chains)
        self._chains = chains
        self.facts = pulumi.Output.all(**{n: c.facts or c.host.facts for n, c in chains.items()})

    # --- helpers -----------------------------------------------------------------------------------

    def _warn_interrupting(self) -> None:
        """Say, in every preview and up, which pools a disruptive host change would take down whole (the
        program cannot tell whether this run changes a driver: the warning stands for the topology)."""
        if not self.plan.serve:
            return
        for note in topology.rolling_notes(self.stack, self.plan, interrupting=True):
            pulumi.log.warn(f"host changes (driver upgrade with reboot, RDMA): {note}", self)

    def mine(self, host: str) -> bool:
        """Whether this component deploys ``host`` (``only_hosts``: the others belong to another stack)."""
        return self._only is None or host in self._only

    def live(self, host: str, key: str) -> pulumi.Output[Step] | None:
        return self._live.apply(lambda a: a[host].steps[key]) if self._live is not None else None

    def lives(self, host: str, keys) -> dict[str, pulumi.Output[Step]]:
        return {k: v for k in keys if (v := self.live(host, k)) is not None}

    def secret_file(self, step: Step) -> pulumi.Output[str]:
        assert step.secret_render is not None
        if step.name == "relay-key":
            assert self._relay_key is not None
            return self._relay_key.apply(lambda k: step.secret_render({"relay_key": k}))
        return self._secret_values.apply(step.secret_render)

    def secret_digest(self, renderer: Callable[[Mapping[str, str]], str]) -> pulumi.Output[str]:
        return self._secret_values.apply(lambda s: digest(renderer(s)))

    # --- the chain of one host ---------------------------------------------------------------------

    def _provision(self, name: str, hs: HostSteps) -> _Chain:
        h, s = hs.host, hs.steps
        hc = self.stack.host(h.name)
        files = [st for k, st in s.items() if k in hostplan.HOST_FILES]
        host = Host(
            f"{name}-{h.name}",
            HostArgs(
                name=h.name,
                address=self._split.addresses.get(h.name, hc.address),
                user=self.stack.ssh.user,
                private_key=self._private_key,
                preflight=s["preflight"],
                ssh_port=hc.ssh_port,
                host_key=hc.host_key,
                dial_attempts=self.stack.ssh.dial_attempts,
                dial_timeout=self.stack.ssh.dial_timeout,
                files=files,
                secret_files={st.name: self.secret_file(st) for st in files},
                live=self.lives(h.name, ["preflight"]),
            ),
            pulumi.ResourceOptions(parent=self),
        )
        chain = _Chain(host)
        previous: pulumi.Resource = host.preflight
        conn = host.connection
        if h.provisioned:
            before_drivers: pulumi.Resource = host.preflight
            if "host-drain" in s:
                # A disruptive change rolls: this host's turn in its pools, then its instances drained.
                after = [self._turns[x] for x in topology.roll_predecessors(self._roll_groups, h.name)
                         if x in self._turns]
                acquire = run_step(f"{name}-{h.name}-turn-acquire", s["turn-acquire"], None, self,
                                   live=self.live(h.name, "turn-acquire"), depends_on=[host.preflight, *after])
                self._turns[h.name] = acquire
                before_drivers = run_step(f"{name}-{h.name}-host-drain", s["host-drain"], conn, self,
                                          live=self.live(h.name, "host-drain"), depends_on=[acquire])
                self._drains[h.name] = before_drivers
            _, drivers = driver_steps(
                f"{name}-{h.name}-drivers", conn, s, self,
                live=self.lives(h.name, [k for k in s if k.startswith("drivers-")]), after=[before_drivers],
                moved_from=self._moved_from(f"{name}-{h.name}-drivers", "Drivers"))
            after_drivers: pulumi.Resource = drivers
            if "firewall" in s:
                after_drivers = self._host_step(f"{name}-{h.name}-firewall", "nftables", conn, s["firewall"], h.name,
                                                [], [drivers])
            gate = self._host_step(f"{name}-{h.name}-health", "gate", conn, s["health-gate"], h.name,
                                   [drivers.stdout], [after_drivers], "Fabric")
            rdma = self._host_step(f"{name}-{h.name}-rdma", "setup", conn, s["rdma"], h.name, [], [gate], "Rdma")
            kv = self._host_step(f"{name}-{h.name}-nic-affinity", "pairs", conn, s["nic-affinity"], h.name, [],
                                 [rdma]) if "nic-affinity" in s else rdma  # nixl.nicPerRank: before ucx.env
            previous = self._host_step(f"{name}-{h.name}-nixl", "ucx-env", conn, s["ucx-env"], h.name, [], [kv], "Nixl")
            if "host-return" in s:
                # Back in service (healthy in the router), then the turn goes to the next host.
                back = run_step(f"{name}-{h.name}-host-return", s["host-return"], conn, self,
                                live=self.live(h.name, "host-return"), triggers=[self._drains[h.name].stdout],
                                depends_on=[previous])
                previous = run_step(f"{name}-{h.name}-turn-release", s["turn-release"], None, self,
                                    live=self.live(h.name, "turn-release"), triggers=[self._turns[h.name].stdout],
                                    depends_on=[back])
            # The host as provisioned (driver answering, RDMA up): read again when the driver, gate or RDMA step ran.
            chain.facts = host.read_facts(
                s["facts"], [drivers.stdout, gate.stdout, rdma.stdout], [previous],
                live=self.live(h.name, "facts"))
        elif "firewall" in s:
            previous = self._host_step(f"{name}-{h.name}-firewall", "nftables", conn, s["firewall"], h.name, [],
                                       [host.preflight])
        if "runtime" in s:
            previous = self._host_step(f"{name}-{h.name}-runtime", "venv", conn, s["runtime"], h.name, [], [previous],
                                       "Runtime")
        chain.ready = [previous, *host.files]
        return chain

    def _host_step(self, name: str, command: str, conn: remote.ConnectionArgs, step: Step, host: str,
                   triggers: list, after: list, old_type: str | None = None) -> remote.Command:
        """The step's command ``{name}-{command}`` (once a HostStep ``name``'s, before that an ``old_type``'s)."""
        return run_step(f"{name}-{command}", step, conn, self, live=self.live(host, step.name), triggers=triggers,
                        depends_on=after, moved_from=self._moved_from(name, "HostStep", old_type))

    def _moved_from(self, name: str, *types: str | None) -> list[pulumi.Output[str]]:
        """The URNs a component ``name`` of each of ``types`` had under this one. Each host step (a host's driver
        steps together) had a component until issue 43: a fifth of a host's resources, never changing alone.
        Aliased there, a deployed step stays as it is; only the empty components go (their delete runs nothing)."""
        return [pulumi.create_urn(name, f"glm-infra:index:{t}", parent=self) for t in types if t]

    def _monitor(self, name: str, after: Sequence[pulumi.Resource] = ()) -> Monitoring | None:
        """The exporters on every host and Prometheus and Alertmanager on the monitoring host, once
        each host is provisioned (the driver step installs DCGM)."""
        hosts = [
            MonitoredHost(h.name, self.hosts[h.name].connection, self.steps[h.name].only(*STEP_KEYS),
                          [*self._chains[h.name].ready, *after], self.lives(h.name, self.steps[h.name].only(*STEP_KEYS)))
            for h in self.plan.hosts if self.mine(h.name) and self.steps[h.name].only(*STEP_KEYS)
        ]
        if not hosts:
            return None
        port = self.stack.monitoring.prometheus_port
        mon = self.stack.monitoring_host
        url = self._resolved.apply(lambda r: f"http://{paths.url_host(r.stack.host(mon).address)}:{port}")
        secrets = self._split.secrets
        return Monitoring(f"{name}-monitoring", MonitoringArgs(hosts, secrets.get("webhook_url"), url,
                                                               secrets.get("dead_mans_switch_url")),
                          pulumi.ResourceOptions(parent=self))


def _read_key(path: str, source: str) -> str:
    try:
        return Path(path).expanduser().read_text()
    except OSError as e:
        raise InvalidArgsError(StackError(source, [Problem("glm-infra:ssh.privateKeyPath", f"cannot read {path}: {e.strerror}")])) from None


class Hosts(_Deployment):
    """GPU servers made ready to serve, without serving: preflight, the pinned NVIDIA driver and fabric
    (rebooting only when the module changed), the health gate, RDMA, the NIXL/UCX environment, the
    host facts, and the checkpoint staged on every host (downloaded once, fanned out) — for a
    serving engine of your own.

    ``args`` are ``ClusterArgs`` without pools or router (``HostsArgs``; pools and router given are
    ignored): ``hosts``, ``ssh``, ``model`` and optionally ``preflight``, ``drivers``, ``rdma``,
    ``nixl``, ``runtime``. The hub source (``model.source: huggingface``) needs glm-infra's Python
    runtime on the seed (``install_runtime``, the keyword or the Args key).
    """

    facts: pulumi.Output[dict[str, Any]]
    """Each host as provisioned, by host name: OS, kernel, GPUs and driver, RDMA ports, memlock, free disk at the model path."""
    prometheus_url: pulumi.Output[str]
    """Prometheus on the monitoring host (http://HOST:PORT); empty without monitoring."""

    def __init__(self, name: str, args: HostsArgs, opts: pulumi.ResourceOptions | None = None, *,
                 install_runtime: bool = False) -> None:
        install_runtime = install_runtime or bool(dict(args).get("install_runtime", False))
        args = {k: v for k, v in dict(args).items() if k not in (*SERVING_KEYS, "install_runtime")}
        super().__init__("glm-infra:index:Hosts", name, args, False, opts, install_runtime)
        self.monitoring = self._monitor(name)
        self.prometheus_url = self.monitoring.prometheus_url if self.monitoring else pulumi.Output.from_input("")
        self.register_outputs({"facts": self.facts, "prometheusUrl": self.prometheus_url})


class Cluster(_Deployment):
    """GLM-5.2 on vLLM with P/D disaggregation on bare-metal B300 servers reached over SSH.

    ``args``: the ``glm-infra:*`` keys of a stack file as a ``ClusterArgs`` dict (snake_case keys).
    ``hosts``, ``ssh`` and ``model`` are enough: the pools default to the recipe (docs/RECIPE.md) (prefill TP1
    DP4 EP ×2 on every host but the last, decode TP1 DP8 EP and the router on the last). The Args
    are validated like ``glm-infra validate`` (same messages) before any resource exists. Host
    addresses, the SSH key, the router API key, the HF token and the mirror URL may be Outputs of
    other resources.
    """

    router_url: pulumi.Output[str]
    """The router's public URL (https://HOST:PORT); empty without a router."""
    router_ca_certificate: pulumi.Output[str]
    """PEM of the CA clients trust for routerUrl when glm-infra generated its certificate, else empty."""
    instances: pulumi.Output[dict[str, dict[str, str]]]
    """Every vLLM instance by name: its host, url and gpus (CUDA_VISIBLE_DEVICES)."""
    facts: pulumi.Output[dict[str, Any]]
    """Each host as provisioned, by host name: OS, kernel, GPUs and driver, RDMA ports, memlock, free disk at the model path."""
    prometheus_url: pulumi.Output[str]
    """Prometheus on the monitoring host (http://HOST:PORT); empty without monitoring."""

    def __init__(self, name: str, args: ClusterArgs, opts: pulumi.ResourceOptions | None = None,
                 only_hosts: Sequence[str] | None = None) -> None:
        """``only_hosts``: deploy only these hosts of the stack (their provisioning and instances; the
        router if it runs there), the others being deployed by another stack."""
        super().__init__("glm-infra:index:Cluster", name, args, True, opts, only_hosts=only_hosts)
        plan = self.plan
        vllm_secrets = self.secret_digest(vllm.vllm_secrets_env)
        # Instances start together on a first deploy; a change restarts each pool one instance at a
        # time, each gated on /health.
        self.services: dict[str, VllmService] = {}
        last_of_pool: dict[str, VllmService] = {}
        prefill_stoppers: list[pulumi.Resource] = []
        # A host's copy of its pool's caches, before its restarts.
        warm_caches = WarmCacheRelays(self, name, {h: c.ready for h, c in self._chains.items()})
        for h, chain in self._chains.items():  # what the plan moves off a host's GPUs and ports, before any starts
            if (step := self.steps[h].steps.get("vllm-placement")) is not None:
                chain.ready = [self._host_step(f"{name}-{h}-vllm-placement", "placement", chain.host.connection, step,
                                               h, [], chain.ready)]
        # A change of identity (revision, vLLM) marked on the router's host before any instance restarts onto it.
        transition: list[pulumi.Resource] = [  # on every router host (router.host's keeps its first name)
            run_step(f"{name}-canary-transition{'' if r == plan.router.host else f'-{r}'}",
                     self.steps[r].steps[router_role.CANARY_TRANSITION], self.hosts[r].connection, self,
                     live=self.live(r, router_role.CANARY_TRANSITION), depends_on=list(self._chains[r].ready))
            for r in (plan.router.host_names if plan.router is not None else ()) if self.mine(r)]
        for inst in plan.instances:
            if not self.mine(inst.host):
                continue
            s = self.steps[inst.host].steps
            keys = [f"{inst.name}-{k}" for k in ("unit", "service", "rollout", "stop")]
            warm = warm_caches.before_rollout(inst.role, inst.host, self.services)  # its start and restart wait for it
            svc = VllmService(
                f"{name}-{inst.name}",
                VllmServiceArgs(
                    instance=inst.name,
                    connection=self.hosts[inst.host].connection,
                    steps={k: s[k] for k in keys},
                    health_url=self._resolved.apply(lambda r, n=inst.name: f"{_instance(r.plan, n).url}/health"),
                    restart_triggers=[vllm_secrets],
                    stop_after=prefill_stoppers if inst.role == "decode" else [],
                    rollout_after=[*([last_of_pool[inst.role].rollout] if inst.role in last_of_pool else []), *transition],
                    live=self.lives(inst.host, keys),
                ),
                pulumi.ResourceOptions(parent=self, depends_on=[*self._chains[inst.host].ready, *warm]),
            )
            if inst.role == "prefill":
                prefill_stoppers.append(svc.stopper)
            self.services[inst.name] = svc
            last_of_pool[inst.role] = svc
        warm_caches.finish(self.services)

        # A host's old revision goes once every instance on that host serves the new one.
        for h in plan.serving_hosts:
            if "prune-weights" in self.steps[h.name].steps and self.mine(h.name):
                run_step(f"{name}-{h.name}-prune-weights", self.steps[h.name].steps["prune-weights"],
                         self.hosts[h.name].connection, self,
                         depends_on=[self.services[i.name].rollout for i in h.instances])

        # Every router host, one at a time on a change (the standbys first); router.host's keeps its first name.
        self.routers: dict[str, Router] = {}
        for r in plan.router.roll_order() if plan.router is not None else ():
            if not self.mine(r):
                continue
            router_steps, first = self.steps[r].only("router-"), self.routers.get(plan.router.host)
            self.routers[r] = Router(
                f"{name}-router" if r == plan.router.host else f"{name}-router-{r}",
                RouterArgs(
                    connection=self.hosts[r].connection,
                    steps=router_steps,
                    url=self._resolved.apply(lambda x: x.plan.router.url),
                    secret_files={k: self.secret_file(st) for k, st in router_steps.items() if st.secret_render},
                    # After every instance's health-gated start, before every stopper: starts last, stops first.
                    after=[x for svc in self.services.values() for x in (svc.service, svc.stopper)],
                    rollouts=[svc.rollout for svc in self.services.values()],
                    live=self.lives(r, router_steps),
                    roll_after=[x.last for x in self.routers.values()],
                    ca=first.ca_export.stdout if first is not None and first.ca_export is not None else None,
                ),
                pulumi.ResourceOptions(parent=self, depends_on=list(self._chains[r].ready)),
            )
        self.router: Router | None = self.routers.get(plan.router.host) if plan.router is not None else None
        self.monitoring = self._monitor(name)
        self.prometheus_url = self.monitoring.prometheus_url if self.monitoring else pulumi.Output.from_input("")
        self.router_url = self._resolved.apply(lambda x: x.plan.router.url if x.plan.router else "")
        self.router_ca_certificate = self.router.ca_certificate if self.router is not None \
            else pulumi.Output.from_input("")
        self.instances = self._resolved.apply(lambda x: {
            i.name: {"host": i.host, "url": i.url, "gpus": i.cuda_visible_devices} for i in x.plan.instances})
        self.register_outputs({"routerUrl": self.router_url, "routerCaCertificate": self.router_ca_certificate,
                               "facts": self.facts, "instances": self.instances, "prometheusUrl": self.prometheus_url})


def _instance(plan: topology.Plan, name: str) -> topology.Instance:
    return next(i for i in plan.instances if i.name == name)
