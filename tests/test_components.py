"""The components as another Pulumi program uses them (under mocks): a minimal Cluster follows the
BRIEF, addresses may come from other resources, bad Args are refused before any resource exists,
and Hosts provisions without serving."""

from __future__ import annotations

import re
from pathlib import Path

import pulumi
import pulumi_command.local as local
import pytest
from pulumi_harness import run_callable

from glm_infra import Cluster, Hosts, InvalidArgsError
from glm_infra.roles import router

KEY = "-----BEGIN OPENSSH PRIVATE KEY-----\nnot-a-real-key\n-----END OPENSSH PRIVATE KEY-----\n"
MODEL = {"repo": "nvidia/GLM-5.2-NVFP4", "revision": "0" * 40, "path": "/mnt/model/glm/GLM-5.2-NVFP4"}
# Who may log in over SSH and who may reach the router's public port: Args say it as a stack file does.
WALL = {"admin_cidrs": ["10.20.0.0/24"]}
CLIENTS = ["10.30.0.0/16"]


def hosts(*addresses):
    return [{"name": f"b300-{i}", "address": a, "compute_nics": ["mlx5_0"]} for i, a in enumerate(addresses, 1)]


def commands(run):
    return {r.name: r for r in run.resources if r.type.startswith("command:")}


def test_a_minimal_cluster_is_the_brief_recipe():
    run, url = run_callable(lambda: Cluster("glm", {"hosts": hosts("10.0.0.11", "10.0.0.12", "10.0.0.13"),
                                                     "ssh": {"private_key": KEY}, "model": MODEL, "firewall": WALL,
                                                     "router": {"host": "b300-3", "allowed_cidrs": CLIENTS}}).router_url)
    cmds = commands(run)
    assert url == "https://10.0.0.13:8000"
    assert sorted(n.removesuffix("-unit") for n in cmds if n.endswith("-unit") and "router" not in n) == [
        "glm-decode-0", "glm-prefill-0", "glm-prefill-1", "glm-prefill-2", "glm-prefill-3"]
    decode = cmds["glm-decode-0-unit"].inputs["stdin"]
    for flag in ("-tp 1 -dp 8", "--max-num-batched-tokens 1024", "--all2all-backend=flashinfer_nvlink_two_sided",
                 '{"method":"mtp","num_speculative_tokens":3}', "--gpu-memory-utilization 0.90"):
        assert flag in decode, flag
    prefill = cmds["glm-prefill-1-unit"].inputs["stdin"]
    assert "-tp 1 -dp 4" in prefill and "CUDA_VISIBLE_DEVICES=4,5,6,7" in prefill
    assert all("connection" in r.secret_inputs for r in run.resources if r.type == "command:remote:Command")
    # A host that does not answer fails a step after 10 attempts of 10 s (the defaults).
    conn = cmds["glm-b300-2-preflight"].inputs["connection"]
    assert (conn["dialErrorLimit"], conn["perDialTimeout"]) == (10, 10)


def test_how_long_a_silent_host_is_tried_comes_from_the_stack():
    run, _ = run_callable(lambda: Cluster("glm", {"hosts": hosts("10.0.0.11", "10.0.0.12", "10.0.0.13"), "model": MODEL,
                                                   "ssh": {"private_key": KEY, "dial_attempts": 3, "dial_timeout": 5},
                                                   "firewall": WALL, "router": {"host": "b300-3", "allowed_cidrs": CLIENTS}}).router_url)
    conns = [r.inputs["connection"] for r in run.resources if r.type == "command:remote:Command"]
    assert conns and all((c["dialErrorLimit"], c["perDialTimeout"]) == (3, 5) for c in conns)


