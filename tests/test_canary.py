"""The canary program (glm_infra/agent/canary/) against fake OpenAI-compatible servers on loopback: a
reference recorded only when the instances agree (never an instance's own first answer), a wrong answer,
a DP rank that hangs, ranks that disagree, a new identity and the transition to it, the operator's accept,
the API key from its file, the metrics and flags it writes, and bad or damaged input."""

from __future__ import annotations

import http.server
import itertools
import json
import re
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from glm_infra.agent import canary


class Fake:
    """Answers /v1/completions: ``answers`` in turn (round robin, as vLLM spreads concurrent requests
    over its DP ranks); an answer "HANG" sleeps past the canary's timeout, an int is that HTTP status."""

    def __init__(self, *answers: object) -> None:
        self.answers = itertools.cycle(answers)
        self.lock = threading.Lock()
        self.seen: list[dict] = []
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.seen.append({"path": self.path, "body": body, "auth": self.headers.get("Authorization"),
                                      "rank": self.headers.get("X-data-parallel-rank")})
                    answer = next(fake.answers)
                if answer == "HANG":
                    time.sleep(1.5)
                    return
                status, data = (answer, b'{"error": "nope"}') if isinstance(answer, int) else (
                    200, json.dumps({"choices": [{"text": answer}]}).encode())
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@contextmanager
def serving(fake: Fake):
    t = threading.Thread(target=fake.server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    t.start()
    try:
        yield fake.url
    finally:
        fake.server.shutdown()
        fake.server.server_close()
        t.join()


def targets(tmp_path: Path, *entries: dict, identity: str = "rev1|vllm 0.33.0", key: str | None = None) -> Path:
    spec = {"identity": identity, "model": "glm-5.2", "targets": list(entries)}
    if key is not None:
        (tmp_path / "vllm.env").write_text(f"VLLM_API_KEY={key}\n")
        spec["api_key_file"] = str(tmp_path / "vllm.env")
    path = tmp_path / "targets.json"
    path.write_text(json.dumps(spec))
    return path


def run(tmp_path: Path, spec: Path, capsys, timeout: str = "0.5") -> tuple[int, str, str]:
    rc = canary.main(["run", "--targets", str(spec), "--state", str(tmp_path / "state"), "--metrics",
                      str(tmp_path / "canary.prom"), "--timeout", timeout])
    out = capsys.readouterr()
    return rc, out.out, out.err


def inst(name: str, url: str, **more: object) -> dict:
    """An instance target, as glm-infra renders it (behind a gate, one canary per DP rank)."""
    return {"name": name, "role": name.split("-")[0], "url": url, "gate": True, **more}


@contextmanager
def instances(*answers: object):
    """One fake instance per answer (an answer as Fake takes it), their URLs."""
    fakes = [Fake(a) for a in answers]
    stack = [serving(f) for f in fakes]
    urls = [c.__enter__() for c in stack]
    try:
        yield urls
    finally:
        for c in reversed(stack):
            c.__exit__(None, None, None)


def reference(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "state" / "reference.json").read_text())


def test_a_reference_is_the_answer_the_instances_agree_on_and_each_is_held_to_it(tmp_path, capsys):
    fake = Fake(" 11, 12")
    with serving(fake) as a, instances(" 11, 12", " 11, 12", " 11, 12") as (b, c, r):
        spec = targets(tmp_path, inst("prefill-0", a, requests=4), inst("prefill-1", b), inst("decode-0", c),
                       {"name": "router", "role": "router", "url": r, "requests": 2}, key="k3y")
        rc, out, err = run(tmp_path, spec, capsys)
        assert rc == 0 and err == "", err
        assert re.search(r"canary: reference of 'rev1\|vllm 0.33.0': ' 11, 12', agreed by decode-0, prefill-0, "
                         r"prefill-1 \(3 of 3 instances\) on \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC: recorded\n", out), out
        for name in ("prefill-0", "prefill-1", "decode-0", "router"):
            assert re.search(rf"canary: {name} ok \(\d+\.\d\d s\)\n", out)
        assert reference(tmp_path)["agreed"] == ["decode-0", "prefill-0", "prefill-1"] and \
            reference(tmp_path)["of"] == 3 and reference(tmp_path)["text"] == " 11, 12"
        before = reference(tmp_path)
        rc, out, err = run(tmp_path, spec, capsys)
        assert rc == 0 and ": recorded" not in out and "canary: reference of 'rev1|vllm 0.33.0'" in out
        assert reference(tmp_path) == before, "recorded once"
    assert len(fake.seen) == 8 and {s["path"] for s in fake.seen} == {"/v1/completions"}
    assert fake.seen[0]["body"] == {"model": "glm-5.2", "prompt": canary.PROMPT, "max_tokens": canary.MAX_TOKENS,
                                    "temperature": 0}
    assert {s["auth"] for s in fake.seen} == {"Bearer k3y"}
    prom = (tmp_path / "canary.prom").read_text()
    assert 'glm_canary_ok{target="prefill-0",role="prefill"} 1\n' in prom
    assert 'glm_canary_ok{target="router",role="router"} 1\n' in prom
    assert "# TYPE glm_canary_seconds gauge" in prom and "glm_canary_last_run_timestamp_seconds " in prom
    assert "glm_canary_transition 0\n" in prom


