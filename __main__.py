"""glm-infra: GLM-5.2-NVFP4 on vLLM with P/D disaggregation on B300 servers, as one Pulumi stack."""

import pulumi

from glm_infra import Cluster
from glm_infra.program import capacity_output, load

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
