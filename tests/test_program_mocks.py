"""The Pulumi program under mocks: resource tree, parents, ordering and secrets, per stack."""

from __future__ import annotations

import re
from pathlib import Path

import pulumi
import pytest
import yaml
from conftest import PROD_STACKS, ROOT, stack_file
from pulumi_harness import _Mocks, leaks, run_program, secret_fields

from glm_infra.plan.topology import plan
from glm_infra.roles import nixl
from glm_infra.spec.config import SECRET_PATHS
from glm_infra.stack import load_file

CMD = "command:remote:Command"


@pytest.fixture
def key_file(tmp_path):
    k = tmp_path / "id_test"
    k.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nnot-a-real-key\n-----END OPENSSH PRIVATE KEY-----\n")
    return k


def _expected_commands(stack: str) -> int:
    p = plan(load_file(stack_file(stack)).config)
    # Serving host: preflight, secrets env, drain, driver install/reboot/back, health gate, RDMA, UCX env,
    # return, facts after them, runtime, placement (what a re-laid-out pool moves off it).
    per_serving_host = 13
    router_only = sum(1 for h in p.hosts if h.runs_router and not h.instances) * 3  # preflight, runtime, placement
    bare = sum(1 for h in p.hosts if not h.runs_router and not h.instances)  # preflight only
    per_instance = 4  # unit file, service (start), rollout (restart), stopper
    # On each router host: secrets file, gates conf, gates, unit file, service, canary, front conf, front keys,
    # front TLS, front; the canaries' transition marker, before any instance restarts
    router = 11 * len(p.router.host_names) if p.router else 0
    if p.router and p.router.virtual:  # each router host's keepalived; the CA sent from router.host, taken by the others
        router += len(p.router.host_names) + 1 + (len(p.router.host_names) - 1)
    # Weights (huggingface source in the committed stacks): the seed's token file and hf CLI; a staging
    # step (which also serves the host's relay children) and, after the services, a prune step per serving host.
    weights = 2 + 2 * len(p.serving_hosts)
    # Monitoring: the node exporter on every host, the unit-memory timer on every host with an instance or the
    # router, the DCGM exporter where the driver step installs DCGM, Prometheus and Alertmanager on one host.
    cfg = load_file(stack_file(stack)).config
    monitoring = (len(p.hosts) + sum(1 for h in p.hosts if h.instances or h.runs_router)
                  + (len(p.serving_hosts) if cfg.drivers.mode == "install" else 0) + 2)
    firewall = len(p.hosts) if cfg.firewall.enabled else 0  # the nftables step on every host
    # With nixl.nicPerRank, each serving host with compute NICs writes each GPU's nearest one (nic-affinity).
    affinity = sum(1 for h in p.serving_hosts if nixl.per_rank(cfg, h.name))
    # Each pool on more than one host: its warm-cache relay, a step on each of its hosts.
    warm_cache = sum(len(pool.hosts) for _, pool in cfg.pools() if len(pool.hosts) > 1)
    # The stack's relay key on each host that sends or takes through a relay (the checkpoint's: every staging
    # host when there are several; a pool's warm-start caches').
    relaying = {h.name for h in p.serving_hosts if len(p.serving_hosts) > 1 and cfg.model.source != "local"}
    relaying |= {h for _, pool in cfg.pools() if len(pool.hosts) > 1 for h in pool.hosts}
    return (len(p.serving_hosts) * per_serving_host + affinity + router_only + bare + len(p.instances) * per_instance + router
            + weights + monitoring + firewall + warm_cache + len(relaying))


@pytest.mark.parametrize("stack", PROD_STACKS)
def test_resource_tree(stack, key_file):
    run = run_program(stack_file(stack), key_file)
    p = plan(load_file(stack_file(stack)).config)
    types = [r.type for r in run.resources]
    assert types.count("glm-infra:index:Cluster") == 1
    assert types.count("glm-infra:index:Host") == len(p.hosts)
    assert types.count("glm-infra:index:VllmService") == len(p.instances)
    assert types.count("glm-infra:index:Router") == (len(p.router.host_names) if p.router else 0)
    assert types.count(CMD) == _expected_commands(stack)
    # The wait for a reboot; the turn taken and given back in the host's pools; the stack's trigger key and
    # (hosts relaying: every committed stack) its relay key.
    relay_files = [r for r in run.resources if r.name.endswith("-etc-glm-infra-secrets-relay-env")]
    relays = len(p.serving_hosts) > 1  # (one host: nothing crosses hosts, no relay key)
    assert bool(relay_files) == relays
    assert types.count("command:local:Command") == 3 * len(p.serving_hosts) + 1 + relays
    for name in ("glm-trigger-key", "glm-relay-key") if relays else ("glm-trigger-key",):
        key = run.get(name)
        assert key.parent == run.urn("glm") and set(key.additional_secret_outputs) >= {"stdout"}
        assert key.inputs["logging"] == "none"
    # The driver steps and the host steps sit under the cluster (issue 43: a component each, changing nothing
    # alone, was a fifth of a host's resources), each aliased to the component it was registered under before.
    assert "glm-infra:index:Drivers" not in types and "glm-infra:index:HostStep" not in types
    cluster = run.get("glm")

    def was_under(r, type_: str) -> str | None:
        """The name of the component of ``type_`` under the cluster that ``r`` was registered under before."""
        prefix = f"{cluster.urn.rsplit('::', 1)[0]}$glm-infra:index:{type_}::"
        old = [a["spec"]["parentUrn"].removeprefix(prefix) for a in r.aliases
               if a["spec"]["parentUrn"].startswith(prefix)]
        return old[0] if old else None

    for h in p.serving_hosts:
        for step in ("install", "reboot", "wait", "back"):
            r = run.get(f"glm-{h.name}-drivers-{step}")
            assert r.parent == cluster.urn and was_under(r, "Drivers") == f"glm-{h.name}-drivers", r.aliases
    runtimes = len({h.name for h in p.hosts if h.instances or h.runs_router})
    # Per serving host: the health gate, RDMA, the nearest NICs (nixl.nicPerRank) and the UCX env file; per
    # host that runs anything: the runtime and the placement; per host: the firewall.
    affinity = sum(1 for h in p.serving_hosts if nixl.per_rank(load_file(stack_file(stack)).config, h.name))
    moved = {r.name: was_under(r, "HostStep") for r in run.resources if was_under(r, "HostStep")}
    assert len(moved) == 3 * len(p.serving_hosts) + affinity + 2 * runtimes + len(p.hosts)
    # Each keeps its name: the component's and what the component called its command.
    assert all(name.startswith(old + "-") and name.removeprefix(old + "-") in
               {"nftables", "gate", "setup", "pairs", "ucx-env", "venv", "placement"} for name, old in moved.items()), moved
    # And before HostStep, four of them had a type of their own.
    assert {was_under(run.get(f"glm-{h.name}-{step}"), type_) for h in p.serving_hosts
            for step, type_ in (("health-gate", "Fabric"), ("rdma-setup", "Rdma"), ("nixl-ucx-env", "Nixl"))} \
        == {f"glm-{h.name}-{c}" for h in p.serving_hosts for c in ("health", "rdma", "nixl")}
    # Every resource hangs under the cluster; names carry their parent's name.
    for r in run.resources:
        if r is cluster:
            continue
        parent = next(x for x in run.resources if x.urn == r.parent)
        assert r.name.startswith(parent.name + "-"), (r.name, parent.name)
    for i in p.instances:
        assert run.get(f"glm-{i.name}").parent == cluster.urn
        assert run.get(f"glm-{i.name}-service").parent == run.urn(f"glm-{i.name}")