def test_an_instance_never_becomes_its_own_reference(tmp_path, capsys):
    """Issue 38: under a new identity an instance's first answer was recorded as its reference ("ok:
    reference recorded"), a wrong one too, and passed for ever. One instance, or instances that do not agree:
    nothing is recorded, every target fails naming the answers, nobody is taken out or put back."""
    flags = tmp_path / "flags"
    flags.mkdir()
    (flags / "prefill-1.failing").write_text("an earlier run\n")

    def go(spec: Path) -> tuple[int, str, str]:
        rc = canary.main(["run", "--targets", str(spec), "--state", str(tmp_path / "state"), "--flags", str(flags),
                          "--metrics", str(tmp_path / "canary.prom"), "--timeout", "0.5"])
        out = capsys.readouterr()
        return rc, out.out, out.err

    with instances(" wrong") as (a,):
        rc, out, err = go(targets(tmp_path, inst("decode-0", a)))
    assert rc == 1 and "reference recorded" not in out and not (tmp_path / "state" / "reference.json").exists()
    assert ("canary: decode-0: no reference of 'rev1|vllm 0.33.0' agreed yet: ' wrong' from decode-0 (at least 2 and "
            "more than half of the 1 instances must agree; one cannot be held against another: canary.py accept "
            "takes its answer)\n") in err
    with instances(" 11, 12", " wrong", 503, " other") as (a, b, c, d):
        rc, out, err = go(targets(tmp_path, inst("prefill-0", a), inst("prefill-1", b), inst("prefill-2", c),
                                  inst("decode-0", d)))
    assert rc == 1 and not (tmp_path / "state" / "reference.json").exists()
    assert ("prefill-0: no reference of 'rev1|vllm 0.33.0' agreed yet: ' 11, 12' from prefill-0; ' wrong' from "
            "prefill-1; ' other' from decode-0 (at least 2 and more than half of the 4 instances must agree)\n") in err
    assert 'prefill-2: 1 of 1 canaries failed: HTTP 503' in err
    assert sorted(p.name for p in flags.iterdir()) == ["prefill-1.failing"], "judged against nothing: flags as they were"
    assert 'glm_canary_ok{target="prefill-0",role="prefill"} 0\n' in (tmp_path / "canary.prom").read_text()


@pytest.mark.parametrize(("answers", "recorded"), [
    ((" a", " a", " b", " b"), None),  # half is not more than half
    ((" a", " a", " b", " c", "DOWN"), None),  # 2 of 5: the instances that do not answer count too
    ((" a", " a", " a", " b", "DOWN"), " a"),
    ((" a", " a"), " a"),
    ((" a", " b"), None),
    ((" a", " a", " a", 503, 503, 503), None),  # 3 of 6
])
def test_more_than_half_of_the_instances_and_two_at_least_must_agree(tmp_path, capsys, answers, recorded):
    live = [a for a in answers if a != "DOWN"]
    with instances(*live) as urls:
        with serving(Fake(" a")) as gone:
            pass  # nothing listens there now
        urls = list(urls) + [gone] * (len(answers) - len(live))
        spec = targets(tmp_path, *(inst(f"prefill-{i}", u) for i, u in enumerate(urls)))
        rc, out, err = run(tmp_path, spec, capsys)
    path = tmp_path / "state" / "reference.json"
    assert (reference(tmp_path)["text"] if path.exists() else None) == recorded
    if recorded is not None:
        agreeing = [f"prefill-{i}" for i, a in enumerate(answers) if a == recorded]
        assert reference(tmp_path)["agreed"] == agreeing and reference(tmp_path)["of"] == len(answers)
        for i, a in enumerate(answers):
            if a not in (recorded, "DOWN", 503):
                assert f"canary: prefill-{i}: answered {a!r} where the reference is {recorded!r}" in err


def test_an_instance_that_disagrees_with_the_others_is_named_and_taken_out(tmp_path, capsys):
    flags = tmp_path / "flags"
    with instances(" 11, 12", " 11, 12", " garbage", " 11, 12") as (a, b, c, r):
        spec = targets(tmp_path, inst("prefill-0", a), inst("prefill-1", b), inst("prefill-2", c),
                       {"name": "router", "role": "router", "url": r})
        rc = canary.main(["run", "--targets", str(spec), "--state", str(tmp_path / "state"), "--flags", str(flags),
                          "--timeout", "0.5"])
    out = capsys.readouterr()
    assert rc == 1 and reference(tmp_path)["text"] == " 11, 12"
    assert "canary: prefill-2: answered ' garbage' where the reference is ' 11, 12'" in out.err
    assert "canary: prefill-2: out of the router's rotation until its canary passes" in out.out
    assert [p.name for p in flags.iterdir()] == ["prefill-2.failing"]


def test_the_router_is_held_to_the_instances_reference_and_does_not_vote(tmp_path, capsys):
    with instances(" 11, 12", " 11, 12", " garbage") as (a, b, r):
        spec = targets(tmp_path, inst("prefill-0", a), inst("decode-0", b), {"name": "router", "role": "router", "url": r})
        rc, out, err = run(tmp_path, spec, capsys)
    assert rc == 1 and reference(tmp_path)["agreed"] == ["decode-0", "prefill-0"]
    assert "canary: router: answered ' garbage' where the reference is ' 11, 12'" in err
    with instances(" x", " x") as (r1, r2):  # the router alone cannot make a reference, whatever it says
        spec = targets(tmp_path, {"name": "router", "role": "router", "url": r1},
                       {"name": "router2", "role": "router", "url": r2}, identity="rev2|vllm 0.33.0")
        rc, out, err = run(tmp_path, spec, capsys)
    assert rc == 1 and reference(tmp_path)["identity"] == "rev1|vllm 0.33.0"
    assert ("router: its reference is of 'rev1|vllm 0.33.0', not 'rev2|vllm 0.33.0': ' x' from router, router2 (at "
            "least 2 and more than half of the 0 instances must agree;") in err


