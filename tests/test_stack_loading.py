"""Loading a stack: from a file, from a Pulumi run's config, or as component Args — every way a stack
can be unreadable gets its own clear message, and lines point into the file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pulumi
import pytest
import yaml
from conftest import ROOT, stack_config, stack_file

from glm_infra import stack as st
from glm_infra.plan.validate import Problem
from glm_infra.stack import StackError, load_file
from glm_infra.tools.cli import main


def problems(path: Path) -> list[str]:
    with pytest.raises(StackError) as e:
        load_file(path)
    return str(e.value).splitlines()


def test_a_file_that_cannot_be_read(tmp_path):
    assert problems(tmp_path / "nope.yaml") == [
        f"{tmp_path / 'nope.yaml'}: invalid stack (1 problem)",
        f"  {tmp_path / 'nope.yaml'}: (file): cannot read: No such file or directory",
    ]


@pytest.mark.parametrize("text, expected", [
    ("config:\n  glm-infra:hosts: [a\n", "(yaml): YAML syntax error at line 3, column 1: expected ',' or ']', but got '<stream end>'"),
    ("- a list\n", "(file): a stack file is a mapping with a 'config' key"),
    ("config: [1, 2]\n", "config: must be a mapping of keys to values"),
])
def test_a_file_that_is_not_a_stack(tmp_path, text, expected):
    p = tmp_path / "Pulumi.x.yaml"
    p.write_text(text)
    lines = problems(p)
    assert lines[0] == f"{p}: invalid stack (1 problem)" and lines[1].startswith(f"  {p}"), lines
    assert lines[1].split(": ", 1)[1] == expected, lines


def test_an_empty_file_lacks_the_required_keys(tmp_path):
    p = tmp_path / "Pulumi.x.yaml"
    p.write_text("")
    assert {l.split(": ", 2)[2] for l in problems(p)[1:]} == {"required key is missing"}
    assert [l.split(": ", 2)[1] for l in problems(p)[1:]] == ["glm-infra:hosts", "glm-infra:ssh", "glm-infra:model"]


def test_lines_point_at_the_key_or_its_nearest_parent(tmp_path):
    text = "config:\n  glm-infra:hosts:\n    - name: a\n      address: 10.0.0.1\n    - name: b\n      address: x..y\n"
    lines = st._key_lines(text)
    assert lines == {"glm-infra:hosts": 2, "glm-infra:hosts[0]": 3, "glm-infra:hosts[0].name": 3,
                     "glm-infra:hosts[0].address": 4, "glm-infra:hosts[1]": 5, "glm-infra:hosts[1].name": 5,
                     "glm-infra:hosts[1].address": 6}
    assert st._line_for(lines, "glm-infra:hosts[1].address") == 6
    assert st._line_for(lines, "glm-infra:hosts[1].gpus") == 5, "a key not in the file: its parent's line"
    assert st._line_for(lines, "glm-infra:prefill.tp") is None
    assert st._line_for(lines, "glm-infra:hosts") == 2
    assert st._line_for(lines, "glm-infra:hosts[7]") == 2, "an item past the list: the list's line"
    nested = st._key_lines("config:\n  glm-infra:capacity:\n    modelFacts:\n      kv_lora_rank: 512\n"
                           "  glm-infra:hosts:\n    - name: a\n      computeNics: [mlx5_0]\n")
    assert st._line_for(nested, "glm-infra:capacity.modelFacts.num_hidden_layers") == 3
    assert st._line_for(nested, "glm-infra:hosts[0].computeNics[1]") == 7
    assert st._key_lines("- not a mapping\n") == {} and st._key_lines("other: 1\n") == {}
    assert st._key_lines("environment:\n  imports: [a]\n") == {}, "only the keys under config"
    e = StackError("f.yaml", [Problem("glm-infra:hosts[1].address", "bad"), Problem("glm-infra:ssh", "missing")], lines)
    assert str(e) == "f.yaml: invalid stack (2 problems)\n  f.yaml:6: glm-infra:hosts[1].address: bad\n  f.yaml: glm-infra:ssh: missing"


@pytest.mark.parametrize("err, expected", [
    ({"loc": ("hosts", 0, "gpus"), "msg": "Input should be a valid integer", "type": "int_parsing", "input": "x"},
     ("glm-infra:hosts[0].gpus", "Input should be a valid integer (got 'x')")),
    ({"loc": ("prefill", "tpp"), "msg": "Extra inputs are not permitted", "type": "extra_forbidden", "input": 1},
     ("glm-infra:prefill.tpp", "unknown key")),
    ({"loc": ("model", "repo"), "msg": "Field required", "type": "missing", "input": {}},
     ("glm-infra:model.repo", "required key is missing")),
    ({"loc": ("ssh",), "msg": "Value error, set exactly one", "type": "value_error", "input": {"user": "x"}},
     ("glm-infra:ssh", "set exactly one")),
    ({"loc": ("router", "apiKey"), "msg": "Value error, must be a secret", "type": "value_error", "input": "hunter2"},
     ("glm-infra:router.apiKey", "must be a secret")),
    ({"loc": ("hosts", "function-after[_name()]", 1), "msg": "bad", "type": "x", "input": [1]},
     ("glm-infra:hosts[1]", "bad")),
    ({"loc": (), "msg": "bad", "type": "x"}, ("glm-infra:(root)", "bad")),
    ({}, ("glm-infra:(root)", "invalid")),
])
def test_pydantic_errors_read_as_key_paths_without_echoing_secrets(err, expected):
    p = st._from_pydantic(err)
    assert (p.path, p.message) == expected


def test_unknown_top_keys_get_a_suggestion_or_the_list():
    assert st._closest("prefil", st.STACK_KEYS) == " (did you mean glm-infra:prefill?)"
    assert st._closest("zzz", st.STACK_KEYS) == " (known keys: " + ", ".join(st.STACK_KEYS) + ")"


PREFILL_HOLDS_ONE = ("glm-infra:prefill: a prefill rank holds 1 request(s) of the maximum context (1,048,576 tokens), "
                     "fewer than capacity.warnBelow 2")  # a DP4 prefill rank at GLM-5.2's 1M positions


def host_keys_unset(*hosts: str) -> str:
    return (f"glm-infra:hosts[].hostKey is not set for {', '.join(hosts)}: whatever answers SSH on their addresses is "
            "taken for them (and gets the steps' secret files); set each host's public key (its "
            "/etc/ssh/ssh_host_ed25519_key.pub, read over a path you trust)")


def decode_on_one_host(host: str, warm: str = "5.8 min", cold: str = "10.3 min") -> str:
    return (f"glm-infra:decode.hosts: decode runs on one host, {host}: its reboot stops generation (every request needs "
            f"a decode instance) for its boot and then about {warm} until its instances are ready ({cold} after a "
            "change of vLLM, flags or revision; glm-infra plan shows the phases); a second decode host keeps it "
            "serving meanwhile (stacks/Pulumi.prod-b300-2decode.yaml)")


NO_DEAD_MANS_SWITCH = ("glm-infra:monitoring.deadMansSwitchUrl is not set: when b300-3 (Prometheus and Alertmanager), "
                       "or either of them, is down, no alert fires and nothing pages; set a dead man's switch, a "
                       "heartbeat service outside the stack that pages when the Watchdog alert stops arriving")
MONITORING_BESIDE_THE_ROUTER = ("glm-infra:monitoring.host: b300-3 also runs the router, so its reboot stops serving "
                                "and every alert at once; put Prometheus and Alertmanager on another host "
                                "(monitoring.host)")


def test_warnings_name_the_key():
    loaded = load_file(stack_file("prod-b300"))
    assert loaded.warnings == (
        PREFILL_HOLDS_ONE,
        decode_on_one_host("b300-3"),
        "glm-infra:firewall.adminCidrs: 192.0.2.0/24 is a documentation network (RFC 5737, RFC 3849), a placeholder "
        "nobody connects from: replace it with the networks you and the machine running pulumi connect from (a "
        "bastion, a VPN)",
        "glm-infra:router.allowedCidrs: 203.0.113.0/24 is a documentation network (RFC 5737, RFC 3849), a "
        "placeholder nobody connects from: replace it with the networks your clients (or their load balancer) "
        "connect from",
        NO_DEAD_MANS_SWITCH.replace("b300-3", "b300-1"),  # (monitoring.host: b300-1, no router: no warning of it)
        host_keys_unset("b300-1", "b300-2", "b300-3"),
        "glm-infra:router.apiKey is not set: the router's public port accepts any client",
        "glm-infra:model.revision: 'main' is not a commit SHA; pin a commit so every host serves the same bytes",
    )
    # The sim stack's startup.* keys are its stand-in's seconds (6 s cold warmup, 0.5 s warm, 1 s capture).
    sim = load_file(stack_file("sim"))
    assert sim.warnings[0] == PREFILL_HOLDS_ONE and sim.warnings[4] == host_keys_unset("sim-1", "sim-2", "sim-3")
    assert sim.warnings[2:4] == (NO_DEAD_MANS_SWITCH.replace("b300-3", "sim-3"),
                                 MONITORING_BESIDE_THE_ROUTER.replace("b300-3", "sim-3"))
    assert sim.warnings[1].startswith("glm-infra:decode.hosts: decode runs on one host, sim-3: ") and len(sim.warnings) == 5


def test_a_pool_on_one_host_is_warned_about_with_its_time_to_ready():
    """Issue 40: a pool whose one host is all of it stops its part of every request while that host reboots,
    for at least its time to ready; the times are the stack's startup.* keys."""
    def one_host(name: str, **startup) -> list[str]:
        raw = st.unprefixed(stack_config(name))
        raw.setdefault("startup", {}).update(startup)
        return [w for w in st.load_dict(raw, name).warnings if "runs on one host" in w]

    assert one_host("prod-b300") == [decode_on_one_host("b300-3")]
    assert one_host("prod-b300", weightLoadSeconds=60, kernelWarmupColdSeconds=600, kernelWarmupWarmSeconds=5,
                    graphCaptureSeconds=4) == [decode_on_one_host("b300-3", warm="69 s", cold="11.1 min")]
    assert one_host("prod-b300-2decode") == [], "two decode hosts: a reboot halves generation, no warning"
    two = one_host("b300-2node")
    assert [w.split(":")[1] for w in two] == ["prefill.hosts", "decode.hosts"]
    assert two[0].startswith("glm-infra:prefill.hosts: prefill runs on one host, b300-1: its reboot stops every new "
                             "request (nothing prefills it) for its boot") and "(stacks/" not in two[0]
    (dev,) = one_host("b300-1node-colocated")
    assert dev.startswith("glm-infra:colocated.hosts: colocated runs on one host, b300-dev: its reboot stops serving ")
    hosts_only = {k: v for k, v in st.unprefixed(stack_config("prod-b300")).items()
                  if k not in ("prefill", "decode", "router")}
    assert not [w for w in st.load_dict(hosts_only, "h", serve=False).warnings if "runs on one host" in w]


