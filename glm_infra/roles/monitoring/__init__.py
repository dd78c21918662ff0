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
from glm_infra.render import render_template
from glm_infra.spec import packages, paths
from glm_infra.spec.config import StackConfig
from glm_infra.steps import RenderedFile, Step, file_step

DASHBOARD = Path(__file__).parent / "dashboards" / "glm-infra.json"

# The units the packages ship.
PROMETHEUS_UNIT = "prometheus.service"
ALERTMANAGER_UNIT = "prometheus-alertmanager.service"
NODE_EXPORTER_UNIT = "prometheus-node-exporter.service"
DCGM_EXPORTER_UNIT = "nvidia-dcgm-exporter.service"  # datacenter-gpu-manager-exporter
WEBHOOK_CREDENTIAL = "webhook-url"

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
        job("vllm-router", [{"targets": [_target(r.address, stack.router.metrics_port)],
                             "labels": {"stack": name, "pool": "router", "host": r.host, "instance": "router"}}],
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
                           mtp=any(p.speculative_tokens > 0 for _, p in stack.pools()))


def alertmanager_config(stack: StackConfig) -> str:
    """Every alert to the stack's webhook, whose URL (a secret) Alertmanager reads from the credential
    systemd hands it; with no webhook the alerts stay in Alertmanager (its UI and API)."""
    m = stack.monitoring
    receiver: dict[str, Any] = {"name": "glm-infra"}
    if m.webhook_url is not None:
        receiver["webhook_configs"] = [{"url_file": paths.credential(ALERTMANAGER_UNIT, WEBHOOK_CREDENTIAL),
                                        "send_resolved": True}]
    config = {
        "route": {"receiver": "glm-infra", "group_by": ["alertname", "stack", "pool"],
                  "group_wait": m.group_wait, "group_interval": "5m", "repeat_interval": m.repeat_interval},
        "receivers": [receiver],
    }
    return _yaml("Managed by glm-infra.", config)


def _defaults(unit: str, args: list[str]) -> str:
    return f"# Managed by glm-infra: the arguments of {unit}.\nARGS=\"{' '.join(args)}\"\n"


def prometheus_defaults(stack: StackConfig) -> str:
    m = stack.monitoring
    return _defaults(PROMETHEUS_UNIT, [f"--config.file={paths.PROMETHEUS_CONFIG}",
                                       f"--web.listen-address=:{m.prometheus_port}",
                                       f"--storage.tsdb.retention.time={m.retention}"])


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


def alertmanager_dropin() -> str:
    return ("# Managed by glm-infra: the webhook URL (a secret) as a credential only this service reads.\n"
            f"[Service]\nLoadCredential={WEBHOOK_CREDENTIAL}:{paths.WEBHOOK_SECRET}\n")


# --- the steps -----------------------------------------------------------------------------------


def alertmanager_webhook(secrets: Mapping[str, str]) -> str:
    """The file Alertmanager's webhook URL is read from (its whole content is the URL)."""
    return secrets["webhook_url"]


def host_steps(stack: StackConfig, plan: Plan, h: HostPlan, stack_name: str, secrets: Mapping[str, str]) -> list[Step]:
    """The exporters of one host, and Prometheus and Alertmanager on the monitoring host."""
    m = stack.monitoring
    if not m.enabled:
        return []
    out = [render.package_service_step(
        "node-exporter", f"the Prometheus node exporter on :{m.node_exporter_port}", h.name,
        ["prometheus-node-exporter"], [NODE_EXPORTER_UNIT], [f"http://127.0.0.1:{m.node_exporter_port}/metrics"],
        [RenderedFile(paths.NODE_EXPORTER_DEFAULTS, node_exporter_defaults(stack))])]
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
        if m.webhook_url is not None:
            out.append(file_step("alertmanager-webhook", paths.WEBHOOK_SECRET, alertmanager_webhook(secrets),
                                 0o600, True, alertmanager_webhook))
            files.append(RenderedFile(paths.dropin(ALERTMANAGER_UNIT), alertmanager_dropin()))
        out.append(render.package_service_step(
            "alertmanager", f"Alertmanager on :{m.alertmanager_port}", h.name,
            ["prometheus-alertmanager"], [ALERTMANAGER_UNIT], [f"http://127.0.0.1:{m.alertmanager_port}/-/ready"],
            files, config_check=f"amtool check-config {paths.ALERTMANAGER_CONFIG}",
            # A new webhook URL restarts Alertmanager (systemd hands it the credential at start).
            runtime_digest=(paths.WEBHOOK_SECRET,) if m.webhook_url is not None else ()))
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
