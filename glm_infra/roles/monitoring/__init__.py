"""What the monitoring deploys, from the plan: the node exporter on every host, NVIDIA's DCGM exporter
where the driver step installs DCGM, and on the monitoring host Prometheus (scrape targets, recording
and alerting rules with the stack's thresholds) and Alertmanager (the stack's webhook). Pure: the
per-host plan (``hostplan``) takes these steps, so ``glm-infra render`` shows exactly what deploys.

Every series carries ``stack``; vLLM, router and exporter series carry ``host``; vLLM series carry
``pool`` (prefill, decode, colocated) and ``instance`` (prefill-0, …), so rules aggregate per pool.
The router's per-worker series get the worker's ``pool`` and ``backend`` (its instance name) from
its URL, so an alert can say the router has no healthy prefill.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from glm_infra import render
from glm_infra.plan.topology import HostPlan, Plan
from glm_infra.roles.router.ha import VRRP_METRICS
from glm_infra.render import render_template
from glm_infra.spec import packages, paths
from glm_infra.spec.config import StackConfig
from glm_infra.steps import RenderedFile, ScriptStep, Step, file_step

DASHBOARD = Path(__file__).parent / "dashboards" / "glm-infra.json"

# The units the packages ship.
PROMETHEUS_UNIT = "prometheus.service"
ALERTMANAGER_UNIT = "prometheus-alertmanager.service"
NODE_EXPORTER_UNIT = "prometheus-node-exporter.service"
DCGM_EXPORTER_UNIT = "nvidia-dcgm-exporter.service"  # datacenter-gpu-manager-exporter
WEBHOOK_CREDENTIAL = "webhook-url"
DEAD_MANS_SWITCH_CREDENTIAL = "dead-mans-switch-url"
PROMETHEUS_RESEND_DELAY = "15s"
WATCHDOG = "Watchdog"  # the always-firing alert (the name Prometheus' community mixins use)
# What a host being down makes its other alerts say again: the host's one page says it.
HOST_DOWN_INHIBITS = ("GlmInstanceDown", "GlmExporterDown", "GlmUnitMemoryUnmeasured")
UNIT_MEMORY_SCRIPT = "glm-unit-memory"  # the unit-memory step's script, under paths.LIBEXEC
UNIT_MEMORY_SERVICE = "glm-unit-memory.service"
UNIT_MEMORY_TIMER = "glm-unit-memory.timer"
UNIT_MEMORY_INTERVAL_S = 15
# Samples older than this are no measure (a stopped timer leaves its last file behind).
UNIT_MEMORY_STALE_S = 4 * UNIT_MEMORY_INTERVAL_S

# DCGM fields the rules and the dashboard read, as dcgm-exporter's collectors file lists them. Its
# default file leaves out the row-remap and NVLink CRC counters the alerts need.
DCGM_COUNTERS = (
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C)."),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W)."),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %)."),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB)."),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB)."),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered."),
    ("DCGM_FI_DEV_ROW_REMAP_PENDING", "gauge", "Number of pending row remaps."),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed."),
    ("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "counter", "Total number of NVLink flow-control CRC errors."),
)


def label(stack: StackConfig, stack_name: str) -> str:
    """The ``stack`` label: the stack's setting, else the Pulumi stack's name."""
    return stack.monitoring.stack_label or stack_name


def dcgm_hosts(stack: StackConfig, plan: Plan) -> list[str]:
    """Hosts whose driver step glm-infra runs in install mode (it installs DCGM there)."""
    if stack.monitoring.dcgm_exporter_package is None or stack.drivers.mode != "install":
        return []
    return [h.name for h in plan.hosts if h.provisioned]


def _target(address: str, port: int) -> str:
    return f"{paths.url_host(address)}:{port}"


def scrape_configs(stack: StackConfig, plan: Plan, stack_name: str) -> list[dict[str, Any]]:
    """One job per kind of target; one static group per target so each has its own labels."""
    m, name = stack.monitoring, label(stack, stack_name)
    jobs: list[dict[str, Any]] = []

    def job(job_name: str, groups: list[dict[str, Any]], **extra: Any) -> None:
        if groups:
            jobs.append({"job_name": job_name, **extra, "static_configs": groups})

    job("vllm", [
        {"targets": [_target(i.address, i.http_port)],
         "labels": {"stack": name, "pool": i.role, "host": i.host, "instance": i.name}}
        for i in plan.instances
    ])
    if plan.router is not None and stack.router is not None:
        r = plan.router
        # The router labels its per-worker series with the worker's URL (its gate's): name its pool and instance.
        relabel = [
            rule
            for g in r.gates
            for rule in (
                {"source_labels": ["worker"], "regex": re.escape(g.url), "target_label": "pool", "replacement": g.role},
                {"source_labels": ["worker"], "regex": re.escape(g.url), "target_label": "backend",
                 "replacement": g.instance},
            )
        ]
        job("vllm-router", [{"targets": [_target(h.address, stack.router.metrics_port)],  # each on its own address
                             "labels": {"stack": name, "pool": "router", "host": h.name, "instance": "router"}}
                            for h in r.hosts],
            metric_relabel_configs=relabel)
    job("node", [
        {"targets": [_target(h.address, m.node_exporter_port)], "labels": {"stack": name, "host": h.name}}
        for h in plan.hosts
    ])
    dcgm = set(dcgm_hosts(stack, plan))
    job("dcgm", [
        {"targets": [_target(h.address, m.dcgm_exporter_port)], "labels": {"stack": name, "host": h.name}}
        for h in plan.hosts if h.name in dcgm
    ])
    mon = stack.monitoring_host
    job("prometheus", [{"targets": [f"localhost:{m.prometheus_port}"], "labels": {"stack": name, "host": mon}}])
    job("alertmanager", [{"targets": [f"localhost:{m.alertmanager_port}"], "labels": {"stack": name, "host": mon}}])
    return jobs


def _yaml(header: str, data: Any) -> str:
    return f"# {header}\n" + yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=1000)


def prometheus_config(stack: StackConfig, plan: Plan, stack_name: str) -> str:
    m = stack.monitoring
    config = {
        "global": {
            "scrape_interval": m.scrape_interval,
            "evaluation_interval": m.evaluation_interval,
            "external_labels": {"stack": label(stack, stack_name)},
        },
        "rule_files": [paths.PROMETHEUS_RULES],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"localhost:{m.alertmanager_port}"]}]}]},
        "scrape_configs": scrape_configs(stack, plan, stack_name),
    }
    return _yaml("Managed by glm-infra: generated from the stack's plan; edits are overwritten.", config)


def rules(stack: StackConfig) -> str:
    """Recording and alerting rules with the stack's SLA and alert thresholds."""
    return render_template("prometheus-rules.yml.j2", sla=stack.sla, m=stack.monitoring,
                           disaggregated=stack.disaggregated,
                           canary={"interval": stack.router.canary_interval, "timeout": stack.router.canary_timeout}
                           if stack.router is not None else None,
                           mtp=any(p.speculative_tokens > 0 for _, p in stack.pools()),
                           unit_memory_stale_s=UNIT_MEMORY_STALE_S,
                           router_address=stack.router is not None and stack.router.virtual_address is not None,
                           router_address_file=VRRP_METRICS.rsplit("/", 1)[1])


