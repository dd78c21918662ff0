"""Each pool's warm-cache relay and the time to ready, as planned and rendered (issue 30, part 4): the
pool's first host serves its warm-start caches once its instances serve, the others copy them (verified by
weights.py), add what they lack to the services' home and only then restart; the relay's name changes with
what vLLM keys its caches by and not with what it does not; ``plan`` shows cold and warm. The behaviour on
hosts is tests/e2e/test_sim_e2e.py's time-to-ready test."""

from __future__ import annotations

import re
import shlex

import pytest
import yaml
from conftest import stack_file

from glm_infra import hostplan
from glm_infra.plan import ports, startup
from glm_infra.plan.topology import plan
from glm_infra.roles import vllm
from glm_infra.spec import paths
from glm_infra.stack import StackError, load_dict, load_file, unprefixed
from glm_infra.tools.cli import main


def _raw(stack: str) -> dict:
    return unprefixed(yaml.safe_load(stack_file(stack).read_text())["config"])


def _steps(cfg, host: str) -> dict:
    return hostplan.host_steps(cfg, plan(cfg), next(h for h in plan(cfg).hosts if h.name == host), stack_name="t").steps


def _argv(command: str) -> list[list[str]]:
    return [shlex.split(part) for part in command.split(" && ")]


def test_the_pools_first_host_serves_its_caches_and_the_others_copy_verify_and_add_them():
    cfg = load_file(stack_file("sim")).config
    key = vllm.warm_cache_key(cfg, "prefill")
    home, folder = paths.home(cfg.runtime.state_dir), paths.warm_cache(cfg.runtime.state_dir, "prefill")
    seed = _steps(cfg, "sim-1")["prefill-warm-cache"]
    shape = re.fullmatch(r"(.+) && (.+) && (\{ systemctl stop .+ \}) && \{ (systemd-run .+) \|\| (\{ .+ \}); \}",
                         seed.create)
    assert shape, seed.create
    stage, prune, stop, relay = (shlex.split(shape.group(i)) for i in (1, 2, 3, 4))
    assert stage[:2] == [paths.WEIGHTS, "stage"] and stage[stage.index("--revision") + 1] == key
    assert stage[stage.index("--role") + 1] == "seed" and stage[stage.index("--source") + 1] == "directory"
    assert stage[stage.index("--from") + 1] == home and stage[stage.index("--path") + 1] == folder
    assert [stage[i + 1] for i, a in enumerate(stage) if a == "--include"] == list(paths.WARM_CACHES)
    assert [stage[i + 1] for i, a in enumerate(stage) if a == "--kind"] == list(paths.WARM_CACHE_KINDS)
    assert "--relay-key-file" not in stage, "the seed's staging copies from its own home: nothing crosses hosts"
    assert prune == [paths.WEIGHTS, "prune", "--revision", key, "--path", folder], "older keys' copies go"
    # Served by a transient unit (the other hosts' steps follow this one), the previous one stopped first;
    # Type=notify: the step waits until the relay listens, and fails (with its last lines) when it cannot.
    unit = paths.warm_cache_relay_unit("prefill")
    assert stop[:3] == ["{", "systemctl", "stop"] and stop[3] == f"{unit}.service"
    assert relay[:3] == ["systemd-run", "--unit", unit] and "--collect" in relay
    assert relay[relay.index("Type=notify") - 1] == "-p"
    served = relay[relay.index(paths.WEIGHTS):]
    assert served == [paths.WEIGHTS, "relay", "--revision", key, "--path", folder, "--bind", "10.88.0.11:7090",
                      "--children", "sim-2", "--relay-key-file", paths.RELAY_KEY]
    assert shlex.split(shape.group(5))[:8] == ["{", "journalctl", "--no-pager", "-o", "cat", "-n", "5", "-u"]
    assert shape.group(5).endswith("the relay of the prefill pool caches did not start (above)' >&2; exit 1; }")
    removed = f"{paths.WEIGHTS} remove --path {folder} && {{ rmdir {cfg.runtime.state_dir}/warm-cache 2>/dev/null || true; }}"
    assert seed.delete == f"{{ systemctl stop {unit}.service 2>/dev/null || true; }} && {removed}"

    peer = _steps(cfg, "sim-2")["prefill-warm-cache"]
    shape = re.fullmatch(r"if (.+?); then (.+?); else rc=\$\?; if \[ \"\$rc\" = 3 \]; then echo (.+) >&2; exit 3; fi; "
                         r"echo (.+) >&2; fi && (.+)", peer.create)
    assert shape, peer.create
    stage, install, forged, message, prune = (shlex.split(shape.group(i)) for i in (1, 2, 3, 4, 5))
    assert stage[stage.index("--role") + 1] == "peer" and stage[stage.index("--peer") + 1] == "http://10.88.0.11:7090"
    assert stage[stage.index("--relay-key-file") + 1] == paths.RELAY_KEY
    assert "--serve" not in stage, "a leaf serves nobody"
    kinds = [x for c in paths.WARM_CACHES for x in ("--include", c)]
    kinds += [x for k in paths.WARM_CACHE_KINDS for x in ("--kind", k)]
    assert install == [paths.WEIGHTS, "install", "--revision", key, "--path", folder, "--into", home, "--owner",
                       cfg.runtime.user, *kinds], "as the services' own, only the kinds relayed"
    # A copy that fails does not hold the instances' restart back: they start cold, and the step says so;
    # one refused as forged fails the step.
    assert message == ["sim-2: warm-cache: no verified copy of the prefill pool's caches from sim-1; its instances here "
                       "start cold"]
    assert forged == ["sim-2: warm-cache: refused what answered for the prefill pool's caches as forged (above): "
                      "nothing installed"]
    assert prune == [paths.WEIGHTS, "prune", "--revision", key, "--path", folder]
    assert "chown" not in peer.create, "nothing given away after the fact: install makes what it adds theirs"
    assert peer.delete == removed
    for step in (seed, peer):
        assert step.triggers[0] == key
        assert step.check.startswith(f"{paths.WEIGHTS} verify --quick --revision {key}")
    assert "decode-warm-cache" not in _steps(cfg, "sim-3"), "a pool on one host relays nothing"
    names = list(_steps(cfg, "sim-2"))
    assert names.index("prefill-3-stop") < names.index("prefill-warm-cache") < names.index("prune-weights")


