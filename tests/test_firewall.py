"""The firewall, against expectations written out by hand from the stack files and the defaults their
Field descriptions give (never from glm_infra.plan.ports, which the rules come from): the table the real
nft makes of each committed stack's ruleset lets exactly the ports listed here in, from exactly the
sources listed here, and drops the rest. In network namespaces of the test's own: a stack host reaches
glm-infra's ports, an outsider is refused there, SSH opens to the admin networks and the stack's hosts,
anything else is dropped, loopback, replies and ICMP pass. The step's check compares the live table
with the plan (flushed, edited, emptied or deleted by hand: it fails) and apply loads it again with a
reload; a host named by DNS is refused; the vLLM and router units require the firewall unit, which
loads before the network. Needs root (ip netns, unshare), as CI runs."""

from __future__ import annotations

import ipaddress
import json
import os
import shlex
import subprocess
import uuid
from pathlib import Path

import pytest
from conftest import STACKS, one_router, stack_config, stack_file
from stubs import StubPath, shellcheck

from glm_infra import hostplan
from glm_infra.plan.topology import plan
from glm_infra.roles import firewall, router, vllm
from glm_infra.stack import StackError, load_dict, load_file, unprefixed

# --- what each committed stack opens, by hand --------------------------------------------------------
# Defaults (glm_infra/spec/config.py): prefill HTTP 8100, DP RPC 29550, NIXL side channel 5600; decode 8200,
# 29650, 5700; colocated 8100, 29550; each further instance on a host +1 (HTTP, DP RPC), its NIXL base
# after the previous instance's DP ranks (one side-channel port per DP rank: base+rank); the router 8000
# public (nginx), 29000 metrics (8001, its own port, and its gates: loopback, opened to nobody); the weights relay 8090 on a host with relay children
# (the seed, the first serving host, when other hosts copy from it); node exporter 9100 on every host,
# DCGM exporter 9400 where the driver step installs (drivers.mode install, the default); Prometheus
# 9090 and Alertmanager 9093 on monitoring.host (prod-b300: b300-1, which runs no router), else the router host,
# else the last host. prod-b300's second router (router.standbyHosts) on b300-2: its public port and metrics too.

# Two prefill instances TP1 DP4 on a host: HTTP 8100, 8101; DP RPC 29550, 29551; NIXL 5600-5603, 5604-5607.
PREFILL_2X_DP4 = {8100, 8101, 29550, 29551, 5600, 5601, 5602, 5603, 5604, 5605, 5606, 5607}
# Four prefill instances TP1 DP2: HTTP 8100-8103; DP RPC 29550-29553; NIXL 5600-5601, …, 5606-5607.
PREFILL_4X_DP2 = {8100, 8101, 8102, 8103, 29550, 29551, 29552, 29553, 5600, 5601, 5602, 5603, 5604, 5605, 5606, 5607}
# One decode instance TP1 DP8: HTTP 8200, DP RPC 29650, NIXL 5700-5707.
DECODE_DP8 = {8200, 29650, 5700, 5701, 5702, 5703, 5704, 5705, 5706, 5707}
EXPORTERS = {9100, 9400}
RELAY = {8090}
WARM_CACHE = {7090}  # the prefill pool's warm-cache relay, on its first host (its relay has children)
DECODE_WARM_CACHE = {7091}  # the decode pool's (startup.relayPort + 1), where decode spans two hosts
ROUTER_PRIVATE = {29000}
MONITORING = {9090, 9093}

PROD_HOSTS = {"10.0.0.11/32", "10.0.0.12/32", "10.0.0.13/32"}
FOUR_HOSTS = PROD_HOSTS | {"10.0.0.14/32"}
TWO_HOSTS = {"10.0.0.11/32", "10.0.0.12/32"}
SIM_HOSTS = {"10.88.0.11/32", "10.88.0.12/32", "10.88.0.13/32"}
MACHINE = {"10.88.0.1/32"}  # the sim's router.allowedCidrs, monitoring.allowedCidrs and firewall.adminCidrs
# The other committed stacks' placeholders (documentation networks): firewall.adminCidrs, router.allowedCidrs.
ADMINS, CLIENTS = {"192.0.2.0/24"}, {"203.0.113.0/24"}
ANYONE = None  # what what_gets_in says of a port open to every address, with no set of sources