def alertmanager_config(stack: StackConfig) -> str:
    """Every alert to the stack's webhook, whose URL (a secret) Alertmanager reads from the credential
    systemd hands it; with no webhook the alerts stay in Alertmanager (its UI and API). The Watchdog goes
    only to the dead man's switch, every ``deadMansSwitchInterval`` (none configured: to no receiver, never
    to the on-call webhook). A host that is down inhibits the alerts of what runs on it."""
    m = stack.monitoring
    receiver: dict[str, Any] = {"name": "glm-infra"}
    if m.webhook_url is not None:
        receiver["webhook_configs"] = [{"url_file": paths.credential(ALERTMANAGER_UNIT, WEBHOOK_CREDENTIAL),
                                        "send_resolved": True}]
    switch: dict[str, Any] = {"name": "dead-mans-switch"}
    if m.dead_mans_switch_url is not None:
        # Resolved never: a switch pages on silence, and "resolved" would be one more heartbeat.
        switch["webhook_configs"] = [{"url_file": paths.credential(ALERTMANAGER_UNIT, DEAD_MANS_SWITCH_CREDENTIAL),
                                      "send_resolved": False}]
    watchdog = {"matchers": [f'alertname="{WATCHDOG}"'], "receiver": "dead-mans-switch", "group_by": ["stack"],
                "group_wait": "0s", "group_interval": m.dead_mans_switch_interval,
                "repeat_interval": m.dead_mans_switch_interval}
    config = {
        "route": {"receiver": "glm-infra", "group_by": ["alertname", "stack", "pool"],
                  "group_wait": m.group_wait, "group_interval": "5m", "repeat_interval": m.repeat_interval,
                  "routes": [watchdog]},
        "inhibit_rules": [{"source_matchers": ['alertname="GlmHostDown"'],
                           "target_matchers": [f'alertname=~"{"|".join(HOST_DOWN_INHIBITS)}"'],
                           "equal": ["stack", "host"]}],
        "receivers": [receiver, switch],
    }
    return _yaml("Managed by glm-infra.", config)