def test_host_addresses_may_come_from_another_resource():
    """Addresses known only when the program deploys (an inventory lookup here) end up in the units,
    the router's worker list and the SSH connections; the shape is decided from the plain values."""

    def program():
        inventory = [local.Command(f"inventory-{i}", create=f"echo 10.1.0.{i}") for i in (1, 2)]
        cluster = Cluster("two", {
            "hosts": [{"name": f"h{i}", "address": c.stdout, "compute_nics": ["mlx5_0"]} for i, c in enumerate(inventory, 1)],
            "ssh": {"private_key": pulumi.Output.secret(KEY)}, "model": MODEL,
            "prefill": {"hosts": ["h1"], "instances_per_host": 1, "dp": 8},
            "decode": {"hosts": ["h2"]}, "router": {"host": "h2", "allowed_cidrs": CLIENTS}, "firewall": WALL,
        })
        return pulumi.Output.all(cluster.router_url, cluster.instances)

    run, (url, instances) = run_callable(program)
    cmds = commands(run)
    assert url == "https://10.1.0.2:8000"
    assert instances["prefill-0"]["url"] == "http://10.1.0.1:8100"
    assert "--host 10.1.0.1 --port 8100" in cmds["two-prefill-0-unit"].inputs["stdin"]
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST=10.1.0.1" in cmds["two-prefill-0-unit"].inputs["stdin"]
    assert "--prefill http://127.0.0.1:8010 --decode http://127.0.0.1:8011" in cmds["two-router-unit"].inputs["stdin"]
    gates = cmds["two-router-gates-conf"].inputs["stdin"]  # the gates pass to the resolved addresses
    assert "server 10.1.0.1:8100 max_fails=0;" in gates and "server 10.1.0.2:8200 max_fails=0;" in gates
    assert '"url": "http://10.1.0.1:8100"' in cmds["two-router-canary"].inputs["stdin"]
    assert "--peer http://10.1.0.1:8090" in cmds["two-weights-h2-stage"].inputs["create"]
    assert cmds["two-h1-preflight"].inputs["connection"]["host"] == "10.1.0.1"
    # Nothing of the stand-in addresses used for the shape reached a resource.
    assert not any("198.51.100." in repr(r.inputs) for r in run.resources)


def test_a_mirror_url_and_addresses_from_other_resources_reach_the_seed(tmp_path):
    """The mirror URL (camelCase or snake_case) and the hosts' addresses known only at deploy time:
    the seed downloads from the real URL, the peers copy from the seed's real address."""

    def program(key: str):
        mirror = local.Command("mirror", create="echo http://10.9.0.1:8089/GLM")
        inventory = [local.Command(f"inventory-{i}", create=f"echo 10.3.0.{i}") for i in (1, 2)]
        cluster = Cluster("m", {
            "hosts": [{"name": f"h{i}", "address": c.stdout, "compute_nics": ["mlx5_0"]} for i, c in enumerate(inventory, 1)],
            "ssh": {"private_key": KEY}, "model": {**MODEL, "source": "mirror", key: mirror.stdout},
            "prefill": {"hosts": ["h1"], "instances_per_host": 1, "dp": 8}, "decode": {"hosts": ["h2"]},
            "router": {"host": "h2", "allowed_cidrs": CLIENTS}, "firewall": WALL,
        })
        return cluster.router_url

    for key in ("mirror_url", "mirrorUrl"):
        run, url = run_callable(lambda: program(key))
        cmds = commands(run)
        assert url == "https://10.3.0.2:8000"
        seed = cmds["m-weights-h1-stage"].inputs["create"]
        assert "--url http://10.9.0.1:8089/GLM" in seed and "--role seed" in seed, seed
        assert "--peer http://10.3.0.1:8090" in cmds["m-weights-h2-stage"].inputs["create"]
        assert not any("198.51.100." in repr(r.inputs) for r in run.resources), "no stand-in reached a resource"