def test_the_warm_caches_relay_no_code_the_host_runs():
    """The services' user writes these folders: only tuning results and GPU code or its IR cross hosts."""
    import fnmatch

    for name in ("autotune_configs_dp0_rank0.json", "kernel.cubin", "_fwd.ttgir", "_fwd.ptx", "_fwd.llir", "_fwd.ttir"):
        assert any(fnmatch.fnmatchcase(name, k) for k in paths.WARM_CACHE_KINDS), name
    for name in ("__triton_launcher.so", "cuda_utils.so", "computation_graph.py", "model", "x.pyc", "a.pkl", "build.ninja"):
        assert not any(fnmatch.fnmatchcase(name, k) for k in paths.WARM_CACHE_KINDS), name
    assert not any("torch_compile_cache" in c for c in paths.WARM_CACHES), "pickled graphs and generated Python"


@pytest.mark.parametrize("key, value, changes", [
    ("prefill.gpuMemoryUtilization", 0.85, False),  # CacheConfig leaves it out of vLLM's hash
    ("prefill.httpPort", 8200, False),
    ("prefill.shutdownTimeout", 120, False),
    ("prefill.maxNumBatchedTokens", 4096, True),
    ("prefill.speculativeTokens", 2, True),
    ("model.revision", "0000000000000000000000000000000000000002", True),
    ("runtime.vllmVersion", "0.33.1", True),
])
def test_the_relays_name_follows_what_vllm_keys_its_caches_by(key, value, changes):
    raw = _raw("sim")
    before = vllm.warm_cache_key(load_dict(raw, "t").config, "prefill")
    top, rest = key.split(".")
    raw[top] = {**raw.get(top, {}), rest: value}
    after = vllm.warm_cache_key(load_dict(raw, "t").config, "prefill")
    assert (after != before) == changes