def _defaults(unit: str, args: list[str]) -> str:
    return f"# Managed by glm-infra: the arguments of {unit}.\nARGS=\"{' '.join(args)}\"\n"


def prometheus_defaults(stack: StackConfig) -> str:
    m = stack.monitoring
    return _defaults(PROMETHEUS_UNIT, [f"--config.file={paths.PROMETHEUS_CONFIG}",
                                       f"--web.listen-address=:{m.prometheus_port}",
                                       f"--storage.tsdb.retention.time={m.retention}",
                                       # An alert Prometheus stops sending ends 4 × this (or the evaluation
                                       # interval) later: the Watchdog stops reaching the dead man's switch
                                       # about a minute after Prometheus dies, not four.
                                       f"--rules.alert.resend-delay={PROMETHEUS_RESEND_DELAY}"])


def alertmanager_defaults(stack: StackConfig) -> str:
    # One Alertmanager: no cluster gossip port.
    return _defaults(ALERTMANAGER_UNIT, [f"--config.file={paths.ALERTMANAGER_CONFIG}",
                                         f"--web.listen-address=:{stack.monitoring.alertmanager_port}",
                                         "--cluster.listen-address="])


def node_exporter_defaults(stack: StackConfig) -> str:
    return _defaults(NODE_EXPORTER_UNIT, [f"--web.listen-address=:{stack.monitoring.node_exporter_port}",
                                          "--collector.systemd",
                                          f"--collector.textfile.directory={paths.NODE_EXPORTER_TEXTFILES}"])


def dcgm_counters() -> str:
    lines = ["# Managed by glm-infra: the DCGM fields its rules and dashboard read (field, type, help)."]
    lines += [f"{f}, {kind}, {text}" for f, kind, text in DCGM_COUNTERS]
    return "\n".join(lines) + "\n"


def dcgm_exporter_dropin(stack: StackConfig) -> str:
    """glm-infra's fields and port, and nvidia-dcgm's host engine (the driver step runs it): without one named
    the exporter runs an embedded engine of its own beside it (glm_infra/spec/packages.py). Named through its
    environment variable, which the exporter reads as its -r option. The engine may not listen yet when the
    exporter starts (nvidia-dcgm's unit is started, not ready), and the exporter exits then: it starts again
    (the packaged unit restarts it only on an abort)."""
    return ("# Managed by glm-infra: the DCGM exporter on glm-infra's fields and port, on nvidia-dcgm's host engine.\n"
            "[Unit]\nRequires=nvidia-dcgm.service\nAfter=nvidia-dcgm.service\n"
            f"[Service]\nEnvironment=DCGM_REMOTE_HOSTENGINE_INFO={packages.DCGM_HOSTENGINE}\n"
            "Restart=on-failure\nRestartSec=5\nExecStart=\n"
            f"ExecStart=/usr/bin/dcgm-exporter -f {paths.DCGM_EXPORTER_COUNTERS} "
            f"-a :{stack.monitoring.dcgm_exporter_port}\n")


