"""The P/D router (vllm-router) as a systemd unit on loopback, behind an nginx front on the public
port that speaks TLS, checks the API key and retries a request the router failed before answering.
The router reaches each instance through a gate (nginx on loopback) that fails its health checks while
the instance's canary fails; the canaries run on a timer on the same host.
The steps come from the per-host plan (router.router_steps)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pulumi
import pulumi_command.remote as remote

from glm_infra.roles.router.ha import CA_EXPORT, CA_GIVEN
from glm_infra.steps import Step, digest

from .remote_step import inherited, run_step


@dataclass
class RouterArgs:
    connection: remote.ConnectionArgs
    """SSH connection to the router's host."""
    steps: Mapping[str, Step]
    """router-secrets, router-gates-conf, router-gates, router-unit, router-service, router-canary,
    router-front-conf, router-front-keys, router-front-tls-given (only with the stack's own certificate),
    router-front-tls, router-front."""
    url: pulumi.Input[str]
    """Public URL (the front)."""
    secret_files: Mapping[str, pulumi.Input[str]] = field(default_factory=dict)
    """The secret files with the real values (router-secrets, router-front-keys, router-front-tls-given;
    the steps hold placeholders)."""
    after: Sequence[pulumi.Resource] = field(default_factory=list)
    """What the router starts after and stops before: every instance's start and stopper."""
    rollouts: Sequence[pulumi.Resource] = field(default_factory=list)
    """Every instance's rollout: the canaries record a new reference only once each has rolled onto it."""
    live: Mapping[str, pulumi.Output[Step]] = field(default_factory=dict)
    """The steps as resolved at deploy time (they name the workers' addresses)."""
    roll_after: Sequence[pulumi.Resource] = field(default_factory=list)
    """What the router restarts only after: the router hosts before it in the roll (one at a time)."""
    ca: pulumi.Input[str] | None = None
    """router.host's generated CA (certificate and key, a secret) for the other router hosts to sign with
    (their ``router-front-ca-given`` step)."""


class Router(pulumi.ComponentResource):
    """Outputs: ``url`` (https), ``ca_certificate`` (PEM of the CA that signed a generated certificate;
    empty when the stack gives its own)."""

    service: remote.Command
    gates: remote.Command
    canary: remote.Command
    front: remote.Command
    tls: remote.Command

    def __init__(self, name: str, args: RouterArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("glm-infra:index:Router", name, None, opts)
        s, live, secret = args.steps, args.live, args.secret_files
        deps = inherited(opts)

        def step(key: str, **kw):
            return run_step(f"{name}-{key.removeprefix('router-')}", s[key], args.connection, self,
                            live=live.get(key), stdin=secret.get(key), **kw)

        def digest_of(key: str) -> list[pulumi.Input[str]]:
            return [pulumi.Output.from_input(secret[key]).apply(digest)] if key in secret else []

        secrets = step("router-secrets", depends_on=deps)
        # The router reaches every instance through its gate (nginx on loopback): the gates listen first.
        gates_conf = step("router-gates-conf", depends_on=deps)
        self.gates = step("router-gates", depends_on=[gates_conf, *deps])
        unit_file = step("router-unit", depends_on=deps)
        self.service = step("router-service", triggers=digest_of("router-secrets"),
                            depends_on=[unit_file, secrets, self.gates, *deps, *args.after, *args.roll_after])
        # The canaries once the router serves and every instance has rolled (their run records the reference
        # the instances agree on, of what they all run now); a new API key re-runs them.
        self.canary = step("router-canary", triggers=digest_of("router-secrets"),
                           depends_on=[self.service, *args.rollouts])
        # The front goes up after the router and comes down before it.
        conf = step("router-front-conf", depends_on=[self.service])
        keys = step("router-front-keys", depends_on=[self.service])
        given = [step("router-front-tls-given", depends_on=deps)] if "router-front-tls-given" in s else []
        ca_digest: list[pulumi.Input[str]] = []
        if CA_GIVEN in s:  # another router host: router.host's CA, before the certificate it signs
            assert args.ca is not None
            ca_digest = [pulumi.Output.from_input(args.ca).apply(lambda v: digest(v or ""))]
            given.append(run_step(f"{name}-front-ca-given", s[CA_GIVEN], args.connection, self, stdin=args.ca,
                                  triggers=ca_digest, depends_on=deps))
        # The TLS step prints the CA of a generated certificate (and nothing else) on stdout.
        self.tls = step("router-front-tls", triggers=[*digest_of("router-front-tls-given"), *ca_digest],
                        depends_on=[*given, *deps])
        # router.host with other router hosts: its CA for them (a secret, never logged).
        self.ca_export = step(CA_EXPORT, triggers=[self.tls.stdout.apply(lambda v: digest(v or ""))],
                              depends_on=[self.tls]) if CA_EXPORT in s else None
        self.front = step("router-front", triggers=[*digest_of("router-front-keys"), *digest_of("router-front-tls-given")],
                          depends_on=[conf, keys, self.tls])
        # keepalived last: its check asks this front.
        self.last = step("router-vrrp", depends_on=[self.front]) if "router-vrrp" in s else self.front
        self.url = pulumi.Output.from_input(args.url)
        self.ca_certificate: pulumi.Output[str] = self.tls.stdout
        self.register_outputs({"url": self.url, "caCertificate": self.ca_certificate})
