"""The real-engine check's runner (testbed/real_engine/check.py) end to end on this machine: prod-b300's lines from
`glm-infra real-engine`, served by the vLLM stand-in behind the real vllm-router 0.1.17. The GPU machine runs
the same runner on the same lines with the real vLLM; here it proves the runner checks what it says and
fails when a check fails."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from glm_infra.tools.cli import main as cli
from standins.test_vllm import ROOT, ROUTER, clean_env, vllm_bin, wheels  # noqa: F401  (fixtures)

CHECK = ROOT / "testbed" / "real_engine" / "check.py"


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def on_free_ports(lines: Path) -> None:
    """The generated lines' fixed ports moved to free ones (tests run side by side on this machine)."""
    ports = iter(free_ports(12))
    moved: dict[str, str] = {}
    for role in ("prefill", "decode", "router"):
        argv = json.loads((lines / f"{role}.argv.json").read_text())
        for i, word in enumerate(argv[:-1]):
            if word in ("--port", "--data-parallel-rpc-port", "--prometheus-port"):
                moved.setdefault(argv[i + 1], str(next(ports)))
                argv[i + 1] = moved[argv[i + 1]]
        env = json.loads((lines / f"{role}.env.json").read_text())
        if "VLLM_NIXL_SIDE_CHANNEL_PORT" in env:
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(next(ports))
        (lines / f"{role}.env.json").write_text(json.dumps(env))
        (lines / f"{role}.argv.json").write_text(json.dumps(argv))
    router = json.loads((lines / "router.argv.json").read_text())
    router = [next((f"http://127.0.0.1:{moved[w.rsplit(':', 1)[1]]}" for _ in [0] if w.startswith("http://")), w)
              for w in router]
    (lines / "router.argv.json").write_text(json.dumps(router))


@pytest.fixture
def bed(vllm_bin, tmp_path):  # noqa: F811
    lines = tmp_path / "lines"
    assert cli(["real-engine", "prod-b300", "--out", str(lines)]) == 0
    on_free_ports(lines)
    model, wrong = tmp_path / "tiny-glm", tmp_path / "other-glm"
    for folder, layers in ((model, 2), (wrong, 3)):  # another config: another model, other greedy answers
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"architectures": ["GlmMoeDsaForCausalLM"],
                                                        "max_position_embeddings": 4096, "num_hidden_layers": layers}))
    binaries = tmp_path / "bin"
    binaries.mkdir()
    (binaries / "vllm").symlink_to(vllm_bin)
    (binaries / "vllm-router").symlink_to(ROUTER)
    return lines, model, binaries, wrong


def check(bed, out: Path, *extra: str) -> subprocess.CompletedProcess:
    lines, model, binaries, wrong = bed
    return subprocess.run([sys.executable, str(CHECK), "--lines", str(lines), "--model", str(model), "--out", str(out),
                           "--wrong-model", str(wrong),
                           "--bin", str(binaries), "--timeout", "90", "--env", "GLM_SIM_STARTUP_SECONDS=0.2", *extra],
                          capture_output=True, text=True, timeout=600, env=clean_env())


def test_the_check_serves_the_rendered_lines_and_proves_each_thing_it_names(bed, tmp_path):
    out = tmp_path / "out"
    p = check(bed, out)
    assert p.returncode == 0, p.stdout + p.stderr
    results = json.loads((out / "results.json").read_text())
    names = [c["name"] for c in results["checks"]]
    assert names == ["prefill healthy", "decode healthy", "router healthy", "chat through the router (not streamed)",
                     "chat through the router (streamed)", "KV over NIXL", "metrics the rules and panels read",
                     "canary against the instances", "wrong healthy", "canary against a planted wrong instance"]
    assert all(c["ok"] for c in results["checks"])
    assert results["nixl"]["transfers"] >= 1 and results["nixl"]["failed"] == 0
    assert results["metrics_missing"] == {}
    # Several API servers, as deployed: no process_* metric (what the unit-memory timer is for).
    assert results["process_metrics"] == []
    assert set(results["phases"]["prefill"]) >= {"weights", "init engine"}
    checks = {c["name"]: c["detail"] for c in results["checks"]}
    assert checks["canary against the instances"].startswith("reference of 'real-engine-check'")
    assert "agreed by decode, prefill (2 of 2 instances)" in checks["canary against the instances"]
    assert checks["canary against a planted wrong instance"].startswith("wrong: answered ")
    transcript = (out / "TRANSCRIPT.md").read_text()
    assert "| KV over NIXL | pass |" in transcript and "Machine: " in transcript
    # Every service was stopped: nothing it started outlives it.
    for role in ("prefill", "decode", "router"):
        assert (out / f"{role}.log").exists()
    listening = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True).stdout
    argv = json.loads((bed[0] / "router.argv.json").read_text())
    assert f":{argv[argv.index('--port') + 1]} " not in listening


def test_a_failing_check_fails_the_run_and_names_it(bed, tmp_path):
    lines = bed[0]
    expected = json.loads((lines / "expected-metrics.json").read_text())
    expected["vllm:a_metric_nothing_serves"] = ["GlmSomethingNew"]
    (lines / "expected-metrics.json").write_text(json.dumps(expected))
    out = tmp_path / "out"
    p = check(bed, out, "--metrics-wait", "3")
    assert p.returncode == 1
    assert "FAIL metrics the rules and panels read" in p.stdout
    assert "missing: vllm:a_metric_nothing_serves (read by GlmSomethingNew)" in p.stdout
    assert json.loads((out / "results.json").read_text())["metrics_missing"] == {
        "vllm:a_metric_nothing_serves": ["GlmSomethingNew"]}


def test_an_instance_that_does_not_start_stops_the_check_with_its_log(bed, tmp_path):
    lines, model, binaries, _ = bed
    (model / "config.json").unlink()  # the stand-in, like vLLM, refuses a checkpoint without its config
    out = tmp_path / "out"
    p = check(bed, out)
    assert p.returncode == 1
    assert "FAIL prefill healthy: exited 1" in p.stdout and "config.json" in p.stdout
    results = json.loads((out / "results.json").read_text())
    assert [c["name"] for c in results["checks"]] == ["prefill healthy"]