def test_prefill_restarts_one_at_a_time_and_router_comes_last(key_file):
    run = run_program(stack_file("prod-b300"), key_file)
    for a, b in [("prefill-0", "prefill-1"), ("prefill-1", "prefill-2"), ("prefill-2", "prefill-3")]:
        # A change restarts b only after a has restarted and answered /health ...
        assert run.urn(f"glm-{a}-rollout") in run.get(f"glm-{b}-rollout").dependencies, f"{b} waits for {a}"
        # ... while a first deploy starts them without waiting for each other: the first host's at once, another
        # host's once that host has the pool's warm-start caches (a host joining starts warm, not racing the copy).
        deps = run.get(f"glm-{b}-service").dependencies
        assert not any(re.search(r"glm-prefill-\d+-(service|rollout)$", d) for d in deps), deps
        assert (run.urn("glm-b300-2-prefill-warm-cache") in deps) == (b in ("prefill-2", "prefill-3")), deps
    assert run.urn("glm-prefill-0-service") not in run.get("glm-decode-0").dependencies  # pools roll independently
    assert not any("prefill" in d for d in run.get("glm-decode-0-rollout").dependencies)
    rollout = run.get("glm-prefill-1-rollout")
    # Created: notes the triggers it runs with; updated: restarts only if they changed since.
    stamp = rollout.inputs["create"].split("; ", 1)[0].removeprefix(": glm-infra-triggers=")
    assert rollout.inputs["create"].endswith(f"/usr/local/libexec/glm-infra/glm-vllm-prefill-1.sh record {stamp}")
    assert rollout.inputs["update"].endswith(f"/usr/local/libexec/glm-infra/glm-vllm-prefill-1.sh rollout {stamp}")
    assert run.get("glm-prefill-1-service").inputs["create"].endswith("glm-vllm-prefill-1.sh start")
    router = run.get("glm-router-service")
    for name in ["prefill-0", "prefill-1", "prefill-2", "prefill-3", "decode-0"]:
        assert run.urn(f"glm-{name}-service") in router.dependencies
    # The router's files do not wait for the instances; only its start does.
    assert not any("prefill" in d for d in run.get("glm-router-unit").dependencies)
    # A service starts after its unit file is written.
    assert run.urn("glm-decode-0-unit") in run.get("glm-decode-0-service").dependencies


def test_destroy_stops_router_then_decode_then_prefill(key_file):
    """Pulumi deletes dependents first: the router depends on every stopper, decode's stopper on the
    prefill stoppers — while the decode service itself does not wait for the prefill services."""
    run = run_program(stack_file("prod-b300"), key_file)
    prefill_stops = [run.urn(f"glm-prefill-{i}-stop") for i in range(4)]
    decode_stop = run.get("glm-decode-0-stop")
    assert all(u in decode_stop.dependencies for u in prefill_stops)
    assert run.urn("glm-decode-0-service") in decode_stop.dependencies
    assert not any("prefill" in d for d in run.get("glm-decode-0-service").dependencies)
    router = run.get("glm-router-service")
    assert all(u in router.dependencies for u in [*prefill_stops, decode_stop.urn])
    assert "remove" in decode_stop.inputs["delete"] and decode_stop.inputs["create"].startswith("echo")


