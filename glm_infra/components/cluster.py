"""The whole deployment of one stack, built from the plan: per host preflight → driver → health
gate → RDMA → NIXL → runtime, then the vLLM instances (each pool one at a time) and the router."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import pulumi

from .. import render
from ..config import StackConfig
from ..steps import digest
from ..topology import Plan, pool_of
from .drivers import Drivers, DriversArgs
from .fabric import Fabric, FabricArgs
from .host import Host, HostArgs
from .nixl import Nixl, NixlArgs
from .rdma import Rdma, RdmaArgs
from .router import Router, RouterArgs
from .runtime import Runtime, RuntimeArgs
from .vllm_service import VllmService, VllmServiceArgs


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
    services: dict[str, VllmService]
    router: Router | None

    def __init__(self, name: str, args: ClusterArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("glm-infra:index:Cluster", name, None, opts)
        stack, plan = args.stack, args.plan
        child = pulumi.ResourceOptions(parent=self)
        secret_values = pulumi.Output.secret(
            pulumi.Output.all(**dict(args.secrets)) if args.secrets else pulumi.Output.from_input({})
        )
        secrets_digest = secret_values.apply(lambda s: digest(render.vllm_secrets_env(s)))
        rt = stack.runtime
        runtime_digest = digest(rt.vllm_version, rt.nixl_version, rt.router_version, rt.venv)

        self.hosts, self.runtimes = {}, {}
        ready: dict[str, list[pulumi.Resource]] = {}
        for h in plan.hosts:
            hc = stack.host(h.name)
            serving = bool(h.instances)
            files = {render.VLLM_SECRETS: (secret_values.apply(render.vllm_secrets_env), 0o600, True)} if serving else {}
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
                    model_path=stack.model.path,
                    files=files,
                ),
                child,
            )
            self.hosts[h.name] = host
            previous: pulumi.Resource = host.preflight
            if serving:
                drivers = Drivers(
                    f"{name}-{h.name}-drivers",
                    DriversArgs(h.name, h.address, hc.ssh_port, host.connection, stack.drivers),
                    pulumi.ResourceOptions(parent=self, depends_on=[host.preflight]),
                )
                fabric = Fabric(
                    f"{name}-{h.name}-health",
                    FabricArgs(
                        host=h.name,
                        connection=host.connection,
                        gpus=hc.gpus,
                        gpu_model=hc.gpu_model,
                        driver_version=stack.drivers.version,
                        fabric=stack.drivers.fabric_manager,
                        dcgm_diag_level=stack.drivers.dcgm_diag_level,
                        triggers=[drivers.ready.stdout],
                    ),
                    pulumi.ResourceOptions(parent=self, depends_on=[drivers]),
                )
                rdma = Rdma(
                    f"{name}-{h.name}-rdma",
                    RdmaArgs(h.name, host.connection, hc.compute_nics, stack.rdma),
                    pulumi.ResourceOptions(parent=self, depends_on=[fabric]),
                )
                nixl = Nixl(
                    f"{name}-{h.name}-nixl",
                    NixlArgs(host.connection, render.ucx_env(stack, h.name)),
                    pulumi.ResourceOptions(parent=self, depends_on=[rdma]),
                )
                previous = nixl
            if serving or h.runs_router:
                runtime = Runtime(
                    f"{name}-{h.name}-runtime",
                    RuntimeArgs(h.name, host.connection, rt),
                    pulumi.ResourceOptions(parent=self, depends_on=[previous]),
                )
                self.runtimes[h.name] = runtime
                ready[h.name] = [runtime, *host.files]

        # Instances of one pool start and restart one at a time, each gated on /health.
        self.services = {}
        last_of_pool: dict[str, VllmService] = {}
        for inst in plan.instances:
            pool = pool_of(stack, inst.role)
            deps = list(ready[inst.host])
            if inst.role in last_of_pool:
                deps.append(last_of_pool[inst.role])
            svc = VllmService(
                f"{name}-{inst.name}",
                VllmServiceArgs(
                    host=inst.host,
                    connection=self.hosts[inst.host].connection,
                    unit_name=inst.unit,
                    unit=render.vllm_unit(stack, inst),
                    health_url=f"{inst.url}/health",
                    drain_s=pool.shutdown_timeout,
                    restart_triggers=[digest(render.ucx_env(stack, inst.host)), secrets_digest, runtime_digest],
                ),
                pulumi.ResourceOptions(parent=self, depends_on=deps),
            )
            self.services[inst.name] = svc
            last_of_pool[inst.role] = svc

        self.router = None
        if plan.router is not None:
            r = plan.router
            self.router = Router(
                f"{name}-router",
                RouterArgs(
                    host=r.host,
                    connection=self.hosts[r.host].connection,
                    unit_name=r.unit,
                    unit=render.router_unit(stack, plan),
                    url=r.url,
                    secrets_env=secret_values.apply(render.router_secrets_env),
                    secrets_path=render.ROUTER_SECRETS,
                    restart_triggers=[runtime_digest],
                ),
                pulumi.ResourceOptions(parent=self, depends_on=[*self.services.values(), *ready[r.host]]),
            )

        self.router_url = pulumi.Output.from_input(plan.router.url if plan.router else "")
        self.facts = pulumi.Output.all(**{n: h.facts for n, h in self.hosts.items()})
        self.register_outputs({"routerUrl": self.router_url, "facts": self.facts})
