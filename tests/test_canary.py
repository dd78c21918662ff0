"""The canary program (glm_infra/agent/canary.py) against a fake OpenAI-compatible server on loopback: a
reference recorded on the first answer, a wrong answer, a DP rank that hangs, ranks that disagree, a new
identity, the API key from its file, the metrics it writes, and bad input."""

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


def test_the_first_answer_is_the_reference_and_the_same_answer_passes(tmp_path, capsys):
    fake = Fake(" Paris. It is the")
    with serving(fake) as url:
        spec = targets(tmp_path, {"name": "prefill-0", "role": "prefill", "url": url, "requests": 4}, key="k3y")
        rc, out, err = run(tmp_path, spec, capsys)
        assert rc == 0 and err == "" and "canary: prefill-0 ok: reference recorded (' Paris. It is the'" in out
        rc, out, err = run(tmp_path, spec, capsys)
        assert rc == 0 and "canary: prefill-0 ok (" in out
    assert len(fake.seen) == 8 and {s["path"] for s in fake.seen} == {"/v1/completions"}
    assert {s["rank"] for s in fake.seen} == {None}, "no rank named without per_rank (the router's target)"
    assert fake.seen[0]["body"] == {"model": "glm-5.2", "prompt": canary.PROMPT, "max_tokens": canary.MAX_TOKENS,
                                    "temperature": 0}
    assert {s["auth"] for s in fake.seen} == {"Bearer k3y"}
    reference = json.loads((tmp_path / "state" / "prefill-0.json").read_text())
    assert reference["identity"] == "rev1|vllm 0.33.0" and reference["text"] == " Paris. It is the"
    prom = (tmp_path / "canary.prom").read_text()
    assert 'glm_canary_ok{target="prefill-0",role="prefill"} 1\n' in prom
    assert "# TYPE glm_canary_seconds gauge" in prom and "glm_canary_last_run_timestamp_seconds " in prom


def test_a_wrong_answer_fails_and_names_both(tmp_path, capsys):
    with serving(Fake(" Paris.")) as url:
        spec = targets(tmp_path, {"name": "decode-0", "role": "decode", "url": url})
        assert run(tmp_path, spec, capsys)[0] == 0
    with serving(Fake(" garbage garbage")) as url:
        spec = targets(tmp_path, {"name": "decode-0", "role": "decode", "url": url})
        rc, out, err = run(tmp_path, spec, capsys)
    assert rc == 1 and out == ""
    assert "canary: decode-0: answered ' garbage garbage' where its reference is ' Paris.'" in err
    assert 'glm_canary_ok{target="decode-0",role="decode"} 0\n' in (tmp_path / "canary.prom").read_text()
    assert json.loads((tmp_path / "state" / "decode-0.json").read_text())["text"] == " Paris.", "kept"


def test_a_dp_rank_that_hangs_or_errs_or_disagrees_fails_its_instance(tmp_path, capsys):
    fake = Fake(" Paris.", "HANG", " Paris.", " Paris.")
    with serving(fake) as url:
        spec = targets(tmp_path, {"name": "prefill-1", "role": "prefill", "url": url, "requests": 4, "per_rank": True})
        start = time.monotonic()
        rc, out, err = run(tmp_path, spec, capsys)
        assert time.monotonic() - start < 1.4, "the canaries run at once, each within the timeout"
    assert rc == 1 and re.search(r"canary: prefill-1: 1 of 4 canaries failed: DP rank [0-3]: no answer within 0.5 s", err)
    assert sorted(x["rank"] for x in fake.seen) == ["0", "1", "2", "3"], "one on each DP rank, by vLLM's header"
    assert not (tmp_path / "state" / "prefill-1.json").exists(), "nothing recorded from a failed round"
    with serving(Fake(" Paris.", 503)) as url:
        spec = targets(tmp_path, {"name": "prefill-1", "role": "prefill", "url": url, "requests": 2})
        rc, out, err = run(tmp_path, spec, capsys)
    assert rc == 1 and 'canary: prefill-1: 1 of 2 canaries failed: HTTP 503: {"error": "nope"}' in err
    with serving(Fake(" Paris.", " Lyon.")) as url:
        spec = targets(tmp_path, {"name": "prefill-1", "role": "prefill", "url": url, "requests": 2})
        rc, out, err = run(tmp_path, spec, capsys)
    assert rc == 1 and "canary: prefill-1: its 2 canaries answered differently: ' Lyon.', ' Paris.'" in err


def test_a_new_model_revision_or_vllm_records_again(tmp_path, capsys):
    with serving(Fake(" Paris.")) as url:
        assert run(tmp_path, targets(tmp_path, {"name": "router", "role": "router", "url": url}), capsys)[0] == 0
    with serving(Fake(" Paris, the capital")) as url:
        rc, out, err = run(tmp_path, targets(tmp_path, {"name": "router", "role": "router", "url": url},
                                            identity="rev2|vllm 0.33.0"), capsys)
    assert rc == 0 and "reference recorded (' Paris, the capital'" in out