def test_host_chain_order(key_file):
    run = run_program(stack_file("prod-b300"), key_file)

    def needs(later: str, earlier: str) -> None:
        assert run.urn(earlier) in run.get(later).dependencies, f"{later} must wait for {earlier}"

    h = "glm-b300-2"
    needs(f"{h}-turn-acquire", f"{h}-preflight")
    needs(f"{h}-host-drain", f"{h}-turn-acquire")
    needs(f"{h}-drivers-install", f"{h}-host-drain")
    needs(f"{h}-drivers-reboot", f"{h}-drivers-install")
    needs(f"{h}-drivers-wait", f"{h}-drivers-reboot")
    needs(f"{h}-drivers-back", f"{h}-drivers-wait")
    needs(f"{h}-health-gate", f"{h}-drivers-back")
    needs(f"{h}-rdma-setup", f"{h}-health-gate")
    needs(f"{h}-nic-affinity-pairs", f"{h}-rdma-setup")
    needs(f"{h}-nixl-ucx-env", f"{h}-nic-affinity-pairs")
    needs(f"{h}-host-return", f"{h}-nixl-ucx-env")
    needs(f"{h}-turn-release", f"{h}-host-return")
    needs(f"{h}-runtime-venv", f"{h}-turn-release")
    # The placement (what a re-laid-out pool moves off the host) after the runtime and the weights, and
    # before every instance of the host and the router.
    needs(f"{h}-vllm-placement-placement", f"{h}-runtime-venv")
    needs(f"{h}-vllm-placement-placement", "glm-weights-b300-2-stage")
    needs("glm-prefill-2-service", f"{h}-vllm-placement-placement")
    needs("glm-prefill-2-unit", f"{h}-vllm-placement-placement")
    needs("glm-router-service", "glm-b300-3-vllm-placement-placement")
    # Hosts provision in parallel: nothing on one host waits for another host's chain (only for its
    # turn-acquire, which a first deploy creates at once).
    assert not any("b300-1" in d for d in run.get(f"{h}-runtime-venv").dependencies)
    assert not any("b300-1" in d for d in run.get(f"{h}-drivers-install").dependencies)


def test_a_host_change_rolls_through_each_pool(key_file):
    """prod-b300: prefill on b300-1 and b300-2 (maxUnavailable 1), decode on b300-3 alone. b300-2's turn
    comes after b300-1's; b300-3 takes its own; every roll step carries the digest of the disruptive steps."""
    run = run_program(stack_file("prod-b300"), key_file)
    acquire2 = run.get("glm-b300-2-turn-acquire")
    assert run.urn("glm-b300-1-turn-acquire") in acquire2.dependencies, "b300-2's turn waits for b300-1's"
    assert not any("b300-2" in d or "b300-1" in d for d in run.get("glm-b300-3-turn-acquire").dependencies)
    assert not any("b300-2" in d for d in run.get("glm-b300-1-turn-acquire").dependencies)
    # The drain waits for the host's turn; the release for its return, which is triggered by the drain.
    assert run.urn("glm-b300-2-turn-acquire") in run.get("glm-b300-2-host-drain").dependencies
    assert run.urn("glm-b300-2-host-return") in run.get("glm-b300-2-turn-release").dependencies
    assert acquire2.type == "command:local:Command" and run.get("glm-b300-2-turn-release").type == acquire2.type
    drain = run.get("glm-b300-2-host-drain")
    roll = drain.inputs["update"].rsplit(" ", 1)[1]
    assert drain.inputs["update"].endswith(f"/usr/local/libexec/glm-infra/roll.sh drain {roll}")
    assert drain.inputs["create"].endswith(f"roll.sh record {roll}"), "a first deploy drains nothing"
    assert acquire2.inputs["update"] == f"bash -s acquire {roll}" and "first deploy" in acquire2.inputs["create"]
    assert run.get("glm-b300-2-host-return").inputs["create"].endswith(f"roll.sh return {roll}")
    assert run.get("glm-b300-2-turn-release").inputs["update"].endswith(f"bash -s release {roll}")
    assert "/prefill" not in acquire2.inputs["stdin"] and "pools=('prefill 1' )" in acquire2.inputs["stdin"]
    # The interrupted pool is said in every preview and up.
    assert any("decode: interrupted: its only host, b300-3, goes down" in m for m in run.logs), run.logs


def test_every_step_tells_the_waiting_turns_when_it_fails(key_file):
    """A step that fails ends the run only once every running step has finished, a host waiting for its turn
    among them: each command carries the error hook that records the failure where that host's lease.sh reads
    it (roll/runs.py). The hook is the Cluster's own (its name), one for the program."""
    run = run_program(stack_file("prod-b300"), key_file)
    commands = [r for r in run.resources if r.type.startswith("command:")]
    keys = {"glm-trigger-key", "glm-relay-key"}  # made once, before any host: a failure there waits for nothing
    assert {r.name for r in commands if not r.on_error} == keys
    assert {tuple(r.on_error) for r in commands if r.name not in keys} == {("glm-run-failed",)}
    for name in ("glm-b300-1-host-drain", "glm-b300-1-drivers-install", "glm-b300-1-host-return",
                 "glm-b300-2-turn-acquire", "glm-router-service"):
        assert run.get(name).on_error == ["glm-run-failed"], name


def test_the_turns_follow_the_pool_order_not_the_host_order(key_file, tmp_path):
    cfg = yaml.safe_load(stack_file("prod-b300").read_text())
    cfg["config"]["glm-infra:prefill"]["hosts"] = ["b300-2", "b300-1"]
    f = tmp_path / "Pulumi.prod-b300.yaml"
    f.write_text(yaml.safe_dump(cfg))
    run = run_program(f, key_file)
    assert run.urn("glm-b300-2-turn-acquire") in run.get("glm-b300-1-turn-acquire").dependencies
    assert not any("b300-1" in d for d in run.get("glm-b300-2-turn-acquire").dependencies)