def test_accept_takes_the_answer_of_the_one_instance_there_is(tmp_path, capsys):
    with instances(" 11, 12") as (a,):
        spec = targets(tmp_path, inst("decode-0", a))
        assert run(tmp_path, spec, capsys)[0] == 1
        assert canary.main(["accept", "--targets", str(spec), "--state", str(tmp_path / "state")]) == 0
        out = capsys.readouterr().out
        assert "accepted by the operator from decode-0 (1 of 1 instances)" in out and ": recorded" in out
        assert reference(tmp_path)["accepted"] is True
        rc, out, err = run(tmp_path, spec, capsys)
        assert rc == 0 and "canary: decode-0 ok (" in out
    with instances(" a", " b") as (a, b):
        spec = targets(tmp_path, inst("prefill-0", a), inst("prefill-1", b), identity="rev2|vllm 0.33.0")
        assert canary.main(["accept", "--targets", str(spec), "--state", str(tmp_path / "state")]) == 1
    assert reference(tmp_path)["identity"] == "rev1|vllm 0.33.0", "instances that differ: nothing to accept"
    assert "no reference" not in capsys.readouterr().out


def test_a_wrong_answer_fails_and_names_both(tmp_path, capsys):
    with instances(" Paris.", " Paris.") as (a, b):
        assert run(tmp_path, targets(tmp_path, inst("decode-0", a), inst("decode-1", b)), capsys)[0] == 0
    with instances(" Paris.", " garbage garbage") as (a, b):
        rc, out, err = run(tmp_path, targets(tmp_path, inst("decode-0", a), inst("decode-1", b)), capsys)
    assert rc == 1 and "canary: decode-1: answered ' garbage garbage' where the reference is ' Paris.'" in err
    assert 'glm_canary_ok{target="decode-1",role="decode"} 0\n' in (tmp_path / "canary.prom").read_text()
    assert reference(tmp_path)["text"] == " Paris.", "kept"


def test_a_dp_rank_that_hangs_or_errs_or_disagrees_fails_its_instance(tmp_path, capsys):
    fake = Fake(" Paris.", "HANG", " Paris.", " Paris.")
    with serving(fake) as url, instances(" Paris.", " Paris.") as (b, c):
        spec = targets(tmp_path, inst("prefill-1", url, requests=4, per_rank=True), inst("prefill-2", b),
                       inst("prefill-3", c))
        start = time.monotonic()
        rc, out, err = run(tmp_path, spec, capsys)
        assert time.monotonic() - start < 1.4, "the canaries run at once, each within the timeout"
    assert rc == 1 and re.search(r"canary: prefill-1: 1 of 4 canaries failed: DP rank [0-3]: no answer within 0.5 s", err)
    assert sorted(x["rank"] for x in fake.seen) == ["0", "1", "2", "3"], "one on each DP rank, by vLLM's header"
    assert reference(tmp_path)["agreed"] == ["prefill-2", "prefill-3"], "a failed instance gives no voice"
    with serving(Fake(" Paris.", 503)) as url:
        rc, out, err = run(tmp_path, targets(tmp_path, inst("prefill-1", url, requests=2)), capsys)
    assert rc == 1 and 'canary: prefill-1: 1 of 2 canaries failed: HTTP 503: {"error": "nope"}' in err
    with serving(Fake(" Paris.", " Lyon.")) as url:
        rc, out, err = run(tmp_path, targets(tmp_path, inst("prefill-1", url, requests=2)), capsys)
    assert rc == 1 and "canary: prefill-1: its 2 canaries answered differently: ' Lyon.', ' Paris.'" in err


def test_a_new_model_revision_or_vllm_records_again_once_the_instances_agree(tmp_path, capsys):
    with instances(" Paris.", " Paris.") as (a, b):
        assert run(tmp_path, targets(tmp_path, inst("prefill-0", a), inst("prefill-1", b)), capsys)[0] == 0
    with instances(" Paris, the capital", " Paris, the capital") as (a, b):
        rc, out, err = run(tmp_path, targets(tmp_path, inst("prefill-0", a), inst("prefill-1", b),
                                             identity="rev2|vllm 0.33.0"), capsys)
    assert rc == 0 and "reference of 'rev2|vllm 0.33.0': ' Paris, the capital', agreed by prefill-0, prefill-1" in out
    assert reference(tmp_path)["identity"] == "rev2|vllm 0.33.0"


def test_an_instance_that_is_down_fails_and_the_others_still_run(tmp_path, capsys):
    with serving(Fake(" Paris.")) as url:
        pass  # closed: nothing listens there now
    with instances(" Paris.", " Paris.") as (up, up2):
        spec = targets(tmp_path, inst("prefill-0", url), inst("prefill-1", up), inst("prefill-2", up2))
        rc, out, err = run(tmp_path, spec, capsys)
    assert rc == 1 and "canary: prefill-1 ok (" in out
    assert "canary: prefill-0: 1 of 1 canaries failed: ConnectionRefusedError" in err
    prom = (tmp_path / "canary.prom").read_text()
    assert 'target="prefill-0",role="prefill"} 0' in prom and 'target="prefill-1",role="prefill"} 1' in prom


def test_an_empty_or_shapeless_answer_fails(tmp_path, capsys):
    with instances("  ", "  ") as (a, b):
        rc, out, err = run(tmp_path, targets(tmp_path, inst("decode-0", a), inst("decode-1", b)), capsys)
    assert rc == 1 and "canary: decode-0: 1 of 1 canaries failed: answered nothing" in err
    assert not (tmp_path / "state" / "reference.json").exists()


@pytest.mark.parametrize("damaged", ['{"identity": "rev1|vllm 0.33.0", "te', "[]", '{"identity": 1, "text": "x"}',
                                     '{"identity": "rev1|vllm 0.33.0"}'])