# stack → host → {who may connect (a set of networks, or ANYONE): the TCP ports they may reach}
EXPECTED: dict[str, dict[str, dict[frozenset[str] | None, set[int]]]] = {
    "prod-b300": {
        "b300-1": {frozenset(PROD_HOSTS): PREFILL_2X_DP4 | EXPORTERS | RELAY | WARM_CACHE | MONITORING,
                   frozenset(PROD_HOSTS | ADMINS): {22}},
        "b300-2": {frozenset(PROD_HOSTS): PREFILL_2X_DP4 | EXPORTERS | ROUTER_PRIVATE,
                   frozenset(PROD_HOSTS | CLIENTS): {8000}, frozenset(PROD_HOSTS | ADMINS): {22}},
        "b300-3": {frozenset(PROD_HOSTS): DECODE_DP8 | EXPORTERS | ROUTER_PRIVATE,
                   frozenset(PROD_HOSTS | CLIENTS): {8000}, frozenset(PROD_HOSTS | ADMINS): {22}},
    },
    "sim": {
        "sim-1": {frozenset(SIM_HOSTS): PREFILL_2X_DP4 | EXPORTERS | RELAY | WARM_CACHE,
                  frozenset(SIM_HOSTS | MACHINE): {22}},
        "sim-2": {frozenset(SIM_HOSTS): PREFILL_2X_DP4 | EXPORTERS, frozenset(SIM_HOSTS | MACHINE): {22}},
        "sim-3": {frozenset(SIM_HOSTS): DECODE_DP8 | EXPORTERS | ROUTER_PRIVATE,
                  frozenset(SIM_HOSTS | MACHINE): {22, 8000} | MONITORING},
    },
    "b300-2node": {
        "b300-1": {frozenset(TWO_HOSTS): PREFILL_2X_DP4 | EXPORTERS | RELAY, frozenset(TWO_HOSTS | ADMINS): {22}},
        "b300-2": {frozenset(TWO_HOSTS): DECODE_DP8 | EXPORTERS | ROUTER_PRIVATE | MONITORING,
                   frozenset(TWO_HOSTS | CLIENTS): {8000}, frozenset(TWO_HOSTS | ADMINS): {22}},
    },
    # One colocated TP1 DP8 instance on httpPort 8000 (DP RPC 29550, no NIXL), no router, no relay.
    "b300-1node-colocated": {
        "b300-dev": {frozenset({"10.0.0.21/32"}): {8000, 29550} | EXPORTERS | MONITORING,
                     frozenset({"10.0.0.21/32"} | ADMINS): {22}},
    },
    # The weights relay: the seed b300-1 serves b300-2 and b300-3, b300-2 serves b300-4 (a tree of two children).
    "prod-b300-2decode": {
        "b300-1": {frozenset(FOUR_HOSTS): PREFILL_2X_DP4 | EXPORTERS | RELAY | WARM_CACHE | MONITORING,
                   frozenset(FOUR_HOSTS | ADMINS): {22}},
        "b300-2": {frozenset(FOUR_HOSTS): PREFILL_2X_DP4 | EXPORTERS | RELAY | ROUTER_PRIVATE,
                   frozenset(FOUR_HOSTS | CLIENTS): {8000}, frozenset(FOUR_HOSTS | ADMINS): {22}},
        "b300-3": {frozenset(FOUR_HOSTS): DECODE_DP8 | EXPORTERS | ROUTER_PRIVATE | DECODE_WARM_CACHE,
                   frozenset(FOUR_HOSTS | CLIENTS): {8000}, frozenset(FOUR_HOSTS | ADMINS): {22}},
        "b300-4": {frozenset(FOUR_HOSTS): DECODE_DP8 | EXPORTERS, frozenset(FOUR_HOSTS | ADMINS): {22}},
    },
    "b300-prefill-dp2": {
        "b300-1": {frozenset(PROD_HOSTS): PREFILL_4X_DP2 | EXPORTERS | RELAY | WARM_CACHE,
                   frozenset(PROD_HOSTS | ADMINS): {22}},
        "b300-2": {frozenset(PROD_HOSTS): PREFILL_4X_DP2 | EXPORTERS, frozenset(PROD_HOSTS | ADMINS): {22}},
        "b300-3": {frozenset(PROD_HOSTS): DECODE_DP8 | EXPORTERS | ROUTER_PRIVATE | MONITORING,
                   frozenset(PROD_HOSTS | CLIENTS): {8000}, frozenset(PROD_HOSTS | ADMINS): {22}},
    },
}


def config(name: str):
    return load_file(stack_file(name)).config


def raw(name: str) -> dict:
    """A committed stack's keys without the glm-infra: prefix, its secrets as plaintext stand-ins."""
    out = unprefixed(stack_config(name))
    if out.get("router"):
        out["router"]["apiKey"] = "sk-test"
    return out


def rules_of(cfg, host: str) -> str:
    return firewall.ruleset(cfg, plan(cfg), host)


def nft_alone(rules: str, *args: str) -> subprocess.CompletedProcess:
    """nft on ``rules`` in a network namespace of its own: no route, no DNS (as at boot)."""
    return subprocess.run(["unshare", "--net", "--", "sh", "-c", 'nft -f - && "$@"', "sh", *args],
                          input=rules, capture_output=True, text=True, timeout=30)


def listing(rules: str) -> list[dict]:
    p = nft_alone(rules, "nft", "-j", "list", "table", "inet", "glm_infra")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)["nftables"]


def _element(e) -> str:
    if isinstance(e, dict):
        return str(ipaddress.ip_network(f"{e['prefix']['addr']}/{e['prefix']['len']}"))
    return str(ipaddress.ip_network(e))


def _ports(right) -> set[int]:
    if isinstance(right, int):
        return {right}
    out: set[int] = set()
    for p in right["set"]:
        out |= set(range(p["range"][0], p["range"][1] + 1)) if isinstance(p, dict) else {p}
    return out


def what_gets_in(items: list[dict]) -> tuple[dict[frozenset[str] | None, set[int]], set[int]]:
    """From nft's listing: {sources (None: anyone): TCP ports accepted}, and the ports reset for the rest."""
    sets = {i["set"]["name"]: {_element(e) for e in i["set"].get("elem", [])} for i in items if "set" in i}
    accepted: dict[str, set[int]] = {}
    refused: set[int] = set()
    for item in items:
        expr = item.get("rule", {}).get("expr", [])
        match = {json.dumps(e["match"]["left"], sort_keys=True): e["match"]["right"] for e in expr if "match" in e}
        dport = match.get(json.dumps({"payload": {"field": "dport", "protocol": "tcp"}}, sort_keys=True))
        if dport is None:
            continue
        src = next((r for k, r in match.items() if '"saddr"' in k), None)
        if any("reject" in e for e in expr):
            refused |= _ports(dport)
        elif any("accept" in e for e in expr):
            accepted.setdefault(src, set()).update(_ports(dport))
    out: dict[frozenset[str] | None, set[int]] = {}
    for src, port_set in accepted.items():  # a set for v4 and one for v6: the same ports, both families
        key = None if src is None else frozenset(sets[src.lstrip("@")] | sets[src.lstrip("@").replace("_v4", "_v6")])
        if key is None or src.endswith("_v4"):
            out.setdefault(key, set()).update(port_set)
    return out, refused


@pytest.mark.parametrize("stack", sorted(EXPECTED))
def test_each_host_lets_in_exactly_the_ports_listed_by_hand(stack):
    assert set(EXPECTED) == set(STACKS), "every committed stack has its hand-written expectation"
    cfg = config(stack)
    assert {h.name for h in plan(cfg).hosts} == set(EXPECTED[stack])
    for host, want in EXPECTED[stack].items():
        items = listing(rules_of(cfg, host))
        (chain,) = [i["chain"] for i in items if "chain" in i]
        assert chain["hook"] == "input" and [i["rule"]["expr"] for i in items if "rule" in i][-1] == [{"drop": None}]
        got, refused = what_gets_in(items)
        assert got == want, (stack, host)
        # glm-infra's own ports answer "refused" to the rest; SSH does not (it drops like the rest).
        assert refused == set().union(*want.values()) - {22}, (stack, host)


def test_hosts_without_pools_open_what_they_run():
    """Hosts (no vLLM, no router): the weights relay on the seed, the exporters, Prometheus and
    Alertmanager where monitoring.host puts them; none of the instances' ports."""
    cfg = config("prod-b300")
    p = plan(cfg, False)
    want = {"b300-1": EXPORTERS | RELAY | MONITORING, "b300-2": EXPORTERS, "b300-3": EXPORTERS}
    for host, port_set in want.items():
        got, _ = what_gets_in(listing(firewall.ruleset(cfg, p, host)))
        assert got == {frozenset(PROD_HOSTS): port_set, frozenset(PROD_HOSTS | ADMINS): {22}}, host


