"""The P/D router (vllm-router) as a systemd unit on loopback, behind an nginx front on the public
port that checks the API key and retries a request the router failed before answering."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pulumi
import pulumi_command.remote as remote

from ..render import FRONT_CONF, FRONT_KEYS, unit_stem
from ..steps import ScriptStep, digest, file_step
from .remote_step import inherited, run_step


@dataclass
class RouterArgs:
    connection: remote.ConnectionArgs
    """SSH connection to the router's host."""
    unit_name: str
    """systemd unit name."""
    unit: str
    """Rendered unit file."""
    script: str
    """Rendered service.sh: (re)start the router and wait for its /health."""
    url: str
    """Public URL (the front)."""
    secrets_env: pulumi.Input[str]
    """Rendered EnvironmentFile with the workers' API key (a secret Output)."""
    secrets_path: str
    """Where that file lives on the host."""
    front_conf: str
    """Rendered nginx configuration of the front."""
    front_keys: pulumi.Input[str]
    """Rendered nginx map entries of the accepted API keys (a secret Output)."""
    front_script: str
    """Rendered router-front.sh: install nginx if missing, load the front, wait for it."""
    restart_triggers: Sequence[pulumi.Input[str]] = field(default_factory=list)
    """Values whose change restarts the router."""
    after: Sequence[pulumi.Resource] = field(default_factory=list)
    """What the router starts after and stops before: every instance's start and stopper."""


class Router(pulumi.ComponentResource):
    service: remote.Command
    front: remote.Command

    def __init__(self, name: str, args: RouterArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("glm-infra:index:Router", name, None, opts)
        deps = inherited(opts)
        secrets = run_step(f"{name}-secrets", file_step("secrets", args.secrets_path, "", mode=0o600, secret=True),
                           args.connection, self, stdin=args.secrets_env, depends_on=deps)
        unit_path = f"/etc/systemd/system/{args.unit_name}"
        unit_file = run_step(f"{name}-unit", file_step("unit", unit_path, args.unit), args.connection, self,
                             depends_on=deps)
        secrets_digest = pulumi.Output.from_input(args.secrets_env).apply(digest)
        self.service = run_step(
            f"{name}-service",
            ScriptStep(unit_stem(args.unit_name), args.script).step(),
            args.connection,
            self,
            triggers=[digest(args.unit), secrets_digest, *args.restart_triggers],
            depends_on=[unit_file, secrets, *deps, *args.after],
        )
        # The front goes up after the router and comes down before it.
        conf = run_step(f"{name}-front-conf", file_step("front-conf", FRONT_CONF, args.front_conf), args.connection,
                        self, depends_on=[self.service])
        keys = run_step(f"{name}-front-keys", file_step("front-keys", FRONT_KEYS, "", mode=0o600, secret=True),
                        args.connection, self, stdin=args.front_keys, depends_on=[self.service])
        self.front = run_step(
            f"{name}-front",
            ScriptStep("router-front", args.front_script).step(),
            args.connection,
            self,
            triggers=[digest(args.front_conf), pulumi.Output.from_input(args.front_keys).apply(digest)],
            depends_on=[conf, keys],
        )
        self.url = pulumi.Output.from_input(args.url)
        self.register_outputs({"url": self.url})
