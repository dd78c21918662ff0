"""The SLA gate's judgement and the drift check's host program, without a cluster: AIPerf's real
output (a capture from a sim run) read and judged, the client's config holding no key, Prometheus's
disagreement named; doctor's checks run on files of a temporary folder, an unreachable host."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT, stack_file
from stubs import shellcheck

from glm_infra.stack import load_file
from glm_infra.steps import RenderedFile, Step
from glm_infra.tools import doctor, sla, sla_verdict
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
    records.write_text("".join(json.dumps({"metadata": {}, "metrics": {}, "error": error}) + "\n" for _ in range(4)))
    b = sla.failed_records(records, 16384)
    assert sla.judge(b, settings()) == ['16K: 4 of 4 requests failed (401 Unauthorized: {"error": "missing or invalid API key"})']


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


# --- the gate on missing data: what it asked for, counted; what is absent, partial or unreadable, named ---

S = "profile_export_aiperf.json"
NOT_STREAMED = " (AIPerf measures it on streamed answers only: were they streamed?)"


def summary(**changes) -> str:
    """The real capture with keys replaced (``None``: removed) or, for "metric.field", one field of a metric."""
    d = json.loads(AIPERF_RESULT.read_text())
    for key, value in changes.items():
        where, _, field = key.replace("__", ".").partition(".")
        target, name = (d[where], field) if field else (d, where)
        if value is None:
            target.pop(name, None)
        else:
            target[name] = value
    return json.dumps(d)


@pytest.mark.parametrize("changes, missing", [
    # Not streamed: AIPerf has no TTFT nor inter-token latency (main read both as 0 and passed "TTFT 0.000 s").
    ({"time_to_first_token": None, "inter_token_latency": None},
     [f"{S}: no time_to_first_token{NOT_STREAMED}", f"{S}: no inter_token_latency{NOT_STREAMED}"]),
    ({"time_to_first_token.avg": None}, [f"{S}: time_to_first_token has no avg"]),
    ({"time_to_first_token.avg": "1816"}, [f'{S}: time_to_first_token.avg is "1816", not a number above 0']),
    ({"time_to_first_token.p50": float("nan")}, [f"{S}: time_to_first_token.p50 is NaN, not a number above 0"]),
    ({"time_to_first_token.p99": -3.5}, [f"{S}: time_to_first_token.p99 is -3.5, not a number above 0"]),
    ({"inter_token_latency.avg": 0}, [f"{S}: inter_token_latency.avg is 0, not a number above 0"]),
    ({"inter_token_latency.avg": True}, [f"{S}: inter_token_latency.avg is true, not a number above 0"]),
    ({"inter_token_latency.p50": float("inf")}, [f"{S}: inter_token_latency.p50 is Infinity, not a number above 0"]),
    ({"inter_token_latency.unit": "s"},
     [f'{S}: inter_token_latency.unit is "s", not a time unit AIPerf writes (ns, us, ms, sec)']),
    ({"time_to_first_token.unit": None},
     [f"{S}: time_to_first_token.unit is null, not a time unit AIPerf writes (ns, us, ms, sec)"]),
    ({"time_to_first_token.unit": ["ms"]},
     [f'{S}: time_to_first_token.unit is ["ms"], not a time unit AIPerf writes (ns, us, ms, sec)']),
    ({"time_to_first_token": [1816.0]}, [f"{S}: time_to_first_token is [1816.0], not an object"]),
    # Measured on fewer requests than were answered: the others were not streamed.
    ({"time_to_first_token.count": 2}, [f"{S}: time_to_first_token covers 2 of the 4 answered requests{NOT_STREAMED}"]),
    ({"inter_token_latency.count": None}, [f"{S}: inter_token_latency has no count"]),
    ({"output_sequence_length.count": 5}, [f"{S}: output_sequence_length covers 5 of the 4 answered requests"]),
    ({"output_sequence_length": None}, [f"{S}: no output_sequence_length"]),
    ({"output_sequence_length.unit": "requests"}, [f'{S}: output_sequence_length.unit is "requests", not tokens']),
    ({"output_sequence_length.min": None}, [f"{S}: output_sequence_length has no min"]),
    ({"output_sequence_length.min": -1}, [f"{S}: output_sequence_length.min is -1, not a number of 0 or more"]),
    ({"was_cancelled": True}, [f"{S}: was_cancelled is true (the run was cut short)"]),
    ({"was_cancelled": None}, []),  # an older AIPerf's summary: the counts say whether it ran whole
    ({"is_complete": False, "incomplete_reason": "record-stall watchdog fired"},
     [f"{S}: is_complete is false (record-stall watchdog fired)"]),
    ({"is_complete": "no"}, [f'{S}: is_complete is "no"']),
    ({"error_summary": "none"}, [f'{S}: error_summary is "none", not a list']),
    ({"error_request_count": {"unit": "requests", "avg": None}}, [f"{S}: error_request_count.avg is null, "
                                                                   "not a number of 0 or more"]),
    ({"completed_request_count.avg": 4.5}, [f"{S}: completed_request_count.avg is 4.5, not a whole number"]),
])
def test_an_aiperf_summary_absent_partial_or_unreadable_fails_the_bucket_naming_the_key(changes, missing, tmp_path):
    (tmp_path / S).write_text(summary(**changes))
    b = sla.read_result(tmp_path / S, 262144)
    assert sla.judge(b, settings()) == [f"256K: {m}" for m in missing]
    assert b.missing == missing
    if any("time_to_first_token" in m for m in missing):
        assert b.ttft is None
    if any("inter_token_latency" in m for m in missing):
        assert b.tpot is None
    if any("output_sequence_length" in m for m in missing):
        assert b.output_tokens is None


def test_a_summary_that_is_not_a_json_object_or_not_readable_fails_the_bucket(tmp_path):
    for text, why in (("{", f"{S} is not JSON (Expecting property name enclosed in double quotes: line 1 column 2 "
                            "(char 1))"),
                      ("[1, 2]", f"{S} is not a JSON object"), ("", f"{S} is not JSON (Expecting value: line 1 "
                                                                 "column 1 (char 0))")):
        b = sla.read_summary(text, 16384)
        assert (b.missing, b.ttft, b.tpot, b.requests, b.errors) == ([why], None, None, 0, 0)
        assert sla.judge(b, settings()) == [f"16K: {why}", "16K: 0 of the 4 requests asked for were counted "
                                                           "(the run was cut short)"]
    (tmp_path / S).mkdir()  # a summary that cannot be read: a folder where the file should be
    b = sla.read_result(tmp_path / S, 16384)
    assert b.missing == [f"{S} could not be read ([Errno 21] Is a directory: '{tmp_path / S}')"]
    (tmp_path / "bad.json").write_bytes(b"\xff\xfe{")
    assert sla.read_result(tmp_path / "bad.json", 16384).missing[0].startswith(f"{S} could not be read ('utf-8' codec")


def test_a_run_cut_short_fails_counting_the_requests_asked_for(tmp_path):
    # 3 of 40 requests answered, each measured: main passed it.
    (tmp_path / S).write_text(summary(request_count={"unit": "requests", "avg": 3.0},
                                      completed_request_count={"unit": "requests", "avg": 3},
                                      time_to_first_token__count=3, inter_token_latency__count=3,
                                      output_sequence_length__count=3))
    b = sla.read_result(tmp_path / S, 16384)
    assert sla.judge(b, settings(requests=40)) == ["16K: 3 of the 40 requests asked for were counted (the run was cut "
                                                   "short)"]
    assert (b.requests, b.errors, b.missing) == (3, 0, [])
    assert sla.judge(b, settings(requests=3)) == []
    assert sla.judge(b, settings(requests=2)) == ["16K: 3 requests were counted where 2 were asked for (not this "
                                                  "bucket's run)"]
    # No request_count at all: nothing is measured, the count is named and so is the shortfall.
    b = sla.read_summary(summary(request_count=None), 16384)
    assert (b.requests, b.ttft, b.tpot, b.output_tokens) == (0, None, None, None)
    assert sla.judge(b, settings()) == [f"16K: {S}: no request_count",
                                        "16K: 0 of the 4 requests asked for were counted (the run was cut short)"]
    for bad, why in (([4], "request_count is [4], not an object"), ({"avg": 3.5}, "request_count.avg is 3.5, not a "
                                                                                  "whole number"),
                     ({"unit": "requests"}, "request_count has no avg"),
                     ({"avg": False}, "request_count.avg is false, not a number of 0 or more")):
        assert sla.read_summary(summary(request_count=bad), 16384).missing == [f"{S}: {why}"]
    b = sla.read_summary(summary(request_count={"avg": 0}), 16384)  # nothing answered: nothing to measure
    assert (b.missing, b.ttft, b.requests) == ([], None, 0)


def test_answers_shorter_than_asked_for_fail_the_bucket(tmp_path):
    (tmp_path / S).write_text(summary(output_sequence_length__min=32.0))
    b = sla.read_result(tmp_path / S, 262144)
    assert sla.judge(b, settings()) == ["256K: the shortest answer had 32 output tokens where 64 were asked for "
                                        "(TPOT over fewer tokens is not the SLA's)"]
    assert (b.output_tokens, b.missing) == (32.0, [])
    assert sla.judge(b, settings(output_tokens=32)) == []
    assert sla.read_summary(summary(output_sequence_length__min=0), 262144).output_tokens == 0.0


@pytest.mark.parametrize("unit, avg", [("ns", 1816034577.75), ("us", 1816034.57775), ("ms", 1816.03457775),
                                       ("sec", 1.81603457775)])
def test_each_of_aiperfs_time_units_is_read_in_seconds(unit, avg):
    b = sla.read_summary(summary(time_to_first_token={"unit": unit, "avg": avg, "p50": avg / 2, "p99": avg * 2,
                                                      "count": 4}), 262144)
    assert b.ttft == pytest.approx({"mean": 1.816035, "p50": 0.908017, "p99": 3.632069}, rel=1e-6)
    assert b.tpot == pytest.approx({"mean": 0.010437256, "p50": 0.010424430, "p99": 0.010561558}, rel=1e-6)
    assert b.output_tokens == 64.0 and b.missing == []


def test_failed_requests_are_counted_from_whichever_of_aiperfs_counts_says_more():
    listed = [{"error_details": {"code": 500, "type": "Internal Server Error", "message": "boom"}, "count": 2}]
    b = sla.read_summary(summary(error_request_count={"unit": "requests", "avg": 2.0},
                                 completed_request_count={"unit": "requests", "avg": 6.0}, error_summary=listed), 16384)
    assert (b.requests, b.errors, b.error_summary, b.missing) == (4, 2, listed, [])
    assert sla.judge(b, settings(requests=6)) == ["16K: 2 of 6 requests failed (500 Internal Server Error: boom)"]
    for changes, errors in (({"completed_request_count": {"avg": 7}}, 3),  # completed less answered
                            ({"completed_request_count": {"avg": 3}}, 0),
                            ({"error_request_count": {"avg": 1}}, 1),
                            ({"error_summary": [{"count": 3}, {"count": 1}]}, 4),
                            ({"error_summary": [{"count": 0}, "refused", {"count": True}, {}]}, 4),  # each at least one
                            ({"error_summary": [{"count": 1}]}, 1)):
        assert sla.read_summary(summary(**changes), 16384).errors == errors, changes
    b = sla.read_summary(summary(completed_request_count={"avg": 6}, request_count={"avg": None}), 16384)
    assert b.errors == 0 and b.missing == [f"{S}: request_count.avg is null, not a number of 0 or more"]


def test_records_without_a_summary_are_counted_and_what_is_unreadable_named(tmp_path):
    ok = json.dumps({"metadata": {}, "metrics": {"time_to_first_token": {"value": 12.0, "unit": "ms"}}, "error": None})
    failed = json.dumps({"metadata": {}, "metrics": {}, "error": {"code": 502, "type": "Bad Gateway", "message": "x"}})
    (tmp_path / "profile_export.jsonl").write_text("\n".join([ok, failed, "not json", "", "[1]", ok]) + "\n")
    b = sla.failed_records(tmp_path / "profile_export.jsonl", 65536)
    assert (b.requests, b.errors, b.ttft, b.tpot) == (2, 1, None, None)
    assert b.missing == ["profile_export.jsonl: 2 lines are not JSON objects (the first: line 3)",
                         f"no {S}, though profile_export.jsonl holds 2 answered requests (AIPerf stopped before its "
                         "summary?)"]
    assert sla.judge(b, settings()) == [f"64K: {m}" for m in b.missing] + ["64K: 1 of 3 requests failed (502 Bad "
                                                                           "Gateway: x)",
                                                                           "64K: 3 of the 4 requests asked for were "
                                                                           "counted (the run was cut short)"]
    empty = sla.read_records("\n", 65536)
    assert (empty.missing, empty.requests, empty.errors) == (["profile_export.jsonl holds no request"], 0, 0)
    assert sla.failed_records(tmp_path / "absent.jsonl", 65536).missing == [
        f"profile_export.jsonl could not be read ([Errno 2] No such file or directory: '{tmp_path / 'absent.jsonl'}')"]


def test_a_bucket_measured_by_hand_is_judged_on_what_it_holds():
    s = settings()
    b = sla.Bucket(16384, None, {"mean": 0.01, "p50": 0.01, "p99": 0.01}, 4, 0, output_tokens=64)
    assert sla.judge(b, s) == ["16K: TTFT not measured"]
    b = sla.Bucket(16384, {"mean": 0.0, "p50": 0.0, "p99": 0.0}, None, 4, 0)  # zero is no measurement
    assert sla.judge(b, s) == ["16K: TTFT and TPOT not measured"]
    b.requests = 0  # nothing answered: the count says so, not the metrics
    assert sla.judge(b, s) == ["16K: 0 of the 4 requests asked for were counted (the run was cut short)"]
    b.requests = 4
    b.missing = ["what AIPerf lacked"]  # named by the reader: not named twice
    assert sla.judge(b, s) == ["16K: what AIPerf lacked"]
    # At the targets exactly: within them.
    b = sla.Bucket(16384, {"mean": 2.5, "p50": 2, "p99": 3}, {"mean": 0.02, "p50": 0.02, "p99": 0.03}, 4, 0,
                   output_tokens=64)
    assert sla.judge(b, s) == []
    b.output_tokens = 63.0
    assert sla.judge(b, s) == ["16K: the shortest answer had 63 output tokens where 64 were asked for (TPOT over "
                               "fewer tokens is not the SLA's)"]
    for stat in ({"mean": 1.0, "p50": 1.0}, {"mean": 1.0, "p99": 1.0}, {"p50": 1.0, "p99": 1.0},
                 {"mean": float("inf"), "p50": 1.0, "p99": 1.0}, {"mean": True, "p50": 1.0, "p99": 1.0},
                 {"mean": 1.0, "p50": -1.0, "p99": 1.0}, {"mean": 1.0, "p50": 1.0, "p99": "1"}, None):
        assert not sla_verdict.measured(stat), stat
    assert sla_verdict.measured({"mean": 1, "p50": 1e-9, "p99": 2.0})


def test_what_aiperf_leaves_out_by_default_is_no_failure_and_long_texts_are_cut():
    # An older AIPerf wrote neither is_complete nor error_summary: the counts still say what came back.
    b = sla.read_summary(summary(is_complete=None, error_summary=None), 16384)
    assert (b.missing, b.errors, b.error_summary) == ([], 0, [])
    b = sla.read_summary(summary(is_complete=False, incomplete_reason="r" * 300), 16384)
    assert b.missing == [f"{S}: is_complete is false ({'r' * 200})"]
    b = sla.read_summary(summary(time_to_first_token__unit="u" * 200), 16384)
    shown = '"' + "u" * 99  # the first 100 characters of the JSON string
    assert b.missing == [f"{S}: time_to_first_token.unit is {shown}, not a time unit AIPerf writes (ns, us, ms, sec)"]
    assert sla.read_summary("[]", 65536).context == 65536
    assert sla.read_result(Path("/nonexistent") / S, 65536).context == 65536
    assert sla.failed_records(Path("/nonexistent") / "profile_export.jsonl", 65536).context == 65536
    first = {"code": 502, "type": "Bad Gateway", "message": "first"}
    two = "".join(json.dumps({"error": e}) + "\n" for e in (first, {"code": 503, "message": "second"}))
    assert sla.read_records(two, 16384).error_summary == [first]


@pytest.mark.parametrize("summary_, text", [
    ([], ""),
    (["connection refused"], " (connection refused)"),
    (["x" * 300], f" ({'x' * 200})"),
    ([{"error_details": {"code": 500, "type": "Internal"}, "count": 2}], " (500 Internal: )"),
    ([{"error_details": {"type": "Timeout", "message": "m" * 300}}], f" (Timeout: {'m' * 200})"),
    ([{"code": 429, "message": "slow down"}], " (429: slow down)"),  # the entry itself, no error_details
])
def test_failed_requests_are_named_with_the_first_error(summary_, text):
    b = sla.Bucket(16384, None, None, 2, 2, summary_, output_tokens=64, missing=["m"])
    assert sla.judge(b, settings())[1] == f"16K: 2 of 4 requests failed{text}"


def test_the_gates_line_and_messages_in_milliseconds_and_the_prediction_beside_them():
    b = sla.Bucket(16384, {"mean": 0.5, "p50": 0.25, "p99": 0.75}, {"mean": 0.1, "p50": 0.05, "p99": 0.2}, 4, 0,
                   output_tokens=64, predicted={"ttft_seconds": 2.6991, "tpot_seconds": 0.1, "error": None})
    assert sla.judge(b, settings()) == ["16K: mean TPOT 100.0 ms > 20 ms"]
    b.failures = sla.judge(b, settings())
    assert sla.line(b, settings()) == ("16K: TTFT mean 0.500 s (p50 0.250, p99 0.750); TPOT mean 100.0 ms (p50 50.0, "
                                       "p99 200.0); 4 ok, 0 failed; predicted TTFT 2.70 s, TPOT 100.0 ms — FAIL")
    b.predicted = {"ttft_seconds": None, "tpot_seconds": None, "error": "OOM"}
    assert sla.line(b, settings()).endswith("4 ok, 0 failed — FAIL")


def test_prometheus_agrees_at_its_bounds_exactly():
    assert sla.prometheus_agrees(1.25, 1.0, 0.25) == (0.25, True)  # the share, exactly
    assert sla.prometheus_agrees(1.25, 1.0, 0.24)[1] is False
    assert sla_verdict.PROMETHEUS_FLOOR_S == 0.05
    assert sla.prometheus_agrees(0.065625, 0.015625, 0.15)[1] is True  # 50 ms, exactly (+320 %)
    assert sla.prometheus_agrees(0.0656251, 0.015625, 0.15)[1] is False

def test_a_zero_client_ttft_with_prometheus_on_fails_the_bucket_instead_of_raising():
    # main: prometheus_agrees divided by the client's mean, 0 when AIPerf measured no TTFT.
    difference, agrees = sla.prometheus_agrees(0.5, 0.0, 0.15)
    assert math.isnan(difference) and agrees is False
    for client in (-1.0, float("nan"), None):
        assert sla.prometheus_agrees(0.5, client, 0.15)[1] is False
    s = settings()
    b = sla.read_summary(summary(time_to_first_token__avg=0.0), 16384)
    b.prometheus = sla.hold_prometheus({"ttft_mean": 0.5, "by_pool": {}}, b, s.tolerance)
    assert b.prometheus == {"ttft_mean": 0.5, "by_pool": {}, "unchecked": "the client measured no TTFT to hold it against"}
    assert sla.judge(b, s) == [f"16K: {S}: time_to_first_token.avg is 0.0, not a number above 0",
                               "16K: Prometheus's view was not held against the client's (the client measured no TTFT "
                               "to hold it against); --no-prometheus skips the cross-check"]
    assert sla.line(b, s) == ("16K: TTFT not measured; TPOT mean 10.4 ms (p50 10.4, p99 10.6); 4 ok, 0 failed; "
                              "Prometheus: the client measured no TTFT to hold it against — ok")


def test_prometheus_is_held_against_the_client_only_when_both_measured_a_time():
    s = settings()
    b = sla.read_result(AIPERF_RESULT, 262144)
    view = {"error": "down"}
    assert sla.hold_prometheus(view, b, 0.15) is view
    for mean in (0.0, None, float("nan"), "1.2"):
        held = sla.hold_prometheus({"ttft_mean": mean}, b, 0.15)
        assert held == {"ttft_mean": mean, "unchecked": f"Prometheus's mean TTFT is {mean!r}, not a time"}, mean
    assert sla.hold_prometheus({}, b, 0.15)["unchecked"] == "Prometheus's mean TTFT is None, not a time"
    held = sla.hold_prometheus({"ttft_mean": 1.7, "by_pool": {"prefill": 1.7}}, b, 0.15)
    assert held == {"ttft_mean": 1.7, "by_pool": {"prefill": 1.7}, "agrees": True,
                    "difference": pytest.approx((1.7 - b.ttft["mean"]) / b.ttft["mean"])}
    b.prometheus = held
    assert sla.judge(b, s) == []
    assert sla.line(b, s) == ("256K: TTFT mean 1.816 s (p50 1.813, p99 1.947); TPOT mean 10.4 ms (p50 10.4, p99 10.6); "
                              "4 ok, 0 failed; Prometheus TTFT 1.700 s (-6%) — ok")
    b.prometheus = {"ttft_mean": 1.7}  # a view nobody compared: not a pass
    assert sla.judge(b, s) == ["256K: Prometheus's view was not held against the client's (no comparison was made); "
                               "--no-prometheus skips the cross-check"]
    assert sla.line(b, s).endswith("; Prometheus: no view — ok")
    b.prometheus, b.failures = {"error": "down"}, ["x"]
    assert sla.line(b, s).endswith("; 4 ok, 0 failed; Prometheus: down — FAIL")
    b.prometheus, b.ttft = {"ttft_mean": 1.2, "difference": -0.3, "agrees": False}, None
    assert sla.judge(b, s)[-1] == ("256K: Prometheus's mean TTFT 1.200 s is -30% from the client's none (tolerance "
                                   "15% or 50 ms)")


def _sample(value, **labels) -> dict:
    return {"metric": {"__name__": "vllm:time_to_first_token_seconds_count", **labels}, "value": [1.0, value]}


def _at(count, total) -> dict:
    return {"count": count, "sum": total}


H = "vllm:time_to_first_token_seconds"


def test_prometheus_answers_are_checked_series_by_series():
    a, b = {"instance": "prefill-0"}, {"instance": "prefill-1"}
    start = _at([_sample("10", **a), _sample("5", **b)], [_sample("20.5", **a), _sample("4", **b)])
    end = _at([_sample("12", **a), _sample("7", **b)], [_sample("22.5", **a), _sample("7", **b)])
    assert sla.pool_ttft_mean("prefill", start, end) == pytest.approx((2 + 3) / 4)
    cases = [
        # No series: not "0 requests before the bucket".
        (_at([], start["sum"]), end, f"has no {H}_count series of prefill at the bucket's start"),
        (start, _at(end["count"], None), f"has no {H}_sum series of prefill at the bucket's end"),
        (start, {}, f"has no {H}_count series of prefill at the bucket's end"),
        (_at([_sample("NaN", **a), _sample("5", **b)], start["sum"]), end,
         f'has {H}_count{{instance="prefill-0"}} at the bucket\'s start = NaN, not a number'),
        (start, _at(end["count"], [_sample("+Inf", **a), _sample("7", **b)]),
         f'has {H}_sum{{instance="prefill-0"}} at the bucket\'s end = +Inf, not a number'),
        (_at([{"metric": a}], start["sum"]), end,
         f"answered {H}_count of prefill at the bucket's start with {{'metric': {{'instance': 'prefill-0'}}}}, "
         "not a sample"),
        (_at([{"metric": a, "value": [1.0, "x"]}], start["sum"]), end,
         f"answered {H}_count of prefill at the bucket's start with {{'metric': {{'instance': 'prefill-0'}}, "
         "'value': [1.0, 'x']}, not a sample"),
        (_at(["10"], start["sum"]), end, f"answered {H}_count of prefill at the bucket's start with 10, not a sample"),
        (_at([{"metric": [], "value": [1, "1"]}], start["sum"]), end,
         f"answered {H}_count of prefill at the bucket's start with {{'metric': [], 'value': [1, '1']}}, not a sample"),
        (_at({"instance": "x"}, start["sum"]), end, f"has no {H}_count series of prefill at the bucket's start"),
        # A restart: one instance's counter went back while the pool's sum still grew.
        (start, _at([_sample("12", **a), _sample("1", **b)], end["sum"]),
         f'saw {H}_count{{instance="prefill-1"}} go backwards during the bucket (5 → 1): the instance restarted, '
         "its requests are not all counted"),
        (start, _at(end["count"], [_sample("22.5", **a), _sample("3.5", **b)]),
         f'saw {H}_sum{{instance="prefill-1"}} go backwards during the bucket (4 → 3.5): the instance restarted, '
         "its requests are not all counted"),
        # The set of instances changed: one left, or came with a fresh counter.
        (start, _at([_sample("12", **a)], end["sum"]),
         f'saw the prefill series of {H}_count change during the bucket (gone: instance="prefill-1"; new: none): '
         "an instance restarted, came or went"),
        (start, _at([_sample("12", instance="prefill-2"), _sample("7", instance="prefill-3")], end["sum"]),
         f'saw the prefill series of {H}_count change during the bucket (gone: instance="prefill-0", '
         'instance="prefill-1"; new: instance="prefill-2", instance="prefill-3"): an instance restarted, came or went'),
        (_at([{"metric": a, "value": [1.0, "y" * 300]}], start["sum"]), end,
         f"answered {H}_count of prefill at the bucket's start with {str({'metric': a, 'value': [1.0, 'y' * 300]})[:200]}, "
         "not a sample"),
        (_at([_sample("10", **a)], start["sum"]), end,
         f'saw the prefill series of {H}_count change during the bucket (gone: none; new: instance="prefill-1"): '
         "an instance restarted, came or went"),
        (start, start, "saw no prefill request between the bucket's start and end"),
        (start, _at(end["count"], start["sum"]),
         f"saw 4 prefill requests and no time to their first tokens ({H}_sum grew by 0)"),
    ]
    for s0, s1, why in cases:
        with pytest.raises(sla.PrometheusViewError) as e:
            sla.pool_ttft_mean("prefill", s0, s1)
        assert str(e.value) == why
    # One series, labels in their order, the metric's own name left out.
    one = sla.pool_ttft_mean("decode", _at([_sample("1", pool="decode", host="h")], [_sample("0.5", host="h", pool="decode")]),
                             _at([_sample("2", pool="decode", host="h")], [_sample("0.75", pool="decode", host="h")]))
    assert one == 0.25
    with pytest.raises(sla.PrometheusViewError, match=r'_count\{host="h",pool="decode"\} go backwards'):
        sla.pool_ttft_mean("decode", _at([_sample("3", pool="decode", host="h")], []),
                           _at([_sample("2", pool="decode", host="h")], []))


class _Prometheus:
    """A loopback Prometheus answering each instant query from a script: per query, the answers in turn."""

    def __init__(self, answers):
        import http.server
        import threading
        import urllib.parse

        self.answers, self.seen = answers, []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                q = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)["query"][0]
                outer.seen.append(q)
                part = "count" if "_count{" in q else "sum"
                n = sum(1 for x in outer.seen if x == q) - 1
                body = json.dumps({"status": "success", "data": {"resultType": "vector",
                                                                 "result": outer.answers(q, part, n)}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def _fake_client(tmp_path, monkeypatch, result: str | None, rc: int = 0) -> Path:
    """The SLA client's environment with a stand-in aiperf that writes ``result`` as its summary (none:
    nothing) and exits ``rc``; the plot runs on this python (matplotlib is in the project's venv)."""
    import sys

    bindir = tmp_path / "client" / "bin"
    bindir.mkdir(parents=True)
    python = bindir / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    if result is not None:
        (tmp_path / "summary.json").write_text(result)
    write = f'cp {tmp_path / "summary.json"} "$artifacts/{S}"\n' if result is not None else ""
    (bindir / "aiperf").write_text('#!/bin/sh\nwhile [ "$1" != -f ]; do shift; done\n'
                                   'artifacts="$(dirname "$2")/artifacts"\nmkdir -p "$artifacts"\n'
                                   f"{write}exit {rc}\n")
    for f in (python, bindir / "aiperf"):
        f.chmod(0o755)
    monkeypatch.setattr(sla, "client_env", lambda: python)
    monkeypatch.setattr(sla.planner, "for_gate", lambda *a: ({"buckets": {}}, "no prediction"))
    monkeypatch.setattr(sla.time, "sleep", lambda s: None)  # the scrape the gate waits for: there is none here
    monkeypatch.setenv("GLM_INFRA_API_KEY", "sk-test")
    return python


def _gate(tmp_path, *extra) -> int:
    return cli(["sla", str(stack_file("sim")), "--out", str(tmp_path / "report"), "--cacert", str(CA), "--no-canary",
                "--contexts", "262144", "--quiet", *extra])


def _histogram(start_count, end_count, start_sum, end_sum):
    def answers(q, part, n):
        pool = "prefill" if 'pool="prefill"' in q else "decode"
        value = {"count": (start_count, end_count), "sum": (start_sum, end_sum)}[part][min(n, 1)]
        return [{"metric": {"instance": f"{pool}-0", "pool": pool}, "value": [0, str(value)]}]
    return answers


def test_the_gate_fails_a_bucket_whose_answers_were_not_streamed_with_prometheus_on(tmp_path, monkeypatch, capsys):
    # main: AIPerf's missing TTFT read as 0, then Prometheus's mean divided by it (ZeroDivisionError).
    _fake_client(tmp_path, monkeypatch, summary(time_to_first_token=None, inter_token_latency=None))
    prom = _Prometheus(_histogram(10, 14, 5.0, 11.0))
    try:
        assert _gate(tmp_path, "--prometheus", prom.url) == sla.EXIT_FAIL
    finally:
        prom.close()
    assert set(prom.seen) == {f'{H}_{part}{{stack="sim",pool="{pool}"}}' for part in ("sum", "count")
                              for pool in ("prefill", "decode")}
    out = capsys.readouterr().out
    assert out.splitlines() == [
        f"FAIL 256K: {S}: no time_to_first_token{NOT_STREAMED}",
        f"FAIL 256K: {S}: no inter_token_latency{NOT_STREAMED}",
        "FAIL 256K: Prometheus's view was not held against the client's (the client measured no TTFT to hold it "
        "against); --no-prometheus skips the cross-check"]
    report = json.loads((tmp_path / "report" / "sla.json").read_text())
    (bucket,) = report["buckets"]
    assert bucket["ttft_seconds"] is None and bucket["tpot_seconds"] is None and not bucket["pass"]
    assert bucket["prometheus"]["ttft_mean"] == pytest.approx(3.0) and bucket["output_tokens_min"] == 64.0
    assert (tmp_path / "report" / "sla.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_gate_names_a_prometheus_counter_that_went_backwards(tmp_path, monkeypatch, capsys):
    _fake_client(tmp_path, monkeypatch, AIPERF_RESULT.read_text())
    prom = _Prometheus(_histogram(10, 3, 5.0, 11.0))  # an instance restarted during the bucket
    try:
        assert _gate(tmp_path, "--prometheus", prom.url) == sla.EXIT_FAIL
    finally:
        prom.close()
    assert capsys.readouterr().out.splitlines() == [
        f"FAIL 256K: Prometheus's view could not be read (Prometheus ({prom.url}) saw {H}_count{{instance=\"prefill-0\","
        "pool=\"prefill\"} go backwards during the bucket (10 → 3): the instance restarted, its requests are not all "
        "counted); --no-prometheus skips the cross-check"]


def test_the_gate_passes_a_whole_run_and_fails_one_whose_client_exited_non_zero(tmp_path, monkeypatch, capsys):
    _fake_client(tmp_path, monkeypatch, AIPERF_RESULT.read_text())
    assert _gate(tmp_path, "--no-prometheus") == sla.EXIT_PASS
    assert capsys.readouterr().out == "PASS: every bucket within mean TTFT 2.5 s and mean TPOT 20 ms\n"
    (tmp_path / "client").rename(tmp_path / "client-0")
    _fake_client(tmp_path, monkeypatch, AIPERF_RESULT.read_text(), rc=3)
    assert _gate(tmp_path, "--no-prometheus") == sla.EXIT_FAIL
    assert capsys.readouterr().out == f"FAIL 256K: AIPerf exited 3 ({tmp_path / 'report/256K/aiperf.log'})\n"


def test_an_earlier_runs_results_are_not_read_as_this_ones(tmp_path, monkeypatch):
    python = _fake_client(tmp_path, monkeypatch, None, rc=1)  # this run writes nothing
    stale = tmp_path / "out" / "artifacts"
    stale.mkdir(parents=True)
    (stale / S).write_text(AIPERF_RESULT.read_text())
    with pytest.raises(sla.SlaError, match=r"^256K: AIPerf exited 1 without results"):
        sla.run_client(python, settings(), 262144, tmp_path / "out", "sk-test", False)


def test_a_canary_check_that_names_no_target_is_a_failure(tmp_path, monkeypatch):
    # main: an SSH run that exited 0 and said nothing about the instances passed.
    from glm_infra.tools import canaries

    cfg = load_file(stack_file("prod-b300")).config
    _fake_ssh(tmp_path, monkeypatch, "cat >/dev/null; exit 0\n")
    view = canaries.canary_check(cfg, None, [])
    assert view == {"pass": False, "lines": ["the check on b300-3 exited 0 and named no instance or router: nothing "
                                             "was checked"]}
    assert canaries.canary_failures(view, "after") == ["canary (after): the check on b300-3 exited 0 and named no "
                                                       "instance or router: nothing was checked"]
    _fake_ssh(tmp_path, monkeypatch, "cat >/dev/null; echo 'judge: no such command' >&2; exit 0\n")
    assert canaries.canary_check(cfg, None, [])["lines"] == [
        "the check on b300-3 exited 0 and named no instance or router: nothing was checked (judge: no such command)"]
    _fake_ssh(tmp_path, monkeypatch, "cat >/dev/null; echo 'b300-3: canary: router ok (0.3 s)'; exit 0\n")
    assert canaries.canary_check(cfg, None, []) == {"pass": False, "lines": [
        "b300-3: canary: router ok (0.3 s)",
        "the check on b300-3 said nothing of decode-0, prefill-0, prefill-1, prefill-2, prefill-3: not checked"]}
    every = "; ".join(f"echo 'b300-3: canary: {n} ok (0.3 s)'" for n in
                      ("prefill-0", "prefill-1", "prefill-2", "prefill-3", "decode-0", "router"))
    _fake_ssh(tmp_path, monkeypatch, f"cat >/dev/null; echo \"b300-3: canary: reference of 'x': ' 1'\"; {every}; exit 0\n")
    assert canaries.canary_check(cfg, None, [])["pass"] is True
    _fake_ssh(tmp_path, monkeypatch, f"cat >/dev/null; {every}; exit 1\n")
    assert canaries.canary_check(cfg, None, [])["pass"] is False, "a check that fails never passes"


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
    _fake_ssh(tmp_path, monkeypatch, "exec 0<&-\necho 'ssh: connect to host 10.9.9.9 port 22: Connection refused' >&2\nexit 255\n")
    monkeypatch.setattr(doctor, "host_program", lambda steps, quick: "#" * (1 << 20) + "\n")
    path = _lone_host_stack(write_stack, tmp_path)
    assert cli(["doctor", str(path)]) == doctor.EXIT_UNREACHABLE
    out = capsys.readouterr().out
    assert "lone: cannot reach lone over SSH: ssh: connect to host 10.9.9.9 port 22: Connection refused" in out, out


def _lone_host_stack(write_stack, tmp_path) -> Path:
    """A stack of one host (lone, 10.9.9.9) and no pools, its SSH key a file that is never used."""
    (tmp_path / "id").write_text("unused\n")
    return write_stack({
        "glm-infra:hosts": [{"name": "lone", "address": "10.9.9.9", "computeNics": ["mlx5_0"]}],
        "glm-infra:ssh": {"user": "root", "privateKeyPath": str(tmp_path / "id")},
        "glm-infra:model": {"repo": "nvidia/GLM-5.2-NVFP4", "revision": "0" * 40, "path": "/mnt/model/glm"},
        "glm-infra:firewall": {"adminCidrs": ["10.20.0.0/24"]},
    })


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
    assert not view["pass"] and view["lines"][1].endswith("where its reference is ' 11, 12'")
    assert view["lines"][-1] == "the check on b300-3 said nothing of prefill-1, prefill-2, prefill-3, router: not checked"
    (failure,) = canaries.canary_failures(view, "before")
    assert failure.startswith("canary (before): b300-3: canary: prefill-0 ok") and "decode-0: answered" in failure
    _fake_ssh(tmp_path, monkeypatch, "echo 'ssh: connect to host 10.0.0.13 port 22: No route to host' >&2; exit 255\n")
    with pytest.raises(canaries.CanaryUnreachable, match="cannot reach b300-3 over SSH for the canaries: ssh: connect"):
        canaries.canary_check(cfg, None, [])


def test_a_host_whose_checks_say_nothing_is_not_called_without_drift(capsys, tmp_path, write_stack, monkeypatch):
    """ssh that exits 0 without running the program (a shell that reads nothing, a forced command) once
    counted as "no drift: 0 steps": every step must say how it stands."""
    _fake_ssh(tmp_path, monkeypatch, "cat >/dev/null; exit 0\n")
    path = _lone_host_stack(write_stack, tmp_path)
    assert cli(["doctor", str(path)]) == doctor.EXIT_UNREACHABLE
    out = capsys.readouterr().out
    assert re.search(r"^lone: the checks said nothing of \d+ of \d+ steps \(preflight, \S+, \S+ \.\.\.\): not checked "
                     r"\(exit 0\)$", out, re.M), out
    # Some steps said, the rest not: named too.
    _fake_ssh(tmp_path, monkeypatch, f"cat >/dev/null; echo '{doctor.BEGIN} preflight'; echo '{doctor.END} preflight 0'\n")
    assert cli(["doctor", str(path)]) == doctor.EXIT_UNREACHABLE
    assert "lone: the checks said nothing of " in capsys.readouterr().out


def test_doctor_checks_a_host_by_the_key_the_stack_gives(tmp_path):
    cfg = load_file(stack_file("sim")).config
    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"
    hosts = [cfg.hosts[0].model_copy(update={"host_key": key}),
             cfg.hosts[1].model_copy(update={"host_key": key, "ssh_port": 2222}), cfg.hosts[2]]
    cfg = cfg.model_copy(update={"hosts": hosts})
    known = doctor.known_hosts(cfg, str(tmp_path))
    assert Path(known).read_text() == f"10.88.0.11 {key}\n[10.88.0.12]:2222 {key}\n", "port 22: the name alone"
    argv = doctor.ssh_argv(cfg, "sim-1", None, ["LogLevel=ERROR"], known)
    assert argv[argv.index(f"UserKnownHostsFile={known}") + 2] == "StrictHostKeyChecking=yes"
    assert "StrictHostKeyChecking=accept-new" not in argv
    assert argv.index("StrictHostKeyChecking=yes") < argv.index("LogLevel=ERROR"), "ssh takes the first value given"
    argv = doctor.ssh_argv(cfg, "sim-3", None, [], known)
    assert "StrictHostKeyChecking=accept-new" in argv and not any(a.startswith("UserKnownHostsFile") for a in argv)