def test_an_instance_that_is_down_fails_and_the_others_still_run(tmp_path, capsys):
    fake = Fake(" Paris.")
    with serving(fake) as url:
        pass  # closed: nothing listens there now
    with serving(Fake(" Paris.")) as up:
        spec = targets(tmp_path, {"name": "prefill-0", "role": "prefill", "url": url},
                       {"name": "prefill-1", "role": "prefill", "url": up})
        rc, out, err = run(tmp_path, spec, capsys)
    assert rc == 1 and "canary: prefill-1 ok: reference recorded" in out
    assert "canary: prefill-0: 1 of 1 canaries failed: ConnectionRefusedError" in err
    prom = (tmp_path / "canary.prom").read_text()
    assert 'target="prefill-0",role="prefill"} 0' in prom and 'target="prefill-1",role="prefill"} 1' in prom


def test_an_empty_or_shapeless_answer_fails(tmp_path, capsys):
    with serving(Fake("  ")) as url:
        rc, out, err = run(tmp_path, targets(tmp_path, {"name": "decode-0", "role": "decode", "url": url}), capsys)
    assert rc == 1 and "canary: decode-0: 1 of 1 canaries failed: answered nothing" in err
    assert not (tmp_path / "state" / "decode-0.json").exists()


def test_a_damaged_reference_fails_and_is_not_recorded_over(tmp_path, capsys):
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "decode-0.json").write_text('{"identity": "rev1|vllm 0.33.0", "te')
    with serving(Fake(" garbage")) as url:
        rc, out, err = run(tmp_path, targets(tmp_path, {"name": "decode-0", "role": "decode", "url": url}), capsys)
    assert rc == 1 and "canary: decode-0: its reference " in err and "remove it to record again" in err
    assert (tmp_path / "state" / "decode-0.json").read_text().endswith('"te'), "left as it was"