def test_the_gpu_of_the_pools_first_host_is_in_the_name():
    raw = _raw("sim")
    before = vllm.warm_cache_key(load_dict(raw, "t").config, "prefill")
    raw["hosts"] = [{**h, "gpuModel": "B300A"} if h["name"] == "sim-1" else h for h in raw["hosts"]]
    raw["capacity"] = {"gpuMemoryGb": 288}
    assert vllm.warm_cache_key(load_dict(raw, "t").config, "prefill") != before


def test_the_relay_port_is_opened_to_the_stacks_hosts_only_where_a_host_serves_children():
    cfg = load_file(stack_file("prod-b300")).config
    relays = startup.warm_cache_relays(cfg)
    listening = [(l.host, l.port, l.audience) for l in ports.listeners(cfg) if "warm-cache" in l.owner]
    expected = [(r.host, startup.relay_port(cfg, role), ports.PEERS) for role, rs in relays.items()
                for r in rs.values() if r.children]
    assert listening == expected and expected
    raw = _raw("prod-b300")
    raw["startup"] = {"warmCache": False}
    cfg = load_dict(raw, "t").config
    assert not startup.warm_cache_relays(cfg) and not [l for l in ports.listeners(cfg) if "warm-cache" in l.owner]
    assert not any(k.endswith("-warm-cache") for h in plan(cfg).hosts
                   for k in hostplan.host_steps(cfg, plan(cfg), h, stack_name="t").steps)


def test_decodes_relay_listens_on_the_next_port():
    raw = _raw("sim")
    raw["decode"] = {**raw["decode"], "hosts": ["sim-3", "sim-2"]}
    raw["prefill"] = {**raw["prefill"], "hosts": ["sim-1"], "instancesPerHost": 1}
    cfg = load_dict(raw, "t").config
    step = _steps(cfg, "sim-3")["decode-warm-cache"]
    assert "--bind 10.88.0.13:7091" in step.create


def test_a_relay_port_taken_is_refused_naming_the_key():
    raw = _raw("prod-b300")
    raw["startup"] = {"relayPort": raw.get("model", {}).get("fanoutPort", 8090)}
    with pytest.raises(StackError) as e:
        load_dict(raw, "t")
    assert "glm-infra:startup.relayPort" in str(e.value)


def test_plan_shows_cold_and_warm_time_to_ready_from_the_stack():
    raw = _raw("prod-b300")
    raw["startup"] = {"weightLoadSeconds": 200, "kernelWarmupColdSeconds": 100, "kernelWarmupWarmSeconds": 10,
                      "graphCaptureSeconds": 15}
    cfg = load_dict(raw, "t").config
    t = startup.time_to_ready(cfg)
    assert (t.cold, t.warm) == (315, 225)
    text = startup.format_time_to_ready(cfg)
    total = next(line for line in text.splitlines() if line.strip().startswith("total"))
    assert total.split()[1:] == ["5.2", "min", "3.8", "min"]
    first, *others = cfg.prefill.hosts
    assert f"{first} starts cold and {', '.join(others)} warm" in text


def test_a_host_in_the_middle_of_the_tree_serves_its_children_while_it_copies():
    raw = _raw("prod-b300")
    extra = [{**raw["hosts"][1], "name": f"b300-{n}", "address": f"10.0.0.{n + 10}"} for n in (4, 5)]
    raw["hosts"] = [*raw["hosts"], *extra]
    raw["prefill"] = {**raw["prefill"], "hosts": ["b300-1", "b300-2", "b300-4", "b300-5"]}
    cfg = load_dict(raw, "t").config
    middle = _steps(cfg, "b300-2")["prefill-warm-cache"].create
    assert "--serve 10.0.0.12:7090 --children b300-5;" in middle
    leaf = _steps(cfg, "b300-5")["prefill-warm-cache"].create
    assert "--peer http://10.0.0.12:7090 --peer http://10.0.0.11:7090;" in leaf, "the parent first, the root last"


def test_glm_infra_plan_ends_with_the_time_to_ready(capsys):
    assert main(["plan", "prod-b300"]) == 0
    out = capsys.readouterr().out
    section = out[out.index("Time to ready"):]
    assert "total                               10.3 min   5.8 min" in section, section
    assert "prefill: after a change of vLLM, flags or revision, b300-1 starts cold and b300-2 warm" in section