def test_bad_args_are_refused_with_the_validate_messages_before_any_resource():
    registered = []

    def program():
        try:
            Cluster("bad", {"hosts": hosts("10.0.0.11", "10.0.0.12"), "ssh": {"private_key": KEY}, "model": MODEL,
                            "decode": {"hosts": ["b300-2"], "tp": 0}, "prefill": {"hosts": ["b300-9"]},
                            "router": {"host": "b300-2"}})
        except InvalidArgsError as e:
            registered.append(e)

    run, _ = run_callable(program)
    (error,) = registered
    assert str(error).startswith("Cluster 'bad': invalid stack")
    assert "glm-infra:decode.tp: Input should be greater than or equal to 1" in str(error)
    assert [p.path for p in error.problems] == ["glm-infra:decode.tp"]
    assert run.resources == [], "no resource exists"
    # Cross-field rules too (once the fields parse): an unknown host.
    with pytest.raises(InvalidArgsError, match=r"glm-infra:prefill.hosts\[0\]: unknown host 'b300-9'"):
        run_callable(lambda: Cluster("bad", {"hosts": hosts("10.0.0.11", "10.0.0.12"), "ssh": {"private_key": KEY},
                                             "model": MODEL, "prefill": {"hosts": ["b300-9"]},
                                             "decode": {"hosts": ["b300-2"]}, "router": {"host": "b300-2"}}))


OPEN_ARGS = {"hosts": hosts("10.0.0.11", "10.0.0.12", "10.0.0.13"), "ssh": {"private_key": KEY}, "model": MODEL}
HOSTS_MODEL = {**MODEL, "source": "mirror", "mirror_url": "http://10.0.0.1/m"}


def test_args_that_leave_ssh_or_the_router_unsaid_are_refused_like_a_stack_file():
    """Secure by default for the components too: a Cluster says who may log in over SSH and who may reach
    its router's public port, Hosts (no router) who may log in; refused before any resource otherwise,
    in validate's words."""
    errors = []

    def program(make):
        try:
            make()
        except InvalidArgsError as e:
            errors.append(e)

    run, _ = run_callable(lambda: program(lambda: Cluster("open", OPEN_ARGS)))
    (error,) = errors
    assert [p.path for p in error.problems] == ["glm-infra:firewall.adminCidrs", "glm-infra:router.allowedCidrs"]
    assert str(error).splitlines()[1:] == [
        "  Cluster 'open': glm-infra:firewall.adminCidrs: not set: list who besides the stack's hosts may reach SSH on "
        "every host: the networks you and the machine running pulumi connect from (a bastion, a VPN), e.g. "
        "[203.0.113.0/24], or 0.0.0.0/0 and ::/0 to open it to every address on purpose (glm-infra will not guess: "
        "left open, any address could reach it; left closed, only the stack's hosts)",
        "  Cluster 'open': glm-infra:router.allowedCidrs: not set: list who besides the stack's hosts may reach the "
        "router's public port (8000 on b300-3): the networks your clients (or their load balancer) connect from, "
        "e.g. [203.0.113.0/24], or 0.0.0.0/0 and ::/0 to open it to every address on purpose (glm-infra will not "
        "guess: left open, any address could reach it; left closed, only the stack's hosts)"]
    assert run.resources == [], "no resource exists"
    with pytest.raises(InvalidArgsError) as e:
        run_callable(lambda: Cluster("open", {**OPEN_ARGS, "firewall": WALL}))
    assert [p.path for p in e.value.problems] == ["glm-infra:router.allowedCidrs"]
    with pytest.raises(InvalidArgsError) as e:
        run_callable(lambda: Cluster("open", {**OPEN_ARGS, "router": {"host": "b300-3", "allowed_cidrs": CLIENTS}}))
    assert [p.path for p in e.value.problems] == ["glm-infra:firewall.adminCidrs"]
    with pytest.raises(InvalidArgsError) as e:  # camelCase and an empty list alike
        run_callable(lambda: Cluster("open", {**OPEN_ARGS, "firewall": {"adminCidrs": []},
                                              "router": {"host": "b300-3", "allowedCidrs": CLIENTS}}))
    assert str(e.value).splitlines()[1:] == [
        "  Cluster 'open': glm-infra:firewall.adminCidrs: List should have at least 1 item after validation, not 0"]
    # Hosts runs no router: who may log in is all it must say.
    with pytest.raises(InvalidArgsError) as e:
        run_callable(lambda: Hosts("fleet", {**OPEN_ARGS, "model": HOSTS_MODEL}))
    assert [p.path for p in e.value.problems] == ["glm-infra:firewall.adminCidrs"]