@pytest.mark.parametrize("spec, says", [
    (json.dumps({"identity": "x", "model": "m", "targets": []}), "no targets"),
    (json.dumps({"identity": "x", "model": "m", "targets": [{"name": "a", "role": "r", "url": "u", "requests": 0}]}),
     "requests is a whole number of at least 1"),
    (json.dumps({"identity": "x", "model": "m", "targets": [{"name": "a", "role": "r"}]}), "'url'"),
    ("not json", "Expecting value"),
    (json.dumps({"identity": "x", "model": "m"}), "'targets'"),
    (json.dumps({"identity": "x", "model": "m", "targets": [{"name": "../etc", "role": "r", "url": "u"}]}),
     "target name '../etc'"),
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

    with serving(Fake(" Paris.")) as a, serving(Fake(" Paris.")) as b, serving(Fake(" Paris.")) as r:
        entries = [{"name": "prefill-0", "role": "prefill", "url": a, "gate": True},
                   {"name": "prefill-1", "role": "prefill", "url": b, "gate": True},
                   {"name": "router", "role": "router", "url": r}]
        assert go(targets(tmp_path, *entries))[0] == 0 and sorted(flags.iterdir()) == []
    with serving(Fake(" Paris.")) as a, serving(Fake(" garbage")) as b, serving(Fake(" garbage")) as r:
        entries = [{"name": "prefill-0", "role": "prefill", "url": a, "gate": True},
                   {"name": "prefill-1", "role": "prefill", "url": b, "gate": True},
                   {"name": "router", "role": "router", "url": r}]
        rc, out, err = go(targets(tmp_path, *entries))
        assert rc == 1 and "canary: prefill-1: out of the router's rotation until its canary passes" in out
        assert [p.name for p in flags.iterdir()] == ["prefill-1.failing"], "the router target has no gate"
        assert "answered ' garbage'" in (flags / "prefill-1.failing").read_text()
        prom = (tmp_path / "textfiles" / "canary.prom").read_text()
        assert 'glm_canary_out_of_rotation{target="prefill-1",role="prefill"} 1\n' in prom
        assert 'glm_canary_out_of_rotation{target="prefill-0",role="prefill"} 0\n' in prom
        rc, out, err = go(targets(tmp_path, *entries))
        assert rc == 1 and "out of the router's rotation" not in out, "said once, when it leaves"
    with serving(Fake(" Paris.")) as a, serving(Fake(" Paris.")) as b, serving(Fake(" Paris.")) as r:
        entries = [{"name": "prefill-0", "role": "prefill", "url": a, "gate": True},
                   {"name": "prefill-1", "role": "prefill", "url": b, "gate": True},
                   {"name": "router", "role": "router", "url": r}]
        rc, out, err = go(targets(tmp_path, *entries))
    assert rc == 0 and "canary: prefill-1: back in the router's rotation" in out and list(flags.iterdir()) == []
    assert 'glm_canary_out_of_rotation{target="prefill-1",role="prefill"} 0\n' in (
        tmp_path / "textfiles" / "canary.prom").read_text()


def test_a_canary_never_takes_a_whole_pool_out(tmp_path, capsys):
    flags = tmp_path / "flags"
    with serving(Fake(" Paris.")) as a:
        spec = targets(tmp_path, {"name": "decode-0", "role": "decode", "url": a, "gate": True})
        assert canary.main(["run", "--targets", str(spec), "--state", str(tmp_path / "state")]) == 0
    flags.mkdir()
    (flags / "decode-0.failing").write_text("an earlier run\n")  # out, from when another decode passed
    with serving(Fake(" garbage")) as a:
        spec = targets(tmp_path, {"name": "decode-0", "role": "decode", "url": a, "gate": True})
        rc = canary.main(["run", "--targets", str(spec), "--state", str(tmp_path / "state"), "--flags", str(flags)])
    out = capsys.readouterr()
    assert rc == 1 and "answered ' garbage'" in out.err
    assert "decode-0: back in the router's rotation" in out.out and not (flags / "decode-0.failing").exists()
    assert "decode-0: left in rotation: no decode instance passes its canary" in out.out


def test_check_judges_without_recording_or_writing(tmp_path, capsys):
    flags, prom = tmp_path / "flags", tmp_path / "canary.prom"

    def check(spec: Path) -> tuple[int, str]:
        rc = canary.main(["run", "--check", "--targets", str(spec), "--state", str(tmp_path / "state"),
                          "--metrics", str(prom), "--flags", str(flags)])
        return rc, capsys.readouterr().err

    with serving(Fake(" Paris.")) as a:
        spec = targets(tmp_path, {"name": "decode-0", "role": "decode", "url": a, "gate": True})
        rc, err = check(spec)
        assert rc == 1 and "decode-0: no reference recorded yet" in err
        assert not (tmp_path / "state").exists() and not prom.exists() and not flags.exists()
        assert canary.main(["run", "--targets", str(spec), "--state", str(tmp_path / "state")]) == 0
        assert check(spec)[0] == 0
        rc, err = check(targets(tmp_path, {"name": "decode-0", "role": "decode", "url": a}, identity="rev2|vllm 0.33.0"))
        assert rc == 1 and "its reference is of 'rev1|vllm 0.33.0', not 'rev2|vllm 0.33.0'" in err
    with serving(Fake(" garbage")) as a:
        spec = targets(tmp_path, {"name": "decode-0", "role": "decode", "url": a, "gate": True})
        rc, err = check(spec)
    assert rc == 1 and "answered ' garbage' where its reference is ' Paris.'" in err
    assert not prom.exists() and not flags.exists()


def test_the_api_key_is_read_under_the_name_the_file_gives_and_a_missing_one_is_named(tmp_path, capsys):
    fake = Fake(" Paris.")
    (tmp_path / "router.env").write_text("OPENAI_API_KEY=s3cret\n")
    spec = {"identity": "x", "model": "glm-5.2", "api_key_file": str(tmp_path / "router.env"),
            "api_key_name": "OPENAI_API_KEY", "targets": [{"name": "a", "role": "r", "url": ""}]}
    with serving(fake) as url:
        spec["targets"][0]["url"] = url
        (tmp_path / "t.json").write_text(json.dumps(spec))
        assert canary.main(["run", "--targets", str(tmp_path / "t.json"), "--state", str(tmp_path / "s")]) == 0
    assert fake.seen[0]["auth"] == "Bearer s3cret"
    spec["api_key_name"] = "VLLM_API_KEY"
    (tmp_path / "t.json").write_text(json.dumps(spec))
    assert canary.main(["run", "--targets", str(tmp_path / "t.json"), "--state", str(tmp_path / "s")]) == 2
    assert f"{tmp_path / 'router.env'} has no VLLM_API_KEY" in capsys.readouterr().err


def test_an_instance_that_refuses_the_connection_keeps_its_flag_as_it_was(tmp_path, capsys):
    """Stopped or restarting: the router's health checks see it; the canary neither raises nor drops a flag."""
    flags = tmp_path / "flags"
    with serving(Fake(" 11, 12")) as a, serving(Fake(" 11, 12")) as b, serving(Fake(" 11, 12")) as c:
        spec = targets(tmp_path, *({"name": f"prefill-{n}", "role": "prefill", "url": u, "gate": True}
                                   for n, u in enumerate((a, b, c))))
        assert canary.main(["run", "--targets", str(spec), "--state", str(tmp_path / "s"), "--flags", str(flags)]) == 0
    flags.joinpath("prefill-1.failing").write_text("wrong before it restarted\n")
    with serving(Fake(" 11, 12")) as a:
        with serving(Fake(" 11, 12")) as gone:
            pass  # nothing listens there now
        spec = targets(tmp_path, *({"name": f"prefill-{n}", "role": "prefill", "url": u, "gate": True}
                                   for n, u in enumerate((a, gone, gone))))
        rc = canary.main(["run", "--targets", str(spec), "--state", str(tmp_path / "s"), "--flags", str(flags)])
    err = capsys.readouterr().err
    assert rc == 1 and "prefill-2: 1 of 1 canaries failed: ConnectionRefusedError" in err
    assert sorted(p.name for p in flags.iterdir()) == ["prefill-1.failing"], "kept; none raised for prefill-2"