def test_monitoring_that_would_page_nobody_when_it_goes_down_is_warned_about():
    """Issue 40: no dead man's switch, or Prometheus on the router's host, leaves that host's death unpaged."""
    def warned(name: str, serve: bool = True, **monitoring) -> list[str]:
        raw = st.unprefixed(stack_config(name))
        if not serve:
            raw = {k: v for k, v in raw.items() if k not in ("prefill", "decode", "colocated", "router")}
        raw.setdefault("monitoring", {}).update(monitoring)
        return [w for w in st.load_dict(raw, name, serve=serve).warnings if w.startswith("glm-infra:monitoring.")]

    no_switch, beside_router = NO_DEAD_MANS_SWITCH, MONITORING_BESIDE_THE_ROUTER
    assert warned("sim") == [no_switch.replace("b300-3", "sim-3"), beside_router.replace("b300-3", "sim-3")]
    assert warned("prod-b300") == [no_switch.replace("b300-3", "b300-1")]  # prod-b300's monitoring.host
    # On a router host of two: its reboot stops every alert while the other router host serves.
    assert warned("prod-b300", host="b300-2")[1] == (
        "glm-infra:monitoring.host: b300-2 also runs the router, so its reboot stops every alert while the other router "
        "host serves; put Prometheus and Alertmanager on another host (monitoring.host)")
    assert warned("prod-b300", host="b300-3") == [no_switch, beside_router.replace(
        "serving and every alert at once", "every alert while the other router host serves")]
    assert warned("prod-b300", deadMansSwitchUrl="https://hc-ping.example/x") == []
    assert warned("prod-b300", enabled=False) == []
    assert warned("prod-b300", serve=False, deadMansSwitchUrl="https://hc-ping.example/x") == []  # no router yet