def test_only_disruptive_changes_roll(key_file, tmp_path):
    """The roll's digest moves with the driver version and the RDMA settings, not with a vLLM flag or the
    health gate's timeout."""
    base = yaml.safe_load(stack_file("prod-b300").read_text())

    def roll_of(change) -> str:
        cfg = yaml.safe_load(stack_file("prod-b300").read_text())
        change(cfg["config"])
        f = tmp_path / "Pulumi.prod-b300.yaml"
        f.write_text(yaml.safe_dump(cfg))
        return run_program(f, key_file).get("glm-b300-1-host-drain").inputs["update"].rsplit(" ", 1)[1]

    same = roll_of(lambda c: None)
    assert roll_of(lambda c: c["glm-infra:prefill"].update(gpuMemoryUtilization=0.91)) == same
    assert roll_of(lambda c: c.setdefault("glm-infra:drivers", {}).update(fabricTimeout=300)) == same
    assert roll_of(lambda c: c.setdefault("glm-infra:drivers", {}).update(version="580.172.08")) != same
    assert roll_of(lambda c: c.setdefault("glm-infra:rdma", {}).update(mtu=4200)) != same
    del base


def test_weights_download_once_and_relay(key_file):
    run = run_program(stack_file("prod-b300"), key_file)
    stage = {h: run.get(f"glm-weights-{h}-stage") for h in ("b300-1", "b300-2", "b300-3")}
    seed_cmd = stage["b300-1"].inputs["create"]
    assert "--role seed --source huggingface --repo nvidia/GLM-5.2-NVFP4 --token-file /etc/glm-infra/secrets/hf.env" in seed_cmd
    for peer in ("b300-2", "b300-3"):
        cmd = stage[peer].inputs["create"]
        assert "--role peer --peer http://10.0.0.11:8090 --name" in cmd and "huggingface" not in cmd
        assert "--serve" not in cmd, "a leaf of the relay tree serves nobody"
    assert "--serve 10.0.0.11:8090 --children b300-2,b300-3" in seed_cmd
    for s in stage.values():
        assert s.retain_on_delete, "destroy keeps the weights by default"
        assert not any("-stage" in d for d in s.dependencies), "hosts stage in parallel"
    # The seed starts once its relay children can start too: they never wait for a parent that is not there.
    for peer in ("b300-2", "b300-3"):
        assert run.urn(f"glm-{peer}-runtime-venv") in stage["b300-1"].dependencies
        assert run.urn("glm-b300-1-runtime-venv") not in stage[peer].dependencies
    assert not [r for r in run.resources if "fanout" in r.name], "no fan-out server outside the staging"
    # The host's instances start on staged weights (through its placement step, which waits for them).
    assert stage["b300-2"].urn in run.get("glm-b300-2-vllm-placement-placement").dependencies
    assert run.urn("glm-b300-2-vllm-placement-placement") in run.get("glm-prefill-2-service").dependencies
    # The hf CLI lives on the seed only, before its staging, and goes on destroy.
    hf_cli = run.get("glm-weights-b300-1-hf-cli")
    assert hf_cli.urn in stage["b300-1"].dependencies
    assert "huggingface_hub[hf_xet]==2.4.0" in hf_cli.inputs["create"]
    assert hf_cli.inputs["delete"].startswith("rm -rf /opt/glm-infra/hf &&") and not hf_cli.retain_on_delete
    assert not [r for r in run.resources if r.name.endswith("-hf-cli") and r is not hf_cli]
    prune = run.get("glm-b300-2-prune-weights")
    assert sorted(d.rsplit("::", 1)[1] for d in prune.dependencies) == ["glm-prefill-2-rollout", "glm-prefill-3-rollout"]


def _variant(tmp_path, name: str, **runtime: str):
    cfg = yaml.safe_load(stack_file("prod-b300").read_text())
    cfg["config"].setdefault("glm-infra:runtime", {}).update(runtime)
    path = tmp_path / f"Pulumi.{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_pins_restart_only_what_runs_them(key_file, tmp_path):
    """A vllm pin restarts the instances, not the router (its own wheel in the venv is untouched);
    a vllm-router pin restarts the router, not the instances."""

    def restarts(path):
        run = run_program(path, key_file)
        return {r.name: r.inputs["update"] for r in run.by_type(CMD)
                if r.name.endswith("-rollout") or r.name == "glm-router-service"}

    base = restarts(stack_file("prod-b300"))
    vllm = restarts(_variant(tmp_path, "vllm-pin", vllmVersion="0.34.0"))
    router = restarts(_variant(tmp_path, "router-pin", routerVersion="0.1.18"))
    assert sorted(n for n in base if vllm[n] != base[n]) == sorted(n for n in base if n.endswith("-rollout"))
    assert [n for n in base if router[n] != base[n]] == ["glm-router-service"]


# Distinctive values for every secret the stack can hold: found anywhere in plaintext, they leaked.
CANARIES = {
    "glm-infra:router.apiKey": "sk-canary-router-5c1f9e0a7d",
    "glm-infra:model.hfToken": "hf_canaryTOKENb41d6e2f93",
    "glm-infra:ssh.privateKey": "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAcanaryKEYBODY7e3a91\n"
                                "-----END OPENSSH PRIVATE KEY-----\n",
    "glm-infra:router.tlsCertificate": "-----BEGIN CERTIFICATE-----\nMIIBcanaryCERTbody0c4e11\n-----END CERTIFICATE-----\n",
    "glm-infra:router.tlsKey": "-----BEGIN PRIVATE KEY-----\nMIGHcanaryTLSKEYbody9d27f\n-----END PRIVATE KEY-----\n",
    "glm-infra:monitoring.webhookUrl": "https://hooks.example.com/canary-hook-token-71be0c",
    "glm-infra:monitoring.deadMansSwitchUrl": "https://hc-ping.example.com/canary-switch-token-3a9d24",
}
# What must never travel in plaintext (for the keys and the certificate, their body: the armour lines are public).
NEEDLES = {"router API key": "sk-canary-router-5c1f9e0a7d", "HF token": "hf_canaryTOKENb41d6e2f93",
           "SSH key": "canaryKEYBODY7e3a91", "TLS certificate": "canaryCERTbody0c4e11",
           "TLS key": "canaryTLSKEYbody9d27f", "webhook URL": "canary-hook-token-71be0c",
           "dead man's switch URL": "canary-switch-token-3a9d24",
           "relay key": _Mocks.relay_key}  # made by the stack itself (remote_step.relay_key), a secret like the rest


