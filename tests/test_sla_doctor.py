"""The SLA gate's judgement and the drift check's host program, without a cluster: AIPerf's real
output (a capture from a sim run) read and judged, the client's config holding no key, Prometheus's
disagreement named; doctor's checks run on files of a temporary folder, an unreachable host."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT, stack_file
from stubs import shellcheck

from glm_infra.stack import load_file
from glm_infra.steps import RenderedFile, Step
from glm_infra.tools import doctor, sla
from glm_infra.tools.cli import main as cli

AIPERF_RESULT = ROOT / "tests" / "fixtures" / "aiperf" / "profile_export_aiperf.json"


@pytest.fixture(autouse=True)
def _sim_tokenizer(tmp_path, monkeypatch):
    """The sim stack names ~/.cache/glm-infra/sim/tokenizer: a HOME where that folder exists."""
    (tmp_path / "home" / ".cache/glm-infra/sim/tokenizer").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


CA = Path(__file__).parent / "fixtures" / "tls" / "ca.crt"


def settings(**kw) -> sla.Settings:
    cfg = load_file(stack_file("sim")).config
    args = argparse.Namespace(url=None, tokenizer=None, contexts=None, output_tokens=None, concurrency=None,
                              requests=None, prometheus=None, no_prometheus=False, cacert=str(CA))
    s = sla.settings(cfg, "sim", args)
    for k, v in kw.items():
        setattr(s, k, v)
    return s


def test_a_real_aiperf_result_is_read_in_seconds():
    b = sla.read_result(AIPERF_RESULT, 262144)
    assert b.name == "256K" and b.requests == 4 and b.errors == 0
    assert b.ttft["mean"] == pytest.approx(1.816, abs=0.001) and b.ttft["p50"] <= b.ttft["p99"]
    assert b.tpot["mean"] == pytest.approx(0.01044, abs=0.0001)


def test_each_failure_names_the_bucket_and_the_metric():
    s = settings()
    b = sla.read_result(AIPERF_RESULT, 262144)
    assert sla.judge(b, s) == []
    assert sla.judge(b, settings(ttft_target=1.5)) == ["256K: mean TTFT 1.816 s > 1.5 s"]
    assert sla.judge(b, settings(tpot_target=0.010)) == ["256K: mean TPOT 10.4 ms > 10 ms"]
    b.prometheus = {"ttft_mean": 1.2, "difference": (1.2 - b.ttft["mean"]) / b.ttft["mean"], "agrees": False}
    (disagree,) = sla.judge(b, s)
    assert disagree.startswith("256K: Prometheus's mean TTFT 1.200 s is -34% from the client's 1.816 s "
                               "(tolerance 15% or 50 ms)")
    # Asked for and unreadable (down, or no sample of the bucket yet): a failure, not a skipped check.
    b.prometheus = {"error": "Prometheus (http://10.0.0.1:9090) saw no prefill request between the bucket's start and end"}
    (unread,) = sla.judge(b, s)
    assert unread == ("256K: Prometheus's view could not be read (Prometheus (http://10.0.0.1:9090) saw no prefill "
                      "request between the bucket's start and end); --no-prometheus skips the cross-check")


@pytest.mark.parametrize("server, client, agrees", [
    (0.154, 0.191, True),   # -19%, 37 ms: the client's own hop at a short context (seen on the sim)
    (2.022, 2.095, True),   # -3%
    (0.120, 0.191, False),  # -37%, 71 ms
    (1.500, 1.816, False),  # -17%, 316 ms
    (2.200, 1.900, False),  # +16%, 300 ms: Prometheus slower than the client is no overhead
])
def test_prometheus_agrees_within_the_share_or_the_clients_fixed_overhead(server, client, agrees):
    difference, ok = sla.prometheus_agrees(server, client, 0.15)
    assert ok is agrees and difference == pytest.approx((server - client) / client)


def test_requests_that_all_failed_are_a_failure_with_the_servers_answer(tmp_path):
    records = tmp_path / "profile_export.jsonl"
    error = {"code": 401, "type": "Unauthorized", "message": '{"error": "missing or invalid API key"}'}
    records.write_text("".join(json.dumps({"metadata": {}, "metrics": {}, "error": error}) + "\n" for _ in range(3)))
    b = sla.failed_records(records, 16384)
    assert sla.judge(b, settings()) == ['16K: 3 of 3 requests failed (401 Unauthorized: {"error": "missing or invalid API key"})']


def test_the_clients_config_holds_no_key_and_the_settings_come_from_the_stack(tmp_path):
    s = settings()
    assert s.url == "https://10.88.0.13:8000" and s.prometheus == "http://10.88.0.13:9090" and s.ca_cert == str(CA)
    assert s.contexts == [16384, 65536, 131072, 262144] and (s.requests, s.concurrency, s.output_tokens) == (4, 2, 64)
    assert s.tokenizer == os.path.expanduser("~/.cache/glm-infra/sim/tokenizer") and s.tokenizer_revision is None
    config = sla.aiperf_config(s, 65536, tmp_path)
    text = json.dumps(config)
    assert config["benchmark"]["endpoint"]["api_key"] == "${OPENAI_API_KEY}"
    assert config["benchmark"]["dataset"]["prompts"]["isl"] == {"mean": 65536, "stddev": 0}
    assert config["benchmark"]["endpoint"]["streaming"] is True and "glm-5.2" in text
    # The production stack: the model's own tokenizer at the pinned revision.
    prod = load_file(stack_file("prod-b300")).config
    p = sla.settings(prod, "prod-b300", argparse.Namespace(**{**vars(argparse.Namespace(
        url=None, tokenizer=None, contexts=None, output_tokens=None, concurrency=None, requests=None,
        prometheus=None, no_prometheus=True, cacert=str(CA)))}))
    assert (p.tokenizer, p.tokenizer_revision) == (prod.model.repo, prod.model.revision) and p.prometheus is None


def test_a_missing_tokenizer_folder_is_named(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GLM_INFRA_API_KEY", "sk-test")
    assert cli(["sla", str(stack_file("sim")), "--out", str(tmp_path), "--cacert", str(CA),
                "--tokenizer", str(tmp_path / "nope")]) == 2
    assert f"the tokenizer folder {tmp_path / 'nope'} (sla.tokenizer or --tokenizer) does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli(["sla", "sim", "--contexts", "0"])
    assert "'0' is not a positive whole number" in capsys.readouterr().err


def test_a_router_with_a_key_wants_it_from_the_environment(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("GLM_INFRA_API_KEY", raising=False)
    assert cli(["sla", str(stack_file("sim")), "--out", str(tmp_path), "--cacert", str(CA)]) == sla.EXIT_ERROR
    err = capsys.readouterr().err
    assert "sla: the router wants its API key: set GLM_INFRA_API_KEY" in err
    assert "pulumi stack output routerApiKey --show-secrets -s sim" in err


def test_a_generated_certificate_wants_its_ca(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GLM_INFRA_API_KEY", "sk-test")
    assert cli(["sla", str(stack_file("sim")), "--out", str(tmp_path)]) == sla.EXIT_ERROR
    assert ("sla: the router's certificate is signed by glm-infra's own CA: pass --cacert FILE (pulumi stack output "
            "routerCaCertificate -s sim > router-ca.pem)") in capsys.readouterr().err
    assert cli(["sla", str(stack_file("sim")), "--out", str(tmp_path), "--cacert", str(tmp_path / "no.pem")]) == 2
    assert f"--cacert {tmp_path / 'no.pem'}: no such file" in capsys.readouterr().err


# --- doctor --------------------------------------------------------------------------------------


def run_program(steps: dict[str, Step], tmp_path: Path) -> doctor.HostResult:
    program = doctor.host_program(steps, quick=False)
    p = subprocess.run(["bash", "-s"], input=program, capture_output=True, text=True, timeout=60)
    return doctor.parse("h", p.stdout)


def test_the_host_program_is_shellcheck_clean(tmp_path):
    cfg = load_file(stack_file("prod-b300")).config
    from glm_infra import hostplan
    from glm_infra.plan.topology import plan

    for host, hs in hostplan.plan_all(cfg, plan(cfg), stack_name="prod-b300").items():
        r = shellcheck(doctor.host_program(hs.steps, quick=True), tmp_path)
        assert r.returncode == 0, f"{host}\n{r.stdout}"


def test_files_are_checked_for_content_mode_and_secrecy(tmp_path):
    plain, secret = tmp_path / "unit.service", tmp_path / "key.env"
    plain.write_text("[Unit]\n")
    plain.chmod(0o644)
    secret.write_text("KEY=real\n")
    secret.chmod(0o600)
    steps = {
        "unit": Step("unit", "true", files=(RenderedFile(str(plain), "[Unit]\n", 0o644),)),
        "key": Step("key", "true", files=(RenderedFile(str(secret), "<secret>", 0o600, secret=True),)),
        "svc": Step("svc", "true", check="echo 'svc: fine'"),
        "bare": Step("bare", "true"),  # nothing to check: not listed
    }
    r = run_program(steps, tmp_path)
    assert [(s.step, s.ok) for s in r.steps] == [("unit", True), ("key", True), ("svc", True)] and r.error is None
    plain.write_text("[Unit]\nedited\n")
    secret.chmod(0o644)
    steps["svc"] = Step("svc", "true", check="echo 'svc: unit is inactive' >&2; exit 3")
    r = run_program(steps, tmp_path)
    by = {s.step: s for s in r.steps}
    assert not by["unit"].ok and by["unit"].lines == [f"{plain} differs from what glm-infra wrote (edited by hand?)"]
    assert not by["key"].ok and by["key"].lines == [f"{secret} is 644 root, not 600 root"]
    assert not by["svc"].ok and by["svc"].lines == ["svc: unit is inactive"]
    plain.unlink()
    plain.mkdir()  # not a file any more
    assert run_program(steps, tmp_path).steps[0].lines == [f"{plain} is missing"]


def test_an_unreachable_host_is_named(capsys, tmp_path, write_stack):
    key = tmp_path / "id"
    key.write_text("not a key: ssh never gets that far\n")
    path = write_stack({
        "glm-infra:hosts": [{"name": "lone", "address": "127.0.0.1", "sshPort": 1, "computeNics": ["mlx5_0"]}],
        "glm-infra:ssh": {"user": "root", "privateKeyPath": str(key)},
        "glm-infra:model": {"repo": "nvidia/GLM-5.2-NVFP4", "revision": "0" * 40, "path": "/mnt/model/glm"},
        "glm-infra:firewall": {"adminCidrs": ["10.20.0.0/24"]},
    })
    assert cli(["doctor", str(path)]) == doctor.EXIT_UNREACHABLE
    out = capsys.readouterr().out
    assert "lone: cannot reach lone over SSH:" in out and "port 1" in out


def test_a_host_whose_ssh_quits_before_reading_the_checks_is_named(capsys, tmp_path, write_stack, monkeypatch):
    """ssh that exits before it reads the checks (seen: a refused port, on a busy machine) closes the pipe
    under doctor's write; a program larger than the pipe's buffer makes that certain."""
    fake = tmp_path / "bin" / "ssh"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexec 0<&-\necho 'ssh: connect to host 10.9.9.9 port 22: Connection refused' >&2\nexit 255\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    monkeypatch.setattr(doctor, "host_program", lambda steps, quick: "#" * (1 << 20) + "\n")
    path = write_stack({
        "glm-infra:hosts": [{"name": "lone", "address": "10.9.9.9", "computeNics": ["mlx5_0"]}],
        "glm-infra:ssh": {"user": "root", "privateKeyPath": str(tmp_path / "id")},
        "glm-infra:model": {"repo": "nvidia/GLM-5.2-NVFP4", "revision": "0" * 40, "path": "/mnt/model/glm"},
        "glm-infra:firewall": {"adminCidrs": ["10.20.0.0/24"]},
    })
    (tmp_path / "id").write_text("unused\n")
    assert cli(["doctor", str(path)]) == doctor.EXIT_UNREACHABLE
    out = capsys.readouterr().out
    assert "lone: cannot reach lone over SSH: ssh: connect to host 10.9.9.9 port 22: Connection refused" in out, out


def _fake_ssh(tmp_path, monkeypatch, body: str) -> Path:
    fake = tmp_path / "bin" / "ssh"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text("#!/bin/sh\n" + body)
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    return tmp_path / "ssh-stdin"


def test_the_gates_canaries_run_on_the_router_host_and_a_mismatch_is_a_failure(tmp_path, monkeypatch):
    from glm_infra.tools import canaries

    cfg = load_file(stack_file("prod-b300")).config
    seen = _fake_ssh(tmp_path, monkeypatch, f'cat > {tmp_path}/ssh-stdin; echo "$@" > {tmp_path}/ssh-args\n'
                     "echo 'b300-3: canary: prefill-0 ok (0.21 s)'\n"
                     "echo \"b300-3: canary: decode-0: answered ' 12, 13' where its reference is ' 11, 12'\" >&2\n"
                     "exit 1\n")
    view = canaries.canary_check(cfg, None, [])
    assert seen.read_text() == "/usr/local/libexec/glm-infra/glm-canary.sh judge\n"
    assert "@10.0.0.13 bash -s" in (tmp_path / "ssh-args").read_text(), "the router host"
    assert not view["pass"] and view["lines"][-1].endswith("where its reference is ' 11, 12'")
    (failure,) = canaries.canary_failures(view, "before")
    assert failure.startswith("canary (before): b300-3: canary: prefill-0 ok") and "decode-0: answered" in failure
    _fake_ssh(tmp_path, monkeypatch, "echo 'ssh: connect to host 10.0.0.13 port 22: No route to host' >&2; exit 255\n")
    with pytest.raises(canaries.CanaryUnreachable, match="cannot reach b300-3 over SSH for the canaries: ssh: connect"):
        canaries.canary_check(cfg, None, [])
