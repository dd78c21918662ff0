"""The firewall's ruleset, loaded by the real nft into network namespaces of the test's own: a stack
host reaches every port glm-infra opens, a client outside the stack is refused on each, the router's
public port opens to the CIDRs the stack lists; SSH and other ports are left alone; the table follows
the plan. Needs root (ip netns), as CI runs."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest

from conftest import stack_config, stack_file
from glm_infra import firewall, hostplan, ports
from glm_infra.stack import load_dict, load_file
from glm_infra.topology import plan

SERVER, PEER, OUTSIDER = "10.99.0.13", "10.99.0.11", "10.99.0.50"


def sim_like(**router) -> object:
    """The sim stack on the test's own addresses (10.99.0.0/24 inside its namespaces)."""
    raw = {k.removeprefix("glm-infra:"): v for k, v in stack_config("sim").items()}
    for i, h in enumerate(raw["hosts"]):
        h["address"] = f"10.99.0.1{i + 1}"
    raw["router"] = {**raw["router"], "apiKey": "sk-test", **router}
    raw["monitoring"] = {**raw["monitoring"], "allowedCidrs": []}
    return load_dict(raw, "test").config


@pytest.fixture
def netns():
    """Two namespaces joined by a veth pair: ``srv`` holds the server's address, ``cli`` a peer's and an
    outsider's."""
    if os.geteuid() != 0:
        pytest.fail("the firewall tests need root (ip netns), as CI runs them", pytrace=False)
    tag = uuid.uuid4().hex[:6]
    srv, cli = f"glmfw-srv-{tag}", f"glmfw-cli-{tag}"

    def sh(cmd: str) -> None:
        subprocess.run(["bash", "-c", cmd], check=True, capture_output=True)

    sh(f"ip netns add {srv} && ip netns add {cli} && ip link add v-{tag}-s netns {srv} type veth peer name v-{tag}-c "
       f"netns {cli} && ip -n {srv} addr add {SERVER}/24 dev v-{tag}-s && ip -n {cli} addr add {PEER}/24 dev v-{tag}-c "
       f"&& ip -n {cli} addr add {OUTSIDER}/24 dev v-{tag}-c && ip -n {srv} link set v-{tag}-s up && "
       f"ip -n {cli} link set v-{tag}-c up && ip -n {srv} link set lo up && ip -n {cli} link set lo up")
    try:
        yield srv, cli
    finally:
        subprocess.run(["ip", "netns", "del", srv], capture_output=True)
        subprocess.run(["ip", "netns", "del", cli], capture_output=True)