def test_a_damaged_reference_fails_every_target_and_is_not_recorded_over(tmp_path, capsys, damaged):
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "reference.json").write_text(damaged)
    flags = tmp_path / "flags"
    flags.mkdir()
    (flags / "decode-1.failing").write_text("an earlier run\n")
    with instances(" garbage", " garbage") as (a, b):
        spec = targets(tmp_path, inst("decode-0", a), inst("decode-1", b))
        rc = canary.main(["run", "--targets", str(spec), "--state", str(tmp_path / "state"), "--flags", str(flags)])
    err = capsys.readouterr().err
    assert rc == 1 and f"canary: decode-0: its reference {tmp_path / 'state' / 'reference.json'} cannot be read" in err
    assert "remove it to record again" in err
    assert (tmp_path / "state" / "reference.json").read_text() == damaged, "left as it was"
    assert sorted(p.name for p in flags.iterdir()) == ["decode-1.failing"], "judged against nothing: flags as they were"


def test_during_a_transition_an_instance_that_differs_is_reported_not_taken_out(tmp_path, capsys):
    """glm-infra marks a change of identity before it restarts the instances; until every one has rolled and
    they agree on the new reference, the instances on the new software may differ from the old reference."""
    flags = tmp_path / "flags"

    def go(spec: Path) -> tuple[int, str, str]:
        rc = canary.main(["run", "--targets", str(spec), "--state", str(tmp_path / "state"), "--flags", str(flags),
                          "--metrics", str(tmp_path / "canary.prom"), "--timeout", "0.5"])
        out = capsys.readouterr()
        return rc, out.out, out.err

    with instances(" old", " old", " old") as urls:
        assert go(targets(tmp_path, *(inst(f"prefill-{i}", u) for i, u in enumerate(urls))))[0] == 0
    (tmp_path / "state" / "transition.json").write_text(json.dumps({"to": "rev2|vllm 0.33.0", "since": 1700000000}))
    with instances(" new", " old", " old") as urls:  # prefill-0 rolled onto rev2: its targets still say rev1
        rc, out, err = go(targets(tmp_path, *(inst(f"prefill-{i}", u) for i, u in enumerate(urls))))
    assert rc == 1 and "canary: prefill-0: answered ' new' where the reference is ' old'" in err
    assert ("canary: a change to 'rev2|vllm 0.33.0' is rolling out (since 2023-11-14 22:13:20 UTC): an instance that "
            "answers otherwise is not taken out of rotation until every one has rolled") in out
    prom = (tmp_path / "canary.prom").read_text()
    assert list(flags.iterdir()) == [] and "glm_canary_transition 1\n" in prom
    assert 'glm_canary_transition_pending{target="prefill-0",role="prefill"} 1\n' in prom
    assert 'glm_canary_transition_pending{target="prefill-1",role="prefill"} 0\n' in prom
    with instances(" new", " new", " new") as urls:  # every one rolled; the canary step wrote the new identity
        rc, out, err = go(targets(tmp_path, *(inst(f"prefill-{i}", u) for i, u in enumerate(urls)),
                                  identity="rev2|vllm 0.33.0"))
    assert rc == 0 and reference(tmp_path)["text"] == " new"
    assert not (tmp_path / "state" / "transition.json").exists(), "over once its reference is recorded"
    assert "glm_canary_transition 0\n" in (tmp_path / "canary.prom").read_text()
    with instances(" new", " new", " bad") as urls:  # no transition any more: taken out as usual
        rc, out, err = go(targets(tmp_path, *(inst(f"prefill-{i}", u) for i, u in enumerate(urls)),
                                  identity="rev2|vllm 0.33.0"))
    assert rc == 1 and [p.name for p in flags.iterdir()] == ["prefill-2.failing"]


@pytest.mark.parametrize("marker", ["{not json", "[]", '{"to": 2}'])
def test_a_damaged_transition_marker_is_named_and_takes_nobody_out_of_judgement(tmp_path, capsys, marker):
    with instances(" old", " old", " old") as urls:
        assert run(tmp_path, targets(tmp_path, *(inst(f"prefill-{i}", u) for i, u in enumerate(urls))), capsys)[0] == 0
    (tmp_path / "state" / "transition.json").write_text(marker)
    flags = tmp_path / "flags"
    with instances(" new", " old", " old") as urls:
        spec = targets(tmp_path, *(inst(f"prefill-{i}", u) for i, u in enumerate(urls)))
        rc = canary.main(["run", "--targets", str(spec), "--state", str(tmp_path / "state"), "--flags", str(flags)])
    out = capsys.readouterr().out
    assert rc == 1 and f"canary: the transition marker {tmp_path / 'state' / 'transition.json'} cannot be read" in out
    assert [p.name for p in flags.iterdir()] == ["prefill-0.failing"], "judged as without a transition"


def test_times_a_state_file_does_not_give_are_said_unknown():
    assert canary.utc(0) == "1970-01-01 00:00:00 UTC" and canary.utc(1.5e9) == "2017-07-14 02:40:00 UTC"
    for bad in (None, "1700000000", True, [1]):
        assert canary.utc(bad) == "an unknown time"
    line = canary.reference_line({"identity": "i", "text": "t", "agreed": "x", "recorded": "soon"})
    assert line == "reference of 'i': 't', agreed by  (0 of ? instances) on an unknown time"


