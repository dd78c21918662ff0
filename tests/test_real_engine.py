"""The real-engine check's lines (glm_infra/tools/real_engine.py, issue 41): generated from what a stack renders,
changed only where one GPU on one machine forces it, each change listed; a flag added to the units reaches the
check without editing it; nothing of the deployed hosts (addresses, NICs, GPU lists) is left in them."""

from __future__ import annotations

import json
import re
import shlex

import pytest
from conftest import stack_config, stack_file
from stubs import shellcheck

from glm_infra import hostplan
from glm_infra.plan.topology import plan
from glm_infra.spec import paths
from glm_infra.stack import load_dict, load_file, unprefixed
from glm_infra.tools import real_engine
from glm_infra.tools.cli import main

MODEL = "/srv/check/tiny-glm"


def rendered(name: str, cfg=None) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Each instance's unit as rendered: (ExecStart argv, Environment=)."""
    cfg = cfg or load_file(stack_file(name)).config
    p = plan(cfg)
    steps = hostplan.plan_all(cfg, p, stack_name=name)
    out = {}
    for inst in p.instances:
        text = steps[inst.host].files()[paths.unit(inst.unit)].content
        argv, env, _ = real_engine.unit_lines(text)
        out[inst.name] = (argv, env)
    return out


def flags(argv: list[str]) -> dict[str, str | None]:
    """Each --flag (or -f) with its value (None for a switch)."""
    out: dict[str, str | None] = {}
    i = 3  # vllm serve MODEL
    while i < len(argv):
        word = argv[i]
        name, eq, value = word.partition("=")
        if eq:
            out[name] = value
        elif i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            out[name] = argv[i + 1]
            i += 1
        else:
            out[name] = None
        i += 1
    return out


@pytest.mark.parametrize("stack", ["prod-b300", "sim", "b300-2node", "b300-prefill-dp2"])
def test_every_rendered_flag_and_variable_reaches_the_check_or_is_listed(stack):
    cfg = load_file(stack_file(stack)).config
    units = rendered(stack)
    lines = real_engine.lines(cfg, stack, MODEL)
    assert [line.role for line in lines] == ["prefill", "decode", "router"]
    for line in lines[:2]:
        argv, env = units[line.instance]
        changed = {c.what for c in line.changes}
        want, got = flags(argv), flags(line.argv)
        for name, value in want.items():
            canonical = {"--data-parallel-size": "-dp", "--tensor-parallel-size": "-tp"}.get(name, name)
            if canonical in changed:
                assert name in got and got[name] != value, (line.instance, name)
            else:
                assert got.get(name, "<absent>") == value, (line.instance, name, value, got.get(name))
        assert line.argv[:3] == ["vllm", "serve", MODEL]
        assert set(got) - set(want) <= {"--api-server-count"}
        listed = changed | {c.what for c in line.left_out}
        for name, value in env.items():
            assert line.env.get(name) == value or name in listed, (line.instance, name)