@pytest.mark.parametrize("everyone,family", [(["0.0.0.0/0"], "IPv4"), (["::/0"], "IPv6"),
                                             (["0.0.0.0/0", "::/0"], "IPv4 and IPv6")], ids=["v4", "v6", "both"])
def test_args_may_open_ssh_and_the_router_to_every_address_with_a_warning(everyone, family):
    """Said on purpose, open to all is accepted, and the run's warnings (what pulumi preview and up
    print) name each key."""
    run, _ = run_callable(lambda: Cluster("open", {**OPEN_ARGS, "firewall": {"admin_cidrs": everyone},
                                                   "router": {"host": "b300-3", "allowed_cidrs": everyone}}).router_url)
    assert any(r.name == "open-b300-1-firewall-nftables" for r in run.resources)
    given = ", ".join(everyone)
    assert [m for m in run.logs if "address reach" in m] == [
        f"glm-infra:firewall.adminCidrs: {given} lets every {family} address reach SSH on every host; list the "
        "networks you and the machine running pulumi connect from (a bastion, a VPN) unless that is what you mean",
        f"glm-infra:router.allowedCidrs: {given} lets every {family} address reach the router's public port (8000 on "
        "b300-3); list the networks your clients (or their load balancer) connect from unless that is what you mean"]


def test_with_the_firewall_off_no_network_is_required_and_the_run_says_nothing_filters():
    for make in (lambda: Hosts("fleet", {**OPEN_ARGS, "model": HOSTS_MODEL, "firewall": {"enabled": False}}).facts,
                 lambda: Cluster("open", {**OPEN_ARGS, "firewall": {"enabled": False}}).router_url):
        run, _ = run_callable(make)
        assert run.resources and not any("firewall" in r.name for r in run.resources)
        assert len([m for m in run.logs if m.startswith("glm-infra:firewall.enabled is false: nothing filters who "
                                                         "reaches the hosts; SSH")]) == 1, run.logs


@pytest.mark.parametrize("key,path,value", [
    ("router", "apiKey", 'sk-0123456789abcdef"; 1;\n'),  # would add to nginx's map of keys
    ("router", "apiKey", "short"),
    ("router", "apiKey", "k" * 513),
    ("model", "hfToken", "hf_abc def0123"),  # a space in an env file
    ("monitoring", "webhookUrl", "https://hooks.example.com/x y"),
    ("monitoring", "webhookUrl", "file:///etc/shadow"),
])
def test_a_secret_that_would_break_its_file_is_refused_without_its_value(key, path, value):
    args = {"hosts": hosts("10.0.0.11", "10.0.0.12", "10.0.0.13"), "ssh": {"private_key": KEY}, "model": dict(MODEL),
            "router": {"host": "b300-3", "allowed_cidrs": CLIENTS}, "firewall": WALL}
    args.setdefault(key, {})[path] = value
    with pytest.raises(InvalidArgsError) as e:
        run_callable(lambda: Cluster("glm", args))
    assert [p.path for p in e.value.problems] == [f"glm-infra:{key}.{path}"]
    assert value.strip() not in str(e.value) and "the secret's value is not" in str(e.value)
    # Given by another resource, it is checked once known, and the run fails with the same message.
    args[key][path] = pulumi.Output.from_input(value)
    with pytest.raises(Exception, match=rf"glm-infra:{key}.{path}: the secret's value is not") as e:
        run_callable(lambda: Cluster("glm", args).router_url)
    assert value.strip() not in str(e.value)


def test_a_long_api_key_fits_nginx_map_of_keys():
    from glm_infra.plan.topology import plan
    from glm_infra.spec.config import API_KEY_MAX
    from glm_infra.stack import load_dict
    cfg = load_dict({"hosts": hosts("10.0.0.11", "10.0.0.12", "10.0.0.13"), "ssh": {"private_key": KEY},
                     "model": MODEL, "router": {"host": "b300-3", "api_key": "k" * 16, "allowed_cidrs": CLIENTS},
                     "firewall": WALL}, "test").config
    conf = router.router_front_conf(cfg, plan(cfg))
    bucket = int(conf.split("map_hash_bucket_size ", 1)[1].split(";", 1)[0])
    # nginx keeps a key with its length and a pointer in a bucket, aligned: room for the longest line.
    assert bucket >= len("Bearer ") + API_KEY_MAX + 16 and bucket & (bucket - 1) == 0