def test_a_host_key_given_is_kept_as_one_line_and_silences_its_warning(write_stack):
    from conftest import stack_config

    cfg = stack_config("sim")
    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl  root@sim "
    for i in (0, 2):
        cfg["glm-infra:hosts"][i]["hostKey"] = key
    loaded = load_file(write_stack(cfg))
    assert [h.host_key for h in loaded.config.hosts] == [key.strip(), None, key.strip()]
    assert host_keys_unset("sim-2") in loaded.warnings


def test_validate_warns_of_a_branch_and_refuses_it_under_strict(capsys):
    """A stack pinning model.revision to a branch deploys whatever the branch points to that day."""
    assert main(["validate", "prod-b300"]) == 0
    assert "warning: glm-infra:model.revision: 'main' is not a commit SHA" in capsys.readouterr().err
    assert main(["validate", "--strict", "prod-b300", "sim"]) == 1
    out = capsys.readouterr()
    source = "stacks/Pulumi.prod-b300.yaml"
    assert out.err.startswith(f"{source}: invalid stack under --strict (1 problem)\n  {source}: glm-infra:model.revision: "
                              "'main' is not a commit SHA; pin a commit so every host serves the same bytes\n")
    assert "stacks/Pulumi.sim.yaml: ok" in out.out and "prod-b300.yaml: ok" not in out.out
    assert main(["validate", "--strict", "sim"]) == 0  # pinned to a commit