def test_the_file_says_what_listens_on_each_port():
    """The ruleset is reviewed (glm-infra render): each group of ports names what listens there."""
    lines = rules_of(config("prod-b300"), "b300-3").splitlines()
    for comment in ("# ssh: sshd on 22",
                    "# peers: DCGM exporter, decode-0 dp-rpc, decode-0 http, decode-0 nixl, node exporter, "
                    "router metrics",
                    "# router: router http"):
        assert f"\t\t{comment}" in lines, comment
    assert "\t\t# operators: alertmanager, prometheus" in rules_of(config("prod-b300"), "b300-1").splitlines()


def test_every_stack_loads_without_network_or_dns():
    """The unit loads the table before the network is up: every committed stack's table loads in a
    namespace with no route and no resolver."""
    for stack in STACKS:
        cfg = config(stack)
        for h in plan(cfg).hosts:
            p = nft_alone(rules_of(cfg, h.name), "true")
            assert p.returncode == 0, (stack, h.name, p.stderr)


# --- in network namespaces: what gets through ----------------------------------------------------

@pytest.fixture
def lab():
    """``lab(server, *clients)``: two network namespaces joined by a veth pair, the server's address on
    one side and every client address on the other; both removed at the end."""
    if os.geteuid() != 0:
        pytest.fail("the firewall tests need root (ip netns, unshare), as CI runs them", pytrace=False)
    made: list[str] = []

    def make(server: str, *clients: str) -> tuple[str, str]:
        tag = uuid.uuid4().hex[:6]
        srv, cli = f"glmfw-s-{tag}", f"glmfw-c-{tag}"
        made.extend([srv, cli])
        cmds = [f"ip netns add {srv}", f"ip netns add {cli}",
                f"ip link add v{tag}s netns {srv} type veth peer name v{tag}c netns {cli}",
                f"ip -n {srv} addr add {server}/24 dev v{tag}s", f"ip -n {srv} link set v{tag}s up",
                f"ip -n {cli} link set v{tag}c up", f"ip -n {srv} link set lo up", f"ip -n {cli} link set lo up",
                *(f"ip -n {cli} addr add {c}/24 dev v{tag}c" for c in clients)]
        for c in cmds:
            subprocess.run(c.split(), check=True, capture_output=True)
        return srv, cli

    yield make
    for ns in made:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def load(ns: str, rules: str) -> None:
    p = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=rules, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


LISTEN = """import socket, sys, time
ss = []
for p in sys.argv[1:]:
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", int(p)))
    s.listen(64); ss.append(s)
print("ready", flush=True)
time.sleep(120)
"""

# Every port at once, non-blocking: answered (open), reset (refused), or no answer in 1 s (dropped).
PROBE = """import errno, json, select, socket, sys, time
src, dst, ports = sys.argv[1], sys.argv[2], sys.argv[3:]
pending, state = {}, {}
for p in ports:
    s = socket.socket(); s.setblocking(False); s.bind((src, 0)); s.connect_ex((dst, int(p))); pending[s] = int(p)
deadline = time.monotonic() + 1
while pending and time.monotonic() < deadline:
    _, ready, _ = select.select([], list(pending), [], max(0.0, deadline - time.monotonic()))
    for s in ready:
        err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        state[pending.pop(s)] = "open" if err == 0 else "refused" if err == errno.ECONNREFUSED else f"error {err}"
        s.close()
state.update({p: "dropped" for p in pending.values()})
print(json.dumps(state))
"""

# One ICMP echo (a raw socket: root), "answered" or "silent".
PING = """import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP); s.bind((sys.argv[1], 0)); s.settimeout(2)
s.sendto(bytes([8, 0, 0xf7, 0xfe, 0, 1, 0, 0]), (sys.argv[2], 0))
try:
    while s.recvfrom(64)[0][20] != 0:
        pass
    print("answered")
except TimeoutError:
    print("silent")
"""