def test_one_gpu_and_loopback_only_and_the_deployed_mode_of_several_api_servers():
    cfg = load_file(stack_file("prod-b300")).config
    addresses = {h.address for h in cfg.hosts}
    for line in real_engine.lines(cfg, "prod-b300", MODEL)[:2]:
        text = " ".join(line.argv) + " " + json.dumps(line.env)
        assert not [a for a in addresses if a in text], line.instance
        assert line.env["CUDA_VISIBLE_DEVICES"] == "0"
        got = flags(line.argv)
        assert (got["-dp"], got["-tp"], got["--host"]) == ("1", "1", "127.0.0.1")
        # prod-b300 runs -dp 4 and 8: one API server per rank, so the check keeps several (no process_* metric).
        assert got["--api-server-count"] == "2"
        assert float(got["--gpu-memory-utilization"]) * 2 <= 0.9, "both instances fit on the one GPU"
        assert line.env["UCX_TLS"] == "tcp,cuda_copy,cuda_ipc" and "UCX_IB_GID_INDEX" not in line.env
        assert line.env["VLLM_API_KEY"] == "${GLM_CHECK_API_KEY}" and line.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
        assert {c.what for c in line.left_out} >= {"UCX_IB_GID_INDEX", f"EnvironmentFile={paths.NIC_AFFINITY_ENV}"}
        kv = json.loads(got["--kv-transfer-config"])
        assert kv["kv_connector"] == "NixlConnector" and kv["kv_role"] == {"prefill": "kv_producer", "decode": "kv_consumer"}[line.role]
    prefill, decode, router = real_engine.lines(cfg, "prod-b300", MODEL)
    assert prefill.port != decode.port != router.port
    # The router's rendered flags, its workers the check's two instances, straight, and its key the check's.
    got = flags(["vllm-router", "", "", *router.argv[1:]])
    assert (got["--prefill"], got["--decode"]) == (f"http://127.0.0.1:{prefill.port}", f"http://127.0.0.1:{decode.port}")
    assert router.argv.count("--prefill") == 1 and "--vllm-pd-disaggregation" in router.argv
    assert got["--policy"] == cfg.router.policy and got["--prometheus-host"] == "127.0.0.1"
    assert router.env["OPENAI_API_KEY"] == "${GLM_CHECK_API_KEY}"
    assert not [a for a in addresses if a in " ".join(router.argv)]
    assert prefill.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] != decode.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]


def test_a_flag_or_variable_added_to_the_units_reaches_the_check_without_editing_it():
    raw = unprefixed(stack_config("prod-b300"))
    raw["decode"]["extraArgs"] = ["--max-num-seqs", "77"]
    raw["decode"]["env"] = {"VLLM_SOMETHING_NEW": "yes"}
    cfg = load_dict(raw, "prod-b300").config
    decode = real_engine.lines(cfg, "prod-b300", MODEL)[1]
    assert flags(decode.argv)["--max-num-seqs"] == "77"
    assert decode.env["VLLM_SOMETHING_NEW"] == "yes"


def test_a_colocated_stack_is_checked_with_its_one_instance():
    cfg = load_file(stack_file("b300-1node-colocated")).config
    (line,) = real_engine.lines(cfg, "b300-1node-colocated", MODEL)
    assert line.role == "colocated" and float(flags(line.argv)["--gpu-memory-utilization"]) == 0.85


def test_a_unit_that_is_not_vllm_serve_is_refused_by_name():
    with pytest.raises(ValueError, match="no ExecStart"):
        real_engine.unit_lines("[Service]\nType=exec\n")


def test_the_command_writes_the_lines_a_person_can_run_and_every_change(tmp_path, capsys):
    out = tmp_path / "check"
    assert main(["real-engine", "prod-b300", "--out", str(out), "--model", MODEL]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["CHANGES.md", "decode.argv.json", "decode.env.json",
                                                    "expected-metrics.json",
                                                    "prefill.argv.json", "prefill.env.json", "router.argv.json",
                                                    "router.env.json", "serve-decode.sh", "serve-prefill.sh",
                                                    "serve-router.sh"]
    argv = json.loads((out / "decode.argv.json").read_text())
    script = (out / "serve-decode.sh").read_text()
    assert shellcheck(script, tmp_path).returncode == 0
    # The script runs exactly the argv (the runner's placeholders expanded by the shell).
    last = script.rstrip().splitlines()[-1]
    assert shlex.split(last) == argv
    changes = (out / "CHANGES.md").read_text()
    assert re.search(r"\| `-dp` \| `8` \| `1` \| one GPU", changes)
    assert "| `UCX_IB_GID_INDEX` | `3` |" in changes
    assert main(["real-engine", "prod-b300", "--out", str(out), "--gpu-share", "1.5"]) == 2
    assert "--gpu-share 1.5: must be in (0, 1]" in capsys.readouterr().err
