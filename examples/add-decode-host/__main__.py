"""A decode host added, from a stack of its own, to a cluster that another stack deployed.

The base cluster's stack file is the definition: this program adds the new host to its decode pool
and has the same validation and planner decide everything (ports, GPUs, flags that must match the
prefill instances), then deploys that one host only (``only_hosts``). From the base stack's outputs
(a StackReference) come the router host's address, to register the new instance with the router,
and the router API key the workers share. The new host downloads the checkpoint itself: it is the
root of this stack's weights relay, whose other hosts (the base stack's) never come to copy from it,
so its staging serves them for ``--stall`` (120 s) after it is done, then ends (saying so in its log).
Its instance starts cold: the decode pool's warm-start caches are relayed from the pool's first host,
which the base stack deploys, so this stack has no warm-cache step to wait on.

The registration lives as long as the router process: when the base stack restarts its router, run
`pulumi up` here again (the command re-registers), or add the host to the base stack's own pool."""

from pathlib import Path

import pulumi
import pulumi_command.remote as remote

from glm_infra import Cluster
from glm_infra.program import cluster_args
from glm_infra.stack import load_file

config = pulumi.Config("glm-example")
base = pulumi.StackReference(config.require("baseStack"))
definition = load_file(Path(config.require("baseStackFile"))).config
new = config.require_object("host")  # {name, address, compute_nics}

args = cluster_args(definition)
args["hosts"] = [*args["hosts"], new]
args["decode"]["hosts"] = [*args["decode"]["hosts"], new["name"]]
args["model"]["seed_host"] = new["name"]
args["ssh"] = {"user": definition.ssh.user, "private_key": config.require_secret("sshPrivateKey")}
args["router"]["api_key"] = base.require_output("routerApiKey")

extra = Cluster("extra", args, only_hosts=[new["name"]])
(decode,) = [svc for name, svc in extra.services.items() if name.startswith("decode-")]

router = definition.router
router_address = base.require_output("hosts").apply(lambda hosts: hosts[router.host])
worker_url = decode.health_url.apply(lambda u: u.removesuffix("/health"))
register = remote.Command(
    "register-with-router",
    connection=remote.ConnectionArgs(host=router_address, user=definition.ssh.user,
                                     private_key=config.require_secret("sshPrivateKey")),
    create=worker_url.apply(lambda u: f"curl -fsS -X POST 'http://127.0.0.1:{router.internal_port}/add_worker?"
                                      f"url={u}&worker_type=decode'"),
    delete=worker_url.apply(lambda u: f"curl -fsS -X POST 'http://127.0.0.1:{router.internal_port}/remove_worker?"
                                      f"url={u}'"),
    opts=pulumi.ResourceOptions(depends_on=[decode.service]),
)

pulumi.export("decodeUrl", worker_url)
pulumi.export("hostFacts", extra.facts)