class Listening:
    def __init__(self, ns: str, port_list: set[int]) -> None:
        self.proc = subprocess.Popen(["ip", "netns", "exec", ns, "python3", "-c", LISTEN, *map(str, sorted(port_list))],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"

    def __enter__(self) -> Listening:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()


def reach(ns: str, source: str, dest: str, port_list: set[int]) -> dict[int, str]:
    out = subprocess.run(["ip", "netns", "exec", ns, "python3", "-c", PROBE, source, dest, *map(str, sorted(port_list))],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return {int(p): s for p, s in json.loads(out.stdout).items()}


def states(result: dict[int, str]) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for port, state in result.items():
        out.setdefault(state, set()).add(port)
    return out


UNKNOWN = {2222, 7777}  # listeners no plan knows of


def test_b300_1_lets_its_peers_in_refuses_outsiders_and_drops_the_rest(lab):
    """prod-b300's b300-1 on its own addresses: b300-2 reaches every port listed by hand and SSH; an
    outsider (outside adminCidrs) gets "refused" on glm-infra's ports and no SSH; nobody gets a listener
    the plan does not know."""
    srv, cli = lab("10.0.0.11", "10.0.0.12", "10.0.0.50")
    load(srv, rules_of(config("prod-b300"), "b300-1"))
    theirs = PREFILL_2X_DP4 | EXPORTERS | RELAY
    with Listening(srv, theirs | {22} | UNKNOWN):
        assert states(reach(cli, "10.0.0.12", "10.0.0.11", theirs | {22} | UNKNOWN)) == {
            "open": theirs | {22}, "dropped": UNKNOWN}
        assert states(reach(cli, "10.0.0.50", "10.0.0.11", theirs | {22} | UNKNOWN)) == {
            "refused": theirs, "dropped": {22} | UNKNOWN}
        # The ports next to them are not the plan's: dropped for a peer too (no reset, although nothing
        # listens there).
        assert set(reach(cli, "10.0.0.12", "10.0.0.11", {5599, 5608, 8089, 8102, 29552}).values()) == {"dropped"}


SERVER, PEER, ADMIN, OUTSIDER, CLIENT = "10.99.0.13", "10.99.0.11", "10.99.0.60", "10.99.0.50", "10.99.0.70"


def sim_like(**firewall_keys) -> object:
    """The sim stack on the test's own addresses (10.99.0.0/24), the router's public port and the
    monitoring open to CLIENT, SSH to ADMIN."""
    r = raw("sim")
    for i, h in enumerate(r["hosts"]):
        h["address"] = f"10.99.0.1{i + 1}"
    r["router"]["allowedCidrs"] = [f"{CLIENT}/32"]
    r["monitoring"]["allowedCidrs"] = [f"{CLIENT}/32"]
    r["firewall"] = {"adminCidrs": [f"{ADMIN}/32"], **firewall_keys}
    return load_dict(r, "test").config


def test_sim_3_ssh_from_admins_public_ports_from_their_cidrs_nothing_else(lab):
    srv, cli = lab(SERVER, PEER, ADMIN, OUTSIDER, CLIENT)
    internal = DECODE_DP8 | EXPORTERS | ROUTER_PRIVATE
    public = {8000} | MONITORING
    cfg = sim_like()
    load(srv, rules_of(cfg, "sim-3"))
    every = internal | public | {22} | UNKNOWN
    with Listening(srv, every):
        assert states(reach(cli, PEER, SERVER, every)) == {"open": internal | public | {22}, "dropped": UNKNOWN}
        assert states(reach(cli, ADMIN, SERVER, every)) == {"open": {22}, "refused": internal | public,
                                                            "dropped": UNKNOWN}
        assert states(reach(cli, CLIENT, SERVER, every)) == {"open": public, "refused": internal,
                                                             "dropped": {22} | UNKNOWN}
        assert states(reach(cli, OUTSIDER, SERVER, every)) == {"refused": internal | public,
                                                               "dropped": {22} | UNKNOWN}
        # Loopback passes whatever the port; so do the replies to a connection the host makes, and ICMP.
        assert set(reach(srv, "127.0.0.1", "127.0.0.1", UNKNOWN).values()) == {"open"}
        with Listening(cli, {7000}):
            assert reach(srv, SERVER, OUTSIDER, {7000}) == {7000: "open"}
        ping = subprocess.run(["ip", "netns", "exec", cli, "python3", "-c", PING, OUTSIDER, SERVER],
                              capture_output=True, text=True, timeout=10)
        assert ping.stdout.strip() == "answered", ping.stderr
        # Flushed by hand (its rules gone, its chain kept): the host is not cut off, SSH included.
        subprocess.run(["ip", "netns", "exec", srv, "nft", "flush", "table", "inet", "glm_infra"], check=True)
        assert reach(cli, OUTSIDER, SERVER, {22}) == {22: "open"}


def test_ssh_is_open_to_every_address_only_when_the_stack_says_so(lab):
    """0.0.0.0/0 and ::/0 in adminCidrs (said on purpose; validate warns): the table loads and an outsider
    gets SSH, still nothing the plan does not know. Unset, validate refuses the stack; a config that
    reached the firewall without it anyway would let the stack's hosts only, never everyone."""
    srv, cli = lab(SERVER, OUTSIDER)
    r = raw("sim")
    for i, h in enumerate(r["hosts"]):
        h["address"] = f"10.99.0.1{i + 1}"
    r["firewall"] = {"adminCidrs": ["0.0.0.0/0", "::/0"]}
    cfg = load_dict(r, "test").config
    load(srv, rules_of(cfg, "sim-3"))
    with Listening(srv, {22, 7777}):
        assert reach(cli, OUTSIDER, SERVER, {22, 7777}) == {22: "open", 7777: "dropped"}
    got, _ = what_gets_in(listing(rules_of(cfg, "sim-3")))
    assert got[frozenset({"0.0.0.0/0", "::/0"})] == {22}
    del r["firewall"]
    with pytest.raises(StackError, match="glm-infra:firewall.adminCidrs: not set"):
        load_dict(r, "test")
    unset = cfg.model_copy(update={"firewall": cfg.firewall.model_copy(update={"admin_cidrs": None})})
    got, _ = what_gets_in(listing(rules_of(unset, "sim-3")))
    assert ANYONE not in got and 22 in got[frozenset({f"10.99.0.1{i}/32" for i in (1, 2, 3)})], got


def test_ssh_opens_on_the_hosts_own_port():
    r = raw("prod-b300")
    r["hosts"][0]["sshPort"] = 2201
    r["firewall"] = {"adminCidrs": ["192.0.2.0/24"]}
    cfg = load_dict(r, "test").config
    got, _ = what_gets_in(listing(rules_of(cfg, "b300-1")))
    assert got[frozenset(PROD_HOSTS | {"192.0.2.0/24"})] == {2201}
    got, _ = what_gets_in(listing(rules_of(cfg, "b300-2")))
    assert got[frozenset(PROD_HOSTS | {"192.0.2.0/24"})] == {22}


def test_a_cidr_around_the_hosts_still_loads():
    """A CIDR that holds the stack's hosts (and an IPv6 host): one interval set cannot hold both the
    network and an address inside it (nft: "conflicting intervals"), so the table keeps the network."""
    r = one_router(raw("prod-b300"))  # (a router host speaks VRRP over IPv4 only)
    r["hosts"][2]["address"] = "2001:db8::13"
    r["router"]["allowedCidrs"] = ["10.0.0.0/24", "10.0.0.12/32", "2001:db8::/64"]
    r["monitoring"] = {"allowedCidrs": ["10.0.0.0/16"]}
    cfg = load_dict(r, "test").config
    got, _ = what_gets_in(listing(rules_of(cfg, "b300-3")))
    assert got[frozenset({"10.0.0.0/24", "2001:db8::/64"})] == {8000}
    assert got[frozenset({"10.0.0.0/16", "2001:db8::13/128"})] == MONITORING
    assert got[frozenset({"10.0.0.11/32", "10.0.0.12/32", "2001:db8::13/128"})] == DECODE_DP8 | EXPORTERS | ROUTER_PRIVATE
    r["firewall"] = {"adminCidrs": ["10.0.0.0/8", "10.0.0.11"]}
    cfg = load_dict(r, "test").config
    got, _ = what_gets_in(listing(rules_of(cfg, "b300-3")))
    assert got[frozenset({"10.0.0.0/8", "2001:db8::13/128"})] == {22}


def test_the_table_follows_the_plan_and_is_the_only_thing_it_owns():
    cfg = config("prod-b300")
    rules = rules_of(cfg, "b300-1")
    assert rules.count("table inet glm_infra {") == 1 and "delete table inet glm_infra\n" in rules
    assert "flush ruleset" not in rules and [i for i in listing(rules) if "table" in i][0]["table"]["name"] == "glm_infra"
    # A host added to the stack: every host lets it in.
    r = raw("prod-b300")
    r["hosts"].append({"name": "b300-4", "address": "10.0.0.14", "computeNics": ["mlx5_0"]})
    more = load_dict(r, "test").config
    got, _ = what_gets_in(listing(rules_of(more, "b300-1")))
    assert got[frozenset(PROD_HOSTS | {"10.0.0.14/32"})] == PREFILL_2X_DP4 | EXPORTERS | RELAY | WARM_CACHE | MONITORING


def test_the_weights_relay_port_is_open_only_where_a_host_has_relay_children():
    cfg = config("prod-b300")  # serving b300-1 (seed) → b300-2, b300-3: both leaves
    opened = {h.name for h in plan(cfg).hosts if RELAY <= what_gets_in(listing(rules_of(cfg, h.name)))[0][
        frozenset(PROD_HOSTS)]}
    assert opened == {"b300-1"}
    local = cfg.model_copy(update={"model": cfg.model.model_copy(update={"source": "local"})})
    got, _ = what_gets_in(listing(rules_of(local, "b300-1")))
    assert got[frozenset(PROD_HOSTS)] == PREFILL_2X_DP4 | EXPORTERS | WARM_CACHE | MONITORING


# --- the step: the live table against the plan ------------------------------------------------------

HOST_DIRS = ["/etc/glm-infra", "/etc/systemd/system", "/var/lib/glm-infra", "/usr/local/libexec/glm-infra"]


@pytest.fixture
def host(lab, tmp_path):
    """b300-1 of prod-b300 in a network namespace and a mount namespace of the test's own: the step's
    script with the real nft, a stub systemctl whose (re)start and reload run the unit's nft command,
    and the folders it writes bound to temporary ones."""
    srv, _ = lab("10.0.0.11", "10.0.0.12")
    cfg = config("prod-b300")
    script = hostplan.plan_all(cfg, plan(cfg), stack_name="prod-b300")["b300-1"].steps["firewall"].stdin
    stubs = StubPath(tmp_path / "stubs")
    stubs.add("dpkg-query", '[ "${!#}" = nftables ] && echo "install ok installed"')  # nftables only
    stubs.add("apt-get", "exit 1")
    # systemd's part: the unit glm-infra-firewall, whose start and reload run its ExecStart (nft -f).
    stubs.add("systemctl", '''if [ "$*" = "show -p DropInPaths --value nftables.service" ]; then  # systemd's view: what is on disk
  ls /etc/systemd/system/nftables.service.d/*.conf 2>/dev/null | tr '\\n' ' '; echo; exit 0
fi
[ "${!#}" = glm-infra-firewall ] || { [ "$1" = daemon-reload ] && exit 0; echo "no unit ${!#}" >&2; exit 5; }
case "$1" in
  restart|reload-or-restart|reload) /usr/sbin/nft -f /etc/glm-infra/firewall.nft && touch "$STATE/active" ;;
  is-active) [ -e "$STATE/active" ] ;;
  enable) ;;
  *) exit 1 ;;
esac''')
    (tmp_path / "script.sh").write_text(script)

    def run(*args: str):
        binds = []
        for d in HOST_DIRS:
            src = tmp_path / "root" / d.lstrip("/")
            src.mkdir(parents=True, exist_ok=True)
            binds.append(f"mkdir -p {d} && mount --bind {shlex.quote(str(src))} {d}")
        inner = " && ".join([*binds, f"exec bash {tmp_path / 'script.sh'} {' '.join(args)}"])
        return stubs.run(f"exec ip netns exec {srv} unshare --mount --propagation private bash -c {shlex.quote(inner)}\n",
                         env={"PATH": f"{stubs.bin}:/usr/sbin:/usr/bin:/sbin:/bin"})

    def nft(*args: str) -> str:
        return subprocess.run(["ip", "netns", "exec", srv, "nft", *args], check=True, capture_output=True,
                              text=True).stdout

    return run, nft


def test_the_step_loads_the_table_and_its_check_sees_it_flushed_and_apply_loads_it_again(host):
    run, nft = host
    r = run("apply")
    assert r.returncode == 0, r.stderr
    assert "b300-1: firewall: glm-infra-firewall running" in r.stdout, r.stdout
    assert run("check").returncode == 0
    nft("flush", "table", "inet", "glm_infra")
    r = run("check")
    assert r.returncode == 1 and "the table inet glm_infra is not the one glm-infra renders" in r.stderr, r.stderr
    # apply: the table comes back, by a reload (a restart would restart every vLLM unit, which require it).
    r = run("apply")
    assert r.returncode == 0, r.stderr
    assert [c for c in r.calls if "start" in c or "reload" in c or "stop" in c] == [
        "systemctl daemon-reload", "systemctl reload-or-restart glm-infra-firewall"]
    assert run("check").returncode == 0
    # Deleted by hand: found; and loaded again.
    nft("delete", "table", "inet", "glm_infra")
    r = run("check")
    assert r.returncode == 1 and "the table inet glm_infra is not loaded" in r.stderr, r.stderr
    assert run("apply").returncode == 0 and run("check").returncode == 0


def test_the_drop_in_for_nftables_service_is_checked_as_systemd_runs_it(host, tmp_path):
    """The drop-in that loads the table again after nftables.service flushes it: systemd must run it;
    removed (and daemon-reloaded), the check says so and apply writes it again."""
    run, _ = host
    assert run("apply").returncode == 0 and run("check").returncode == 0
    dropin = tmp_path / "root" / firewall.NFTABLES_DROPIN.lstrip("/")
    assert dropin.read_text() == firewall.nftables_dropin()
    dropin.unlink()
    r = run("check")
    assert r.returncode == 1 and (f"b300-1: firewall: systemd runs nftables.service without {firewall.NFTABLES_DROPIN} "
                                  "(its drop-ins: none): a restart, stop, start or reload of it would leave the "
                                  "table inet glm_infra flushed") in r.stderr, r.stderr
    assert run("apply").returncode == 0 and dropin.read_text() == firewall.nftables_dropin()
    assert run("check").returncode == 0
    # destroy: the drop-in and its folder go with the rest.
    r = run("remove")
    assert r.returncode == 0, r.stderr
    assert not dropin.exists() and not dropin.parent.exists()


# --- the distribution's nftables.service, as systemd runs it with glm-infra's drop-in ---------------

NFTABLES = Path(__file__).parent / "fixtures" / "nftables"  # Debian 12's package (CAPTURES-SOURCES.md)
DEBIAN_UNIT = NFTABLES / "debian-12-nftables-1.0.6-2+deb12u2.service"
DEBIAN_CONF = NFTABLES / "debian-12-nftables-1.0.6-2+deb12u2.conf"


def service_commands(*texts: str) -> dict[str, list[str]]:
    """The Exec*= lists of a unit's [Service] section and its drop-ins, merged as systemd does: each
    assignment appends, an empty one empties the list."""
    out: dict[str, list[str]] = {}
    for text in texts:
        section = ""
        for line in text.splitlines():
            if line.startswith("["):
                section = line
            elif section == "[Service]" and line.startswith("Exec") and "=" in line:
                key, value = line.split("=", 1)
                out[key] = out.get(key, []) + [value] if value else []
    return out


def systemd_runs(commands: dict[str, list[str]], action: str, run) -> None:
    """``action`` (start, stop, restart, reload) as systemd runs a Type=oneshot unit's commands, in order:
    a command that fails (without ``-``) ends its phase, and a failed start runs ExecStopPost."""

    def phase(keys: list[str]) -> bool:
        for key in keys:
            for c in commands.get(key, []):
                if run(shlex.split(c.lstrip("-"))) != 0 and not c.startswith("-"):
                    return False
        return True

    if action in ("stop", "restart"):
        phase(["ExecStop"])
        phase(["ExecStopPost"])  # whether ExecStop failed or not
    if action in ("start", "restart") and not phase(["ExecStartPre", "ExecStart", "ExecStartPost"]):
        phase(["ExecStopPost"])
    if action == "reload":
        phase(["ExecReload"])


@pytest.fixture
def nftables_service(lab, tmp_path):
    """b300-1's table loaded in a namespace; ``act(action, firewall_active=True)`` runs Debian 12's
    nftables.service for that action with glm-infra's drop-in, its files where the host has them
    (/etc/nftables.conf: the package's default ruleset, which flushes everything)."""
    srv, _ = lab("10.0.0.11", "10.0.0.12")
    rules = rules_of(config("prod-b300"), "b300-1")
    (tmp_path / "firewall.nft").write_text(rules)
    load(srv, rules)
    stubs = StubPath(tmp_path / "stubs")
    stubs.add("systemctl", f'[ "$*" = "is-active --quiet {firewall.UNIT}" ] && [ -e "$STATE/firewall-active" ]')
    commands = service_commands(DEBIAN_UNIT.read_text(), firewall.nftables_dropin())
    where = {"/etc/nftables.conf": str(DEBIAN_CONF), firewall.RULESET: str(tmp_path / "firewall.nft")}
    env = {**os.environ, "PATH": f"{stubs.bin}:/usr/sbin:/usr/bin:/sbin:/bin", "STATE": str(stubs.state),
           "STUB_LOG": str(stubs.log)}

    def run(argv: list[str]) -> int:
        argv = [where.get(a, a) for a in argv]
        if argv[:2] == ["/bin/sh", "-c"]:
            for path, there in where.items():
                argv[2] = argv[2].replace(path, there)
        return subprocess.run(["ip", "netns", "exec", srv, *argv], env=env, capture_output=True, timeout=30).returncode

    def act(action: str, firewall_active: bool = True) -> None:
        (stubs.state / "firewall-active").unlink(missing_ok=True)
        if firewall_active:
            (stubs.state / "firewall-active").touch()
        systemd_runs(commands, action, run)

    def tables() -> str:
        return subprocess.run(["ip", "netns", "exec", srv, "nft", "list", "tables"], capture_output=True, text=True,
                              check=True).stdout

    def live() -> subprocess.CompletedProcess:
        script = tmp_path / "firewall-live.sh"
        script.write_text(firewall.live_script())
        return subprocess.run(["ip", "netns", "exec", srv, "bash", str(script)], input=rules, capture_output=True,
                              text=True, timeout=30)

    return act, tables, live


def test_debian_nftables_service_flushes_the_table_on_each_action():
    """What the drop-in is for: every command Debian 12's nftables.service runs flushes the whole ruleset."""
    commands = service_commands(DEBIAN_UNIT.read_text())
    assert commands == {"ExecStart": ["/usr/sbin/nft -f /etc/nftables.conf"],
                        "ExecReload": ["/usr/sbin/nft -f /etc/nftables.conf"],
                        "ExecStop": ["/usr/sbin/nft flush ruleset"]}
    assert DEBIAN_CONF.read_text().splitlines()[2] == "flush ruleset"


@pytest.mark.parametrize("actions", [["restart"], ["stop"], ["stop", "start"], ["reload"],
                                     ["restart", "reload", "stop", "start", "restart"]],
                         ids=["restart", "stop", "start", "reload", "all"])
def test_whatever_nftables_service_does_the_table_is_loaded_again_right_after(nftables_service, actions):
    """Issue 38: ``ReloadPropagatedFrom=nftables.service`` covered reloads only; ``systemctl restart nftables``
    (its ExecStop and ExecStart flush the ruleset) left every port unfiltered while glm-infra's unit stayed
    active. With the drop-in the table is back after each action, as glm-infra renders it."""
    act, tables, live = nftables_service
    for action in actions:
        act(action)
        assert "table inet glm_infra" in tables(), (action, tables())
        p = live()
        assert p.returncode == 0, (action, p.stdout, p.stderr)
    if actions[-1] in ("start", "restart", "reload"):
        assert "table inet filter" in tables(), "the distribution's own ruleset is loaded too"


def test_with_the_firewall_unit_stopped_nftables_service_leaves_the_table_out(nftables_service):
    """glm-infra's unit owns the table: stopped (or not yet started at boot, when nftables.service runs
    first), nftables.service's commands load nothing of glm-infra's."""
    act, tables, _ = nftables_service
    act("restart", firewall_active=False)
    assert "glm_infra" not in tables() and "table inet filter" in tables()
    act("reload", firewall_active=True)
    assert "table inet glm_infra" in tables()


@pytest.fixture
def live(lab, tmp_path):
    """The live check alone, in a namespace holding b300-1's table: its exit status and message."""
    srv, _ = lab("10.0.0.11", "10.0.0.12")
    rules = rules_of(config("prod-b300"), "b300-1")
    load(srv, rules)
    script = tmp_path / "firewall-live.sh"
    script.write_text(firewall.live_script())

    def check(expected: str = rules, path: str | None = None, args: list[str] = ()) -> subprocess.CompletedProcess:
        env = {**os.environ, "PATH": path} if path else None
        return subprocess.run(["ip", "netns", "exec", srv, "bash", str(script), *args], input=expected,
                              capture_output=True, text=True, timeout=30, env=env)

    def nft(*args: str) -> str:
        return subprocess.run(["ip", "netns", "exec", srv, "nft", *args], check=True, capture_output=True,
                              text=True).stdout

    return check, nft


NOT_RENDERED = "the table inet glm_infra is not the one glm-infra renders"


def test_the_live_check_passes_the_table_as_rendered(live):
    check, _ = live
    p = check()
    assert p.returncode == 0 and p.stdout == p.stderr == "", p


@pytest.mark.parametrize("edit", [
    ["flush", "table", "inet", "glm_infra"],
    ["delete", "element", "inet", "glm_infra", "peers_v4", "{ 10.0.0.12 }"],
    ["add", "element", "inet", "glm_infra", "peers_v4", "{ 10.0.0.99 }"],
    ["flush", "chain", "inet", "glm_infra", "input"],
    ["add", "rule", "inet", "glm_infra", "input", "tcp", "dport", "7777", "accept"],
    ["insert", "rule", "inet", "glm_infra", "input", "accept"],
    ["chain", "inet", "glm_infra", "input", "{ policy drop; }"],
], ids=["flushed", "element-deleted", "element-added", "chain-flushed", "rule-added", "rule-first", "policy-drop"])
def test_the_live_check_fails_a_table_changed_by_hand(live, edit):
    check, nft = live
    nft(*edit)
    p = check()
    assert p.returncode == 1 and NOT_RENDERED in p.stderr, p


def handle_of(nft, fragment: str) -> int:
    """The handle of the first rule of the live table whose JSON holds ``fragment``."""
    items = json.loads(nft("-j", "list", "table", "inet", "glm_infra"))["nftables"]
    return next(i["rule"]["handle"] for i in items if "rule" in i and fragment in json.dumps(i["rule"]))


def test_the_live_check_fails_an_edited_rule(live):
    """The peers' rule with one NIXL side-channel port fewer, in place (same rule, same position)."""
    check, nft = live
    port_list = ", ".join(str(p) for p in sorted(PREFILL_2X_DP4 - {5603} | EXPORTERS | RELAY))
    nft("replace", "rule", "inet", "glm_infra", "input", "handle", str(handle_of(nft, "@peers_v4")),
        "tcp", "dport", f"{{ {port_list} }}", "ip", "saddr", "@peers_v4", "accept")
    p = check()
    assert p.returncode == 1 and NOT_RENDERED in p.stderr and "5603" in p.stderr, p


def test_the_live_check_fails_the_same_rules_in_another_order(live):
    check, nft = live
    nft("delete", "rule", "inet", "glm_infra", "input", "handle", str(handle_of(nft, '"established"')))
    nft("add", "rule", "inet", "glm_infra", "input", "ct", "state", "established,related", "accept")
    p = check()
    assert p.returncode == 1 and f"{NOT_RENDERED} (flushed or edited by hand?): its rules are in another order" in p.stderr, p


def test_the_live_check_fails_without_the_last_drop(live):
    check, nft = live
    nft("delete", "rule", "inet", "glm_infra", "input", "handle", str(handle_of(nft, '"drop": null')))
    p = check()
    assert p.returncode == 1 and NOT_RENDERED in p.stderr and '"drop"' in p.stderr, p


def test_the_live_check_fails_a_deleted_table(live):
    check, nft = live
    nft("delete", "table", "inet", "glm_infra")
    p = check()
    assert p.returncode == 1 and "the table inet glm_infra is not loaded" in p.stdout, p


def test_the_live_check_refuses_an_empty_or_unloadable_expectation(live):
    check, _ = live
    p = check("")
    assert p.returncode == 1 and "empty input" in p.stdout, p
    p = check("table inet glm_infra { set x { type ipv4_addr; elements = { b300-3.example.com } } }\n")
    assert p.returncode == 1 and "does not load on its own" in p.stdout, p


@pytest.mark.parametrize("dropins, load_state, ok", [
    (firewall.NFTABLES_DROPIN, "loaded", True),
    (f"/usr/lib/systemd/system/nftables.service.d/x.conf {firewall.NFTABLES_DROPIN}", "loaded", True),
    ("", "loaded", False),
    (f"{firewall.NFTABLES_DROPIN}.off", "loaded", False),
    ("", "masked", True),  # it cannot run: nothing of it flushes the ruleset
    ("", "not-found", False),
], ids=["loaded", "among-others", "none", "another-name", "masked", "not-found"])
def test_the_live_check_reads_which_drop_ins_systemd_runs_nftables_service_with(live, tmp_path, dropins, load_state, ok):
    check, _ = live
    stubs = StubPath(tmp_path / "stubs")
    stubs.add("systemctl", f'''case "$*" in
  "show -p DropInPaths --value nftables.service") echo {shlex.quote(dropins)} ;;
  "show -p LoadState --value nftables.service") echo {load_state} ;;
  *) exit 1 ;;
esac''')
    p = check(path=f"{stubs.bin}:/usr/sbin:/usr/bin:/sbin:/bin", args=[firewall.NFTABLES_DROPIN])
    assert (p.returncode == 0) == ok, p
    if not ok:
        assert (f"systemd runs nftables.service without {firewall.NFTABLES_DROPIN} (its drop-ins: {dropins or 'none'}): "
                "a restart, stop, start or reload of it would leave the table inet glm_infra flushed") in p.stdout, p


def test_the_step_and_its_check_script_are_shellcheck_clean(tmp_path):
    cfg = config("sim")
    step = hostplan.plan_all(cfg, plan(cfg), stack_name="sim")["sim-1"].steps["firewall"]
    for name, text in (("firewall.sh", step.stdin), ("firewall-live.sh", firewall.live_script())):
        r = shellcheck(text, tmp_path, name)
        assert r.returncode == 0, f"{name}\n{r.stdout}"


def test_the_firewall_step_checks_its_table_and_can_be_turned_off():
    cfg = config("sim")
    hs = hostplan.plan_all(cfg, plan(cfg), stack_name="sim")["sim-1"]
    names = list(hs.steps)
    assert names.index("drivers-back") < names.index("firewall") < names.index("health-gate")
    step = hs.steps["firewall"]
    files = {f.path: f for f in step.files}
    assert files[firewall.LIVE].mode == 0o755 and files[firewall.LIVE].content == firewall.live_script()
    assert files[firewall.RULESET].content == rules_of(cfg, "sim-1")
    assert files["/etc/systemd/system/glm-infra-firewall.service"].content == firewall.unit()
    assert f"content {firewall.RULESET} | {firewall.LIVE}" in step.stdin and "nft -c -f /etc/glm-infra/firewall.nft" in step.stdin
    r = raw("sim")
    r["firewall"] = {"enabled": False}
    off = load_dict(r, "test").config
    assert all("firewall" not in h.steps for h in hostplan.plan_all(off, plan(off), stack_name="sim").values())


# --- DNS names: refused where nft would have to resolve them -------------------------------------

def test_a_host_named_by_dns_is_refused_naming_its_key(write_stack):
    c = one_router(stack_config("prod-b300"))  # (a router host named by DNS is refused for VRRP too)
    c["glm-infra:hosts"][2]["address"] = "b300-3.example.com"
    with pytest.raises(StackError) as e:
        load_file(write_stack(c))
    assert ("glm-infra:hosts[2].address: 'b300-3.example.com' is a DNS name; with the firewall on "
            "(glm-infra:firewall.enabled) a host's address must be an IP address: nft resolves names when it loads "
            "the table, at boot before the network is up, so the table would not load") in str(e.value)
    assert len(e.value.problems) == 1
    # Without the firewall the name is fine (SSH and the router resolve it when they connect).
    c["glm-infra:firewall"] = {"enabled": False}
    assert load_file(write_stack(c)).config.hosts[2].address == "b300-3.example.com"


def test_a_dns_name_never_reaches_the_ruleset():
    """A name given later (a component's Output) is validated again, and the renderer refuses it too."""
    r = one_router(raw("prod-b300"))
    r["firewall"] = {"enabled": False}
    r["hosts"][1]["address"] = "b300-2.example.com"
    cfg = load_dict(r, "test").config
    on = cfg.model_copy(update={"firewall": cfg.firewall.model_copy(update={"enabled": True})})
    with pytest.raises(ValueError, match="'b300-2.example.com' is not an IP address or network"):
        rules_of(on, "b300-1")


@pytest.mark.parametrize("value, message", [
    (["10.0.0.0/33"], "glm-infra:firewall.adminCidrs[0]: '10.0.0.0/33' is not an address or network"),
    (["bastion.example.com"], "glm-infra:firewall.adminCidrs[0]: 'bastion.example.com' is not an address or network"),
    ([], "glm-infra:firewall.adminCidrs: List should have at least 1 item"),
])
def test_admin_cidrs_are_networks(write_stack, value, message):
    c = stack_config("prod-b300")
    c["glm-infra:firewall"] = {"adminCidrs": value}
    with pytest.raises(StackError) as e:
        load_file(write_stack(c))
    assert message in str(e.value)


def test_a_bad_cidr_is_named(write_stack):
    c = stack_config("prod-b300")
    c["glm-infra:router"]["allowedCidrs"] = ["10.0.0.0/33"]
    with pytest.raises(StackError) as e:
        load_file(write_stack(c))
    assert "glm-infra:router.allowedCidrs[0]: '10.0.0.0/33' is not an address or network" in str(e.value)


# --- the units: nothing listens before the table, the table before the network --------------------

def test_vllm_and_the_router_require_the_firewall_unit():
    cfg = config("prod-b300")
    p = plan(cfg)
    units = [vllm.vllm_unit(cfg, i) for i in p.instances] + [router.router_unit(cfg, p)]
    for u in units:
        lines = u.split("\n[Service]")[0].splitlines()
        assert f"Requires={firewall.UNIT}" in lines and f"After={firewall.UNIT}" in lines, u
    r = raw("prod-b300")
    r["firewall"] = {"enabled": False}
    off = load_dict(r, "test").config
    po = plan(off)
    for u in [vllm.vllm_unit(off, i) for i in po.instances] + [router.router_unit(off, po)]:
        assert firewall.UNIT not in u


SYSTEMD_KEYS = {"Unit": {"Description", "DefaultDependencies", "Wants", "After", "Before", "Conflicts"},
                "Service": {"Type", "RemainAfterExit", "ExecStart", "ExecReload", "ExecStop"},
                "Install": {"WantedBy"}}


def test_the_firewall_unit_loads_before_the_network_after_the_distributions_ruleset():
    lines = firewall.unit().splitlines()
    section = ""
    for line in lines:  # what systemd reads: comments, sections and the keys it knows there
        if line.startswith("["):
            section = line.strip("[]")
            assert section in SYSTEMD_KEYS, line
        elif line and not line.startswith("#"):
            assert line.split("=", 1)[0] in SYSTEMD_KEYS[section], line
    for line in ("DefaultDependencies=no", "Wants=network-pre.target", "Before=network-pre.target shutdown.target",
                 "After=nftables.service", "WantedBy=sysinit.target",
                 "Type=oneshot", "RemainAfterExit=yes", f"ExecStart=/usr/sbin/nft -f {firewall.RULESET}",
                 f"ExecReload=/usr/sbin/nft -f {firewall.RULESET}", "ExecStop=-/usr/sbin/nft delete table inet glm_infra"):
        assert line in lines, line
    assert not any("network-online" in x or "nss-lookup" in x for x in lines), "no DNS, no network at load"


def test_the_drop_in_loads_the_table_after_each_of_nftables_services_commands_and_restarts_nothing():
    """Not PartOf= nor anything that restarts glm-infra-firewall.service: the vLLM and router units require
    it, and would restart with it."""
    lines = firewall.nftables_dropin().splitlines()
    keys = [line.split("=", 1)[0] for line in lines if line and not line.startswith(("#", "["))]
    assert lines[2] == "[Service]" and sorted(keys) == ["ExecReload", "ExecStartPost", "ExecStopPost"]
    load_again = ("/bin/sh -c 'if systemctl is-active --quiet glm-infra-firewall.service; then "
                  "exec /usr/sbin/nft -f /etc/glm-infra/firewall.nft; fi'")
    assert all(line.split("=", 1)[1] == load_again for line in lines[3:]), lines
    assert firewall.NFTABLES_DROPIN == "/etc/systemd/system/nftables.service.d/glm-infra.conf"
    for text in (firewall.unit(), firewall.nftables_dropin()):
        read = [line for line in text.splitlines() if not line.startswith("#")]  # what systemd reads
        assert not any(k in line for line in read for k in ("PartOf=", "BindsTo=", "Propagate", "restart")), read
