"""glm-infra: GLM-5.2-NVFP4 on vLLM with P/D disaggregation on B300 servers, as one Pulumi stack."""

import pulumi

from glm_infra.components import Cluster, ClusterArgs
from glm_infra.program import load

deployment = load()
cluster = Cluster(
    "glm",
    ClusterArgs(
        stack=deployment.stack,
        plan=deployment.plan,
        private_key=deployment.private_key,
        secrets=deployment.secrets,
    ),
)

pulumi.export("hosts", {h.name: h.address for h in deployment.plan.hosts})
pulumi.export("instances", {i.name: {"host": i.host, "url": i.url, "gpus": i.cuda_visible_devices} for i in deployment.plan.instances})
pulumi.export("routerUrl", cluster.router_url)
if "router_api_key" in deployment.secrets:
    pulumi.export("routerApiKey", deployment.secrets["router_api_key"])  # a secret output
pulumi.export("hostFacts", cluster.facts)