def test_the_canaries_cover_every_secret():
    assert set(CANARIES) == {f"glm-infra:{top}.{sub}" for top, sub in SECRET_PATHS}


def secret_stack(tmp_path):
    """prod-b300 with every secret set: router API key, HF token, an inline SSH key, the front's TLS
    certificate and key, the webhook URL, the dead man's switch URL."""
    cfg = yaml.safe_load(stack_file("prod-b300").read_text())
    cfg["config"]["glm-infra:router"]["apiKey"] = {"secure": "v1:x"}
    cfg["config"]["glm-infra:model"]["hfToken"] = {"secure": "v1:x"}
    cfg["config"]["glm-infra:ssh"] = {"user": "root", "privateKey": {"secure": "v1:x"}}
    cfg["config"]["glm-infra:router"].update(tlsCertificate={"secure": "v1:x"}, tlsKey={"secure": "v1:x"})
    cfg["config"].setdefault("glm-infra:monitoring", {}).update(webhookUrl={"secure": "v1:x"},
                                                                deadMansSwitchUrl={"secure": "v1:x"})
    path = tmp_path / "Pulumi.prod-secrets.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def secret_problems(run) -> list[str]:
    """Every plaintext appearance of a secret, and every secret step that logs or returns it unmarked."""
    problems = [f"{what}: {place}" for what, needle in NEEDLES.items() for place in leaks(run, needle)]
    for r in run.by_type(CMD):
        carried = secret_fields(r.raw_inputs) - {"connection"}
        if not carried:
            continue
        if r.inputs.get("logging") != "none":
            problems.append(f"{r.name}: carries a secret in {sorted(carried)} but logs its output")
        missing = carried - set(r.additional_secret_outputs)
        if missing:
            problems.append(f"{r.name}: {sorted(missing)} not kept secret in its outputs")
    return problems


def test_every_secret_travels_only_as_a_secret(key_file, tmp_path):
    run = run_program(secret_stack(tmp_path), key_file, secrets=CANARIES)
    assert secret_problems(run) == []
    # They did reach the hosts, as secrets: the files that need them, and every connection.
    holders = {what: sorted(r.name for r in run.by_type(CMD) if needle in repr(r.inputs)) for what, needle in NEEDLES.items()}
    assert "glm-router-secrets" in holders["router API key"] and "glm-router-front-keys" in holders["router API key"]
    assert "glm-b300-1-etc-glm-infra-secrets-vllm-env" in holders["router API key"]
    assert holders["HF token"] == ["glm-b300-1-etc-glm-infra-secrets-hf-env"], "only the seed's token file"
    assert len(holders["SSH key"]) == len(run.by_type(CMD)), "every remote command's connection"
    tls_files = ["glm-router-b300-2-front-tls-given", "glm-router-front-tls-given"]
    assert holders["TLS certificate"] == tls_files and holders["TLS key"] == tls_files, "the router hosts only"
    assert holders["webhook URL"] == ["glm-monitoring-b300-1-alertmanager-webhook"], holders["webhook URL"]
    for r in run.by_type(CMD):
        assert "connection" in r.secret_inputs, f"{r.name}: the connection (the SSH key) must be secret"
    # The stack's outputs hold the API key, as a secret only (and were searched above).
    # The root stack by its type: the mocks keep the first run's root (and its name) for the whole process.
    (stack_outputs,) = [o for urn, o in run.outputs.items() if "::pulumi:pulumi:Stack::" in urn]
    assert {"routerApiKey", "hostFacts", "routerUrl", "capacity"} <= set(stack_outputs)
    assert secret_fields(stack_outputs) == {"routerApiKey"}


def test_a_planted_leak_is_caught(key_file, tmp_path, monkeypatch):
    """The check above can fail: with the hashing of restart triggers dropped (a plausible slip), the
    secret env file's text lands, unmarked, in the instances' commands."""
    import glm_infra.components.cluster as cluster
    import glm_infra.components.remote_step as remote_step

    for module in (cluster, remote_step):
        monkeypatch.setattr(module, "digest", lambda *parts: "|".join(parts))
    monkeypatch.setattr(remote_step, "keyed_digest", lambda key, *parts: "|".join(parts))
    run = run_program(secret_stack(tmp_path), key_file, secrets=CANARIES)
    problems = secret_problems(run)
    assert any(p.startswith("router API key: glm-prefill-0-rollout: input create") for p in problems), problems
    assert any(p.startswith("HF token: ") for p in problems) is False, "only what was planted"


def test_a_secret_step_that_logs_is_caught(key_file, tmp_path, monkeypatch):
    import types

    import glm_infra.components.remote_step as remote_step

    logging_on = types.SimpleNamespace(NONE=remote_step.remote.Logging.STDOUT_AND_STDERR,
                                       STDOUT_AND_STDERR=remote_step.remote.Logging.STDOUT_AND_STDERR)
    monkeypatch.setattr(remote_step.remote, "Logging", logging_on)
    run = run_program(secret_stack(tmp_path), key_file, secrets=CANARIES)
    assert "glm-router-secrets: carries a secret in ['stdin'] but logs its output" in secret_problems(run)


