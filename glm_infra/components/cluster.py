"""The whole deployment of one stack, built from the plan: per host preflight → driver → health
gate → RDMA → NIXL → runtime, the weights (downloaded once, fanned out), then the vLLM instances
(each pool one at a time) and the router."""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass

import pulumi

from .. import render
from ..config import StackConfig
from ..steps import Step, digest
from ..topology import Plan, seed_host
from .drivers import Drivers, DriversArgs
from .fabric import Fabric, FabricArgs
from .host import Host, HostArgs
from .nixl import Nixl, NixlArgs
from .rdma import Rdma, RdmaArgs
from .remote_step import run_step
from .router import Router, RouterArgs
from .runtime import Runtime, RuntimeArgs
from .vllm_service import VllmService, VllmServiceArgs
from .weights import ModelWeights, ModelWeightsArgs, WeightsHost


@dataclass
class ClusterArgs:
    stack: StackConfig
    """The validated stack."""
    plan: Plan
    """Its topology plan."""
    private_key: pulumi.Input[str]
    """SSH private key (secret)."""
    secrets: Mapping[str, pulumi.Input[str]]
    """Secret values by template name (router_api_key, hf_token), as secret Outputs."""


class Cluster(pulumi.ComponentResource):
    hosts: dict[str, Host]
    runtimes: dict[str, Runtime]
    weights: ModelWeights | None
    services: dict[str, VllmService]
    router: Router | None

    def __init__(self, name: str, args: ClusterArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("glm-infra:index:Cluster", name, None, opts)
        stack, plan = args.stack, args.plan
        secret_values = pulumi.Output.secret(
            pulumi.Output.all(**dict(args.secrets)) if args.secrets else pulumi.Output.from_input({})
        )
        secrets_digest = secret_values.apply(lambda s: digest(render.vllm_secrets_env(s)))
        rt = stack.runtime
        # What the vLLM processes load from the venv; the router's pin restarts only the router.
        runtime_digest = digest(rt.vllm_version, rt.nixl_version, rt.venv)
        seed = seed_host(stack)

        self.hosts, self.runtimes = {}, {}
        ready: dict[str, list[pulumi.Resource]] = {}
        facts: dict[str, pulumi.Output[dict]] = {}
        for h in plan.hosts:
            hc = stack.host(h.name)
            files: dict[str, tuple[pulumi.Input[str], int, bool]] = {}
            if h.instances:
                files[render.VLLM_SECRETS] = (secret_values.apply(render.vllm_secrets_env), 0o600, True)
            if h.name == seed and stack.model.source == "huggingface":
                files[render.HF_SECRETS] = (secret_values.apply(render.hf_secrets_env), 0o600, True)
            host = Host(
                f"{name}-{h.name}",
                HostArgs(
                    name=h.name,
                    address=h.address,
                    user=stack.ssh.user,
                    private_key=args.private_key,
                    ssh_port=hc.ssh_port,
                    allowed_os=stack.preflight.allowed_os,
                    min_kernel=stack.preflight.min_kernel,
                    gpus=hc.gpus,
                    gpu_model=hc.gpu_model,
                    require_driver=stack.drivers.mode == "verify",
                    model_path=stack.model.path if h.instances else None,
                    min_free_gb=stack.preflight.min_free_disk_gb if h.instances else None,
                    files=files,
                ),
                pulumi.ResourceOptions(parent=self),
            )
            self.hosts[h.name] = host
            previous: pulumi.Resource = host.preflight
            if h.instances:
                drivers = Drivers(
                    f"{name}-{h.name}-drivers",
                    DriversArgs(
                        host=h.name,
                        connection=host.connection,
                        script=render.drivers_script(stack, h.name),
                        reboot_script=render.reboot_script(h.name),
                        wait_script=render.waitboot_script(stack, h.name),
                        reboot_timeout=stack.drivers.reboot_timeout,
                    ),
                    pulumi.ResourceOptions(parent=self, depends_on=[host.preflight]),
                )
                fabric = Fabric(
                    f"{name}-{h.name}-health",
                    FabricArgs(
                        connection=host.connection,
                        script=render.health_script(stack, h.name),
                        timeout_s=stack.drivers.fabric_timeout,
                        triggers=[drivers.ready.stdout],
                    ),
                    pulumi.ResourceOptions(parent=self, depends_on=[drivers]),
                )
                rdma = Rdma(
                    f"{name}-{h.name}-rdma",
                    RdmaArgs(host.connection, render.rdma_script(stack, h.name)),
                    pulumi.ResourceOptions(parent=self, depends_on=[fabric]),
                )
                previous = Nixl(
                    f"{name}-{h.name}-nixl",
                    NixlArgs(host.connection, render.ucx_env(stack, h.name)),
                    pulumi.ResourceOptions(parent=self, depends_on=[rdma]),
                )
                # The host as provisioned (driver answering, RDMA up): read again whenever the
                # driver, the gate or the RDMA step ran again.
                facts[h.name] = host.read_facts(
                    [drivers.ready.stdout, fabric.gate.stdout, rdma.setup.stdout], depends_on=[previous]
                )
            if h.instances or h.runs_router:
                runtime = Runtime(
                    f"{name}-{h.name}-runtime",
                    RuntimeArgs(host.connection, render.runtime_script(stack, h.name)),
                    pulumi.ResourceOptions(parent=self, depends_on=[previous]),
                )
                self.runtimes[h.name] = runtime
                ready[h.name] = [runtime, *host.files]

        self.weights = None
        if plan.serving_hosts and seed is not None:
            self.weights = ModelWeights(
                f"{name}-weights",
                ModelWeightsArgs(
                    model=stack.model,
                    runtime=rt,
                    hosts=[
                        WeightsHost(h.name, h.address, self.hosts[h.name].connection, ready[h.name])
                        for h in plan.serving_hosts
                    ],
                    seed=seed,
                ),
                pulumi.ResourceOptions(parent=self),
            )
            for h in plan.serving_hosts:
                ready[h.name] = [*ready[h.name], self.weights.staged[h.name]]

        # Instances start together on a first deploy; a change restarts each pool one instance at a
        # time, each gated on /health.
        self.services = {}
        last_of_pool: dict[str, VllmService] = {}
        prefill_stoppers: list[pulumi.Resource] = []
        for inst in plan.instances:
            svc = VllmService(
                f"{name}-{inst.name}",
                VllmServiceArgs(
                    host=inst.host,
                    connection=self.hosts[inst.host].connection,
                    unit_name=inst.unit,
                    unit=render.vllm_unit(stack, inst),
                    script=render.vllm_service_script(stack, inst),
                    health_url=f"{inst.url}/health",
                    start_timeout_s=render.SERVICE_START_TIMEOUT_S,
                    restart_triggers=[
                        digest(render.ucx_env(stack, inst.host)),
                        secrets_digest,
                        runtime_digest,
                        stack.model.revision,
                    ],
                    stop_after=prefill_stoppers if inst.role == "decode" else [],
                    rollout_after=[last_of_pool[inst.role].rollout] if inst.role in last_of_pool else [],
                ),
                pulumi.ResourceOptions(parent=self, depends_on=list(ready[inst.host])),
            )
            if inst.role == "prefill":
                prefill_stoppers.append(svc.stopper)
            self.services[inst.name] = svc
            last_of_pool[inst.role] = svc

        # A host's old revision goes once every instance on that host serves the new one.
        if self.weights is not None and stack.model.source != "local":
            for h in plan.serving_hosts:
                cmd = [render.WEIGHTS, "prune", "--revision", stack.model.revision, "--path", stack.model.path]
                prune = Step("prune", " ".join(shlex.quote(c) for c in cmd))
                run_step(f"{name}-{h.name}-prune-weights", prune, self.hosts[h.name].connection, self,
                         triggers=[stack.model.revision],
                         depends_on=[self.services[i.name].rollout for i in h.instances])

        self.router = None
        if plan.router is not None:
            r = plan.router
            self.router = Router(
                f"{name}-router",
                RouterArgs(
                    connection=self.hosts[r.host].connection,
                    unit_name=r.unit,
                    unit=render.router_unit(stack, plan),
                    script=render.router_service_script(stack, plan),
                    url=r.url,
                    secrets_env=secret_values.apply(render.router_secrets_env),
                    secrets_path=render.ROUTER_SECRETS,
                    front_conf=render.router_front_conf(stack, plan),
                    front_keys=secret_values.apply(render.router_front_keys),
                    front_script=render.router_front_script(plan),
                    # vllm-router is its own wheel in the shared venv: a new vllm pin updates the venv
                    # in place and leaves the router's files alone, so only its own pin restarts it.
                    restart_triggers=[digest(rt.router_version, rt.venv)],
                    # After every instance's health-gated start, before every stopper: the router
                    # starts last and stops first.
                    after=[x for s in self.services.values() for x in (s.service, s.stopper)],
                ),
                pulumi.ResourceOptions(parent=self, depends_on=list(ready[r.host])),
            )

        self.router_url = pulumi.Output.from_input(plan.router.url if plan.router else "")
        self.facts = pulumi.Output.all(**{n: facts.get(n, h.facts) for n, h in self.hosts.items()})
        self.register_outputs({"routerUrl": self.router_url, "facts": self.facts})