def alertmanager_dropin(stack: StackConfig) -> str:
    m = stack.monitoring
    lines = [f"LoadCredential={WEBHOOK_CREDENTIAL}:{paths.WEBHOOK_SECRET}"] if m.webhook_url is not None else []
    if m.dead_mans_switch_url is not None:
        lines.append(f"LoadCredential={DEAD_MANS_SWITCH_CREDENTIAL}:{paths.DEAD_MANS_SWITCH_SECRET}")
    return ("# Managed by glm-infra: the receivers' URLs (secrets) as credentials only this service reads.\n"
            "[Service]\n" + "".join(line + "\n" for line in lines))


# --- each unit's memory, from its cgroup ---------------------------------------------------------


def measured_units(plan: Plan, h: HostPlan) -> list[dict[str, str]]:
    """The units whose memory the host measures: its vLLM instances and, on the router's host, the router;
    labelled as the vllm and vllm-router jobs label their instances."""
    units = [{"unit": i.unit, "instance": i.name, "pool": i.role} for i in h.instances]
    if h.runs_router and plan.router is not None:
        units.append({"unit": plan.router.unit, "instance": "router", "pool": "router"})
    return units


def unit_memory_script(plan: Plan, h: HostPlan) -> str:
    units = measured_units(plan, h)
    names = [u["unit"] for u in units]
    service = render_template("unit-memory.service.j2", timer=UNIT_MEMORY_TIMER, interval=UNIT_MEMORY_INTERVAL_S,
                              units=names, textfiles=paths.NODE_EXPORTER_TEXTFILES, exec_start=render.systemd_quote(
                                  ["/usr/bin/python3", paths.UNIT_MEMORY, "--units", paths.UNIT_MEMORY_UNITS,
                                   "--out", paths.UNIT_MEMORY_METRICS]))
    return render_template(
        "unit-memory.sh.j2", host=h.name, units=names, interval=UNIT_MEMORY_INTERVAL_S, service=UNIT_MEMORY_SERVICE,
        timer=UNIT_MEMORY_TIMER, program=paths.UNIT_MEMORY, units_path=paths.UNIT_MEMORY_UNITS,
        metrics=paths.UNIT_MEMORY_METRICS, textfiles=paths.NODE_EXPORTER_TEXTFILES,
        program_source=render.unit_memory_source(), units_json=json.dumps(units, indent=2) + "\n",
        service_unit=service, timer_unit=render_template("unit-memory.timer.j2", interval=UNIT_MEMORY_INTERVAL_S))


# --- the steps -----------------------------------------------------------------------------------


def alertmanager_webhook(secrets: Mapping[str, str]) -> str:
    """The file Alertmanager's webhook URL is read from (its whole content is the URL)."""
    return secrets["webhook_url"]


def alertmanager_dead_mans_switch(secrets: Mapping[str, str]) -> str:
    """The file Alertmanager's dead man's switch URL is read from (its whole content is the URL)."""
    return secrets["dead_mans_switch_url"]