def test_bad_stack_registers_nothing(key_file, tmp_path):
    cfg = yaml.safe_load(stack_file("prod-b300").read_text())
    cfg["config"]["glm-infra:decode"]["tp"] = 0
    path = tmp_path / "Pulumi.bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(pulumi.RunError, match=r"glm-infra:decode.tp: Input should be greater than or equal to 1"):
        run_program(path, key_file)


def test_missing_key_file_is_named(tmp_path):
    with pytest.raises(pulumi.RunError, match=r"glm-infra:ssh.privateKeyPath: cannot read .*nope"):
        run_program(stack_file("prod-b300"), tmp_path / "nope")


def test_the_capacity_output_has_each_pools_kv_room(key_file):
    run = run_program(stack_file("prod-b300"), key_file)
    (stack_outputs,) = [o for urn, o in run.outputs.items() if "::pulumi:pulumi:Stack::" in urn]
    pools = stack_outputs["capacity"]["pools"]
    assert set(pools) == {"prefill", "decode"}
    decode = pools["decode"]
    assert decode["kvBytesPerToken"] == 54728 and decode["tokensPerRank"] == 2883550
    assert decode["requestsPerInstance"] == {"16384": 1400, "262144": 80, "max": 16}
    # Where each fact came from: GLM-5.2's own config, the weight bytes synthetic.
    sources = stack_outputs["capacity"]["factSources"]
    assert sources["max_position_embeddings"] == "real: config.json#max_position_embeddings"
    assert sources["weights"].startswith("synthetic: ")
    # The mocks' hosts report no facts: the GPU table's memory, as plan shows it.
    assert decode["gpuMemorySource"] == "B300 288 GB (GPU table)"


def test_host_facts_are_read_after_the_host_is_provisioned(key_file):
    run = run_program(stack_file("prod-b300"), key_file)
    for h in ("b300-1", "b300-2", "b300-3"):
        facts = run.get(f"glm-{h}-facts")
        assert facts.parent == run.urn(f"glm-{h}")
        assert facts.inputs["create"].endswith("/usr/local/libexec/glm-infra/hostcheck.py facts --model-path /mnt/model/glm/GLM-5.2-NVFP4")
        # After the host is back (turn-release comes after ucx-env and the instances' return).
        assert run.urn(f"glm-{h}-turn-release") in facts.dependencies
        assert run.urn(f"glm-{h}-rdma-setup") in facts.dependencies


def test_a_rotated_secret_changes_only_what_reads_it(key_file, tmp_path):
    """The guide's rotations: a new HF token rewrites the seed's token file and restarts nothing; a
    new API key rewrites the key files and restarts every instance and the router, and runs the canaries
    with it."""
    path = secret_stack(tmp_path)

    def sent(**rotated):
        run = run_program(path, key_file, secrets={**CANARIES, **rotated})
        return {r.name: (r.inputs.get("create"), r.inputs.get("update"), r.inputs.get("stdin")) for r in run.by_type(CMD)}

    base = sent()
    hf = sent(**{"glm-infra:model.hfToken": "hf_rotatedTOKEN0e1f"})
    assert [n for n in base if hf[n] != base[n]] == ["glm-b300-1-etc-glm-infra-secrets-hf-env"]
    key = sent(**{"glm-infra:router.apiKey": "sk-rotated-key-77aa"})
    changed = {n for n in base if key[n] != base[n]}
    rollouts = {n for n in base if n.endswith("-rollout")}
    assert len(rollouts) == 5 and rollouts <= changed and "glm-router-service" in changed
    key_files = {n for n in changed if "-secrets-vllm-env" in n}
    assert len(key_files) == 3, key_files  # each serving host's vLLM env
    assert changed - rollouts - key_files == {f"glm-router{h}-{step}" for h in ("", "-b300-2") for step in (
        "secrets", "service", "front", "front-keys", "canary")}, changed  # on both router hosts


def test_the_program_installs_the_round_wait(key_file, monkeypatch):
    """glm-infra's own program opts in to the SDK round wait (glm_infra/sdk_wait.py), before any
    resource; GLM_INFRA_SDK_WAIT=sdk keeps the SDK as it comes."""
    from glm_infra import sdk_wait

    was = sdk_wait.installed()
    try:
        sdk_wait.uninstall()
        monkeypatch.setenv("GLM_INFRA_SDK_WAIT", "sdk")
        run_program(stack_file("prod-b300"), key_file)
        assert not sdk_wait.installed()
        monkeypatch.delenv("GLM_INFRA_SDK_WAIT")
        run_program(stack_file("prod-b300"), key_file)
        assert sdk_wait.installed()
    finally:
        sdk_wait.uninstall()
        if was:
            sdk_wait.install()


# --- no function of a secret in plaintext (issue 25, defect 8) ------------------------------------

ROTATED = {k: v.replace("canary", "rotated") for k, v in CANARIES.items()}  # every secret, another value


def _plain_leaves(run) -> dict[str, str]:
    """Every string the program hands the engine, or gets back from it, outside a secret: each
    resource's name, inputs (as sent, secrets still marked) and outputs (what the mocks answered; the
    engine keeps secret the outputs whose input was secret and those in additional_secret_outputs),
    component and stack outputs, log messages. By a path naming where it is."""
    from pulumi_harness import SECRET_KEY, SECRET_SIG

    out: dict[str, str] = {}

    def walk(value, path: str) -> None:
        if isinstance(value, dict) and value.get(SECRET_KEY) == SECRET_SIG:
            return
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{path}.{k}")
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, f"{path}[{i}]")
        elif isinstance(value, str):
            out[path] = value

    for r in run.resources:
        out[f"{r.name}: urn"] = r.urn
        walk(r.raw_inputs, f"{r.name}: input")
        hidden = set(r.secret_inputs) | set(r.additional_secret_outputs)
        walk({k: v for k, v in r.outputs.items() if k not in hidden}, f"{r.name}: output")
    for urn, outputs in run.outputs.items():
        walk(outputs, f"{urn.rsplit('::', 1)[-1]}: outputs")
    for i, m in enumerate(run.logs):
        out[f"log {i}"] = m
    return out


