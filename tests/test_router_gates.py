"""The router's gates and canaries as planned and rendered (issue 30, part 1): the router knows each
instance by its gate on loopback; each gate passes to its instance and answers /health 503 while the
instance's canary is flagged; the canary's targets are every instance on its own URL (a request per DP
rank) and the router; bad input (a gate port taken) is refused naming the key. The behaviour on hosts
is tests/e2e/test_faults.py's canary test."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from conftest import stack_file
from stubs import shellcheck

from glm_infra.plan.topology import plan
from glm_infra.roles import monitoring, router
from glm_infra.spec import paths
from glm_infra.stack import StackError, load_dict, load_file, unprefixed


def _raw(stack: str) -> dict:
    return unprefixed(yaml.safe_load(stack_file(stack).read_text())["config"])


def test_the_router_reaches_every_instance_through_its_gate():
    cfg = load_file(stack_file("prod-b300")).config
    p = plan(cfg)
    args = router.router_args(cfg, p)
    assert [args[i + 1] for i, a in enumerate(args) if a in ("--prefill", "--decode")] == [g.url for g in p.router.gates]
    conf = router.router_gates_conf(cfg, p)
    servers = re.findall(r"upstream (glm_infra_gate_\w+) \{\n    server (\S+) max_fails=0;", conf)
    listens = re.findall(r"listen (127\.0\.0\.1:\d+);", conf)
    assert [(u, s) for u, s in servers] == [(f"glm_infra_gate_{g.instance.replace('-', '_')}", g.upstream.split("//")[1])
                                            for g in p.router.gates]
    assert listens == [g.url.split("//")[1] for g in p.router.gates], "loopback only"
    for g in p.router.gates:  # /health: 503 while flagged, else the instance's own
        block = conf[conf.index(f"listen 127.0.0.1:{g.port};"):]
        assert block.index(f"if (-f {paths.CANARY_FLAGS}/{g.instance}.failing)") < block.index("proxy_pass")
    assert conf.count("proxy_next_upstream off;") == len(p.router.gates), "a request is never retried by a gate"
    assert conf.count("proxy_buffering off;") == len(p.router.gates), "streamed tokens pass as they come"


def test_the_canary_targets_every_instance_per_dp_rank_and_the_router():
    cfg = load_file(stack_file("prod-b300")).config
    p = plan(cfg)
    spec = json.loads(router.canary_targets(cfg, p))
    assert spec["identity"] == f"{cfg.model.repo}@{cfg.model.revision} vllm {cfg.runtime.vllm_version}"
    assert "api_key_file" not in spec, "no router.apiKey: no key to read"
    by_name = {t["name"]: t for t in spec["targets"]}
    for i in p.instances:
        pool = dict(cfg.pools())[i.role]
        assert by_name[i.name] == {"name": i.name, "role": i.role, "url": i.url, "requests": pool.dp, "per_rank": True,
                                   "gate": True}
    assert by_name["router"] == {"name": "router", "role": "router", "url": f"http://127.0.0.1:{cfg.router.internal_port}",
                                 "requests": 4}
    cfg = load_file(stack_file("sim")).config  # router.apiKey: the workers' key, vllm-router's OPENAI_API_KEY
    spec = json.loads(router.canary_targets(cfg, plan(cfg)))
    assert spec["api_key_file"] == paths.ROUTER_SECRETS and spec["api_key_name"] == "OPENAI_API_KEY"


def test_the_canary_unit_and_timer_follow_the_stack(tmp_path):
    raw = _raw("prod-b300")
    raw["router"] = {**raw["router"], "canaryInterval": 15, "canaryTimeout": 7}
    cfg = load_dict(raw, "t").config
    script = router.canary_script(cfg, plan(cfg))
    assert "OnUnitActiveSec=15s" in script and "--timeout 7" in script and "TimeoutStartSec=44" in script
    assert f"--metrics {paths.CANARY_METRICS}" in script and f"--flags {paths.CANARY_FLAGS}" in script
    assert "RuntimeDirectory=glm-canary\n" in script and "RuntimeDirectoryPreserve=yes" in script
    assert shellcheck(script, tmp_path).returncode == 0
    rules = monitoring.rules(cfg)
    assert "alert: GlmCanaryFailing" in rules and "for: 30s" in rules
    assert "time() - glm_canary_last_run_timestamp_seconds > 52\n" in rules
    raw["monitoring"] = {"enabled": False}
    cfg = load_dict(raw, "t").config
    assert "--metrics" not in router.canary_args(cfg), "no monitoring: no textfile"
    assert f"--collector.textfile.directory={paths.NODE_EXPORTER_TEXTFILES}" in monitoring.node_exporter_defaults(
        load_file(stack_file("prod-b300")).config)


@pytest.mark.parametrize("router_keys, says", [
    ({"gatePort": 8198}, "glm-infra:router.gatePort: port 8200 on b300-3 used twice: decode-0 http and router gate of prefill-2"),
    ({"canaryInterval": 2}, "canaryInterval"),
    ({"canaryTimeout": 0}, "canaryTimeout"),
])
def test_a_gate_port_taken_or_a_bad_canary_setting_is_refused(router_keys, says):
    raw = _raw("prod-b300")
    raw["router"] = {**raw["router"], **router_keys}
    with pytest.raises(StackError) as e:
        load_dict(raw, "t")
    assert says in str(e.value)