def test_stack_names_resolve_in_the_project_around_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "Pulumi.yaml").write_text("name: mine\n")
    (tmp_path / "stacks").mkdir()
    (tmp_path / "stacks" / "Pulumi.own.yaml").write_text("config: {}\n")
    (tmp_path / "deep").mkdir()
    monkeypatch.chdir(tmp_path / "deep")
    assert st.resolve_stack_file("own").resolve() == (tmp_path / "stacks" / "Pulumi.own.yaml")
    assert st.resolve_stack_file("prod-b300").resolve() == ROOT / "stacks" / "Pulumi.prod-b300.yaml", "then this source tree's"
    assert st.resolve_stack_file("x.yaml") == Path("x.yaml") and st.resolve_stack_file("a/b") == Path("a/b")
    assert st.resolve_stack_file("nope") == tmp_path / "stacks" / "Pulumi.nope.yaml", "missing: named in the project"
    monkeypatch.chdir(ROOT)
    assert st.resolve_stack_file("sim") == Path("stacks/Pulumi.sim.yaml"), "shown relative to the current directory"
    assert st.resolve_stack_file("own", project_dir=tmp_path) == tmp_path / "stacks" / "Pulumi.own.yaml"


def pulumi_run_config(monkeypatch, config: dict, secret: list[str], stack: str = "t") -> None:
    monkeypatch.setattr(pulumi, "get_stack", lambda: stack)
    pulumi.runtime.set_all_config({k: v if isinstance(v, str) else json.dumps(v) for k, v in config.items()}, secret)