@pytest.mark.parametrize("spec, says", [
    (json.dumps({"identity": "x", "model": "m", "targets": []}), "no targets: a run that checks nothing passes nothing"),
    (json.dumps({"identity": "x", "model": "m", "targets": [{"name": "a", "role": "r", "url": "u", "requests": 0}]}),
     "target a: requests is a whole number of at least 1"),
    (json.dumps({"identity": "x", "model": "m", "targets": [{"name": "a", "role": "r", "url": "u", "requests": True}]}),
     "target a: requests is a whole number of at least 1"),
    (json.dumps({"identity": "x", "model": "m", "targets": [{"name": "a", "role": "r", "url": 7}]}),
     "target a: role and url are strings"),
    (json.dumps({"identity": "x", "model": "m", "targets": [{"name": "a", "role": "r"}]}), "'url'"),
    ("not json", "Expecting value: line 1 column 1 (char 0)"),
    (json.dumps({"identity": "x", "model": "m"}), "'targets'"),
    (json.dumps({"identity": "x", "model": "m", "targets": [{"name": "../etc", "role": "r", "url": "u"}]}),
     "target name '../etc': letters, digits, '.', '_' and '-' only"),
    (json.dumps({"identity": "x", "model": "m", "targets": [{"name": "a", "role": "r", "url": "u"},
                                                          {"name": "a", "role": "r", "url": "v"}]}),
     "a target name is given twice"),
    (json.dumps({"identity": "", "model": "m", "targets": [{"name": "a", "role": "r", "url": "u"}]}),
     "identity and model are strings, identity not empty"),
])
def test_a_bad_targets_file_is_named_and_nothing_runs(tmp_path, capsys, spec, says):
    import socket

    path = tmp_path / "targets.json"
    path.write_text(spec)
    rc, out, err = run(tmp_path, path, capsys)
    assert (rc, err) == (2, f"{socket.gethostname()}: canary: {path}: {says}\n")
    assert not (tmp_path / "canary.prom").exists() and not (tmp_path / "state").exists()


def test_the_command_line():
    a = canary.parser().parse_args(["run", "--targets", "t", "--state", "s"])
    assert (a.cmd, a.targets, a.state, a.timeout, a.metrics, a.flags, a.check) == ("run", "t", "s", 30.0, None, None,
                                                                                   False)
    a = canary.parser().parse_args(["accept", "--targets", "t", "--state", "s", "--timeout", "2"])
    assert (a.cmd, a.timeout, a.metrics, a.flags) == ("accept", 2.0, None, None) and a.check is False
    for bad in ([], ["run"], ["run", "--state", "s"], ["run", "--targets", "t"], ["accept", "--targets", "t"],
                ["accept", "--targets", "t", "--state", "s", "--check"]):
        with pytest.raises(SystemExit):
            canary.parser().parse_args(bad)


def test_a_canary_run_takes_seconds_not_an_epoch(tmp_path, capsys):
    with instances(" a", " a") as (a, b):
        run(tmp_path, targets(tmp_path, inst("p-0", a), inst("p-1", b)), capsys)
    seconds = [float(line.split()[-1]) for line in (tmp_path / "canary.prom").read_text().splitlines()
               if line.startswith("glm_canary_seconds{")]
    assert len(seconds) == 2 and all(0 < s < 10 for s in seconds)


def test_a_target_without_a_gate_first_does_not_keep_the_others_in(tmp_path, capsys):
    flags = tmp_path / "flags"
    with instances(" a", " a", " a", " b") as (r, a, b, c):
        spec = targets(tmp_path, {"name": "router", "role": "router", "url": r}, inst("prefill-0", a),
                       inst("prefill-1", b), inst("prefill-2", c))
        assert canary.main(["run", "--targets", str(spec), "--state", str(tmp_path / "s"), "--flags", str(flags)]) == 1
    assert (flags / "prefill-2.failing").read_text() == "prefill-2: answered ' b' where the reference is ' a'\n"
    assert [p.name for p in flags.iterdir()] == ["prefill-2.failing"]


def test_a_failing_instance_is_flagged_out_of_rotation_and_back_once_it_passes(tmp_path, capsys):
    flags = tmp_path / "flags"

    def go(spec: Path) -> tuple[int, str, str]:
        rc = canary.main(["run", "--targets", str(spec), "--state", str(tmp_path / "state"), "--metrics",
                          str(tmp_path / "textfiles" / "canary.prom"), "--flags", str(flags), "--timeout", "0.5"])
        out = capsys.readouterr()
        return rc, out.out, out.err

    def entries(a: str, b: str, c: str, r: str) -> list[dict]:
        return [inst("prefill-0", a), inst("prefill-1", b), inst("prefill-2", c),
                {"name": "router", "role": "router", "url": r}]

    with instances(" Paris.", " Paris.", " Paris.", " Paris.") as urls:
        assert go(targets(tmp_path, *entries(*urls)))[0] == 0 and sorted(flags.iterdir()) == []
    with instances(" Paris.", " garbage", " Paris.", " garbage") as urls:
        rc, out, err = go(targets(tmp_path, *entries(*urls)))
        assert rc == 1 and "canary: prefill-1: out of the router's rotation until its canary passes" in out
        assert [p.name for p in flags.iterdir()] == ["prefill-1.failing"], "the router target has no gate"
        assert "answered ' garbage'" in (flags / "prefill-1.failing").read_text()
        prom = (tmp_path / "textfiles" / "canary.prom").read_text()
        assert 'glm_canary_out_of_rotation{target="prefill-1",role="prefill"} 1\n' in prom
        assert 'glm_canary_out_of_rotation{target="prefill-0",role="prefill"} 0\n' in prom
        rc, out, err = go(targets(tmp_path, *entries(*urls)))
        assert rc == 1 and "out of the router's rotation" not in out, "said once, when it leaves"
    with instances(" Paris.", " Paris.", " Paris.", " Paris.") as urls:
        rc, out, err = go(targets(tmp_path, *entries(*urls)))
    assert rc == 0 and "canary: prefill-1: back in the router's rotation" in out and list(flags.iterdir()) == []
    assert 'glm_canary_out_of_rotation{target="prefill-1",role="prefill"} 0\n' in (
        tmp_path / "textfiles" / "canary.prom").read_text()


