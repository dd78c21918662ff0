"""The monitoring of a deployment: the node exporter on every host, NVIDIA's DCGM exporter where the
driver step installed DCGM, the memory of glm-infra's units on every host with an instance or the router
(unit-memory), Prometheus and Alertmanager on the monitoring host. The steps (and every
file they write) come from the per-host plan (``glm_infra.roles.monitoring.host_steps``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pulumi
import pulumi_command.remote as remote

from glm_infra.steps import Step, digest

from .remote_step import inherited, run_step

STEP_KEYS = ("node-exporter", "unit-memory", "dcgm-exporter", "prometheus", "alertmanager-webhook",
             "alertmanager-dead-mans-switch", "alertmanager")
# The steps that write a receiver's URL (a secret, their stdin), by the MonitoringArgs field holding it.
SECRET_STEPS = {"alertmanager-webhook": "webhook_url", "alertmanager-dead-mans-switch": "dead_mans_switch_url"}


@dataclass
class MonitoredHost:
    name: str
    """Host name from the stack."""
    connection: remote.ConnectionArgs
    """SSH connection."""
    steps: Mapping[str, Step]
    """Its monitoring steps (keys of ``STEP_KEYS``) from the per-host plan."""
    after: Sequence[pulumi.Resource] = field(default_factory=list)
    """What must be in place first (the host's provisioning: the driver step installs DCGM)."""
    live: Mapping[str, pulumi.Output[Step]] = field(default_factory=dict)
    """The steps as resolved at deploy time, when they depend on values other resources produce."""


@dataclass
class MonitoringArgs:
    hosts: Sequence[MonitoredHost]
    """Every host with its monitoring steps."""
    webhook_url: pulumi.Input[str] | None = None
    """The Alertmanager webhook URL (a secret) when the plan has an ``alertmanager-webhook`` step."""
    prometheus_url: pulumi.Input[str] = ""
    """Where Prometheus answers (an output, for the SLA gate and operators)."""
    dead_mans_switch_url: pulumi.Input[str] | None = None
    """The dead man's switch URL (a secret) when the plan has an ``alertmanager-dead-mans-switch`` step."""


class Monitoring(pulumi.ComponentResource):
    """``glm-infra:index:Monitoring``: exporters, Prometheus and Alertmanager as systemd services of
    the distribution's packages, configured from the plan. ``commands[host][step]`` are the steps."""

    commands: dict[str, dict[str, remote.Command]]

    def __init__(self, name: str, args: MonitoringArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("glm-infra:index:Monitoring", name, None, opts)
        deps = inherited(opts)
        self.commands = {}
        for h in args.hosts:
            made: dict[str, remote.Command] = {}
            for key in STEP_KEYS:
                step = h.steps.get(key)
                if step is None:
                    continue
                # One after the other on a host: each installs packages.
                stdin, triggers, after = None, [], [*deps, *h.after, *list(made.values())[-1:]]
                if key in SECRET_STEPS:
                    url = getattr(args, SECRET_STEPS[key])
                    assert url is not None, f"the {key} step needs MonitoringArgs.{SECRET_STEPS[key]}"
                    stdin = pulumi.Output.secret(url)
                elif key == "alertmanager":
                    # A new URL restarts Alertmanager (systemd hands it the credentials at start).
                    triggers = [pulumi.Output.secret(getattr(args, SECRET_STEPS[k])).apply(digest)  # secret: run_step keys it
                                for k in SECRET_STEPS if k in made]
                made[key] = run_step(f"{name}-{h.name}-{key}", step, h.connection, self, live=h.live.get(key),
                                     stdin=stdin, triggers=triggers, depends_on=after)
            self.commands[h.name] = made
        self.prometheus_url = pulumi.Output.from_input(args.prometheus_url)
        self.register_outputs({"prometheusUrl": self.prometheus_url})