def test_the_config_of_a_pulumi_run(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    cfg = stack_config("sim")
    cfg["glm-infra:router"]["apiKey"] = "sk-decrypted"
    cfg["command:other"] = "left alone"
    pulumi_run_config(monkeypatch, cfg, ["glm-infra:router"])
    loaded = st.load_pulumi_config()
    assert loaded.source == "stacks/Pulumi.t.yaml" and loaded.config.router.api_key.plaintext == "sk-decrypted"
    # A secret set in plaintext (`config set` without --secret) is refused, naming the fix.
    pulumi_run_config(monkeypatch, cfg, [])
    with pytest.raises(StackError) as e:
        st.load_pulumi_config()
    assert "glm-infra:router.apiKey: is not a secret; set it with: pulumi config set --secret --path " \
           "'glm-infra:router.apiKey' < FILE" in str(e.value)
    assert "sk-decrypted" not in str(e.value)
    # Lines come from the stack file when there is one.
    (tmp_path / "stacks").mkdir()
    (tmp_path / "stacks" / "Pulumi.t.yaml").write_text(yaml.safe_dump({"config": {**cfg, "glm-infra:prefill": {
        **cfg["glm-infra:prefill"], "tp": 0}}}, sort_keys=False))
    bad = {**cfg, "glm-infra:prefill": {**cfg["glm-infra:prefill"], "tp": 0}}
    pulumi_run_config(monkeypatch, bad, ["glm-infra:router"])
    with pytest.raises(StackError) as e:
        st.load_pulumi_config()
    line = next(i for i, l in enumerate((tmp_path / "stacks/Pulumi.t.yaml").read_text().splitlines(), 1) if "tp: 0" in l)
    assert f"stacks/Pulumi.t.yaml:{line}: glm-infra:prefill.tp:" in str(e.value)


def test_run_config_from_the_environment_and_unknown_keys(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    cfg = stack_config("sim")
    model = cfg.pop("glm-infra:model")
    pulumi_run_config(monkeypatch, {**cfg, "glm-infra:modell": "x"}, ["glm-infra:router"])
    monkeypatch.setenv("PULUMI_CONFIG", json.dumps({"glm-infra:model": json.dumps(model)}))
    with pytest.raises(StackError) as e:
        st.load_pulumi_config()
    assert [p.path for p in e.value.problems] == ["glm-infra:modell"], "the model came from PULUMI_CONFIG"
    assert e.value.problems[0].message == "unknown key (did you mean glm-infra:model?)"


def test_component_args_load_like_the_file_in_either_spelling():
    """Cluster(…, {"hosts": …}) takes the keys without their prefix, camelCase or snake_case."""
    raw = st.unprefixed(stack_config("prod-b300"))
    from_file = load_file(stack_file("prod-b300")).config
    assert st.load_dict(raw, "Cluster 'glm'").config == from_file
    snake = {"hosts": raw["hosts"], "ssh": {"private_key_path": "~/.ssh/id_ed25519"}, "model": raw["model"],
             "monitoring": {"prometheus_port": 9091}, "firewall": {"admin_cidrs": ["10.20.0.0/24"]},
             "router": {"host": "b300-3", "allowed_cidrs": ["10.30.0.0/16"]}}
    loaded = st.load_dict(snake, "Cluster 'glm'")
    assert loaded.config.monitoring.prometheus_port == 9091 and loaded.config.prefill is not None
    assert loaded.warnings and loaded.source == "Cluster 'glm'"


def test_component_args_that_are_not_a_stack_name_the_component():
    with pytest.raises(StackError) as e:
        st.load_dict(["hosts"], "Cluster 'glm'")  # type: ignore[arg-type]
    assert str(e.value) == "Cluster 'glm': invalid stack (1 problem)\n  Cluster 'glm': (args): must be a mapping of glm-infra keys to values"
    raw = {"hosts": [{"name": "a", "address": "10.0.0.1", "computeNics": ["mlx5_0"]}], "sssh": {}, "model_x": 1}
    with pytest.raises(StackError) as e:
        st.load_dict(raw, "Cluster 'glm'")
    lines = str(e.value).splitlines()
    assert "  Cluster 'glm': glm-infra:sssh: unknown key (did you mean glm-infra:ssh?)" in lines
    assert any(line.startswith("  Cluster 'glm': glm-infra:model_x: unknown key") for line in lines)
    assert "  Cluster 'glm': glm-infra:ssh: required key is missing" in lines, lines
    assert [sum(f"glm-infra:{k}:" in line for line in lines) for k in ("sssh", "model_x")] == [1, 1], "each named once"
    # Without pools (Hosts): the pools and the router are not judged, the rest is.
    hosts_only = {"hosts": raw["hosts"], "ssh": {"privateKeyPath": "k"}, "model": {"repo": "r/m", "revision": "0" * 40,
                                                                                    "path": "/mnt/m"},
                  "firewall": {"adminCidrs": ["10.20.0.0/24"]}}
    assert st.load_dict(hosts_only, "Hosts 'h'", serve=False).config.hosts[0].name == "a"


@pytest.mark.parametrize("revision,warned", [("0" * 40, False), ("ab" * 20, False), ("0" * 39, True),
                                             ("A" * 40, True), ("g" * 40, True), ("X" * 40, True), ("main", True)])
def test_only_a_full_lowercase_commit_sha_is_a_pin(revision, warned):
    cfg = load_file(stack_file("sim")).config
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"revision": revision})})
    warnings = st._warnings(cfg)
    assert any(w.startswith("glm-infra:model.revision:") for w in warnings) == warned, warnings