def test_an_address_known_later_is_still_checked():
    def program():
        same = [local.Command(f"inventory-{i}", create="echo 10.2.0.1") for i in (1, 2)]
        return Cluster("dup", {"hosts": [{"name": f"h{i}", "address": c.stdout, "compute_nics": ["mlx5_0"]} for i, c in enumerate(same, 1)],
                               "ssh": {"private_key": KEY}, "model": MODEL, "firewall": WALL,
                               "router": {"host": "h2", "allowed_cidrs": CLIENTS}}).router_url

    with pytest.raises(Exception, match=r"glm-infra:hosts\[1\].address: duplicate address '10.2.0.1'"):
        run_callable(program)


def test_hosts_provisions_without_serving():
    run, facts = run_callable(lambda: Hosts("fleet", {
        "hosts": hosts("10.0.0.41", "10.0.0.42"), "ssh": {"private_key": KEY}, "firewall": WALL,
        "model": {**MODEL, "source": "mirror", "mirror_url": "http://10.0.0.1/m"},
    }).facts)
    names = set(commands(run))
    for h in ("b300-1", "b300-2"):
        assert {f"fleet-{h}-preflight", f"fleet-{h}-drivers-install", f"fleet-{h}-health-gate", f"fleet-{h}-rdma-setup",
                f"fleet-{h}-nixl-ucx-env", f"fleet-{h}-facts", f"fleet-weights-{h}-stage"} <= names
    assert not any("vllm" in n or "runtime" in n or "router" in n or "prune" in n for n in names)
    assert set(facts) == {"b300-1", "b300-2"}
    # Nothing serves, so no host takes turns: no step needs to tell a waiting turn it failed.
    assert not any(r.on_error for r in run.resources)
    # The hub needs the runtime's uv for the hf CLI: asked for, or refused plainly.
    with pytest.raises(InvalidArgsError, match="install_runtime=True"):
        run_callable(lambda: Hosts("fleet", {"hosts": hosts("10.0.0.41"), "ssh": {"private_key": KEY}, "model": MODEL,
                                             "firewall": WALL}))
    run, _ = run_callable(lambda: Hosts("fleet", {"hosts": hosts("10.0.0.41"), "ssh": {"private_key": KEY},
                                                  "model": MODEL, "firewall": WALL}, install_runtime=True).facts)
    assert {"fleet-b300-1-runtime-venv", "fleet-weights-b300-1-hf-cli"} <= set(commands(run))