def _derived_needles(sources: dict[str, str]) -> dict[str, str]:
    """What a guess of a secret lets anyone compute offline: the secret, the hex digests (sha256, sha1,
    md5) of it and of each file made of it, with or without a NUL or newline after, once or digested
    again — each as its first and last 8 hex digits (a longer piece of a digest holds them)."""
    import hashlib

    out: dict[str, str] = {}
    for name, text in sources.items():
        out[text] = name
        firsts = []
        for suffix in ("", "\0", "\n"):
            for algo in ("sha256", "sha1", "md5"):
                h = hashlib.new(algo, (text + suffix).encode()).hexdigest()
                firsts.append(h)
                out[h[:8]], out[h[-8:]] = f"{algo} of {name}", f"{algo} of {name}"
        for h in firsts:
            for cut in (8, 16, 32, 64):
                for suffix in ("", "\0"):
                    again = hashlib.sha256((h[:cut] + suffix).encode()).hexdigest()
                    out[again[:8]] = out[again[-8:]] = f"sha256 of a digest of {name}"
    return out


def _rendered_secret_files(path, secrets: dict[str, str]) -> dict[str, str]:
    """The secret files the hosts get (vLLM's and the router's env files, the hub token file, the
    front's keys and certificate, the webhook URL), rendered with the real values."""
    from glm_infra import hostplan, render
    from glm_infra.plan.topology import plan as make_plan

    stack = load_file(path).config
    values = {name: secrets[key] for name, key in render.configured_secrets(stack).items()}
    values["relay_key"] = _Mocks.relay_key  # made by the stack (its local command), not given
    steps = hostplan.plan_all(stack, make_plan(stack), values, stack_name="test")
    return {f"{h}:{s.name}": s.secret_render(values)
            for h, hs in steps.items() for s in hs.steps.values() if s.secret_render}


def derived_leaks(path, key_file) -> list[str]:
    """Every string outside a secret, searched for each secret, each secret file's text, and the
    digests a guessed secret lets anyone recompute offline."""
    run = run_program(path, key_file, secrets=CANARIES)
    files = _rendered_secret_files(path, CANARIES)
    assert {k.split(":", 1)[1] for k in files} >= {"vllm-secrets", "hf-secrets", "router-secrets", "router-front-keys",
                                                   "router-front-tls-given", "alertmanager-webhook", "relay-key"}
    sources = {**{k: v for k, v in CANARIES.items() if k != "glm-infra:ssh.privateKey"}, **files}
    needles = _derived_needles(sources)
    leaves = _plain_leaves(run)
    assert len(leaves) > 1000  # the walk did see the program
    hex_runs = {(m.group(), where) for where, s in leaves.items() for m in re.finditer(r"[0-9a-f]{8,}", s)}
    found = sorted({f"{where}: {needles[n]}" for hex_run, where in hex_runs for n in
                    {hex_run[i:i + 8] for i in range(len(hex_run) - 7)} if n in needles})
    found += sorted(f"{where}: {name}" for where, s in leaves.items() for text, name in sources.items()
                    if len(text) >= 8 and text in s)
    found += sorted(f"{where}: {name} (body)" for where, s in leaves.items() for name, body in NEEDLES.items()
                    if body in s)
    return found


def unkeyed(path, key_file, monkeypatch) -> list[str]:
    """The plain strings that change with the secrets but not with the stack's trigger key: functions
    of the secrets and public values alone, which a guess can be checked against offline. Three runs:
    the canaries, every secret rotated, the canaries with another key."""
    from pulumi_harness import _Mocks

    base = _plain_leaves(run_program(path, key_file, secrets=CANARIES))
    rotated = _plain_leaves(run_program(path, key_file, secrets=ROTATED))
    with monkeypatch.context() as m:
        m.setattr(_Mocks, "trigger_key", "0a1b" * 16, raising=False)
        rekeyed = _plain_leaves(run_program(path, key_file, secrets=CANARIES))
    assert set(base) == set(rotated) == set(rekeyed)
    with_secret = {p for p in base if not p.startswith("log ") and base[p] != rotated[p]}
    assert any(p.startswith("glm-prefill-0-rollout: input.create") for p in with_secret), with_secret
    return sorted(p for p in with_secret if base[p] == rekeyed[p])


def test_no_function_of_a_secret_is_in_plaintext(key_file, tmp_path):
    """A plain digest of a secret env file in a command once matched a guessed 16-character API key."""
    assert derived_leaks(secret_stack(tmp_path), key_file) == []


def test_what_depends_on_a_secret_in_plaintext_is_keyed(key_file, tmp_path, monkeypatch):
    assert unkeyed(secret_stack(tmp_path), key_file, monkeypatch) == [], "functions of a secret, not keyed"


def test_an_unkeyed_digest_of_a_secret_is_caught(key_file, tmp_path, monkeypatch):
    """Both checks above can fail: with the trigger key ignored (a plausible slip), the restart stamps
    of the instances, the router and Alertmanager are plain digests of the secret files again."""
    import glm_infra.components.remote_step as remote_step
    from glm_infra.steps import digest

    monkeypatch.setattr(remote_step, "keyed_digest", lambda key, *parts: digest(*parts))
    path = secret_stack(tmp_path)
    leaks_found = derived_leaks(path, key_file)
    # The steps with one secret trigger (with more, the digest is of several values: the check below; Alertmanager
    # has two here, the webhook's and the dead man's switch's URLs).
    assert "glm-router-front-tls: input.create: sha256 of a digest of b300-3:router-front-tls-given" in leaks_found
    found = unkeyed(path, key_file, monkeypatch)
    for name in ("glm-prefill-0-rollout", "glm-decode-0-rollout", "glm-router-service", "glm-router-front",
                 "glm-router-b300-2-service", "glm-monitoring-b300-1-alertmanager"):
        assert f"{name}: input.create" in found, (name, found)


