"""The monitoring as rendered for every stack: the rules under `promtool test rules`, every generated
Prometheus and Alertmanager configuration under `promtool check config` / `amtool check-config` (the
tools of the packages the hosts install), scrape targets and labels from the plan, the dashboard's
queries, and the monitoring host script against a stub PATH."""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, STACKS, stack_config, stack_file
from stubs import StubPath, in_root, isolated

from glm_infra import hostplan
from glm_infra.plan.topology import plan
from glm_infra.roles import monitoring
from glm_infra.spec import paths
from glm_infra.stack import load_dict, load_file, unprefixed

PROMTOOL_TESTS = ROOT / "tests" / "promtool"


@pytest.fixture(scope="module")
def tools() -> Path:
    p = subprocess.run([str(ROOT / "scripts/prometheus-tools")], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    return Path(p.stdout.strip().splitlines()[-1])


def run(tool: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(tool), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def monitoring_files(stack: str) -> dict[str, str]:
    """Every file the monitoring steps write on every host, by ``host:path``."""
    cfg = load_file(stack_file(stack)).config
    out = {}
    for host, hs in hostplan.plan_all(cfg, plan(cfg), stack_name=stack).items():
        for key in ("node-exporter", "dcgm-exporter", "prometheus", "alertmanager"):
            if key in hs.steps:
                out.update({f"{host}:{f.path}": f.content for f in hs.steps[key].files if not f.path.endswith(".sh")})
    return out


def test_the_rules_pass_their_promtool_tests(tools, tmp_path):
    """The P/D rules with the default thresholds (the test file's comment says which)."""
    cfg = load_file(stack_file("prod-b300")).config
    (tmp_path / "rules.yml").write_text(monitoring.rules(cfg))
    shutil.copy(PROMTOOL_TESTS / "pd.test.yml", tmp_path)
    p = run(tools / "promtool", "test", "rules", "pd.test.yml", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr


def test_thresholds_come_from_the_stack(tools, tmp_path):
    raw = stack_config("prod-b300")
    raw["glm-infra:sla"] = {"ttftSeconds": 1.5, "tpotSeconds": 0.03, "window": "5m"}
    raw["glm-infra:monitoring"] = {"mtpAcceptanceMin": 0.7, "kvTransferP99Seconds": 0.25}
    cfg = load_dict(unprefixed(raw), "test").config
    text = monitoring.rules(cfg)
    assert "glm:service_ttft_seconds:mean > 1.5\n" in text and "glm:service_tpot_seconds:mean > 0.03\n" in text
    assert "glm:mtp_acceptance:ratio < 0.7\n" in text and "glm:kv_transfer_seconds:p99 > 0.25\n" in text
    fixed = ("increase(DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL[10m])", "changes(glm_router_address_held[10m])")
    assert "[5m]" in text and "[10m]" not in functools.reduce(lambda t, f: t.replace(f, ""), fixed, text)
    (tmp_path / "rules.yml").write_text(text)
    p = run(tools / "promtool", "check", "rules", "rules.yml", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr


def test_a_colocated_stack_has_no_pd_rules():
    cfg = load_file(stack_file("b300-1node-colocated")).config
    text = monitoring.rules(cfg)
    assert 'pool="colocated"' in text and "nixl" not in text and "GlmRouterNoHealthyPrefill" not in text
    assert "GlmRouterNoHealthyColocated" in text


@pytest.mark.parametrize("stack", STACKS)
def test_every_generated_configuration_is_accepted(stack, tools, tmp_path):
    files = monitoring_files(stack)
    (prom,) = [k for k in files if k.endswith(paths.PROMETHEUS_CONFIG)]
    host = prom.split(":")[0]
    # The configuration names its rules by their path on the host: here, beside it.
    (tmp_path / "rules.yml").write_text(files[f"{host}:{paths.PROMETHEUS_RULES}"])
    (tmp_path / "prometheus.yml").write_text(files[prom].replace(paths.PROMETHEUS_RULES, str(tmp_path / "rules.yml")))
    p = run(tools / "promtool", "check", "config", "prometheus.yml", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "SUCCESS: 1 rule files found" in p.stdout + p.stderr
    (tmp_path / "alertmanager.yml").write_text(files[f"{host}:{paths.ALERTMANAGER_CONFIG}"])
    p = run(tools / "amtool", "check-config", "alertmanager.yml", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr


def test_a_webhook_is_read_from_the_credential_never_written_in_the_config(tools, tmp_path):
    raw = unprefixed(stack_config("sim"))
    raw["router"]["apiKey"] = "sk-router"
    raw["monitoring"] = {"webhookUrl": "https://hooks.example/T0/secret-token"}
    cfg = load_dict(raw, "test").config
    hs = hostplan.host_steps(cfg, plan(cfg), plan(cfg).host("sim-3"), {"webhook_url": "<webhook>",
                             "router_api_key": "<key>"}, stack_name="sim")
    secret = hs.steps["alertmanager-webhook"]
    assert secret.secret and secret.stdin == "<webhook>" and secret.files[0].mode == 0o600
    assert secret.files[0].path.startswith(paths.SECRETS_DIR + "/")
    am = hs.steps["alertmanager"]
    config = next(f.content for f in am.files if f.path == paths.ALERTMANAGER_CONFIG)
    dropin = next(f.content for f in am.files if f.path == paths.dropin(monitoring.ALERTMANAGER_UNIT))
    url_file = yaml.safe_load(config)["receivers"][0]["webhook_configs"][0]["url_file"]
    assert url_file == f"/run/credentials/prometheus-alertmanager.service/{monitoring.WEBHOOK_CREDENTIAL}"
    assert f"LoadCredential={monitoring.WEBHOOK_CREDENTIAL}:{paths.WEBHOOK_SECRET}" in dropin
    assert "<webhook>" not in am.stdin and "<webhook>" not in config
    # A new URL restarts Alertmanager: the script folds the file's digest into what it applied.
    assert f"sha256sum < {paths.WEBHOOK_SECRET}" in am.stdin
    (tmp_path / "alertmanager.yml").write_text(config)
    assert run(tools / "amtool", "check-config", "alertmanager.yml", cwd=tmp_path).returncode == 0


@pytest.mark.parametrize("switch", [True, False], ids=["dead-mans-switch", "no-switch"])
def test_the_watchdog_goes_only_to_the_dead_mans_switch_and_every_other_alert_to_the_webhook(tools, tmp_path, switch):
    """Routing as Alertmanager's own amtool decides it, on the rendered configuration."""
    raw = unprefixed(stack_config("sim"))
    raw["router"]["apiKey"] = "sk-router"
    raw["monitoring"] = {"webhookUrl": "https://hooks.example/T0/secret-token",
                         **({"deadMansSwitchUrl": "https://hc-ping.example/uuid-1", "deadMansSwitchInterval": "20s"}
                            if switch else {})}
    cfg = load_dict(raw, "test").config
    secrets = {"webhook_url": "<webhook>", "router_api_key": "<key>", "dead_mans_switch_url": "<switch>"}
    hs = hostplan.host_steps(cfg, plan(cfg), plan(cfg).host("sim-3"), secrets, stack_name="sim")
    am = hs.steps["alertmanager"]
    config = next(f.content for f in am.files if f.path == paths.ALERTMANAGER_CONFIG)
    dropin = next(f.content for f in am.files if f.path == paths.dropin(monitoring.ALERTMANAGER_UNIT))
    (tmp_path / "alertmanager.yml").write_text(config)
    checked = run(tools / "amtool", "check-config", "alertmanager.yml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr

    def receiver(*labels: str) -> str:
        p = run(tools / "amtool", "config", "routes", "test", "--config.file=alertmanager.yml", *labels, cwd=tmp_path)
        assert p.returncode == 0, p.stderr
        return p.stdout.strip()

    assert receiver("alertname=Watchdog", "stack=sim", "severity=none") == "dead-mans-switch"
    assert receiver("alertname=GlmHostDown", "stack=sim", "host=sim-1") == "glm-infra"
    assert receiver("alertname=GlmInstanceDown", "stack=sim", "pool=decode") == "glm-infra"
    data = yaml.safe_load(config)
    (switch_receiver,) = [r for r in data["receivers"] if r["name"] == "dead-mans-switch"]
    (watchdog,) = data["route"]["routes"]
    if switch:
        assert switch_receiver["webhook_configs"] == [{
            "url_file": f"/run/credentials/prometheus-alertmanager.service/{monitoring.DEAD_MANS_SWITCH_CREDENTIAL}",
            "send_resolved": False}]
        assert (watchdog["group_interval"], watchdog["repeat_interval"], watchdog["group_wait"]) == ("20s", "20s", "0s")
        step = hs.steps["alertmanager-dead-mans-switch"]
        assert step.secret and step.stdin == "<switch>" and step.files[0].mode == 0o600
        assert f"LoadCredential={monitoring.DEAD_MANS_SWITCH_CREDENTIAL}:{paths.DEAD_MANS_SWITCH_SECRET}" in dropin
        assert f"sha256sum < {paths.DEAD_MANS_SWITCH_SECRET}" in am.stdin  # a new URL restarts Alertmanager
    else:  # nowhere: never every few minutes to the on-call webhook
        assert switch_receiver == {"name": "dead-mans-switch"} and "alertmanager-dead-mans-switch" not in hs.steps
        assert monitoring.DEAD_MANS_SWITCH_CREDENTIAL not in dropin
    assert "<switch>" not in am.stdin and "<webhook>" not in am.stdin
    # A host that is down: its one page, not one per instance and exporter on it.
    assert data["inhibit_rules"] == [{"source_matchers": ['alertname="GlmHostDown"'],
                                      "target_matchers": ['alertname=~"GlmInstanceDown|GlmExporterDown|GlmUnitMemoryUnmeasured"'],
                                      "equal": ["stack", "host"]}]


def test_scrape_targets_and_labels_follow_the_plan():
    cfg = load_file(stack_file("prod-b300")).config
    p = plan(cfg)
    jobs = {j["job_name"]: j for j in monitoring.scrape_configs(cfg, p, "prod-b300")}
    vllm = {g["labels"]["instance"]: (g["targets"], g["labels"]) for g in jobs["vllm"]["static_configs"]}
    assert set(vllm) == {i.name for i in p.instances}
    for i in p.instances:
        targets, labels = vllm[i.name]
        assert targets == [f"{i.address}:{i.http_port}"]
        assert labels == {"stack": "prod-b300", "pool": i.role, "host": i.host, "instance": i.name}
    assert [(g["targets"], g["labels"]["host"]) for g in jobs["vllm-router"]["static_configs"]] == [
        ([f"{cfg.host(h).address}:{cfg.router.metrics_port}"], h) for h in p.router.host_names], "each router host's"
    # The router's per-worker series: worker URL (its gate's) → pool and instance name.
    relabel = jobs["vllm-router"]["metric_relabel_configs"]
    for i in p.instances:
        assert not [r for r in relabel if re.fullmatch(r["regex"], i.url)], "the router never sees this URL"
        rules = [r for r in relabel if re.fullmatch(r["regex"], p.router.worker_url(i.name))]
        assert {(r["target_label"], r["replacement"]) for r in rules} == {("pool", i.role), ("backend", i.name)}
    assert [g["labels"]["host"] for g in jobs["node"]["static_configs"]] == [h.name for h in p.hosts]
    assert [g["targets"][0] for g in jobs["dcgm"]["static_configs"]] == [f"{h.address}:9400" for h in p.hosts]
    assert {"prometheus", "alertmanager"} <= set(jobs)


def test_the_dcgm_exporter_uses_nvidia_dcgms_host_engine_not_an_embedded_one():
    """Without -r / DCGM_REMOTE_HOSTENGINE_INFO the exporter starts a host engine of its own beside nvidia-dcgm's
    (dcgm-exporter pkg/cmd/app.go: UseRemoteHE is whether the option was set)."""
    files = monitoring_files("prod-b300")
    dropins = [v for k, v in files.items() if k.endswith("/nvidia-dcgm-exporter.service.d/glm-infra.conf")]
    assert dropins and len(dropins) == len(load_file(stack_file("prod-b300")).config.hosts)
    for text in dropins:
        lines = text.splitlines()
        assert "Environment=DCGM_REMOTE_HOSTENGINE_INFO=localhost:5555" in lines
        assert "Requires=nvidia-dcgm.service" in lines and "After=nvidia-dcgm.service" in lines
        assert lines.index("[Unit]") < lines.index("Requires=nvidia-dcgm.service") < lines.index("[Service]")
        assert "Restart=on-failure" in lines  # the engine may not listen yet when the exporter first starts
        assert "ExecStart=/usr/bin/dcgm-exporter -f /etc/dcgm-exporter/glm-infra-counters.csv -a :9400" in lines


def test_no_dcgm_exporter_where_glm_infra_does_not_install_the_driver():
    raw = unprefixed(stack_config("prod-b300"))
    raw["drivers"] = {**raw.get("drivers", {}), "mode": "verify"}
    cfg = load_dict(raw, "test").config
    jobs = {j["job_name"] for j in monitoring.scrape_configs(cfg, plan(cfg), "x")}
    assert "dcgm" not in jobs
    assert all("dcgm-exporter" not in hs.steps for hs in hostplan.plan_all(cfg, plan(cfg), stack_name="x").values())


def test_the_monitoring_host_and_label_are_stack_settings():
    raw = unprefixed(stack_config("prod-b300"))
    raw["monitoring"] = {"host": "b300-1", "stackLabel": "glm-prod", "scrapeInterval": "5s", "retention": "30d"}
    cfg = load_dict(raw, "test").config
    steps = hostplan.plan_all(cfg, plan(cfg), stack_name="prod-b300")
    assert [h for h, hs in steps.items() if "prometheus" in hs.steps] == ["b300-1"]
    prom = yaml.safe_load(monitoring.prometheus_config(cfg, plan(cfg), "prod-b300"))
    assert prom["global"]["scrape_interval"] == "5s" and prom["global"]["external_labels"] == {"stack": "glm-prod"}
    assert "--storage.tsdb.retention.time=30d" in monitoring.prometheus_defaults(cfg)
    raw["monitoring"] = {"enabled": False}
    cfg = load_dict(raw, "test").config
    assert not any(k in hs.steps for hs in hostplan.plan_all(cfg, plan(cfg), stack_name="x").values()
                   for k in ("node-exporter", "prometheus"))


def test_monitoring_ports_are_checked_for_collisions():
    raw = unprefixed(stack_config("prod-b300"))
    raw["monitoring"] = {"nodeExporterPort": 8100}  # prefill-0's HTTP port
    with pytest.raises(Exception) as e:
        load_dict(raw, "test")
    assert "glm-infra:monitoring.nodeExporterPort" in str(e.value) and "8100" in str(e.value)
    raw["monitoring"] = {"host": "b300-9"}
    with pytest.raises(Exception) as e:
        load_dict(raw, "test")
    assert "glm-infra:monitoring.host: unknown host 'b300-9'" in str(e.value)


# --- the dashboard -------------------------------------------------------------------------------


def test_every_dashboard_query_parses(tools, tmp_path):
    """Each panel's query as a recording rule: `promtool check rules` parses every expression."""
    queries = monitoring.dashboard_queries("prod-b300", "1m")
    assert len(queries) >= 15 and not any("$" in q for _, q in queries)
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:q{i}", "expr": q}
                                                         for i, (_, q) in enumerate(queries)]}]}
    (tmp_path / "q.yml").write_text(yaml.safe_dump(rules))
    p = run(tools / "promtool", "check", "rules", "q.yml", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr


def test_the_dashboard_shows_what_the_issue_asks():
    d = monitoring.dashboard()
    titles = [p["title"] for p in d["panels"]]
    text = json.dumps(d)
    for needle in ("glm:sla_ttft_seconds:target", "glm:sla_tpot_seconds:target", "glm:ttft_seconds:p99",
                   "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "glm:mtp_acceptance:ratio",
                   "glm:kv_transfer_seconds:p99", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_POWER_USAGE", "glm:requests:rate"):
        assert needle in text, needle
    assert len(set(titles)) == len(titles)
    assert all(p["datasource"]["uid"] == "${datasource}" for p in d["panels"])
    assert {v["name"] for v in d["templating"]["list"]} == {"datasource", "stack"}


# --- the host script -----------------------------------------------------------------------------


@pytest.fixture
def service_stubs(tmp_path):
    s = StubPath(tmp_path / "stubs")
    for d in ("installed", "active", "enabled"):
        (s.state / d).mkdir()
    s.add("dpkg-query", '[ -e "$STATE/installed/${!#}" ] && printf "install ok installed" || exit 1')
    s.add("apt-get", '''case "$1" in install) for a in "$@"; do case "$a" in -*|install|Dpkg*) ;;
  *) touch "$STATE/installed/$a" ;; esac; done ;; purge) for a in "$@"; do rm -f "$STATE/installed/$a"; done ;; esac''')
    s.add("systemctl", '''case "$1" in is-active) [ -e "$STATE/active/${!#}" ] || { [ "$2" = --quiet ] || echo inactive; exit 3; } ;;
  restart) touch "$STATE/active/$2" ;; enable) touch "$STATE/enabled/${!#}" ;;
  disable) rm -f "$STATE/enabled/${!#}" "$STATE/active/${!#}" ;; esac''')
    s.add("curl", 'exit 0')
    s.add("promtool", 'exit 0')
    return s


def test_the_prometheus_step_writes_its_files_and_restarts_only_on_a_change(service_stubs, tmp_path):
    cfg = load_file(stack_file("sim")).config
    step = hostplan.plan_all(cfg, plan(cfg), stack_name="sim")["sim-3"].steps["prometheus"]
    dirs = ["/etc/prometheus", "/etc/default", "/var/lib/glm-infra"]
    r = isolated(service_stubs, step.stdin, ["apply"], dirs, tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.called("apt-get install") and r.called("systemctl restart prometheus")
    assert r.called(f"promtool check config {paths.PROMETHEUS_CONFIG}")
    written = {f.path: f.content for f in step.files if not f.path.endswith(".sh")}
    for path, content in written.items():
        assert in_root(tmp_path, path).read_text() == content
    assert "sim-3: prometheus: prometheus running" in r.stdout
    # Again: nothing to install, write or restart.
    r = isolated(service_stubs, step.stdin, ["apply"], dirs, tmp_path)
    assert r.returncode == 0 and not r.called("apt-get") and not r.called("systemctl restart"), r.calls
    assert isolated(service_stubs, step.stdin, ["check"], dirs, tmp_path).returncode == 0
    # A hand edit: check names the file and changes nothing; apply writes it back and restarts.
    edited = in_root(tmp_path, paths.PROMETHEUS_CONFIG)
    edited.write_text(edited.read_text() + "# edited by hand\n")
    r = isolated(service_stubs, step.stdin, ["check"], dirs, tmp_path)
    assert r.returncode == 1 and f"sim-3: prometheus: {paths.PROMETHEUS_CONFIG} differs from what glm-infra wrote" in r.stderr
    assert edited.read_text().endswith("# edited by hand\n") and not r.called("systemctl restart")
    (service_stubs.state / "active" / "prometheus").unlink()
    r = isolated(service_stubs, step.stdin, ["check"], dirs, tmp_path)
    assert "sim-3: prometheus: prometheus is inactive" in r.stderr
    r = isolated(service_stubs, step.stdin, ["apply"], dirs, tmp_path)
    assert r.returncode == 0 and r.called("systemctl restart prometheus")
    assert edited.read_text() == written[paths.PROMETHEUS_CONFIG]
    # remove: the services stop, the files go, the packages glm-infra installed are purged.
    r = isolated(service_stubs, step.stdin, ["remove"], dirs, tmp_path)
    assert r.returncode == 0 and r.called("apt-get purge -y -q prometheus") and not edited.exists()


def test_a_package_glm_infra_did_not_install_is_kept(service_stubs, tmp_path):
    cfg = load_file(stack_file("sim")).config
    step = hostplan.plan_all(cfg, plan(cfg), stack_name="sim")["sim-1"].steps["node-exporter"]
    (service_stubs.state / "installed" / "prometheus-node-exporter").touch()
    dirs = ["/etc/default", "/var/lib/glm-infra"]
    assert isolated(service_stubs, step.stdin, ["apply"], dirs, tmp_path).returncode == 0
    r = isolated(service_stubs, step.stdin, ["remove"], dirs, tmp_path)
    assert r.returncode == 0 and not r.called("apt-get purge") and r.called("systemctl disable")
