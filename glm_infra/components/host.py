"""One server reached over SSH: its connection and the host-wide files the services share."""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_command.remote as remote

from ..steps import file_step
from .remote_step import run_step


@dataclass
class HostArgs:
    name: str
    """Host name from the stack (b300-1)."""
    address: str
    """Address glm-infra connects to over SSH."""
    user: str
    """SSH user."""
    private_key: pulumi.Input[str]
    """SSH private key (a secret Output)."""
    ssh_port: int = 22
    """SSH port."""
    files: dict[str, tuple[pulumi.Input[str], int, bool]] = field(default_factory=dict)
    """Host-wide files: absolute path → (content, mode, secret)."""


class Host(pulumi.ComponentResource):
    connection: remote.ConnectionArgs
    files: list[remote.Command]

    def __init__(self, name: str, args: HostArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("glm-infra:index:Host", name, None, opts)
        self.connection = remote.ConnectionArgs(
            host=args.address,
            port=args.ssh_port,
            user=args.user,
            private_key=args.private_key,
            dial_error_limit=30,
            per_dial_timeout=10,
        )
        self.files = []
        for path, (content, mode, secret) in sorted(args.files.items()):
            slug = path.strip("/").replace("/", "-").replace(".", "-")
            step = file_step(slug, path, "", mode=mode, secret=secret)
            self.files.append(run_step(f"{name}-{slug}", step, self.connection, self, stdin=content))
        self.address = pulumi.Output.from_input(args.address)
        self.register_outputs({"address": self.address})
