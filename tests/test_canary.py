"""The canary program (glm_infra/agent/canary.py) against fake OpenAI-compatible servers on loopback: a
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
    assert list(flags.iterdir()) == [] and "glm_canary_transition 1\n" in (tmp_path / "canary.prom").read_text()
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
    (json.dumps({"identity": "x", "model": "m", "targets": []}), "no targets"),
    (json.dumps({"identity": "x", "model": "m", "targets": [{"name": "a", "role": "r", "url": "u", "requests": 0}]}),
     "requests is a whole number of at least 1"),
    (json.dumps({"identity": "x", "model": "m", "targets": [{"name": "a", "role": "r", "url": "u", "requests": True}]}),
     "requests is a whole number of at least 1"),
    (json.dumps({"identity": "x", "model": "m", "targets": [{"name": "a", "role": "r"}]}), "'url'"),
    ("not json", "Expecting value"),
    (json.dumps({"identity": "x", "model": "m"}), "'targets'"),
    (json.dumps({"identity": "x", "model": "m", "targets": [{"name": "../etc", "role": "r", "url": "u"}]}),
     "target name '../etc'"),
    (json.dumps({"identity": "x", "model": "m", "targets": [{"name": "a", "role": "r", "url": "u"},
                                                          {"name": "a", "role": "r", "url": "v"}]}),
     "a target name is given twice"),
    (json.dumps({"identity": "", "model": "m", "targets": [{"name": "a", "role": "r", "url": "u"}]}),
     "identity not empty"),
])
def test_a_bad_targets_file_is_named_and_nothing_runs(tmp_path, capsys, spec, says):
    path = tmp_path / "targets.json"
    path.write_text(spec)
    rc, out, err = run(tmp_path, path, capsys)
    assert rc == 2 and f"canary: {path}: " in err and says in err and not (tmp_path / "canary.prom").exists()


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
