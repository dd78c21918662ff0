"""The planner: GPU sets and ports for every committed stack, and its invariants."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import STACKS, stack_file

from glm_infra.plan.topology import (
    format_table,
    plan,
    pool_of,
    roll_predecessors,
    rolling,
    rolling_notes,
    seed_host,
    weights_relay,
)
from glm_infra.stack import load_file
from glm_infra.tools.cli import main


def _plan(name):
    cfg = load_file(stack_file(name)).config
    return cfg, plan(cfg)


def test_prod_b300_layout():
    _, p = _plan("prod-b300")
    rows = [(i.name, i.host, i.cuda_visible_devices, i.http_port, i.dp_rpc_port, i.nixl_port_base, i.nixl_port_count) for i in p.instances]
    assert rows == [
        ("prefill-0", "b300-1", "0,1,2,3", 8100, 29550, 5600, 4),
        ("prefill-1", "b300-1", "4,5,6,7", 8101, 29551, 5604, 4),
        ("prefill-2", "b300-2", "0,1,2,3", 8100, 29550, 5600, 4),
        ("prefill-3", "b300-2", "4,5,6,7", 8101, 29551, 5604, 4),
        ("decode-0", "b300-3", "0,1,2,3,4,5,6,7", 8200, 29650, 5700, 8),
    ]
    assert {i.host: i.nixl_host for i in p.instances} == {"b300-1": "10.0.0.11", "b300-2": "10.0.0.12", "b300-3": "10.0.0.13"}
    assert p.router.url == "https://10.0.0.10:8000" and p.router.host_names == ("b300-3", "b300-2")  # two routers
    # The router reaches each instance through its gate on loopback (router.gatePort on, in plan order).
    assert [(g.instance, g.role, g.url, g.upstream, g.requests) for g in p.router.gates] == [
        ("prefill-0", "prefill", "http://127.0.0.1:8010", "http://10.0.0.11:8100", 4),
        ("prefill-1", "prefill", "http://127.0.0.1:8011", "http://10.0.0.11:8101", 4),
        ("prefill-2", "prefill", "http://127.0.0.1:8012", "http://10.0.0.12:8100", 4),
        ("prefill-3", "prefill", "http://127.0.0.1:8013", "http://10.0.0.12:8101", 4),
        ("decode-0", "decode", "http://127.0.0.1:8014", "http://10.0.0.13:8200", 8),
    ]
    assert p.router.prefill_urls == tuple(f"http://127.0.0.1:{port}" for port in range(8010, 8014))
    assert p.router.decode_urls == ("http://127.0.0.1:8014",) and p.router.worker_url("decode-0") == p.router.decode_urls[0]
    assert [h.gpus_used for h in p.hosts] == [8, 8, 8]


def test_prefill_dp2_layout():
    _, p = _plan("b300-prefill-dp2")
    prefill = p.by_role("prefill")
    assert len(prefill) == 8
    assert [i.cuda_visible_devices for i in prefill[:4]] == ["0,1", "2,3", "4,5", "6,7"]
    assert [i.nixl_port_base for i in prefill[:4]] == [5600, 5602, 5604, 5606]
    assert [i.http_port for i in prefill[4:]] == [8100, 8101, 8102, 8103]


def test_two_node_layout():
    _, p = _plan("b300-2node")
    assert [(i.name, i.host, i.cuda_visible_devices) for i in p.instances] == [
        ("prefill-0", "b300-1", "0,1,2,3"),
        ("prefill-1", "b300-1", "4,5,6,7"),
        ("decode-0", "b300-2", "0,1,2,3,4,5,6,7"),
    ]
    assert p.router.host == "b300-2"


def test_colocated_layout():
    cfg, p = _plan("b300-1node-colocated")
    (inst,) = p.instances
    assert inst.role == "colocated" and inst.cuda_visible_devices == "0,1,2,3,4,5,6,7" and inst.http_port == 8000
    assert not p.disaggregated and p.router is None
    assert [k for k, _ in inst.ports()] == ["http", "dp-rpc"]  # no NIXL without P/D


@pytest.mark.parametrize("stack", STACKS)
def test_invariants(stack):
    cfg, p = _plan(stack)
    for h in p.hosts:
        gpus = [g for i in h.instances for g in i.gpus]
        assert len(gpus) == len(set(gpus)), "GPU sets on a host are disjoint"
        assert all(0 <= g < h.gpus for g in gpus)
        ports = [port for i in h.instances for _, port in i.ports()]
        if h.runs_router:
            ports.append(p.router.port)
        assert len(ports) == len(set(ports)), "ports on a host are unique"
    for i in p.instances:
        pool = getattr(cfg, i.role)
        assert len(i.gpus) == pool.tp * pool.dp
        assert list(i.nixl_ports) == [i.nixl_port_base + r for r in range(pool.dp)]
    assert len({(i.host, i.unit) for i in p.instances}) == len(p.instances)


def test_shared_host_gets_disjoint_gpus(write_stack, prod_config):
    prod_config["glm-infra:hosts"][2]["gpus"] = 16
    prod_config["glm-infra:prefill"]["hosts"] = ["b300-1", "b300-2", "b300-3"]
    prod_config["glm-infra:decode"]["httpPort"] = 8300
    prod_config["glm-infra:decode"]["nixlSideChannelPort"] = 5800
    prod_config["glm-infra:decode"]["dpRpcPort"] = 29750
    p = plan(load_file(write_stack(prod_config)).config)
    on3 = {i.name: i.cuda_visible_devices for i in p.instances if i.host == "b300-3"}
    assert on3 == {"prefill-4": "0,1,2,3", "prefill-5": "4,5,6,7", "decode-0": "8,9,10,11,12,13,14,15"}


def test_plan_command_prints_the_table(capsys):
    assert main(["plan", "prod-b300"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert any(l.split()[:3] == ["b300-1", "10.0.0.11", "prefill-0"] and "0,1,2,3" in l and "5600-5603" in l for l in lines)
    assert any("decode-0" in l and "0,1,2,3,4,5,6,7" in l and "8200" in l and "5700-5707" in l for l in lines)
    assert "GPU use: b300-1: 8/8 GPUs, b300-2: 8/8 GPUs, b300-3: 8/8 GPUs" in out
    assert "router: https://10.0.0.10:8000 (P/D; 5 workers)" in out


@pytest.mark.parametrize("stack", STACKS)
def test_plan_tables_match_their_golden_copies(stack, capsys):
    """The review table, word for word (regenerate with GLM_INFRA_REGEN_GOLDEN=1, then review the diff)."""
    assert main(["plan", stack]) == 0
    out = capsys.readouterr().out
    golden = Path(__file__).parent / "golden" / f"plan-{stack}.txt"
    if os.environ.get("GLM_INFRA_REGEN_GOLDEN"):
        golden.write_text(out)
    assert out == golden.read_text()


def test_a_host_with_nothing_to_run_shows_its_idle_gpus(write_stack, prod_config):
    prod_config["glm-infra:hosts"].append({"name": "spare", "address": "10.0.0.99"})
    out = format_table(load_file(write_stack(prod_config)).config, plan(load_file(write_stack(prod_config)).config))
    row = next(l for l in out.splitlines() if l.startswith("spare"))
    assert row.split() == ["spare", "10.0.0.99", "-", "-", "0/8", "used", "-", "-", "-"]
    assert "spare: 0/8 GPUs" in out


def test_hosts_provisioned_without_serving(prod_config, write_stack):
    cfg = load_file(write_stack(prod_config)).config
    p = plan(cfg, serve=False, runtime=True)
    assert p.instances == () and p.router is None and not p.serve
    assert [(h.name, h.address, h.gpus, h.instances, h.runs_router, h.provision_only, h.runtime) for h in p.hosts] == [
        (h.name, h.address, 8, (), False, True, True) for h in cfg.hosts]
    assert all(not h.runtime for h in plan(cfg, serve=False).hosts)
    assert seed_host(cfg, serve=False) == "b300-1" and seed_host(cfg) == "b300-1"
    cfg2 = cfg.model_copy(update={"model": cfg.model.model_copy(update={"seed_host": "b300-2"})})
    assert seed_host(cfg2, serve=False) == "b300-2"
    assert plan(cfg).serve


def test_a_colocated_pool_behind_the_router_round_robin(write_stack):
    cfg = load_file(write_stack({
        "glm-infra:hosts": [{"name": "a", "address": "10.0.0.1"}, {"name": "b", "address": "10.0.0.2"}],
        "glm-infra:ssh": {"privateKeyPath": "/k"},
        "glm-infra:model": {"repo": "o/m", "revision": "0" * 40, "path": "/m"},
        # A model glm-infra has no facts snapshot of: the stack gives what capacity planning needs.
        "glm-infra:capacity": {"modelFacts": {"num_hidden_layers": 4, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                                              "max_position_embeddings": 32768},
                               "routedBytes": 8 * 10**9, "residentBytes": 2 * 10**9},
        "glm-infra:sla": {"contexts": [16384]},  # within its 32,768 positions
        "glm-infra:colocated": {"hosts": ["a", "b"], "ep": False},
        "glm-infra:router": {"host": "b", "allowedCidrs": ["10.30.0.0/16"]},
        "glm-infra:firewall": {"adminCidrs": ["10.20.0.0/24"]},
    })).config
    p = plan(cfg)
    assert p.router.worker_urls == ("http://127.0.0.1:8010", "http://127.0.0.1:8011")
    assert [g.upstream for g in p.router.gates] == ["http://10.0.0.1:8100", "http://10.0.0.2:8100"]
    assert p.router.prefill_urls == () == p.router.decode_urls and not p.disaggregated
    assert [(i.name, i.slot, i.address, i.nixl_host) for i in p.instances] == [
        ("colocated-0", 0, "10.0.0.1", "10.0.0.1"), ("colocated-1", 0, "10.0.0.2", "10.0.0.2")]
    table = format_table(cfg, p)
    assert "colocated-0 (tp1 dp8)  " in table and "router: https://10.0.0.2:8000 (round robin; 2 workers)" in table
    assert table.splitlines()[0] == table.splitlines()[0].rstrip() and table.startswith("host ")
    with pytest.raises(KeyError, match="prefill"):
        pool_of(cfg, "prefill")


def test_weights_go_to_the_serving_hosts_and_with_hosts_only_to_every_host(write_stack, prod_config):
    """A host that serves nothing neither seeds nor relays the checkpoint; provisioned without pools
    (Hosts), every host stages it, the first seeds it, and no host is drained for a rolling change."""
    prod_config["glm-infra:hosts"].insert(0, {"name": "spare", "address": "10.0.0.99"})
    prod_config["glm-infra:hosts"].append({"name": "spare-2", "address": "10.0.0.98"})
    cfg = load_file(write_stack(prod_config)).config
    assert seed_host(cfg) == "b300-1" and seed_host(cfg, serve=False) == "spare"
    assert list(weights_relay(cfg)) == ["b300-1", "b300-2", "b300-3"]
    assert list(weights_relay(cfg, serve=False)) == ["spare", "b300-1", "b300-2", "b300-3", "spare-2"]
    assert weights_relay(cfg, serve=False)["b300-3"].ancestors == ("b300-1", "spare")
    assert rolling(cfg, plan(cfg, serve=False)) == () and rolling_notes(cfg, plan(cfg, serve=False)) == []


def test_a_host_in_two_pools_waits_for_both_and_takes_the_stricter_limit(write_stack, prod_config):
    prod_config["glm-infra:hosts"].append(dict(prod_config["glm-infra:hosts"][0], name="b300-4", address="10.0.0.14",
                                               gpus=16))
    prod_config["glm-infra:prefill"]["hosts"] = ["b300-1", "b300-2", "b300-4"]
    prod_config["glm-infra:decode"].update(hosts=["b300-3", "b300-4"], maxUnavailable=2)
    cfg = load_file(write_stack(prod_config)).config
    p = plan(cfg)
    groups = rolling(cfg, p)
    assert {h.name: roll_predecessors(groups, h.name) for h in cfg.hosts} == {
        "b300-1": (), "b300-2": ("b300-1",), "b300-3": (), "b300-4": ("b300-2", "b300-3")}
    assert rolling_notes(cfg, p) == [
        "prefill: 3 hosts, 1 at a time (maxUnavailable 1), each drained and healthy again before the next: "
        "b300-1, then b300-2, then b300-4",
        "decode: 2 hosts, 1 at a time (maxUnavailable 2, 1 on a host another pool shares), each drained and healthy "
        "again before the next: b300-3, then b300-4"]


def test_no_line_of_the_table_ends_in_spaces(write_stack, prod_config):
    prod_config["glm-infra:prefill"]["nixlSideChannelPort"] = 15600  # "15600-15603": wider than its header
    cfg = load_file(write_stack(prod_config)).config
    table = format_table(cfg, plan(cfg))
    assert "15600-15603" in table and [line for line in table.splitlines() if line != line.rstrip()] == []
