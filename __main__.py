"""glm-infra: GLM-5.2-NVFP4 on vLLM with P/D disaggregation on B300 servers, as one Pulumi stack."""

import pulumi

from glm_infra import Cluster, sdk_cycles, sdk_debug, sdk_wait
from glm_infra.program import capacity_output, load

# A fleet registers thousands of resources: the SDK waits for them one round at a time instead of once
# per output (glm_infra/sdk_wait.py: tested SDK versions only; GLM_INFRA_SDK_WAIT=sdk leaves it alone).
sdk_wait.install()
# The SDK's own debug lines (five per resource, each a synchronous call to the engine) stay in the program
# (glm_infra/sdk_debug.py; GLM_INFRA_SDK_DEBUG=1 keeps them).
sdk_debug.quiet()
# Its cycle check on each dependency searched from both ends (glm_infra/sdk_cycles.py).
sdk_cycles.install()
cluster = Cluster("glm", load())

pulumi.export("hosts", {n: h.address for n, h in cluster.hosts.items()})
pulumi.export("instances", cluster.instances)
pulumi.export("routerUrl", cluster.router_url)
pulumi.export("routerCaCertificate", cluster.router_ca_certificate)  # trust it for routerUrl (curl --cacert)
pulumi.export("prometheusUrl", cluster.prometheus_url)
if "router_api_key" in cluster.secrets:
    pulumi.export("routerApiKey", cluster.secrets["router_api_key"])  # a secret output
pulumi.export("hostFacts", cluster.facts)
pulumi.export("capacity", capacity_output(cluster))  # KV-cache room per rank of each pool
