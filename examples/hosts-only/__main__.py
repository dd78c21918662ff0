"""GPU servers made ready for a serving engine of your own: glm-infra's preflight, pinned driver and
NVLink fabric, health gate, RDMA, NIXL/UCX environment and the checkpoint staged on every host, without
its vLLM services. What to run on top is yours; here, a readiness marker per host after the weights."""

import pulumi
import pulumi_command.remote as remote

from glm_infra import Hosts

config = pulumi.Config("glm-example")
fleet = Hosts("fleet", config.require_object("hosts"))

for name, host in fleet.hosts.items():
    remote.Command(
        f"{name}-my-engine-ready",
        connection=host.connection,
        create="mkdir -p /etc/my-engine && date -u > /etc/my-engine/weights-ready",
        delete="rm -rf /etc/my-engine",
        opts=pulumi.ResourceOptions(depends_on=[fleet.weights.staged[name]] if fleet.weights else []),
    )

pulumi.export("facts", fleet.facts)