def test_a_canary_never_takes_a_whole_pool_out(tmp_path, capsys):
    flags = tmp_path / "flags"
    with instances(" Paris.", " Paris.") as (a, p):
        spec = targets(tmp_path, inst("decode-0", a), inst("prefill-0", p))
        assert canary.main(["run", "--targets", str(spec), "--state", str(tmp_path / "state")]) == 0
    flags.mkdir()
    (flags / "decode-0.failing").write_text("an earlier run\n")  # out, from when another decode passed
    with instances(" garbage", " Paris.") as (a, p):
        spec = targets(tmp_path, inst("decode-0", a), inst("prefill-0", p))
        rc = canary.main(["run", "--targets", str(spec), "--state", str(tmp_path / "state"), "--flags", str(flags)])
    out = capsys.readouterr()
    assert rc == 1 and "answered ' garbage'" in out.err
    assert "decode-0: back in the router's rotation" in out.out and not (flags / "decode-0.failing").exists()
    assert "decode-0: left in rotation: no decode instance passes its canary" in out.out


def test_check_judges_without_recording_or_writing_and_shows_the_reference(tmp_path, capsys):
    flags, prom = tmp_path / "flags", tmp_path / "canary.prom"

    def check(spec: Path) -> tuple[int, str, str]:
        rc = canary.main(["run", "--check", "--targets", str(spec), "--state", str(tmp_path / "state"),
                          "--metrics", str(prom), "--flags", str(flags)])
        out = capsys.readouterr()
        return rc, out.out, out.err

    with instances(" Paris.", " Paris.") as (a, b):
        spec = targets(tmp_path, inst("decode-0", a), inst("prefill-0", b))
        rc, out, err = check(spec)
        assert rc == 1 and "canary: decode-0: no reference of 'rev1|vllm 0.33.0' agreed yet\n" in err
        assert not (tmp_path / "state").exists() and not prom.exists() and not flags.exists()
        assert canary.main(["run", "--targets", str(spec), "--state", str(tmp_path / "state")]) == 0
        capsys.readouterr()
        rc, out, err = check(spec)
        assert rc == 0 and "canary: reference of 'rev1|vllm 0.33.0': ' Paris.', agreed by decode-0, prefill-0 (2 of 2" in out
        rc, out, err = check(targets(tmp_path, inst("decode-0", a), inst("prefill-0", b), identity="rev2|vllm 0.33.0"))
        assert rc == 1 and "its reference is of 'rev1|vllm 0.33.0', not 'rev2|vllm 0.33.0'\n" in err
        assert reference(tmp_path)["identity"] == "rev1|vllm 0.33.0", "check records nothing"
    with instances(" garbage", " Paris.") as (a, b):
        rc, out, err = check(targets(tmp_path, inst("decode-0", a), inst("prefill-0", b)))
    assert rc == 1 and "answered ' garbage' where the reference is ' Paris.'" in err
    assert not prom.exists() and not flags.exists()


def test_the_api_key_is_read_under_the_name_the_file_gives_and_a_missing_one_is_named(tmp_path, capsys):
    fake = Fake(" Paris.")
    (tmp_path / "router.env").write_text("OPENAI_API_KEY=s3cret\n")
    spec = {"identity": "x", "model": "glm-5.2", "api_key_file": str(tmp_path / "router.env"),
            "api_key_name": "OPENAI_API_KEY", "targets": [inst("a-0", ""), inst("a-1", "")]}
    with serving(fake) as url:
        for t in spec["targets"]:
            t["url"] = url
        (tmp_path / "t.json").write_text(json.dumps(spec))
        assert canary.main(["run", "--targets", str(tmp_path / "t.json"), "--state", str(tmp_path / "s")]) == 0
    assert {s["auth"] for s in fake.seen} == {"Bearer s3cret"}
    spec["api_key_name"] = "VLLM_API_KEY"
    (tmp_path / "t.json").write_text(json.dumps(spec))
    assert canary.main(["run", "--targets", str(tmp_path / "t.json"), "--state", str(tmp_path / "s")]) == 2
    assert f"{tmp_path / 'router.env'} has no VLLM_API_KEY" in capsys.readouterr().err


def test_an_instance_that_refuses_the_connection_keeps_its_flag_as_it_was(tmp_path, capsys):
    """Stopped or restarting: the router's health checks see it; the canary neither raises nor drops a flag."""
    flags = tmp_path / "flags"
    with instances(" 11, 12", " 11, 12", " 11, 12") as (a, b, c):
        spec = targets(tmp_path, *(inst(f"prefill-{n}", u) for n, u in enumerate((a, b, c))))
        assert canary.main(["run", "--targets", str(spec), "--state", str(tmp_path / "s"), "--flags", str(flags)]) == 0
    flags.joinpath("prefill-1.failing").write_text("wrong before it restarted\n")
    with instances(" 11, 12") as (a,):
        with serving(Fake(" 11, 12")) as gone:
            pass  # nothing listens there now
        spec = targets(tmp_path, *(inst(f"prefill-{n}", u) for n, u in enumerate((a, gone, gone))))
        rc = canary.main(["run", "--targets", str(spec), "--state", str(tmp_path / "s"), "--flags", str(flags)])
    err = capsys.readouterr().err
    assert rc == 1 and "prefill-2: 1 of 1 canaries failed: ConnectionRefusedError" in err
    assert sorted(p.name for p in flags.iterdir()) == ["prefill-1.failing"], "kept; none raised for prefill-2"


# --- the pieces, one by one ----------------------------------------------------------------------------


