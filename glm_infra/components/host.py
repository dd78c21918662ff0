"""One server reached over SSH: its connection, the host checker's preflight, its host-wide files
(secrets) and, once provisioned, its facts."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pulumi
import pulumi_command.remote as remote

from glm_infra.steps import Step

from .remote_step import run_step


@dataclass
class HostArgs:
    name: str
    """Host name from the stack (b300-1)."""
    address: pulumi.Input[str]
    """Address glm-infra connects to over SSH (may come from another resource)."""
    user: str
    """SSH user."""
    private_key: pulumi.Input[str]
    """SSH private key (a secret)."""
    preflight: Step
    """The preflight step (preflight.preflight_step): installs hostcheck.py and refuses a host that cannot serve."""
    ssh_port: int = 22
    """SSH port."""
    host_key: str | None = None
    """The host's SSH public key (`ssh-ed25519 AAAA…`): the connection refuses a host that does not hold it.
    None: any key is taken."""
    dial_attempts: int = 10
    """Connection attempts before a step fails (a host that does not answer fails after about
    dial_attempts × (dial_timeout + 5) s: the provider backs off up to 5 s between attempts)."""
    dial_timeout: int = 10
    """Seconds one connection attempt may take."""
    files: Sequence[Step] = field(default_factory=list)
    """Host-wide files (hostplan: vllm-secrets, hf-secrets), written after preflight."""
    secret_files: Mapping[str, pulumi.Input[str]] = field(default_factory=dict)
    """Step name → the real content of a secret file (the steps hold placeholders)."""
    live: Mapping[str, pulumi.Output[Step]] = field(default_factory=dict)
    """Step name → the step as resolved at deploy time, when it depends on values other resources produce."""


class Host(pulumi.ComponentResource):
    """A server: SSH connection, preflight facts, host-wide files. ``read_facts`` adds the facts of the
    host once provisioned."""

    connection: remote.ConnectionArgs
    preflight: remote.Command
    facts: pulumi.Output[dict]
    files: list[remote.Command]

    def __init__(self, name: str, args: HostArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("glm-infra:index:Host", name, None, opts)
        self._name = name
        self.connection = remote.ConnectionArgs(
            host=args.address,
            port=args.ssh_port,
            user=args.user,
            private_key=args.private_key,
            dial_error_limit=args.dial_attempts,
            per_dial_timeout=args.dial_timeout,
            host_key=args.host_key,
        )
        self.preflight = run_step(f"{name}-preflight", args.preflight, self.connection, self,
                                  live=args.live.get("preflight"))
        self.facts = self.preflight.stdout.apply(_last_json)
        self.files = []
        for step in args.files:
            slug = step.files[0].path.strip("/").replace("/", "-").replace(".", "-")
            self.files.append(run_step(f"{name}-{slug}", step, self.connection, self,
                                       stdin=args.secret_files.get(step.name), depends_on=[self.preflight]))
        self.address = pulumi.Output.from_input(args.address)
        self.register_outputs({"address": self.address, "facts": self.facts})

    def read_facts(self, step: Step, triggers: Sequence[pulumi.Input[str]], depends_on: Sequence[pulumi.Resource],
                   live: pulumi.Output[Step] | None = None) -> pulumi.Output[dict]:
        """The host's facts read again once ``depends_on`` ran (preflight's are from before the
        driver was installed); re-read whenever a ``triggers`` value changes."""
        read = run_step(f"{self._name}-facts", step, self.connection, self, live=live, triggers=triggers,
                        depends_on=depends_on)
        return read.stdout.apply(_last_json)


def _last_json(stdout: str | None) -> dict:
    for line in reversed((stdout or "").splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {}
