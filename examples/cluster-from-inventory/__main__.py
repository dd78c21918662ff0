"""A Cluster on hosts whose addresses are known only at deploy time (an inventory command's output),
in a topology of its own: one prefill host with a single TP1 DP8 instance, one decode host with the
router beside it. The host names (which shape the deployment) are plain config; the addresses are
Outputs of another resource."""

import json

import pulumi
import pulumi_command.local as local

from glm_infra import Cluster

config = pulumi.Config("glm-example")
prefill_host, decode_host = config.require_object("hosts")
nics = config.require_object("computeNics")
settings = config.require_object("cluster")  # the other ClusterArgs: ssh, model, drivers, runtime, …

inventory = local.Command("inventory", create=config.require("inventoryCommand"))
addresses = inventory.stdout.apply(json.loads)

cluster = Cluster("small", {
    **settings,
    "hosts": [{"name": n, "address": addresses.apply(lambda a, n=n: a[n]), "compute_nics": nics}
              for n in (prefill_host, decode_host)],
    "prefill": {"hosts": [prefill_host], "instances_per_host": 1, "dp": 8},
    "decode": {"hosts": [decode_host]},
    # Who may reach the public port besides the cluster's hosts: the stack names its clients (required, as
    # firewall.adminCidrs in the cluster settings is: glm-infra does not guess either).
    "router": {"host": decode_host, "api_key": config.require_secret("apiKey"),
               "allowed_cidrs": config.require_object("routerClients")},
})

pulumi.export("routerUrl", cluster.router_url)
pulumi.export("routerCaCertificate", cluster.router_ca_certificate)  # what clients trust for routerUrl
pulumi.export("instances", cluster.instances)
pulumi.export("routerApiKey", cluster.secrets["router_api_key"])
