// glm-infra's Cluster from TypeScript: the sim stack's deployment (stacks/Pulumi.sim.yaml) through the
// component package in ../../provider. `pulumi install` (or `pulumi package add ../../provider`)
// generates the SDK, sdks/glm-infra, from the package's schema: the same Args as the Python
// ClusterArgs, camelCase, each field documented.
import * as pulumi from "@pulumi/pulumi";
import * as glm from "@pulumi/glm-infra";

const config = new pulumi.Config("glm-example");
const hosts = config.requireObject<Record<string, string>>("hosts"); // name → address
const nics = config.requireObject<string[]>("computeNics");
// The other Args (ssh, preflight, model, drivers, runtime, monitoring, firewall, sla) as the stack gives them.
const settings = config.requireObject<Omit<glm.ClusterArgs, "hosts">>("cluster");

const names = Object.keys(hosts);
const last = names[names.length - 1];
const cluster = new glm.Cluster("glm", {
    ...settings,
    hosts: names.map(name => ({ name, address: hosts[name], computeNics: nics })),
    // The recipe (docs/RECIPE.md): prefill TP1 DP4 EP twice on every host but the last, MTP 1; decode TP1 DP8 EP
    // on the last, MTP 3, with the router beside it.
    prefill: { hosts: names.slice(0, -1), instancesPerHost: 2, tp: 1, dp: 4, ep: true, speculativeTokens: 1,
               gpuMemoryUtilization: 0.92 },
    decode: { hosts: [last], instancesPerHost: 1, tp: 1, dp: 8, ep: true, speculativeTokens: 3,
              gpuMemoryUtilization: 0.9, maxNumBatchedTokens: 1024, cudagraphMode: "FULL_DECODE_ONLY",
              all2allBackend: "flashinfer_nvlink_two_sided" },
    // Who may reach the public port besides the cluster's hosts: the stack names its clients (required, as
    // firewall.adminCidrs in the cluster settings is: glm-infra does not guess either).
    router: { host: last, port: 8000, apiKey: config.requireSecret("apiKey"),
              allowedCidrs: config.requireObject<string[]>("routerClients") },
});

export const routerUrl = cluster.routerUrl;
export const routerCaCertificate = cluster.routerCaCertificate; // what clients trust for routerUrl
export const instances = cluster.instances;
export const prometheusUrl = cluster.prometheusUrl;
