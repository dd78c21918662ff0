"""glm-infra propose: which of aiconfigurator's configurations glm-infra deploys (pure), and a proposal
from prod-b300 through validate, render and the engine's preview like any committed stack."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import yaml
from conftest import ROOT, stack_config, stack_file

from glm_infra.plan import proposal
from glm_infra.spec.config import StackConfig
from glm_infra.stack import load_file
from glm_infra.tools.cli import main

S = proposal.Shape


def _candidate(prefill: proposal.Shape, decode: proposal.Shape, replicas: int = 1, rank: int = 1):
    return proposal.Candidate(rank=rank, prefill=prefill, decode=decode, replicas=replicas, ttft_ms=2300.0,
                              tpot_ms=17.0, tokens_per_s_per_gpu=240.8, concurrency=56.0)


@pytest.mark.parametrize("shape, reason", [
    (S(tp=1, pp=2, dp=1, moe_tp=1, moe_ep=1, workers=4), "prefill uses pipeline parallel (pp2), which glm-infra does "
                                                         "not deploy"),
    (S(tp=1, pp=1, dp=16, moe_tp=1, moe_ep=16, workers=1), "a prefill worker spans 16 GPUs, more than a host's 8"),
    (S(tp=2, pp=1, dp=2, moe_tp=2, moe_ep=2, workers=1), "prefill's experts are split tp2 × ep2: vLLM either spreads "
                                                         "them over every rank (-ep) or shards each over every rank"),
    (S(tp=1, pp=1, dp=4, moe_tp=1, moe_ep=4, workers=2), None),  # -ep over the 4 ranks
    (S(tp=2, pp=1, dp=4, moe_tp=8, moe_ep=1, workers=1), None),  # each expert sharded over the 8 ranks
    (S(tp=2, pp=1, dp=1, moe_tp=2, moe_ep=1, workers=4), None),
])
def test_what_glm_infra_cannot_run_is_named(shape, reason):
    assert proposal.why_not(shape, "prefill", 8) == reason


@pytest.mark.parametrize("workers, gpus, per_host, hosts", [
    (8, 2, 4, 2),  # four 2-GPU workers fill a host
    (2, 4, 2, 1),
    (5, 2, 1, 5),  # 4 fit, but a pool runs as many on each of its hosts: 5 is only 1 × 5
    (6, 2, 3, 2),
    (1, 8, 1, 1),
])
def test_workers_go_evenly_onto_as_few_hosts_as_fit(workers, gpus, per_host, hosts):
    assert proposal.layout(workers, gpus, 8) == proposal.Layout(workers, per_host, hosts)


def test_a_configuration_needing_more_hosts_than_given_is_refused():
    # 2 replicas of 4 prefill workers (tp2) and 1 decode (dp4): 16 + 8 GPUs on 2 + 1 hosts
    c = _candidate(S(2, 1, 1, 2, 1, 4), S(1, 1, 4, 1, 4, 1), replicas=2)
    assert proposal.why_not_candidate(c, 8, 3) is None
    assert proposal.why_not_candidate(c, 8, 2) == ("its 8 prefill and 2 decode workers take 2 + 1 hosts (a host "
                                                   "serves one pool), more than the 2 given")


def test_a_row_of_aiconfigurators_table_is_a_candidate_with_its_replicas():
    row = {"(p)tp": 2, "(p)pp": 1, "(p)dp": 1, "(p)moe_tp": 2, "(p)moe_ep": 1, "(p)workers": 4,
           "(d)tp": 1, "(d)pp": 1, "(d)dp": 4, "(d)moe_tp": 1, "(d)moe_ep": 4, "(d)workers": 1,
           "num_total_gpus": 12, "ttft": 2295.169, "tpot": 16.924, "tokens/s/gpu_cluster": 240.845, "concurrency": 56}
    c = proposal.Candidate.from_row(1, row, 24)
    assert (c.replicas, c.prefill.gpus, c.decode.label, c.ttft_ms) == (2, 2, "tp1 pp1 dp4 moe tp1/ep4", 2295.169)


def test_the_search_tries_one_stage_of_at_most_a_hosts_gpus():
    exp = proposal.experiment("nvidia/GLM-5.2-NVFP4", "b300_sxm", "vllm", "0.24.0", "SILICON", 24, 8, 16384, 1024,
                              2500.0, 20.0, 3, 1.8)
    assert exp["prefill_pp_candidates"] == exp["decode_pp_candidates"] == [1]
    assert exp["prefill_num_gpu_candidates"] == exp["decode_num_gpu_candidates"] == [1, 2, 4, 8]
    assert (exp["serving_mode"], exp["total_gpus"], exp["ttft"], exp["tpot"], exp["nextn_accepted"]) == (
        "disagg", 24, 2500.0, 20.0, 1.8)
    assert exp["decode_model_path"] == "nvidia/GLM-5.2-NVFP4" and "model_path" not in exp


def test_the_document_keeps_the_bases_keys_and_replaces_the_topology():
    base = {"config": stack_config("prod-b300")}
    base["config"]["glm-infra:monitoring"] = {"host": "b300-3"}
    config = StackConfig.model_validate({k.removeprefix("glm-infra:"): v for k, v in base["config"].items()})
    c = _candidate(S(2, 1, 1, 2, 1, 4), S(1, 1, 4, 1, 4, 1), replicas=1)  # 8 + 4 GPUs: one host each
    doc = proposal.stack_document(base, config, c, 8, {"ttftSeconds": 2.0}, 3, 1, 262400)["config"]
    assert [h["name"] for h in doc["glm-infra:hosts"]] == ["b300-1", "b300-2"]
    assert doc["glm-infra:prefill"] == {**stack_config("prod-b300")["glm-infra:prefill"], "hosts": ["b300-1"],
                                        "instancesPerHost": 4, "tp": 2, "dp": 1, "ep": False, "speculativeTokens": 1}
    assert doc["glm-infra:decode"]["all2allBackend"] == "flashinfer_nvlink_two_sided", "the base's own settings stay"
    assert (doc["glm-infra:decode"]["hosts"], doc["glm-infra:decode"]["dp"], doc["glm-infra:decode"]["ep"]) == (
        ["b300-2"], 4, True)
    assert doc["glm-infra:router"]["host"] == "b300-2" and doc["glm-infra:model"]["maxModelLen"] == 262400
    assert doc["glm-infra:sla"]["ttftSeconds"] == 2.0
    assert "host" not in doc["glm-infra:monitoring"], "a host the proposal does not use is no longer named"
    assert base["config"]["glm-infra:prefill"]["tp"] == 1, "the base document is not changed"


# --- through aiconfigurator, validate, render and the engine ----------------------------------------------


@pytest.fixture(scope="module")
def proposed(tmp_path_factory):
    out = tmp_path_factory.mktemp("propose") / "Pulumi.proposed.yaml"
    p = subprocess.run([str(ROOT / "venv/bin/glm-infra"), "propose", "--from", "prod-b300", "--out", str(out),
                        "--fresh"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return out, p


def test_propose_writes_a_stack_that_validates_and_renders(proposed, tmp_path):
    out, p = proposed
    assert "searching 24 B300 GPUs (3 hosts of stacks/Pulumi.prod-b300.yaml) for ISL 16384, OSL 1024" in p.stderr
    text = out.read_text()
    assert text.startswith("# Proposed by `glm-infra propose --from prod-b300 --hosts 3 --isl 16384 --osl 1024 "
                           "--ttft 2.5 --tpot 0.02 --mtp 3`: aiconfigurator 0.12.0")
    assert p.stdout.startswith(f"wrote {out}: prefill ")
    doc = yaml.safe_load(text)["config"]
    base = stack_config("prod-b300")
    assert doc["glm-infra:ssh"] == base["glm-infra:ssh"] and doc["glm-infra:drivers"] == base["glm-infra:drivers"]
    loaded = load_file(out)
    assert loaded.config.prefill.tp * loaded.config.prefill.dp <= 8
    assert main(["validate", "--no-predict", str(out)]) == 0
    assert main(["plan", str(out)]) == 0
    assert main(["render", str(out), "--out", str(tmp_path / "render")]) == 0
    assert (tmp_path / "render" / loaded.config.router.host).is_dir()
    # What propose wrote, predict reads back: the same TTFT and TPOT it printed for the ISL it searched.
    assert main(["predict", str(out), "--json"]) == 0


def test_the_same_search_again_comes_from_the_cache(proposed, tmp_path, capsys):
    out, first = proposed
    assert "from the cache" not in first.stderr and "ranking of this same search" not in first.stderr
    again = tmp_path / "Pulumi.proposed.yaml"
    assert main(["propose", "--from", "prod-b300", "--out", str(again)]) == 0
    err = capsys.readouterr().err
    assert "aiconfigurator's ranking of this same search, from " in err and "/planner/search-" in err
    assert again.read_text() == out.read_text()


def test_the_proposal_previews_through_the_engine(proposed, tmp_path):
    out, _ = proposed
    assert subprocess.run([str(ROOT / "scripts/toolchain"), "--engine-only"], capture_output=True).returncode == 0
    project = tmp_path / "project"
    project.mkdir()
    for name in ("Pulumi.yaml", "__main__.py", "glm_infra"):
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, project / name)
    (project / "stacks").mkdir()
    shutil.copy(out, project / "stacks" / "Pulumi.proposed.yaml")
    (project / "venv").symlink_to(ROOT / "venv")
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(home / ".ssh/glm-infra_ed25519")],
                   check=True)
    cache = os.environ.get("GLM_INFRA_CACHE", os.path.expanduser("~/.cache/glm-infra"))
    env = dict(os.environ, HOME=str(home), GLM_INFRA_CACHE=cache, PULUMI_HOME=f"{cache}/pulumi-home",
               PULUMI_CONFIG_PASSPHRASE="glm-infra-test", PULUMI_BACKEND_URL=f"file://{tmp_path / 'state'}")
    (tmp_path / "state").mkdir()

    def pulumi(args: str) -> subprocess.CompletedProcess:
        p = subprocess.run(["bash", "-c", f". {ROOT}/scripts/lib/pulumi-env.sh; cd {project}; pulumi {args}"],
                           env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, f"pulumi {args}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        return p

    pulumi("stack init proposed --secrets-provider passphrase")
    steps = json.loads(pulumi("preview -s proposed --json --non-interactive").stdout)["steps"]
    services = [s["urn"].rsplit("::", 1)[-1] for s in steps
                if s["op"] == "create" and s["urn"].split("::")[-2].endswith("glm-infra:index:VllmService")]
    cfg = load_file(out).config
    want = len(cfg.prefill.hosts) * cfg.prefill.instances_per_host + len(cfg.decode.hosts) * cfg.decode.instances_per_host
    assert len(services) == want, services


def test_no_proposal_without_a_configuration_that_meets_the_sla(tmp_path, capsys):
    out = tmp_path / "Pulumi.none.yaml"
    assert main(["propose", "--from", "prod-b300", "--hosts", "1", "--ttft", "0.01", "--out", str(out)]) == 1
    assert "no configuration of the 0 that meet the SLA can glm-infra deploy on 1 hosts (none meets it: loosen " \
           "--ttft/--tpot or give more hosts)" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [], "nothing written"


def test_more_hosts_than_the_base_has_is_named_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "Pulumi.bad.yaml"
    assert main(["propose", "--from", "prod-b300", "--out", str(out), "--hosts", "4"]) == 2
    assert "stacks/Pulumi.prod-b300.yaml: --hosts 4: the stack has 3" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("args, message", [
    (["--isl", "0"], "'0' is not a positive whole number"),
    (["--hosts", "two"], "'two' is not a positive whole number"),
    (["--tpot", "-1"], "'-1' is not a positive number of seconds"),
    (["--ttft", "nan"], "'nan' is not a positive number of seconds"),
    (["--mtp", "-1"], "'-1' is not a whole number, 0 or more"),
])
def test_bad_arguments_are_named_and_write_nothing(tmp_path, capsys, args, message):
    out = tmp_path / "Pulumi.bad.yaml"
    with pytest.raises(SystemExit) as e:
        main(["propose", "--from", "prod-b300", "--out", str(out), *args])
    assert e.value.code == 2 and message in capsys.readouterr().err and not out.exists()


def test_a_folder_that_is_not_there_is_named(tmp_path, capsys):
    out = tmp_path / "nowhere" / "Pulumi.x.yaml"
    assert main(["propose", "--from", "prod-b300", "--out", str(out)]) == 2
    assert f"{out}: no folder {out.parent} to write it in" in capsys.readouterr().err


def test_an_existing_file_is_kept_without_force(tmp_path, capsys):
    out = tmp_path / "Pulumi.kept.yaml"
    out.write_text("mine\n")
    assert main(["propose", "--from", str(stack_file("prod-b300")), "--out", str(out)]) == 2
    assert "exists (use --force to replace it)" in capsys.readouterr().err and out.read_text() == "mine\n"
