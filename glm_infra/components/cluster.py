"""The whole deployment of one stack: hosts, vLLM instances and the router, built from the plan."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import pulumi

from .. import render
from ..config import StackConfig
from ..steps import digest
from ..topology import Plan, pool_of
from .host import Host, HostArgs
from .router import Router, RouterArgs
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
    services: dict[str, VllmService]
    router: Router | None

    def __init__(self, name: str, args: ClusterArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("glm-infra:index:Cluster", name, None, opts)
        stack, plan = args.stack, args.plan
        secret_values = pulumi.Output.secret(
            pulumi.Output.all(**dict(args.secrets)) if args.secrets else pulumi.Output.from_input({})
        )

        self.hosts = {}
        for h in plan.hosts:
            files: dict[str, tuple[pulumi.Input[str], int, bool]] = {}
            if h.instances:
                files[render.UCX_ENV] = (render.ucx_env(stack, h.name), 0o644, False)
                files[render.VLLM_SECRETS] = (secret_values.apply(render.vllm_secrets_env), 0o600, True)
            self.hosts[h.name] = Host(
                f"{name}-{h.name}",
                HostArgs(
                    name=h.name,
                    address=h.address,
                    user=stack.ssh.user,
                    private_key=args.private_key,
                    ssh_port=stack.host(h.name).ssh_port,
                    files=files,
                ),
                pulumi.ResourceOptions(parent=self),
            )

        # Instances of one pool start and restart one at a time, each gated on /health.
        self.services = {}
        previous: dict[str, VllmService] = {}
        for inst in plan.instances:
            host = self.hosts[inst.host]
            pool = pool_of(stack, inst.role)
            deps: list[pulumi.Resource] = list(host.files)
            if inst.role in previous:
                deps.append(previous[inst.role])
            svc = VllmService(
                f"{name}-{inst.name}",
                VllmServiceArgs(
                    host=inst.host,
                    connection=host.connection,
                    unit_name=inst.unit,
                    unit=render.vllm_unit(stack, inst),
                    health_url=f"{inst.url}/health",
                    drain_s=pool.shutdown_timeout,
                    restart_triggers=[
                        digest(render.ucx_env(stack, inst.host)),
                        secret_values.apply(lambda s: digest(render.vllm_secrets_env(s))),
                    ],
                ),
                pulumi.ResourceOptions(parent=self, depends_on=deps),
            )
            self.services[inst.name] = svc
            previous[inst.role] = svc

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
                ),
                pulumi.ResourceOptions(parent=self, depends_on=list(self.services.values())),
            )

        self.router_url = pulumi.Output.from_input(plan.router.url if plan.router else "")
        self.register_outputs(
            {
                "hosts": [h.name for h in plan.hosts],
                "instances": {i.name: i.url for i in plan.instances},
                "routerUrl": self.router_url,
            }
        )