def test_a_step_reaches_the_provider_as_planned():
    """run_step, the one place components touch the provider: the step's commands and stdin, secrecy
    and silence for a secret step, its timeout, triggers folded into the commands, never the previous
    output in the environment; a local step on the machine running pulumi."""
    from pulumi_command import remote

    from glm_infra.components.remote_step import run_step
    from glm_infra.steps import Step

    def program():
        parent = pulumi.ComponentResource("test:index:Parent", "p")
        conn = remote.ConnectionArgs(host="10.0.0.1", user="root", private_key=pulumi.Output.secret(KEY))
        run_step("plain", Step("plain", "echo create", "echo delete", "the script", timeout="5m"), conn, parent)
        run_step("secret", Step("secret", "cat > f", "rm f", "<placeholder>", secret=True), conn, parent,
                 stdin="s3cr3t-value")
        run_step("updating", Step("updating", "echo a", "echo d", None, update="echo u", triggers=("t1",)), conn, parent,
                 triggers=["t2"])
        run_step("waits", Step("waits", "sleep 1", "echo gone", "input", local=True), None, parent, environment={"X": "1"})
        return pulumi.Output.from_input("done")

    run, _ = run_callable(program)
    plain, secret, updating, waits = (run.get(n) for n in ("plain", "secret", "updating", "waits"))
    assert (plain.type, plain.inputs["create"], plain.inputs["update"], plain.inputs["delete"], plain.inputs["stdin"]) == (
        "command:remote:Command", "echo create", "echo create", "cat >/dev/null; echo delete", "the script")
    # A remote delete reads its stdin first (the provider writes it there too); one without stdin and a
    # local one run as written. A deployed step keeps the delete it was created with.
    assert secret.inputs["delete"] == "cat >/dev/null; rm f" and updating.inputs["delete"] == "echo d"
    assert plain.ignore_changes == secret.ignore_changes == updating.ignore_changes == ["delete"]
    assert waits.ignore_changes == []
    assert plain.inputs["logging"] == "stdoutAndStderr" and plain.inputs["addPreviousOutputInEnv"] is False
    assert "stdin" not in plain.secret_inputs and "stdin" not in plain.additional_secret_outputs
    assert plain.custom_timeouts == {"create": "5m", "update": "5m"} and secret.custom_timeouts == {}
    assert secret.inputs["stdin"] == "s3cr3t-value" and "stdin" in secret.secret_inputs
    assert secret.inputs["logging"] == "none" and "stdin" in secret.additional_secret_outputs
    assert updating.inputs["create"].startswith(": glm-infra-triggers=") and updating.inputs["create"].endswith("; echo a")
    assert updating.inputs["update"].endswith("; echo u") and updating.inputs["update"].split(";")[0] == \
        updating.inputs["create"].split(";")[0], "one digest of both triggers, in both commands"
    assert "stdin" not in updating.inputs
    assert (waits.type, waits.inputs["create"], waits.inputs["update"], waits.inputs["delete"], waits.inputs["stdin"]) == (
        "command:local:Command", "sleep 1", "sleep 1", "echo gone", "input")
    assert waits.inputs["environment"] == {"X": "1"} and waits.inputs["addPreviousOutputInEnv"] is False


def test_drivers_and_hoststep_register_the_steps_cluster_registers_directly():
    """For a program of your own: Drivers and HostStep make the same commands as Cluster (which registers them
    under itself, aliased to these components), each chained as the cluster chains them."""
    from pulumi_command import remote

    from glm_infra import Drivers, DriversArgs, HostStep, HostStepArgs
    from glm_infra.steps import Step

    def program():
        conn = remote.ConnectionArgs(host="10.0.0.1", user="root", private_key=pulumi.Output.secret(KEY))
        steps = {k: Step(k, f"echo {k}", None, None, local=k == "drivers-wait")
                 for k in ("drivers-install", "drivers-reboot", "drivers-wait", "drivers-back")}
        before = local.Command("before", create="true")
        d = Drivers("h-drivers", DriversArgs(conn, steps), pulumi.ResourceOptions(depends_on=[before]))
        HostStep("h-rdma", HostStepArgs(conn, Step("rdma", "echo rdma", "echo undo"), "setup", [d.ready.stdout]),
                 pulumi.ResourceOptions(depends_on=[d]))
        return d.ready.stdout

    run, _ = run_callable(program)
    cmds = commands(run)
    assert sorted(cmds) == ["before", "h-drivers-back", "h-drivers-install", "h-drivers-reboot", "h-drivers-wait", "h-rdma-setup"]
    assert all(cmds[f"h-drivers-{s}"].parent == run.urn("h-drivers") for s in ("install", "reboot", "wait", "back"))
    assert cmds["h-rdma-setup"].parent == run.urn("h-rdma") and cmds["h-rdma-setup"].aliases == []
    assert cmds["h-drivers-wait"].type == "command:local:Command"
    for a, b in [("before", "h-drivers-install"), ("h-drivers-install", "h-drivers-reboot"),
                 ("h-drivers-reboot", "h-drivers-wait"), ("h-drivers-wait", "h-drivers-back")]:
        assert run.urn(a) in cmds[b].dependencies, (a, b)
    assert cmds["h-drivers-wait"].inputs["create"].startswith(": glm-infra-triggers="), "re-run when the reboot's output changes"
    assert cmds["h-rdma-setup"].inputs["create"].startswith(": glm-infra-triggers=")


