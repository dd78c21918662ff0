"""Two routers behind one address (issue 40): router.standbyHosts and router.virtualAddress, from the stack
file to what reaches each router host (keepalived, the fronts that pass requests to each other, the drain
around a router restart, the shared CA, the firewall's VRRP rule, the scrape targets)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time

import pytest
from pulumi_harness import run_program
from stubs import StubPath, in_root, isolated
from test_monitoring import PROMTOOL_TESTS, run, tools  # noqa: F401  (tools: the promtool fixture)

from glm_infra import hostplan
from glm_infra.plan.topology import plan
from glm_infra.roles import firewall
from glm_infra.roles import router as router_role
from glm_infra.roles import monitoring
from glm_infra.roles.monitoring import scrape_configs
from glm_infra.roles.router import ha
from glm_infra.spec import paths
from glm_infra.stack import StackError, load_file

CMD = "command:remote:Command"
VIP = "10.0.0.10"


def ha_config(prod_config: dict, **router) -> dict:
    prod_config["glm-infra:router"].update({"standbyHosts": ["b300-2"], "virtualAddress": VIP, **router})
    return prod_config


@pytest.fixture
def ha_stack(prod_config, write_stack):
    return load_file(write_stack(ha_config(prod_config))).config


@pytest.mark.parametrize("router, key, reason", [
    ({"virtualAddress": None}, "glm-infra:router.virtualAddress", "needs the address clients use"),
    ({"standbyHosts": ["b300-9"]}, "glm-infra:router.standbyHosts[0]", "unknown host 'b300-9'"),
    ({"standbyHosts": ["b300-3"]}, "glm-infra:router.standbyHosts[0]", "already runs a router"),
    ({"standbyHosts": ["b300-2", "b300-2"]}, "glm-infra:router.standbyHosts[1]", "already runs a router"),
    ({"virtualAddress": "10.0.0.12"}, "glm-infra:router.virtualAddress", "is b300-2's own address"),
    ({"virtualAddress": "fd00::10"}, "glm-infra:router.virtualAddress", "not an IPv4 address"),
    ({"vrrpRouterId": 0}, "glm-infra:router.vrrpRouterId", "greater than or equal to 1"),
])
def test_a_bad_standby_or_virtual_address_is_refused_naming_the_key(prod_config, write_stack, router, key, reason):
    path = write_stack(ha_config(prod_config, **router))
    with pytest.raises(StackError) as err:
        load_file(path)
    assert str(path) in str(err.value) and f"{key}:" in str(err.value) and reason in str(err.value), str(err.value)


def test_a_router_host_named_by_dns_cannot_speak_vrrp(prod_config, write_stack):
    prod_config["glm-infra:firewall"] = {"enabled": False}  # (the firewall refuses DNS names on its own)
    prod_config["glm-infra:hosts"][1]["address"] = "b300-2.example.net"
    with pytest.raises(StackError, match=r"router host b300-2's address is 'b300-2.example.net'"):
        load_file(write_stack(ha_config(prod_config)))


def test_clients_use_the_virtual_address_and_every_router_host_runs_the_router(ha_stack, one_router_stack):
    p = plan(ha_stack)
    assert p.router.url == f"https://{VIP}:8000" and p.router.virtual
    assert p.router.host_names == ("b300-3", "b300-2") and p.router.roll_order() == ("b300-3", "b300-2")
    assert [h.name for h in p.hosts if h.runs_router] == ["b300-2", "b300-3"]
    assert [h.address for h in p.router.peers("b300-2")] == ["10.0.0.13"]
    # One router host: nothing moves, the address is the host's own (no keepalived, no peer).
    single = plan(one_router_stack).router
    assert single.url == "https://10.0.0.13:8000" and not single.virtual and single.peers("b300-3") == ()


def test_each_router_host_gets_the_router_its_front_and_keepalived_and_the_ca_goes_from_the_first(ha_stack):
    steps = hostplan.plan_all(ha_stack, plan(ha_stack), stack_name="prod-b300")
    for host in ("b300-3", "b300-2"):
        names = list(steps[host].steps)
        router_steps = [n for n in names if n.startswith("router-")]
        assert {"router-service", "router-gates", "router-canary", "router-front", "router-vrrp"} <= set(router_steps)
        assert router_steps[-1] == "router-vrrp", "keepalived after the front it checks"
        assert "canary-transition" in names
    first, other = list(steps["b300-3"].steps), list(steps["b300-2"].steps)
    assert first.index("router-front-tls") < first.index(ha.CA_EXPORT) and ha.CA_GIVEN not in first
    assert other.index(ha.CA_GIVEN) < other.index("router-front-tls") and ha.CA_EXPORT not in other
    export = steps["b300-3"].steps[ha.CA_EXPORT]
    assert export.secret and export.secret_output, "the CA's key travels only as a secret"
    tls = steps["b300-2"].steps["router-front-tls"].stdin
    assert f"take_ca\n" in tls and "make_ca\n" not in tls.split("case \"${1:-apply}\"")[1]
    # Every router host's certificate names the address clients use and each router host's own address.
    assert f"san=IP:{VIP},IP:10.0.0.13,IP:10.0.0.12\n" in tls


def test_a_front_passes_what_its_router_cannot_take_to_the_other_front_and_never_back(ha_stack, one_router_stack):
    p = plan(ha_stack)
    conf = router_role.router_front_conf(ha_stack, p, "b300-2")
    assert "listen 10.0.0.12:8000 ssl;" in conf and f"listen {VIP}:8000 ssl;" in conf
    # Its own router first (each try), then the other front as a backup: one more try than the router's.
    upstream = re.search(r"upstream glm_infra_router \{(.*?)\}", conf, re.S).group(1)
    assert upstream.count("server 127.0.0.1:8001 max_fails=0;") == 3 and "server 127.0.0.1:8002 backup;" in upstream
    assert "proxy_next_upstream_tries 4;" in conf
    peers = re.search(r"upstream glm_infra_peer_fronts \{(.*?)\}", conf, re.S).group(1)
    assert "server 10.0.0.13:8000" in peers and "10.0.0.12:8000" not in peers
    # Over TLS checked against glm-infra's CA, marked so the other front sends it to its own router only.
    assert f"proxy_ssl_trusted_certificate {paths.FRONT_CA};" in conf and "proxy_ssl_verify on;" in conf
    assert "proxy_set_header X-Glm-Infra-Peer 1;" in conf
    assert re.search(r'"00" glm_infra_router;\s+"01" glm_infra_router_drained;\s+default glm_infra_router_local;', conf)
    assert f"include {paths.FRONT_DRAIN_DIR}/*.conf;" in conf
    # One router host: the front is as it was, with no peer, no drain.
    single = one_router_stack
    plain = router_role.router_front_conf(single, plan(single))
    assert "backup" not in plain and "glm_infra_upstream" not in plain and "proxy_pass http://glm_infra_router;" in plain


def test_a_router_restart_drains_to_another_front_only_with_one(ha_stack, one_router_stack):
    p = plan(ha_stack)
    script = router_role.router_service_script(ha_stack, p, "b300-2")
    apply = script.split("\napply() {")[1].split("\n}\n")[0]
    assert apply.index("drain_begin") < apply.index("systemctl restart") < apply.index("wait_healthy") < apply.index(
        "drain_end")
    assert "https://10.0.0.13:8000/health" in script
    single = one_router_stack
    assert "drain_begin" not in router_role.router_service_script(single, plan(single))


def test_keepalived_speaks_to_the_other_router_hosts_only_and_the_firewall_lets_only_them_in(ha_stack, one_router_stack):
    p = plan(ha_stack)
    vrrp = hostplan.plan_all(ha_stack, p, stack_name="prod-b300")["b300-2"].steps["router-vrrp"].stdin
    assert "unicast_src_ip 10.0.0.12" in vrrp and re.search(r"unicast_peer \{\s+10.0.0.13\s+\}", vrrp)
    assert "nopreempt" in vrrp and f"{VIP}/32 dev $1" in vrrp and "virtual_router_id 51" in vrrp
    assert "priority 140" in vrrp  # router.host 150, the first standby 140
    assert "ip protocol vrrp ip saddr { 10.0.0.13 } accept" in firewall.ruleset(ha_stack, p, "b300-2")
    assert "vrrp" not in firewall.ruleset(ha_stack, p, "b300-1"), "a host without a router takes no advert"
    single = one_router_stack
    assert "vrrp" not in firewall.ruleset(single, plan(single), "b300-3")


def test_prometheus_scrapes_each_router_on_its_own_address(ha_stack):
    job = next(j for j in scrape_configs(ha_stack, plan(ha_stack), "prod-b300") if j["job_name"] == "vllm-router")
    assert [(g["targets"], g["labels"]["host"]) for g in job["static_configs"]] == [
        (["10.0.0.13:29000"], "b300-3"), (["10.0.0.12:29000"], "b300-2")]


def test_the_rendered_scripts_are_shellcheck_clean(ha_stack, tmp_path):
    steps = hostplan.plan_all(ha_stack, plan(ha_stack), stack_name="prod-b300")
    for host in ("b300-3", "b300-2"):
        for name in ("router-vrrp", "router-service", "router-front", "router-front-tls"):
            script = tmp_path / f"{host}-{name}.sh"
            script.write_text(steps[host].steps[name].stdin)
            p = subprocess.run(["venv/bin/shellcheck", "-s", "bash", str(script)], capture_output=True, text=True)
            assert p.returncode == 0, p.stdout
        # The scripts keepalived runs, as written on the host.
        for fn in ("check_source", "notify_source"):
            body = vrrp_file(ha_stack, host, fn)
            script = tmp_path / f"{host}-{fn}.sh"
            script.write_text(body)
            p = subprocess.run(["venv/bin/shellcheck", str(script)], capture_output=True, text=True)
            assert p.returncode == 0, p.stdout


def vrrp_file(ha_stack, host: str, fn: str) -> str:
    """A file the router-vrrp step writes on ``host``, as written there (the heredoc of its function ``fn``)."""
    vrrp = hostplan.plan_all(ha_stack, plan(ha_stack), stack_name="prod-b300")[host].steps["router-vrrp"].stdin
    return vrrp.split(f"{fn}() {{\n  cat <<'GLM_INFRA_FILE_END'\n")[1].split("GLM_INFRA_FILE_END\n}")[0]


def test_keepalived_s_check_fails_closed_on_what_it_cannot_see_and_says_so_for_prometheus(ha_stack, tmp_path):
    """The check keepalived runs every second, on a host of its own (stubs for curl and ip): the front's own 404
    for the probe path and the router's liveness, nothing else, count as serving; a front that answers anything
    else, a router down without a fresh drain, a drain older than its bound do not. Each run says so in the node
    exporter's textfile, readable by the exporter, rewritten on a change and once 30 s old."""
    stubs = StubPath(tmp_path / "stubs")
    # curl as keepalived's check calls it (-w '%{http_code}'): the code in $STATE/front for the front's probe path,
    # in $STATE/router for the router's liveness; 000 and exit 7 for one that does not answer, as curl does.
    stubs.add("curl", f'for a; do url=$a; done; case $url in *{ha.FRONT_PROBE}) f=front ;; *) f=router ;; esac\n'
                      'code=$(cat "$STATE/$f"); printf %s "$code"; [ "$code" != 000 ] || exit 7')
    stubs.add("ip", '[ -e "$STATE/held" ] && echo "2: eth0    inet 10.0.0.10/32 scope global eth0"; exit 0')
    script = vrrp_file(ha_stack, "b300-2", "check_source")
    dirs = [paths.FRONT_DRAIN_DIR, paths.NODE_EXPORTER_TEXTFILES]
    metrics, drain = in_root(tmp_path, ha.VRRP_METRICS), in_root(tmp_path, paths.FRONT_DRAIN)

    def check(front: str, router: str) -> int:
        (stubs.state / "front").write_text(front)
        (stubs.state / "router").write_text(router)
        return isolated(stubs, script, [], dirs, tmp_path).returncode

    def said() -> tuple[str, str]:
        text = metrics.read_text()
        return (re.search(r'^glm_router_address_held\{address="10.0.0.10"\} (\d)$', text, re.M)[1],
                re.search(r'^glm_router_serves\{address="10.0.0.10"\} (\d)$', text, re.M)[1])

    assert check("404", "200") == 0 and said() == ("0", "1")
    assert oct(metrics.stat().st_mode)[-3:] == "644", "the node exporter runs as a user of its own"
    calls = stubs.log.read_text()
    assert f"--cacert {paths.FRONT_CA} https://10.0.0.12:8000{ha.FRONT_PROBE}" in calls, "TLS, on its own address"
    assert "--max-time 1.5" in calls and "http://127.0.0.1:8001/liveness" in calls
    (stubs.state / "held").touch()
    assert check("404", "200") == 0 and said() == ("1", "1")
    for front in ("200", "502", "000"):  # anything but the front's own 404: not this host's front, or none
        assert check(front, "200") == 1 and said() == ("1", "0"), front
    assert check("404", "000") == 1, "the router down and the front not drained"
    assert check("404", "500") == 1
    drain.write_text("")
    assert check("404", "000") == 0 and said() == ("1", "1"), "a restart in its drain window"
    old = time.time() - ha.DRAIN_MAX_S - 5
    os.utime(drain, (old, old))
    assert check("404", "000") == 1 and said() == ("1", "0"), "a drain older than any restart takes"
    # Unchanged and fresh: left alone; unchanged and 30 s old: written again (an old file means the check stopped).
    os.utime(metrics, (time.time() - 10,) * 2)
    before = metrics.stat().st_mtime
    check("404", "000")
    assert metrics.stat().st_mtime == before
    os.utime(metrics, (time.time() - 31,) * 2)
    check("404", "000")
    assert metrics.stat().st_mtime > time.time() - 5