def test_secret_triggers_are_keyed_and_the_others_are_as_they_were(key_file, tmp_path):
    """Upgrading changes only the commands of steps with a secret trigger (in place: a new stamp, as a
    rotated secret does); every other step keeps the plain digest it had, and does not wait for the key."""
    import hashlib

    run = run_program(secret_stack(tmp_path), key_file, secrets=CANARIES)
    key = run.urn("glm-trigger-key")
    waits = {r.name for r in run.resources if key in r.dependencies}
    assert waits == {"glm-prefill-0-rollout", "glm-prefill-1-rollout", "glm-prefill-2-rollout",
                     "glm-prefill-3-rollout", "glm-decode-0-rollout", "glm-router-service", "glm-router-front",
                     "glm-router-front-tls", "glm-router-canary", "glm-router-b300-2-service", "glm-router-b300-2-front",
                     "glm-router-b300-2-front-tls", "glm-router-b300-2-canary", "glm-monitoring-b300-1-alertmanager"}, waits

    def plain(*parts: str) -> str:  # steps.digest as it has always been: sha256 of NUL-ended parts
        return hashlib.sha256(b"".join(p.encode() + b"\0" for p in parts)).hexdigest()[:16]

    # prune-weights is stamped with its one trigger, the model revision, digested twice (step, then run_step).
    prune = run.get("glm-b300-2-prune-weights").inputs["create"]
    revision = yaml.safe_load(stack_file("prod-b300").read_text())["config"]["glm-infra:model"]["revision"]
    assert prune.startswith(f": glm-infra-triggers={plain(plain(revision))}; "), prune


def _prod_with(tmp_path, edit) -> Path:
    cfg = yaml.safe_load(stack_file("prod-b300").read_text())
    edit(cfg["config"])
    path = tmp_path / "Pulumi.test.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_the_program_refuses_a_stack_that_leaves_ssh_or_the_routers_clients_unsaid(key_file, tmp_path):
    """pulumi preview and up stop where validate does: before any resource, naming the key."""
    path = _prod_with(tmp_path, lambda c: (c.pop("glm-infra:firewall"), c["glm-infra:router"].pop("allowedCidrs")))
    with pytest.raises(pulumi.RunError) as e:
        run_program(path, key_file)
    assert [line.split(": ", 2)[1] for line in str(e.value).splitlines()[1:]] == [
        "glm-infra:firewall.adminCidrs", "glm-infra:router.allowedCidrs"], str(e.value)
    assert "glm-infra:firewall.adminCidrs: not set: list who besides the stack's hosts may reach SSH" in str(e.value)


def test_the_program_warns_of_ssh_and_the_router_open_to_every_address(key_file, tmp_path):
    """Open to all, said on purpose: deployed, and pulumi preview and up warn as validate does."""
    def edit(c):
        c["glm-infra:firewall"]["adminCidrs"] = ["0.0.0.0/0", "::/0"]
        c["glm-infra:router"]["allowedCidrs"] = ["0.0.0.0/0"]

    run = run_program(_prod_with(tmp_path, edit), key_file)
    assert run.by_type(CMD)
    assert {m for m in run.logs if "address reach" in m} == {
        "glm-infra:firewall.adminCidrs: 0.0.0.0/0, ::/0 lets every IPv4 and IPv6 address reach SSH on every host; "
        "list the networks you and the machine running pulumi connect from (a bastion, a VPN) unless that is what "
        "you mean",
        "glm-infra:router.allowedCidrs: 0.0.0.0/0 lets every IPv4 address reach the router's public port (8000 on "
        "b300-3); list the networks your clients (or their load balancer) connect from unless that is what you mean"}


def test_a_host_key_given_is_what_every_connection_to_that_host_checks(key_file, tmp_path):
    """hosts[].hostKey reaches every command's connection to that host (pulumi-command then refuses a host that
    does not hold it); a host without one is connected to as before."""
    cfg = yaml.safe_load(stack_file("sim").read_text())
    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"
    cfg["config"]["glm-infra:hosts"][0]["hostKey"] = key
    path = tmp_path / "Pulumi.sim.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run = run_program(path, key_file, stack="sim")
    by_host: dict[str, set] = {}
    for r in run.resources:
        if r.type == "command:remote:Command":
            by_host.setdefault(r.inputs["connection"]["host"], set()).add(r.inputs["connection"].get("hostKey"))
    assert by_host["10.88.0.11"] == {key}
    assert by_host["10.88.0.12"] == by_host["10.88.0.13"] == {None}


def test_the_program_refuses_an_up_with_its_state_in_the_checkout(key_file, monkeypatch):
    """The fallback of scripts/lib/pulumi-env.sh (the checkout's .pulumi-state) for a stack that does not say
    its hosts are disposable: stopped before any resource; the sim stack says so and deploys."""
    monkeypatch.setenv("PULUMI_BACKEND_URL", f"file://{ROOT}/.pulumi-state")
    monkeypatch.chdir(ROOT)
    with pytest.raises(pulumi.RunError, match=rf"stack test: its state would live in {ROOT}/\.pulumi-state, inside "
                                              rf"the checkout {ROOT} \(backend file://"):
        run_program(stack_file("prod-b300"), key_file)
    assert run_program(stack_file("sim"), key_file).by_type(CMD)