def test_the_components_leave_the_sdk_as_it_is():
    """The round wait is the program's choice (glm_infra.sdk_wait.install()), never a constructor's:
    a program that only builds a Cluster and Hosts runs the SDK it imported."""
    from glm_infra import sdk_wait

    was = sdk_wait.installed()
    sdk_wait.uninstall()
    try:
        run_callable(lambda: Cluster("glm", {"hosts": hosts("10.0.0.11", "10.0.0.12", "10.0.0.13"),
                                             "ssh": {"private_key": KEY}, "model": MODEL, "firewall": WALL,
                                             "router": {"host": "b300-3", "allowed_cidrs": CLIENTS}}).router_url)
        run_callable(lambda: Hosts("fleet", {"hosts": hosts("10.0.0.41"), "ssh": {"private_key": KEY},
                                             "model": MODEL, "firewall": WALL}, install_runtime=True).facts)
        assert not sdk_wait.installed()
    finally:
        if was:
            sdk_wait.install()


def test_a_secret_trigger_is_keyed_with_the_stack_key_or_kept_secret():
    """A trigger that is a secret (or made of one) stamps the command with an HMAC keyed by the stack's
    trigger key, which is not kept secret (nobody can check a guess against it); before any key (a
    component registered outside Cluster and Hosts) the command stays secret; a public trigger keeps
    its plain digest."""
    import hashlib
    import hmac

    from pulumi_command import remote
    from pulumi_harness import _Mocks

    from glm_infra.components.remote_step import run_step, trigger_key
    from glm_infra.steps import Step

    def program():
        parent = pulumi.ComponentResource("test:index:Parent", "p")
        conn = remote.ConnectionArgs(host="10.0.0.1", user="root", private_key=pulumi.Output.secret(KEY))
        step = Step("s", "echo a", "echo d")
        run_step("before-key", step, conn, parent, triggers=[pulumi.Output.secret("s3cr3t-api-key")])
        trigger_key("p-trigger-key", parent)
        run_step("keyed", step, conn, parent, triggers=[pulumi.Output.secret("s3cr3t-api-key")])
        run_step("public", step, conn, parent, triggers=["public-value"])
        return pulumi.Output.from_input("done")

    run, _ = run_callable(program)
    before, keyed, public, key = (run.get(n) for n in ("before-key", "keyed", "public", "p-trigger-key"))
    assert {"create", "update"} <= before.secret_inputs
    want = hmac.new(_Mocks.trigger_key.encode(), b"s3cr3t-api-key\0", hashlib.sha256).hexdigest()[:16]
    assert keyed.inputs["create"] == f": glm-infra-triggers={want}; echo a" and "create" not in keyed.secret_inputs
    assert key.urn in keyed.dependencies and key.urn not in public.dependencies
    plain = hashlib.sha256(b"public-value\0").hexdigest()[:16]
    assert public.inputs["create"] == f": glm-infra-triggers={plain}; echo a"
    assert key.type == "command:local:Command" and "stdout" in key.additional_secret_outputs
    assert key.inputs["logging"] == "none" and "/dev/urandom" in key.inputs["create"]


def test_the_components_page_snippet_runs_as_written():
    """docs/COMPONENTS.md's program, exactly as the page shows it, under the mocks: it defines what it uses,
    registers the recipe's instances and exports the router's URL and CA, the SSH key kept secret."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "COMPONENTS.md").read_text()
    code = re.search(r"```python\n(.*?)```", page, re.S).group(1)
    namespace: dict = {"__name__": "__main__"}
    run, _ = run_callable(lambda: exec(compile(code, "docs/COMPONENTS.md", "exec"), namespace),
                          config={"glm-infra:sshPrivateKey": KEY}, secret_keys=["glm-infra:sshPrivateKey"])
    cmds = commands(run)
    assert {n for n in cmds if n.endswith("-unit") and "router" not in n} == {
        "glm-decode-0-unit", *(f"glm-prefill-{i}-unit" for i in range(4))}
    assert all("connection" in r.secret_inputs for r in run.resources if r.type == "command:remote:Command")
    assert isinstance(namespace["cluster"], Cluster)