def test_the_metrics_are_prometheus_text_exactly():
    results = [{"name": "prefill-0", "role": "prefill", "ok": True, "seconds": 0.25},
               {"name": "decode-0", "role": "decode", "ok": False, "seconds": 1.5, "pending": True}]
    assert canary.metrics(results, 1700000000.4, {"decode-0"}, True) == (
        "# HELP glm_canary_ok 1 when every canary of the target answered the agreed reference in time.\n"
        "# TYPE glm_canary_ok gauge\n"
        'glm_canary_ok{target="prefill-0",role="prefill"} 1\n'
        'glm_canary_ok{target="decode-0",role="decode"} 0\n'
        "# HELP glm_canary_seconds How long the target's canaries took, all of them.\n"
        "# TYPE glm_canary_seconds gauge\n"
        'glm_canary_seconds{target="prefill-0",role="prefill"} 0.250\n'
        'glm_canary_seconds{target="decode-0",role="decode"} 1.500\n'
        "# HELP glm_canary_out_of_rotation 1 while the target's gate keeps it out of the router's rotation.\n"
        "# TYPE glm_canary_out_of_rotation gauge\n"
        'glm_canary_out_of_rotation{target="prefill-0",role="prefill"} 0\n'
        'glm_canary_out_of_rotation{target="decode-0",role="decode"} 1\n'
        "# HELP glm_canary_transition 1 while the instances roll onto another model revision or vLLM.\n"
        "# TYPE glm_canary_transition gauge\n"
        "glm_canary_transition 1\n"
        "# HELP glm_canary_transition_pending 1 when the target answered otherwise than the old reference while "
        "they roll (not taken out of rotation; judged once every instance has rolled).\n"
        "# TYPE glm_canary_transition_pending gauge\n"
        'glm_canary_transition_pending{target="prefill-0",role="prefill"} 0\n'
        'glm_canary_transition_pending{target="decode-0",role="decode"} 1\n'
        "# HELP glm_canary_last_run_timestamp_seconds When the canaries last ran.\n"
        "# TYPE glm_canary_last_run_timestamp_seconds gauge\n"
        "glm_canary_last_run_timestamp_seconds 1700000000\n")
    assert "glm_canary_transition 0\n" in canary.metrics(results, 0)
    assert 'glm_canary_out_of_rotation{target="decode-0",role="decode"} 0\n' in canary.metrics(results, 0)


class Conn:
    """http.client's connection, recording what the canary asks and answering ``answer``."""

    made: list[Conn] = []

    def __init__(self, host: str, port: int | None, timeout: float) -> None:
        self.where, self.timeout, self.sent, self.closed = (host, port), timeout, None, False
        Conn.made.append(self)

    def request(self, method: str, path: str, body: bytes, headers: dict) -> None:
        self.sent = (method, path, json.loads(body), dict(headers))
        if isinstance(self.answer, BaseException):
            raise self.answer

    def getresponse(self):  # noqa: ANN201
        status, data = self.answer

        class R:
            def read(self) -> bytes:
                return data

        r = R()
        r.status = status
        return r

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def conns(monkeypatch):
    Conn.made = []
    plain = type("Plain", (Conn,), {"answer": (200, json.dumps({"choices": [{"text": " 11"}]}).encode())})
    tls = type("Tls", (Conn,), {"answer": (200, json.dumps({"choices": [{"text": " 12"}]}).encode())})
    monkeypatch.setattr(canary.http.client, "HTTPConnection", plain)
    monkeypatch.setattr(canary.http.client, "HTTPSConnection", tls)
    return plain, tls


def test_a_canary_asks_exactly_this(conns):
    plain, tls = conns
    assert canary.complete("http://10.0.0.11:8100", "glm-5.2", "k3y", 4.5, rank=3) == " 11"
    (c,) = Conn.made
    assert c.where == ("10.0.0.11", 8100) and c.timeout == 4.5 and c.closed
    assert c.sent == ("POST", "/v1/completions",
                      {"model": "glm-5.2", "prompt": canary.PROMPT, "max_tokens": canary.MAX_TOKENS, "temperature": 0},
                      {"Content-Type": "application/json", "Authorization": "Bearer k3y", "X-data-parallel-rank": "3"})
    assert canary.complete("https://router.example:8443/base/", "m", None, 1) == " 12", "https: TLS"
    assert Conn.made[-1].sent[1] == "/base/v1/completions" and Conn.made[-1].sent[3] == {"Content-Type": "application/json"}
    assert isinstance(Conn.made[-1], tls) and isinstance(Conn.made[0], plain)


@pytest.mark.parametrize("url", ["ftp://h:1", "h:1", "http://", "https:///x", "file:///etc/passwd"])
def test_a_target_that_is_not_an_http_url_is_named(conns, url):
    with pytest.raises(canary.CanaryError) as e:
        canary.complete(url, "m", None, 1)
    assert str(e.value) == f"not an http(s) URL: {url!r}" and not e.value.down and Conn.made == []


@pytest.mark.parametrize(("answer", "said", "down"), [
    ((503, b"engine gone"), "HTTP 503: engine gone", True),
    ((504, b"late"), "HTTP 504: late", False),
    ((500, b"x" * 300), "HTTP 500: " + "x" * 200, False),
    ((500, b"\xff bad"), "HTTP 500: \ufffd bad", False),
    ((200, b'{"choices": []}'), 'not a completion: {"choices": []}', False),
    ((200, b'{"choices": [{"text": 7}]}'), 'not a completion: {"choices": [{"text": 7}]}', False),
    ((200, b"\xff" + b"y" * 300), "not a completion: \ufffd" + "y" * 199, False),
    ((200, b'{"choices": [{"text": " \\n "}]}'), "answered nothing", False),
    (ConnectionRefusedError(111, "Connection refused"), "ConnectionRefusedError: [Errno 111] Connection refused", True),
    (OSError(113, "No route to host"), "OSError: [Errno 113] No route to host", False),
    (TimeoutError(), "no answer within 1 s", False),
])
def test_what_is_not_an_answer_is_named(conns, monkeypatch, answer, said, down):
    plain, _ = conns
    monkeypatch.setattr(plain, "answer", answer)
    with pytest.raises(canary.CanaryError) as e:
        canary.complete("http://h:1", "m", None, 1)
    assert (str(e.value), e.value.down) == (said, down)
    assert canary.CanaryError("x").down is False