def load(ns: str, rules: str, tmp_path: Path) -> None:
    f = tmp_path / "firewall.nft"
    f.write_text(rules)
    p = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", str(f)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def listen(ns: str, port_list: list[int]) -> subprocess.Popen:
    code = ("import socket, sys, time\nss = []\nfor p in sys.argv[1:]:\n    s = socket.socket(); "
            "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0', int(p))); s.listen(64); "
            "ss.append(s)\nprint('ready', flush=True)\ntime.sleep(60)\n")
    p = subprocess.Popen(["ip", "netns", "exec", ns, "python3", "-c", code, *map(str, port_list)], stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def reach(ns: str, source: str, port_list: list[int]) -> dict[int, str]:
    """From ``source`` in ``ns``: each port 'open' or 'refused'."""
    code = ("import socket, sys\nsrc, dst = sys.argv[1], sys.argv[2]\nfor p in sys.argv[3:]:\n    s = socket.socket(); "
            "s.settimeout(3); s.bind((src, 0))\n    try:\n        s.connect((dst, int(p))); print(p, 'open')\n"
            "    except ConnectionRefusedError:\n        print(p, 'refused')\n    except OSError as e:\n"
            "        print(p, 'error', e)\n    s.close()\n")
    out = subprocess.run(["ip", "netns", "exec", ns, "python3", "-c", code, source, SERVER, *map(str, port_list)],
                         capture_output=True, text=True, timeout=60).stdout
    return {int(line.split()[0]): line.split(" ", 1)[1] for line in out.splitlines()}


def test_stack_hosts_reach_every_port_outsiders_none(netns, tmp_path):
    srv, cli = netns
    cfg = sim_like()
    p = plan(cfg)
    mine = [li for li in ports.listeners(cfg) if li.host == "sim-3"]
    internal = sorted({li.port for li in mine if li.audience != ports.ROUTER})
    public = sorted({li.port for li in mine if li.audience == ports.ROUTER})
    assert public == [8000] and {8200, 8001, 29000, 9100, 9400, 9090, 9093} <= set(internal)
    load(srv, firewall.ruleset(cfg, p, "sim-3"), tmp_path)
    server = listen(srv, [*internal, *public, 22, 2222])
    try:
        assert set(reach(cli, PEER, [*internal, *public, 22]).values()) == {"open"}
        outside = reach(cli, OUTSIDER, [*internal, *public, 22, 2222])
        assert all(outside[port] == "refused" for port in [*internal, *public]), outside
        assert outside[22] == "open" and outside[2222] == "open", "only glm-infra's ports are the table's"
        # The public port opens to the CIDRs the stack lists, and only it.
        load(srv, firewall.ruleset(sim_like(allowedCidrs=[f"{OUTSIDER}/32"]), p, "sim-3"), tmp_path)
        outside = reach(cli, OUTSIDER, [*internal, *public])
        assert outside[8000] == "open" and all(outside[port] == "refused" for port in internal), outside
    finally:
        server.kill()
        server.wait()


def test_the_table_follows_the_plan_and_is_the_only_thing_it_owns():
    cfg = load_file(stack_file("prod-b300")).config
    rules = firewall.ruleset(cfg, plan(cfg), "b300-1")
    assert rules.count("table inet glm_infra {") == 1 and "delete table inet glm_infra\n" in rules
    assert "policy accept;" in rules and "drop" not in rules and " 22 " not in rules and "flush ruleset" not in rules
    assert "10.0.0.11/32, 10.0.0.12/32, 10.0.0.13/32" in rules
    # A host added to the stack: every host lets it in.
    raw = {k.removeprefix("glm-infra:"): v for k, v in stack_config("prod-b300").items()}
    raw["hosts"].append({"name": "b300-4", "address": "10.0.0.14", "computeNics": ["mlx5_0"]})
    more = load_dict(raw, "test").config
    assert "10.0.0.14/32" in firewall.ruleset(more, plan(more), "b300-1")
    assert firewall.ruleset(more, plan(more), "b300-1") != rules


def test_every_port_glm_infra_opens_is_in_its_hosts_table():
    for stack in ("prod-b300", "b300-2node", "b300-1node-colocated", "sim"):
        cfg = load_file(stack_file(stack)).config
        for h in plan(cfg).hosts:
            rules = firewall.ruleset(cfg, plan(cfg), h.name)
            for li in ports.listeners(cfg):
                if li.host == h.name:
                    assert f" {li.port}," in rules or f" {li.port} }}" in rules or f"{{ {li.port}," in rules, (stack, li)


def test_the_weights_relay_port_is_open_only_where_a_host_has_relay_children():
    cfg = load_file(stack_file("prod-b300")).config  # serving b300-1 (seed) → b300-2, b300-3: both leaves
    port = cfg.model.fanout_port
    opened = {h.name for h in plan(cfg).hosts if "weights relay" in firewall.ruleset(cfg, plan(cfg), h.name)}
    assert opened == {"b300-1"}
    assert f" {port}" not in firewall.ruleset(cfg, plan(cfg), "b300-2")
    local = cfg.model_copy(update={"model": cfg.model.model_copy(update={"source": "local"})})
    assert not any("weights relay" in firewall.ruleset(local, plan(local), h.name) for h in plan(local).hosts)


def test_the_firewall_step_checks_its_table_and_can_be_turned_off():
    cfg = load_file(stack_file("sim")).config
    hs = hostplan.plan_all(cfg, plan(cfg), stack_name="sim")["sim-1"]
    names = list(hs.steps)
    assert names.index("drivers-back") < names.index("firewall") < names.index("health-gate")
    step = hs.steps["firewall"]
    assert "nft -c -f /etc/glm-infra/firewall.nft" in step.stdin and "is not the one glm-infra wrote" in step.stdin
    assert {f.path for f in step.files} >= {firewall.RULESET, "/etc/systemd/system/glm-infra-firewall.service"}
    raw = {k.removeprefix("glm-infra:"): v for k, v in stack_config("sim").items()}
    raw["router"]["apiKey"] = "sk"
    raw["firewall"] = {"enabled": False}
    off = load_dict(raw, "test").config
    assert all("firewall" not in h.steps for h in hostplan.plan_all(off, plan(off), stack_name="sim").values())


def test_a_bad_cidr_is_named(write_stack):
    raw = stack_config("prod-b300")
    raw["glm-infra:router"]["allowedCidrs"] = ["10.0.0.0/33"]
    with pytest.raises(Exception) as e:
        load_file(write_stack(raw))
    assert "glm-infra:router.allowedCidrs[0]: '10.0.0.0/33' is not an address or network" in str(e.value)