def test_an_unknown_gpu_or_version_is_said_to_go_unchecked():
    cfg = load_file(stack_file("sim")).config
    hosts = [cfg.hosts[0].model_copy(update={"gpu_model": "NVIDIA X900"}), *cfg.hosts[1:]]
    runtime = cfg.runtime.model_copy(update={"vllm_version": "9.9.0", "router_version": "9.9.0"})
    model = cfg.model.model_copy(update={"weight_format": "nvfp4"})
    warnings = st._warnings(cfg.model_copy(update={"hosts": hosts, "runtime": runtime, "model": model}))
    assert "glm-infra:hosts[0].gpuModel: 'NVIDIA X900' is not a GPU glm-infra knows; the NVFP4 weights are not checked against it" in warnings
    assert any(w.startswith("glm-infra:runtime.vllmVersion: glm-infra knows the choices of 0.33.0 only; the model's "
                            "parsers, the all2all backend, the CUDA graph mode are not checked against 9.9.0") for w in warnings), warnings
    assert any(w.startswith("glm-infra:runtime.routerVersion:") and "router.policy are not checked against 9.9.0" in w
               for w in warnings), warnings
    # "NVIDIA " is only a prefix: a known model with it is checked, not warned about.
    known = [cfg.hosts[0].model_copy(update={"gpu_model": "NVIDIA B300 SXM6"}), *cfg.hosts[1:]]
    assert not any("gpuModel" in w for w in st._warnings(cfg.model_copy(update={"hosts": known, "model": model})))


@pytest.mark.parametrize("warn_below,warned", [(2, True), (1, False)])
def test_a_pool_holding_fewer_max_requests_than_warn_below_is_warned(write_stack, warn_below, warned):
    """At GLM-5.2's 1M context a prod-b300 prefill rank holds exactly one request (a decode rank two):
    below warnBelow 2, not below 1."""
    cfg = stack_config("prod-b300")
    cfg["glm-infra:capacity"] = {"warnBelow": warn_below}
    got = [w for w in load_file(write_stack(cfg)).warnings if "capacity.warnBelow" in w]
    assert got == ([PREFILL_HOLDS_ONE] if warned else [])


def test_a_yml_file_is_a_path_and_a_name_is_looked_up_in_the_nearest_project_only(tmp_path, monkeypatch):
    (tmp_path / "Pulumi.yaml").write_text("name: outer\n")
    (tmp_path / "stacks").mkdir()
    (tmp_path / "stacks" / "Pulumi.outer-only.yaml").write_text("config: {}\n")
    (tmp_path / "inner").mkdir()
    (tmp_path / "inner" / "Pulumi.yaml").write_text("name: inner\n")
    monkeypatch.chdir(tmp_path / "inner")
    assert st.resolve_stack_file("x.yml") == Path("x.yml")
    assert st.resolve_stack_file("outer-only") == Path("stacks/Pulumi.outer-only.yaml"), "not the outer project's"


def test_a_control_character_is_a_yaml_error_without_a_position(tmp_path):
    p = tmp_path / "Pulumi.x.yaml"
    p.write_text("config:\n  glm-infra:hosts: \x07\n")
    assert problems(p)[1].split(": ", 1)[1].startswith(
        "(yaml): YAML syntax error at unknown position: unacceptable character #x0007")


def test_hosts_without_pools_get_no_capacity_warnings():
    """The KV room is the pools' (Hosts serves nothing); the same hosts as a Cluster are warned."""
    cfg = stack_config("prod-b300")
    raw = {"hosts": cfg["glm-infra:hosts"], "ssh": cfg["glm-infra:ssh"], "firewall": cfg["glm-infra:firewall"],
           "router": {"host": "b300-3", "allowedCidrs": ["10.30.0.0/16"]}, "model": {**cfg["glm-infra:model"], "revision": "0" * 40}}
    assert not [w for w in st.load_dict(raw, "Hosts 'h'", serve=False).warnings if "capacity.warnBelow" in w]
    assert [w for w in st.load_dict(raw, "Cluster 'c'").warnings if "capacity.warnBelow" in w]


def test_the_kv_room_is_judged_from_every_way_in_unless_left_out(write_stack):
    """A decode rank too small for one request: refused from a file and from component Args alike;
    ``capacity=False`` (what ``capacity fetch`` loads the stack with) takes it, without the room's warnings."""
    cfg = stack_config("prod-b300")
    cfg["glm-infra:decode"].update(dp=2, instancesPerHost=4)
    path = write_stack(cfg)
    assert "glm-infra:decode: a decode rank (tp1 dp2) cannot hold one request" in "\n".join(problems(path))
    raw = st.unprefixed(cfg)
    with pytest.raises(StackError, match="glm-infra:decode: a decode rank"):
        st.load_dict(raw, "Cluster 'glm'")
    loaded = load_file(path, capacity=False)
    assert loaded.config.decode.dp == 2 and not [w for w in loaded.warnings if "capacity.warnBelow" in w]