def test_env_values_are_read_as_systemd_takes_them(tmp_path):
    f = tmp_path / "k.env"
    f.write_text("A=1\nK=a=b\nQ=\"quoted\"\nS='single'\n  T = x \nK=later\n")
    assert [canary.read_env_value(str(f), k) for k in ("K", "Q", "S", "A", "T", "none")] == \
        ["a=b", "quoted", "single", "1", None, None]


def test_target_names_and_the_reference_file_they_share():
    assert canary.target_name_problem("Prefill-0.a_b") is None
    assert canary.target_name_problem("-x") == "target name '-x': letters, digits, '.', '_' and '-' only"
    assert canary.target_name_problem(7) == "target name 7: letters, digits, '.', '_' and '-' only"


def test_a_state_file_that_is_not_an_object_with_its_keys_is_named(tmp_path):
    (tmp_path / "r.json").write_text('{"identity": "i"}')
    with pytest.raises(ValueError) as e:
        canary.read_state(str(tmp_path), "r.json", "identity", "text")
    assert str(e.value) == f"{tmp_path / 'r.json'} cannot be read (not an object with identity, text)"
    assert canary.read_state(str(tmp_path), "none.json", "x") is None


def asked(*answers: tuple[str, str | None], gate: bool = True) -> list[dict]:
    return [{"name": n, "role": n.split("-")[0], "gate": gate, "seconds": 0.1, **({"text": t} if t else {"line": "x"})}
            for n, t in answers]


def test_who_answered_what_most_first_and_what_is_agreed():
    a = asked(("p-0", " b"), ("p-1", " a"), ("p-2", " a"), ("p-3", None))
    assert canary.answers_of(a) == "' a' from p-1, p-2; ' b' from p-0"
    assert canary.agreed(a, 4) is None, "2 of 4 is not more than half"
    assert canary.agreed(a, 3) == (" a", ["p-1", "p-2"])
    assert canary.agreed(asked(("p-0", " a")), 1) is None, "one instance agrees with nobody"
    assert canary.agreed(asked(("p-0", " a")), 1, accept=True) == (" a", ["p-0"])
    assert canary.agreed(asked(("r-0", " a"), ("r-1", " a"), gate=False), 0) is None, "only instances vote"


def test_judge_records_only_what_the_instances_agree_on(tmp_path):
    results, notes = canary.judge(asked(("p-0", " a")), "id", str(tmp_path), True)
    assert not results[0]["ok"] and results[0]["hold"] and not (tmp_path / "reference.json").exists()
    assert results[0]["line"].endswith("(at least 2 and more than half of the 1 instances must agree; one cannot be "
                                       "held against another: canary.py accept takes its answer)")
    results, _ = canary.judge(asked(("p-0", " a"), ("p-1", " b")), "id", str(tmp_path), True)
    assert results[0]["line"] == ("p-0: no reference of 'id' agreed yet: ' a' from p-0; ' b' from p-1 (at least 2 and "
                                  "more than half of the 2 instances must agree)")
    failed = asked(("p-0", None), ("p-1", " a"))
    results, _ = canary.judge(failed, "id", str(tmp_path), True)
    assert results[0]["line"] == "x", "a target's own failure is what it says"
    results, notes = canary.judge(asked(("p-0", " a"), ("p-1", " a")), "id", str(tmp_path), True)
    assert [r["ok"] for r in results] == [True, True] and notes[0].endswith(": recorded")
    assert all("pending" not in r for r in results)


def test_the_file_the_router_host_gets_is_the_package_bundled_and_runs_alone(tmp_path):
    """render.canary_source(): the package as one stdlib-only file (glm_infra/agent/bundle.py), the same bytes each
    time; run by a bare python (-I: no glm_infra on its path) from an empty folder, it records the agreed
    reference and judges, as canary.main does in process, and names a targets file it cannot read."""
    import subprocess
    import sys

    from glm_infra import render

    text = render.canary_source()
    assert text == render.canary_source() and text.startswith("#!/usr/bin/env python3\n")
    program = tmp_path / "canary.py"
    program.write_text(text)
    (tmp_path / "empty").mkdir()

    def bundled(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-I", str(program), *args], capture_output=True, text=True,
                              cwd=tmp_path / "empty", timeout=60)

    assert "usage: canary.py [-h] {run,accept}" in bundled("--help").stdout
    with serving(Fake(" 11, 12, 13")) as a, serving(Fake(" 11, 12, 13")) as b:
        spec = targets(tmp_path, {"name": "prefill-0", "role": "prefill", "url": a, "gate": True},
                       {"name": "decode-0", "role": "decode", "url": b, "gate": True})
        first = bundled("run", "--targets", str(spec), "--state", str(tmp_path / "state"))
    assert first.returncode == 0, first.stderr
    assert "reference of 'rev1|vllm 0.33.0': ' 11, 12, 13', agreed by decode-0, prefill-0 (2 of 2 instances)" in first.stdout
    assert first.stdout.splitlines()[0].endswith(": recorded")
    assert " 11, 12, 13" in json.loads((tmp_path / "state" / canary.REFERENCE).read_text()).values()
    with serving(Fake(" 11, 12, 13")) as a, serving(Fake(" wrong")) as b:
        spec = targets(tmp_path, {"name": "prefill-0", "role": "prefill", "url": a, "gate": True},
                       {"name": "decode-0", "role": "decode", "url": b, "gate": True})
        judged = bundled("run", "--targets", str(spec), "--state", str(tmp_path / "state"))
    assert judged.returncode == 1 and "decode-0" in judged.stderr, judged.stdout + judged.stderr
    broken = bundled("run", "--targets", str(tmp_path / "none.json"), "--state", str(tmp_path / "state"))
    assert broken.returncode == 2 and "none.json" in broken.stderr