def host_steps(stack: StackConfig, plan: Plan, h: HostPlan, stack_name: str, secrets: Mapping[str, str]) -> list[Step]:
    """The exporters of one host (with the memory of its glm-infra units), and Prometheus and Alertmanager on
    the monitoring host."""
    m = stack.monitoring
    if not m.enabled:
        return []
    out = [render.package_service_step(
        "node-exporter", f"the Prometheus node exporter on :{m.node_exporter_port}", h.name,
        ["prometheus-node-exporter"], [NODE_EXPORTER_UNIT], [f"http://127.0.0.1:{m.node_exporter_port}/metrics"],
        [RenderedFile(paths.NODE_EXPORTER_DEFAULTS, node_exporter_defaults(stack))])]
    if measured_units(plan, h):
        out.append(ScriptStep(UNIT_MEMORY_SCRIPT, unit_memory_script(plan, h)).step("unit-memory"))
    if h.name in dcgm_hosts(stack, plan):
        assert m.dcgm_exporter_package is not None
        out.append(render.package_service_step(
            "dcgm-exporter", f"NVIDIA's DCGM exporter on :{m.dcgm_exporter_port}", h.name,
            [m.dcgm_exporter_package], [DCGM_EXPORTER_UNIT], [f"http://127.0.0.1:{m.dcgm_exporter_port}/metrics"],
            [RenderedFile(paths.DCGM_EXPORTER_COUNTERS, dcgm_counters()),
             RenderedFile(paths.dropin(DCGM_EXPORTER_UNIT), dcgm_exporter_dropin(stack))]))
    if h.name == stack.monitoring_host:
        out.append(render.package_service_step(
            "prometheus", f"Prometheus on :{m.prometheus_port} (retention {m.retention})", h.name,
            ["prometheus"], [PROMETHEUS_UNIT], [f"http://127.0.0.1:{m.prometheus_port}/-/ready"],
            [RenderedFile(paths.PROMETHEUS_CONFIG, prometheus_config(stack, plan, stack_name)),
             RenderedFile(paths.PROMETHEUS_RULES, rules(stack)),
             RenderedFile(paths.PROMETHEUS_DEFAULTS, prometheus_defaults(stack))],
            config_check=f"promtool check config {paths.PROMETHEUS_CONFIG}"))
        files = [RenderedFile(paths.ALERTMANAGER_CONFIG, alertmanager_config(stack)),
                 RenderedFile(paths.ALERTMANAGER_DEFAULTS, alertmanager_defaults(stack))]
        credentials = []
        if m.webhook_url is not None:
            out.append(file_step("alertmanager-webhook", paths.WEBHOOK_SECRET, alertmanager_webhook(secrets),
                                 0o600, True, alertmanager_webhook))
            credentials.append(paths.WEBHOOK_SECRET)
        if m.dead_mans_switch_url is not None:
            out.append(file_step("alertmanager-dead-mans-switch", paths.DEAD_MANS_SWITCH_SECRET,
                                 alertmanager_dead_mans_switch(secrets), 0o600, True, alertmanager_dead_mans_switch))
            credentials.append(paths.DEAD_MANS_SWITCH_SECRET)
        if credentials:
            files.append(RenderedFile(paths.dropin(ALERTMANAGER_UNIT), alertmanager_dropin(stack)))
        out.append(render.package_service_step(
            "alertmanager", f"Alertmanager on :{m.alertmanager_port}", h.name,
            ["prometheus-alertmanager"], [ALERTMANAGER_UNIT], [f"http://127.0.0.1:{m.alertmanager_port}/-/ready"],
            files, config_check=f"amtool check-config {paths.ALERTMANAGER_CONFIG}",
            # A new URL restarts Alertmanager (systemd hands it the credentials at start).
            runtime_digest=tuple(credentials)))
    return out


# --- the dashboard -------------------------------------------------------------------------------


def dashboard() -> dict[str, Any]:
    """The Grafana dashboard (in the repository): per-pool latency against the SLA lines,
    throughput, queues, KV cache, MTP, KV transfer, GPU memory and power."""
    return json.loads(DASHBOARD.read_text())


def dashboard_queries(stack_label: str = "$stack", rate_interval: str = "$__rate_interval") -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel target, with the dashboard's variables filled in."""
    out = []
    for panel in dashboard()["panels"]:
        for t in panel.get("targets", []):
            expr = t["expr"].replace("$stack", stack_label).replace("$__rate_interval", rate_interval)
            out.append((panel["title"], expr))
    return out


# --- which metrics the rules and the dashboard read ----------------------------------------------

_PROMQL_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
                    "group_right", "inf", "nan", "atan2"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (not its functions, labels, strings or keywords): what must
    be scraped, or recorded by a rule, for it to return anything."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings (label_replace's arguments)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)  # label lists
    words = re.finditer(r"(?<![\w:.$])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()", text)
    return {w.group(1) for w in words if w.group(1).lower() not in _PROMQL_KEYWORDS}


def read_metrics(stack: StackConfig, stack_label: str) -> dict[str, list[str]]:
    """Every metric the stack's rules and the dashboard read that no rule records (what the targets must
    serve), with the alerts, recording rules and panels that read it."""
    groups = yaml.safe_load(rules(stack))["groups"]
    recorded = {r["record"] for g in groups for r in g["rules"] if "record" in r}
    readers: dict[str, list[str]] = {}
    for g in groups:
        for r in g["rules"]:
            for name in metric_names(r["expr"]) - recorded:
                readers.setdefault(name, []).append(r.get("alert") or r["record"])
    for title, expr in dashboard_queries(stack_label, "1m"):
        for name in metric_names(expr) - recorded:
            readers.setdefault(name, []).append(f"panel {title!r}")
    return readers