def test_the_program_registers_a_router_per_host_and_keeps_the_ca_secret(prod_config, write_stack, tmp_path):
    key = tmp_path / "id_test"
    key.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nnot-a-real-key\n-----END OPENSSH PRIVATE KEY-----\n")
    run = run_program(write_stack(ha_config(prod_config)), key)
    routers = [r.name for r in run.resources if r.type == "glm-infra:index:Router"]
    assert sorted(routers) == ["glm-router", "glm-router-b300-2"], "router.host's keeps its first name (no URN changes)"
    export = run.get("glm-router-ca-export")
    assert export.inputs.get("logging") == "none" and {"stdin", "stdout"} <= set(export.additional_secret_outputs)
    taken = run.get("glm-router-b300-2-front-ca-given")
    assert taken.inputs.get("logging") == "none" and "stdin" in taken.additional_secret_outputs
    assert run.urn("glm-router-ca-export") in taken.dependencies
    # One at a time: the second router's restart waits for the first router host's keepalived.
    assert run.urn("glm-router-vrrp") in run.get("glm-router-b300-2-service").dependencies
    assert run.exports["routerUrl"] == f"https://{VIP}:8000"



def test_the_address_rules_pass_their_promtool_tests(ha_stack, one_router_stack, tools, tmp_path):
    """Unheld (a stale claim is none), held twice, moved, a router host that cannot serve, a check that stopped."""
    (tmp_path / "rules.yml").write_text(monitoring.rules(ha_stack))
    shutil.copy(PROMTOOL_TESTS / "ha.test.yml", tmp_path)
    p = run(tools / "promtool", "test", "rules", "ha.test.yml", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    single = one_router_stack
    assert "GlmRouterAddress" not in monitoring.rules(single)
