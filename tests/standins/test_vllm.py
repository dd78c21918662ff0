"""The stand-in vllm of the simulated cluster (testbed/standins): built into wheels, installed into a
fresh venv like on a host, and run on loopback alone, as P/D pairs behind the real vllm-router, and
through its lifecycle (loading, draining on SIGTERM, engine death). Needs Go (or a cached simulator
build) and, on the first run only, PyPI for the vllm-router and uv wheels."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import ROOT, STACKS, stack_file

from glm_infra.agent import hostcheck
from glm_infra.plan.topology import plan
from glm_infra.roles.vllm import vllm_args
from glm_infra.stack import load_file
from testbed import STANDINS
from testbed.hardware import HW_LIB, TOOLS, Sim

BUILD_WHEELS = STANDINS / "build-wheels"
ROUTER = ROOT / "venv" / "bin" / "vllm-router"
VERSION = "0.33.0+glmsim"
MODEL_NAME = "glm-5.2"
PRODUCER = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_producer"})
CONSUMER = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_consumer"})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_range(count: int) -> int:
    """A base port with count free ports from it (for NIXL side channels, one per DP rank)."""
    while True:
        base = free_port()
        if base + count > 65535:
            continue
        try:
            held = [socket.create_server(("127.0.0.1", base + i)) for i in range(count)]
        except OSError:
            continue
        for s in held:
            s.close()
        return base


def request(port: int, method: str, path: str, body: dict | None = None, headers: dict | None = None,
            timeout: float = 30) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        payload = json.dumps(body).encode() if body is not None else None
        all_headers = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=payload, headers=all_headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def chat(stream: bool = False, **extra: object) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Say hello"}], "stream": stream, **extra}


def metric(port: int, finish_reason: str) -> float:
    status, body = request(port, "GET", "/metrics")
    assert status == 200
    pattern = rf'^vllm:request_success_total{{[^}}]*finish_reason="{finish_reason}"[^}}]*}} (\S+)$'
    found = re.search(pattern, body.decode(), re.M)
    return float(found.group(1)) if found else 0.0


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    """Running, not gone and not a zombie waiting for its reaper."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def refused(port: int) -> bool:
    """The port is reserved or closed: a connection attempt is refused, as a router sees it."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return False
    except ConnectionRefusedError:
        return True
    except ConnectionResetError:  # caught in the backlog as the listener closed: ask again
        return False


def answers(port: int, path: str = "/health", status: int = 200) -> bool:
    try:
        return request(port, "GET", path, timeout=2)[0] == status
    except OSError:
        return False


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheels")
    subprocess.run([str(BUILD_WHEELS), str(out)], check=True)
    return out


@pytest.fixture(scope="module")
def vllm_bin(wheels, tmp_path_factory) -> Path:
    """The stand-in installed into a fresh venv, offline, pinned the way production pins vLLM."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
         "--no-index", "--find-links", str(wheels), "vllm==0.33.0", "nixl==1.5.1"],
        check=True,
    )
    return venv / "bin" / "vllm"


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """Staged weights, as far as vLLM looks before loading."""
    model = tmp_path / "GLM-5.2-NVFP4"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["GlmMoeDsaForCausalLM"]}')
    return model


def clean_env(**overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "GLM_SIM_", "CUDA_"))}
    env = {k: v for k, v in env.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    env["NO_PROXY"] = "127.0.0.1,localhost"
    env.update(overrides)
    return env


@dataclass
class Instance:
    process: subprocess.Popen
    port: int
    log: Path

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines()

    def simulator_pid(self) -> int | None:
        found = re.search(r"llm-d-inference-sim on port \d+, pid (\d+)", self.log.read_text())
        return int(found.group(1)) if found else None

    def wait_healthy(self, timeout: float = 30) -> Instance:
        wait_for(lambda: self.process.poll() is not None or answers(self.port), timeout, f"{self.log.name} healthy")
        assert self.process.poll() is None, f"{self.log.name} exited:\n{self.log.read_text()}"
        return self


@pytest.fixture
def launch(vllm_bin, model_dir, tmp_path):
    """Start ``vllm serve`` on loopback; everything started is killed at teardown."""
    started: list[Instance] = []

    def start(*flags: str, gpus: str = "0", env: dict[str, str] | None = None, startup: str = "0.2",
              name: str = "vllm", model: Path | None = None) -> Instance:
        port = free_port()
        log = tmp_path / f"{name}-{port}.log"
        argv = [str(vllm_bin), "serve", str(model or model_dir), "--served-model-name", MODEL_NAME,
                "--host", "127.0.0.1", "--port", str(port), *flags]
        # The engine's caches in the test's folder, never the machine's ~/.cache/vllm.
        environment = clean_env(CUDA_VISIBLE_DEVICES=gpus, GLM_SIM_STARTUP_SECONDS=startup,
                                **{"VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"), **(env or {})})
        with log.open("w") as out:
            process = subprocess.Popen(argv, env=environment, stdout=out, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        started.append(Instance(process, port, log))
        return started[-1]

    yield start
    for instance in started:
        simulator = instance.simulator_pid()
        if instance.process.poll() is None:
            os.killpg(instance.process.pid, signal.SIGKILL)
        instance.process.wait()
        if simulator is not None and alive(simulator):  # it dies with its parent; this guards a leak
            with contextlib.suppress(ProcessLookupError):
                os.kill(simulator, signal.SIGKILL)


def run_serve(vllm_bin: Path, *argv: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(vllm_bin), "serve", *argv], env=clean_env(**env), capture_output=True, text=True,
                          timeout=30)


def nixl_env(base: int) -> dict[str, str]:
    return {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(base)}


# --- the wheels -------------------------------------------------------------------------------


def test_wheels_are_complete_and_rebuilds_are_skipped(wheels):
    names = sorted(p.name for p in wheels.glob("*.whl"))
    assert f"vllm-{VERSION}-py3-none-linux_x86_64.whl" in names
    assert "nixl-1.5.1+glmsim-py3-none-any.whl" in names
    assert any(n.startswith("vllm_router-0.1.17-") and "manylinux" in n for n in names)
    assert any(n.startswith("uv-0.13.8-") and "manylinux" in n for n in names)
    index = (wheels / "index.html").read_text()
    for name in names:
        assert f'href="{name.replace("+", "%2B")}#sha256=' in index

    with zipfile.ZipFile(wheels / f"vllm-{VERSION}-py3-none-linux_x86_64.whl") as whl:
        record = whl.read(f"vllm-{VERSION}.dist-info/RECORD").decode().splitlines()
        for line in record:
            path, digest, size = line.rsplit(",", 2)
            if digest:
                data = whl.read(path)
                expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                assert (digest, int(size)) == (f"sha256={expected}", len(data)), path
        assert {line.split(",")[0] for line in record} == set(whl.namelist())
        assert whl.getinfo("vllm/_bin/llm-d-inference-sim").external_attr >> 16 == 0o100755
        assert "vllm = vllm.cli:main" in whl.read(f"vllm-{VERSION}.dist-info/entry_points.txt").decode()

    before = {p.name: p.stat().st_mtime_ns for p in wheels.iterdir()}
    again = subprocess.run([str(BUILD_WHEELS), str(wheels)], capture_output=True, text=True, check=True)
    assert "up to date" in again.stderr
    assert {p.name: p.stat().st_mtime_ns for p in wheels.iterdir()} == before


def test_uv_installs_from_the_find_links_page(wheels, tmp_path):
    """What a host runs (runtime.sh): uv pip install --no-index --find-links http://.../wheels/ with the
    pins of the sim stack; vllm-router's dependencies must be on the page too."""
    tools = tmp_path / "tools"
    subprocess.run(["python3", "-m", "venv", str(tools)], check=True)
    subprocess.run([str(tools / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    "--no-index", "--find-links", str(wheels), "uv==0.13.8"], check=True)
    target = tmp_path / "target"
    subprocess.run(["python3", "-m", "venv", "--without-pip", str(target)], check=True)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "--directory",
                               str(wheels), str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: answers(port, "/index.html"), 10, "wheel server")
        subprocess.run(
            [str(tools / "bin" / "uv"), "pip", "install", "--python", str(target / "bin" / "python"),
             "--no-index", "--find-links", f"http://127.0.0.1:{port}/", "vllm==0.33.0+glmsim",
             "nixl==1.5.1+glmsim", "vllm-router==0.1.17"],
            check=True, env=clean_env(UV_CACHE_DIR=str(tmp_path / "uv-cache"), UV_NO_CONFIG="1"),
        )
        version = subprocess.run([str(target / "bin" / "vllm"), "--version"], capture_output=True, text=True,
                                 check=True)
        assert version.stdout.strip() == VERSION
        assert os.access(next(target.glob("lib/python3*/site-packages/vllm/_bin/llm-d-inference-sim")), os.X_OK)
        subprocess.run([str(target / "bin" / "vllm-router"), "--help"], capture_output=True, check=True)
        # What runtime.sh runs after installing vLLM: the kernels come from the same page, through the uv
        # that made the venv (on PATH), and each run is recorded.
        assert not has_dist(target, "flashinfer-cubin")
        kernels = subprocess.run(
            [str(target / "bin" / "vllm"), "download-kernels"], capture_output=True, text=True,
            env=clean_env(PATH=f"{tools / 'bin'}:/usr/bin:/bin", UV_INDEX_URL=f"http://127.0.0.1:{port}/",
                          UV_FIND_LINKS=f"http://127.0.0.1:{port}/", UV_CACHE_DIR=str(tmp_path / "uv-cache")))
        assert kernels.returncode == 0, kernels.stdout + kernels.stderr
    finally:
        server.kill()
        server.wait()
    assert has_dist(target, "flashinfer-cubin") == has_dist(target, "flashinfer-python") == "0.7.2.post1+glmsim"
    (record,) = [json.loads(l) for l in (target / "glm-sim-download-kernels.log").read_text().splitlines()]
    assert record["exit"] == 0 and record["command"][-1] == "flashinfer-cubin==0.7.2.post1"
    assert record["command"][0] == str(tools / "bin" / "uv")


def has_dist(venv: Path, name: str) -> str | None:
    """The version of distribution name installed in venv, or None."""
    p = subprocess.run([str(venv / "bin" / "python"), "-c", f"import importlib.metadata as m; print(m.version({name!r}))"],
                       capture_output=True, text=True)
    return p.stdout.strip() if p.returncode == 0 else None


def test_versions(vllm_bin):
    assert subprocess.run([str(vllm_bin), "--version"], capture_output=True, text=True).stdout.strip() == VERSION
    python = vllm_bin.parent / "python"
    nixl = subprocess.run([str(python), "-c", "import nixl; print(nixl.__version__)"], capture_output=True, text=True)
    assert nixl.stdout.strip() == "1.5.1+glmsim"


# --- what vllm serve refuses ------------------------------------------------------------------


def test_unknown_flag_is_a_usage_error(vllm_bin, model_dir):
    result = run_serve(vllm_bin, str(model_dir), "-tp", "1", "--tensor-paralel-size", "2", CUDA_VISIBLE_DEVICES="0")
    assert result.returncode == 2
    assert "vllm: error: unrecognized arguments: --tensor-paralel-size 2" in result.stderr


@pytest.mark.parametrize(
    "flag",
    [["--kv-transfer-config", "not json"], ["--speculative-config", "[1]"], ["--gpu-memory-utilization", "1.2"],
     ["--chat-template-content-format", "xml"], ["--served-model"]],
)
def test_malformed_flags_are_usage_errors(vllm_bin, model_dir, flag):
    result = run_serve(vllm_bin, str(model_dir), *flag, CUDA_VISIBLE_DEVICES="0")
    assert result.returncode == 2, result.stderr
    assert "error: " in result.stderr


@pytest.mark.parametrize("stack", STACKS)
def test_every_rendered_command_parses(vllm_bin, stack):
    """Each instance's rendered ExecStart gets past argparse: it stops at the first check (exit 1),
    because CUDA_VISIBLE_DEVICES is left out, not at a usage error (exit 2)."""
    config = load_file(stack_file(stack)).config
    for instance in plan(config).instances:
        argv = vllm_args(config, instance)
        result = run_serve(vllm_bin, *argv[2:])
        assert result.returncode == 1, f"{instance.name}: {result.stderr}"
        assert "CUDA_VISIBLE_DEVICES is not set" in result.stderr


def test_gpu_count_must_match_tp_times_dp(vllm_bin, model_dir):
    result = run_serve(vllm_bin, str(model_dir), "-tp", "1", "-dp", "4", CUDA_VISIBLE_DEVICES="0,1,2")
    assert result.returncode == 1
    assert "CUDA_VISIBLE_DEVICES=0,1,2 lists 3 GPUs but -tp 1 × -dp 4 needs 4" in result.stderr


def test_model_needs_staged_config_json(vllm_bin, tmp_path):
    (tmp_path / "empty").mkdir()
    result = run_serve(vllm_bin, str(tmp_path / "empty"), CUDA_VISIBLE_DEVICES="0")
    assert result.returncode == 1
    assert f"model {tmp_path / 'empty'} has no config.json" in result.stderr
    result = run_serve(vllm_bin, str(tmp_path / "absent"), CUDA_VISIBLE_DEVICES="0")
    assert result.returncode == 1
    assert "is not a directory" in result.stderr


def test_kv_transfer_needs_the_nixl_side_channel_env(vllm_bin, model_dir):
    result = run_serve(vllm_bin, str(model_dir), "--kv-transfer-config", PRODUCER, CUDA_VISIBLE_DEVICES="0")
    assert result.returncode == 1
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST is not set" in result.stderr
    result = run_serve(vllm_bin, str(model_dir), "--kv-transfer-config", PRODUCER, CUDA_VISIBLE_DEVICES="0",
                       VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1")
    assert result.returncode == 1
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT is not set" in result.stderr
    bad_role = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_prefill"})
    result = run_serve(vllm_bin, str(model_dir), "--kv-transfer-config", bad_role, CUDA_VISIBLE_DEVICES="0")
    assert result.returncode == 1
    assert "kv_role 'kv_prefill' is not one of kv_producer, kv_consumer, kv_both" in result.stderr


def test_nixl_side_channel_collision_fails_the_second_instance(launch):
    base = free_port_range(3)
    first = launch("--kv-transfer-config", PRODUCER, "-dp", "2", gpus="0,1", env=nixl_env(base), name="first")
    first.wait_healthy()
    # Its ranks hold base and base+1; the second instance's rank 0 wants base+1.
    second = launch("--kv-transfer-config", PRODUCER, "-dp", "2", gpus="2,3", env=nixl_env(base + 1), name="second")
    assert second.process.wait(30) == 1
    assert f"cannot bind NIXL side channel of DP rank 0 on 127.0.0.1:{base + 1}: Address already in use" in (
        second.log.read_text())
    assert first.process.poll() is None


def test_data_parallel_rpc_port_collision_fails(launch):
    rpc_port = free_port()
    launch("--data-parallel-rpc-port", str(rpc_port), name="first").wait_healthy()
    second = launch("--data-parallel-rpc-port", str(rpc_port), name="second")
    assert second.process.wait(30) == 1
    assert f"cannot bind the data-parallel RPC port on 127.0.0.1:{rpc_port}" in second.log.read_text()


# --- serving ----------------------------------------------------------------------------------


@pytest.mark.parametrize("api_key", [None, "k3y"], ids=["open", "api-key"])
def test_prefill_then_decode_behind_the_real_router(launch, tmp_path, api_key):
    """With router.apiKey, glm-infra gives the instances VLLM_API_KEY and the router OPENAI_API_KEY,
    which the router sends on its prefill and decode requests."""
    instance_env = {"VLLM_API_KEY": api_key} if api_key else {}
    prefill = launch("--kv-transfer-config", PRODUCER, "-ep", "-tp", "1", "-dp", "2", gpus="0,1",
                     env={**nixl_env(free_port_range(2)), **instance_env}, name="prefill")
    decode = launch("--kv-transfer-config", CONSUMER, "-ep", "-tp", "1", "-dp", "4",
                    "--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 3}), gpus="0,1,2,3",
                    env={**nixl_env(free_port_range(4)), **instance_env, "GLM_SIM_MTP_ACCEPTANCE": "0.5",
                         "GLM_SIM_KV_TRANSFER_MS": "30"}, name="decode")
    prefill.wait_healthy()
    decode.wait_healthy()

    router_port = free_port()
    router_log = tmp_path / "router.log"
    with router_log.open("w") as out:
        router = subprocess.Popen(
            [str(ROUTER), "--vllm-pd-disaggregation", "--prefill", f"http://127.0.0.1:{prefill.port}",
             "--decode", f"http://127.0.0.1:{decode.port}", "--host", "127.0.0.1", "--port", str(router_port),
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
            env=clean_env(**({"OPENAI_API_KEY": api_key} if api_key else {})), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for(lambda: router.poll() is not None or answers(router_port), 60, "router healthy")
        assert router.poll() is None, router_log.read_text()[-3000:]
        status, body = request(router_port, "POST", "/v1/chat/completions", chat())
        assert status == 200, body
        answer = json.loads(body)
        assert answer["choices"][0]["finish_reason"] == "stop"
        assert answer["choices"][0]["message"]["content"]
    finally:
        os.killpg(router.pid, signal.SIGKILL)
        router.wait()

    assert metric(prefill.port, "remote_decode") == 1  # /metrics needs no key
    assert metric(prefill.port, "stop") == 0
    assert metric(decode.port, "stop") == 1
    prefill_line = next(line for line in prefill.lines() if "POST /v1/chat/completions 200" in line)
    decode_line = next(line for line in decode.lines() if "POST /v1/chat/completions 200" in line)
    assert prefill_line.startswith("glm-sim prefill: ") and "do_remote_decode=true do_remote_prefill=false" in (
        prefill_line)
    assert decode_line.startswith("glm-sim decode: ") and "do_remote_decode=false do_remote_prefill=true" in (
        decode_line)
    request_id = re.search(r"request_id=(\S+)", prefill_line).group(1)
    assert f"request_id={request_id}" in decode_line

    # vLLM's families the simulator lacks: one KV pull of 30 ms on decode, MTP counters from the
    # tokens decode generated at 50 % acceptance of 3-token drafts.
    text = request(decode.port, "GET", "/metrics")[1].decode()
    series = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    labels = f'engine="0",model_name="{MODEL_NAME}"'
    assert series[f"vllm:nixl_xfer_time_seconds_count{{{labels}}}"] == 1
    assert series[f"vllm:nixl_xfer_time_seconds_sum{{{labels}}}"] == pytest.approx(0.03)
    assert series[f'vllm:nixl_xfer_time_seconds_bucket{{{labels},le="0.025"}}'] == 0
    assert series[f'vllm:nixl_xfer_time_seconds_bucket{{{labels},le="0.05"}}'] == 1
    assert series[f"vllm:nixl_num_failed_transfers_total{{{labels}}}"] == 0
    generated = sum(v for k, v in series.items() if k.startswith("vllm:generation_tokens_total"))
    assert generated > 0
    drafted = series[f"vllm:spec_decode_num_draft_tokens_total{{{labels}}}"]
    accepted = series[f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}}"]
    assert accepted / drafted == pytest.approx(0.5, abs=0.01)
    assert series[f"vllm:spec_decode_num_drafts_total{{{labels}}}"] + accepted == pytest.approx(generated, abs=0.2)
    # Four DP ranks, so four API servers: vLLM 0.33.0 then serves no process_* family (real-engine README).
    assert not [line for line in text.splitlines() if "process_" in line]
    prefill_text = request(prefill.port, "GET", "/metrics")[1].decode()
    assert "vllm:nixl_xfer_time_seconds" not in prefill_text and "spec_decode" not in prefill_text
    # TTFT from the request's arrival, as vLLM measures it (the simulator's counts only its sleep):
    # one family, decode's at least its 30 ms KV pull, prefill's at least its 50 ms prefill.
    prefill_series = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in prefill_text.splitlines()
                      if line and not line.startswith("#")}
    for exposition, values, floor in ((text, series, 0.03), (prefill_text, prefill_series, 0.05)):
        assert exposition.count("# TYPE vllm:time_to_first_token_seconds histogram") == 1
        assert values[f"vllm:time_to_first_token_seconds_count{{{labels}}}"] == 1
        assert values[f"vllm:time_to_first_token_seconds_sum{{{labels}}}"] >= floor
        assert values[f'vllm:time_to_first_token_seconds_bucket{{{labels},le="+Inf"}}'] == 1


def test_port_refuses_connections_while_loading(launch):
    """Like vLLM, whose API server listens only once the engine is up: a router's connection attempt
    is refused (and tried elsewhere) rather than left waiting for minutes of weight loading."""
    started = time.monotonic()
    instance = launch(startup="2")
    wait_for(lambda: "serving" in instance.log.read_text(), 10, "the instance to start")
    assert refused(instance.port)
    with pytest.raises(OSError):
        request(instance.port, "POST", "/v1/chat/completions", chat())
    instance.wait_healthy()
    assert time.monotonic() - started >= 2
    assert request(instance.port, "POST", "/v1/chat/completions", chat())[0] == 200


def test_sigterm_drains_a_streaming_request(launch):
    instance = launch("--shutdown-timeout", "30", env={"GLM_SIM_ITL_MS": "10"}).wait_healthy()
    first_token = threading.Event()
    events: list[str] = []
    outcome: dict[str, object] = {}

    def stream() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", instance.port, timeout=30)
        body = chat(stream=True, max_tokens=200, ignore_eos=True, stream_options={"include_usage": True})
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        outcome["status"] = response.status
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                if '"content"' in line:
                    first_token.set()
        outcome["finished"] = time.monotonic()
        conn.close()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first_token.wait(10)
    instance.process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    wait_for(lambda: refused(instance.port), 1, "new connections refused after SIGTERM")
    reader.join(30)

    assert outcome["status"] == 200
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 200
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert outcome["finished"] - signalled > 0.5  # most of the 200 tokens came after the signal
    assert instance.process.wait(15) == 0
    assert "glm-sim colocated: drained" in instance.lines()
    assert not alive(instance.simulator_pid())


def test_simulator_death_fails_the_instance(launch):
    instance = launch().wait_healthy()
    os.kill(instance.simulator_pid(), signal.SIGKILL)
    assert instance.process.wait(10) != 0
    assert any("llm-d-inference-sim exited with code" in line for line in instance.lines())


def test_killed_instance_takes_the_simulator_along(launch):
    instance = launch().wait_healthy()
    simulator = instance.simulator_pid()
    instance.process.kill()
    instance.process.wait()
    wait_for(lambda: not alive(simulator), 5, "the simulator to exit")


def test_api_key_is_required_except_for_health_and_metrics(launch):
    instance = launch(env={"VLLM_API_KEY": "s3cret"}).wait_healthy()
    assert request(instance.port, "GET", "/v1/models")[0] == 401
    assert request(instance.port, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"})[0] == 401
    assert request(instance.port, "POST", "/v1/chat/completions", chat())[0] == 401
    status, body = request(instance.port, "GET", "/v1/models", headers={"Authorization": "Bearer s3cret"})
    assert status == 200 and MODEL_NAME in body.decode()
    status, _ = request(instance.port, "POST", "/v1/chat/completions", chat(),
                        headers={"Authorization": "Bearer s3cret"})
    assert status == 200
    assert request(instance.port, "GET", "/health")[0] == 200
    assert request(instance.port, "GET", "/metrics")[0] == 200


# --- each rank's NIC (vLLM 0.33.0's VLLM_GPU_NIC_PCIE_MAPPING) ----------------------------------------


@pytest.fixture
def hardware(tmp_path) -> dict[str, str]:
    """A simulated B300's nvidia-smi and ibdev2netdev on PATH, as on a sim host, and the pairs the
    nic-affinity step writes for it (hostcheck.py's own reading of those tools)."""
    sim = Sim(tmp_path / "hw")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("nvidia-smi", "ibdev2netdev"):
        (bin_dir / tool).symlink_to(TOOLS[tool])
    topo = hostcheck.parse_topo_m(sim.out("nvidia-smi", "topo", "-m"))
    gpus = hostcheck.parse_gpu_bus_ids(sim.out("nvidia-smi", "--query-gpu=index,pci.bus_id", "--format=csv,noheader"))
    nics = hostcheck.parse_ibdev2netdev(sim.out("ibdev2netdev", "-v"))
    nearest, problems = hostcheck.nic_affinity(topo, gpus, nics, [f"mlx5_{i}" for i in range(8)], "PXB")
    assert problems == []
    mapping = hostcheck.nic_affinity_env(nearest, gpus, nics, "sim-1").splitlines()[-1].split("=", 1)[1]
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "GLM_SIM_ROOT": str(sim.root), "PYTHONPATH": str(HW_LIB),
            "VLLM_GPU_NIC_PCIE_MAPPING": mapping, "VLLM_NIC_SELECTION_VARS": "UCX_NET_DEVICES:1",
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def test_each_rank_gets_the_nic_of_its_gpu(launch, hardware):
    env = {**nixl_env(free_port_range(2)), **hardware}
    prefill = launch("--kv-transfer-config", PRODUCER, "-dp", "2", gpus="2,3", env=env).wait_healthy()
    assert [l for l in prefill.lines() if "UCX_NET_DEVICES=" in l] == [
        "glm-sim prefill: DP rank 0 TP rank 0 on GPU 2: UCX_NET_DEVICES=mlx5_2:1",
        "glm-sim prefill: DP rank 1 TP rank 0 on GPU 3: UCX_NET_DEVICES=mlx5_3:1"]
    # A global UCX_NET_DEVICES is kept behind the rank's NIC (so UCX would use every NIC again).
    env = {**nixl_env(free_port_range(1)), **hardware, "UCX_NET_DEVICES": "mlx5_0:1,mlx5_1:1"}
    tp2 = launch("--kv-transfer-config", CONSUMER, "-tp", "2", gpus="4,5", env=env).wait_healthy()
    assert [l.split(": ", 1)[1] for l in tp2.lines() if "UCX_NET_DEVICES=" in l] == [
        "DP rank 0 TP rank 0 on GPU 4: UCX_NET_DEVICES=mlx5_4:1,mlx5_0:1,mlx5_1:1",
        "DP rank 0 TP rank 1 on GPU 5: UCX_NET_DEVICES=mlx5_5:1,mlx5_0:1,mlx5_1:1"]


def test_a_gpu_without_a_nic_pair_fails_the_start(vllm_bin, model_dir, hardware):
    pairs = hardware["VLLM_GPU_NIC_PCIE_MAPPING"].split(",")
    env = {**nixl_env(free_port_range(2)), **hardware, "VLLM_GPU_NIC_PCIE_MAPPING": ",".join(pairs[:3])}
    result = run_serve(vllm_bin, str(model_dir), "--kv-transfer-config", PRODUCER, "-dp", "2",
                       CUDA_VISIBLE_DEVICES="2,3", **env)
    assert result.returncode == 1
    assert "RuntimeError: VLLM_GPU_NIC_PCIE_MAPPING has no NIC for GPU 3 (0000:73:00.0)" in result.stderr


# --- greedy answers and the faults canaries catch -----------------------------------------------------


def greedy(port: int, prompt: str = "The capital of France is", timeout: float = 30, **extra: object) -> tuple[int, dict]:
    status, body = request(port, "POST", "/v1/completions",
                           {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra},
                           timeout=timeout)
    return status, json.loads(body) if status == 200 else {}


def test_greedy_requests_answer_the_same_until_the_engine_breaks(launch, tmp_path):
    faults = tmp_path / "faults"
    faults.mkdir()
    vllm = launch(env={"GLM_SIM_VLLM_FAULTS": str(faults)}).wait_healthy()
    first = greedy(vllm.port)[1]["choices"][0]["text"]
    assert len(first.split()) == 8 and all(greedy(vllm.port)[1]["choices"][0]["text"] == first for _ in range(3))
    assert greedy(vllm.port, "Another prompt")[1]["choices"][0]["text"] != first
    # A broken engine: HTTP 200 and other words (what the P/D trackers report after a failed KV pull).
    (faults / str(vllm.port)).write_text("wrong\n")
    status, answer = greedy(vllm.port)
    assert status == 200 and answer["choices"][0]["text"] != first and answer["usage"]["completion_tokens"] == 8
    (faults / str(vllm.port)).unlink()
    assert greedy(vllm.port)[1]["choices"][0]["text"] == first


@pytest.mark.parametrize(("flags", "gpus", "served"), [
    ((), "0", True),
    (("-dp", "2"), "0,1", False),  # -dp 2: two API servers, as vLLM 0.33.0 starts by default
    (("-dp", "2", "--api-server-count", "1"), "0,1", True),
    (("--api-server-count", "2"), "0", False),
], ids=["one-api-server", "dp-2", "dp-2-one-api-server", "two-api-servers"])
def test_process_metrics_are_served_only_by_one_api_server(launch, flags, gpus, served):
    """vLLM 0.33.0 on a real GPU: with more than one API server its /metrics has no process_* family
    at all; with one it serves process_resident_memory_bytes (shared/real-engine/README.md)."""
    vllm = launch(*flags, gpus=gpus).wait_healthy()
    status, body = request(vllm.port, "GET", "/metrics")
    assert status == 200
    text = body.decode()
    assert "vllm:num_requests_running" in text  # the engine's own families either way
    resident = [line for line in text.splitlines() if line.startswith("process_resident_memory_bytes ")]
    if served:
        assert len(resident) == 1 and float(resident[0].split()[1]) > 10 * 2**20
    else:
        assert "process_" not in text


def test_the_latency_histograms_are_served_at_zero_before_any_request_and_then_counted(launch):
    """vLLM binds each engine's histograms at start (vllm/v1/metrics/loggers.py, make_per_engine), so the rules'
    inter-token latency has a series before the first request, and keeps exactly one family after; the
    simulator alone serves it only once a request of two tokens or more was observed (CI met one without)."""
    vllm = launch().wait_healthy()
    family = "vllm:inter_token_latency_seconds"

    def counts() -> list[str]:
        text = request(vllm.port, "GET", "/metrics")[1].decode()
        assert text.count(f"# TYPE {family} histogram") == 1, text
        return [line for line in text.splitlines() if line.startswith(f"{family}_count")]

    assert [line.rsplit(" ", 1)[1] for line in counts()] == ["0"]
    for _ in range(3):
        status, answer = greedy(vllm.port, ignore_eos=True)  # every one of its 8 tokens generated
        assert status == 200 and answer["usage"]["completion_tokens"] == 8
    deadline = time.monotonic() + 10
    while float(counts()[0].rsplit(" ", 1)[1]) == 0:  # the simulator counts on a goroutine of its own
        assert time.monotonic() < deadline, "the simulator observed the inter-token latency"
        time.sleep(0.2)
    assert len(counts()) == 1


def test_the_startup_phases_are_logged_as_the_real_engine_logs_them(launch, model_dir):
    """What the real-engine check reads from vLLM 0.33.0's log on a GPU (tests/fixtures/real-engine/), the
    stand-in logs too: weights, model loading, graph capture, init engine."""
    from testbed.real_engine import check

    (model_dir / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 4096)
    vllm = launch().wait_healthy()
    logged = check.phases(vllm.log.read_text())
    assert set(logged) == set(check.PHASES), vllm.log.read_text()[-2000:]
    real = check.phases((ROOT / "tests/fixtures/real-engine/2026-12-06-h100/prefill.log").read_text())
    assert set(real) == set(logged)


def test_the_dp_rank_header_picks_the_rank_and_an_unknown_one_is_refused(launch, tmp_path):
    faults = tmp_path / "faults"
    faults.mkdir()
    vllm = launch("-dp", "2", gpus="0,1", env={"GLM_SIM_VLLM_FAULTS": str(faults)}).wait_healthy()
    (faults / str(vllm.port)).write_text("hang-rank=1\n")
    try:
        for _ in range(3):  # rank 0, named, every time: never the hung one's turn
            status, _ = request(vllm.port, "POST", "/v1/completions", {"model": MODEL_NAME, "prompt": "1, 2,",
                                "max_tokens": 2, "temperature": 0}, timeout=10, headers={"X-data-parallel-rank": "0"})
            assert status == 200
        status, body = request(vllm.port, "POST", "/v1/completions", {"model": MODEL_NAME, "prompt": "1, 2,",
                               "max_tokens": 2}, timeout=10, headers={"X-data-parallel-rank": "2"})
        assert status == 400 and "data_parallel_rank 2 is out of range [0, 2)." in body.decode()
    finally:
        (faults / str(vllm.port)).unlink()


def test_another_revision_of_the_same_model_answers_the_same_and_another_model_does_not(launch, model_dir, tmp_path):
    first = greedy(launch().wait_healthy().port)[1]["choices"][0]["text"]
    revision = tmp_path / "GLM-5.2-NVFP4.revisions" / "rev2"  # staged elsewhere, the same config
    revision.mkdir(parents=True)
    config = json.loads((model_dir / "config.json").read_text())
    (revision / "config.json").write_text(json.dumps({**config, "revision": "rev2"}))  # as make-checkpoint stamps it
    assert greedy(launch(model=revision).wait_healthy().port)[1]["choices"][0]["text"] == first
    other = tmp_path / "another-model"
    other.mkdir()
    (other / "config.json").write_text('{"architectures": ["GlmMoeDsaForCausalLM"], "num_hidden_layers": 4}')
    assert greedy(launch(model=other).wait_healthy().port)[1]["choices"][0]["text"] != first


def test_a_hung_dp_rank_holds_its_requests_while_health_stays_ok(launch, tmp_path):
    faults = tmp_path / "faults"
    faults.mkdir()
    env = {**nixl_env(free_port_range(2)), "GLM_SIM_VLLM_FAULTS": str(faults)}
    vllm = launch("--kv-transfer-config", PRODUCER, "-dp", "2", gpus="0,1", env=env).wait_healthy()
    (faults / str(vllm.port)).write_text("hang-rank=1\n")
    results: list[object] = []

    def one() -> None:
        try:
            results.append(greedy(vllm.port, timeout=2)[0])
        except OSError as e:
            results.append(type(e).__name__)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(map(str, results)) == ["200", "TimeoutError"], results
    assert answers(vllm.port, "/health"), "vLLM's /health does not see a hung rank"
    (faults / str(vllm.port)).unlink()
    assert all(greedy(vllm.port, timeout=10)[0] == 200 for _ in range(2))


def test_the_canary_program_catches_a_wrong_answer_and_a_hung_rank(launch, tmp_path, capsys):
    from glm_infra.agent import canary

    faults = tmp_path / "faults"
    faults.mkdir()
    env = {**nixl_env(free_port_range(2)), "GLM_SIM_VLLM_FAULTS": str(faults), "VLLM_API_KEY": "k3y"}
    vllm = launch("--kv-transfer-config", PRODUCER, "-dp", "2", gpus="0,1", env=env).wait_healthy()
    (tmp_path / "vllm.env").write_text("VLLM_API_KEY=k3y\n")
    spec = tmp_path / "targets.json"
    spec.write_text(json.dumps({"identity": "rev1|0.33.0+glmsim", "model": MODEL_NAME,
                                "api_key_file": str(tmp_path / "vllm.env"),
                                "targets": [{"name": "prefill-0", "role": "prefill", "requests": 2, "gate": True,
                                             "url": f"http://127.0.0.1:{vllm.port}"}]}))

    def run() -> tuple[int, str]:
        rc = canary.main(["run", "--targets", str(spec), "--state", str(tmp_path / "state"), "--timeout", "2"])
        out = capsys.readouterr()
        return rc, out.out + out.err

    rc, said = run()
    assert rc == 1 and "no reference of 'rev1|0.33.0+glmsim' agreed yet" in said, "one instance: nothing to agree with"
    assert canary.main(["accept", "--targets", str(spec), "--state", str(tmp_path / "state"), "--timeout", "2"]) == 0
    assert "accepted by the operator from prefill-0" in capsys.readouterr().out
    rc, said = run()
    assert rc == 0 and "canary: prefill-0 ok (" in said, "the same greedy answer from both ranks, again"
    (faults / str(vllm.port)).write_text("wrong\n")
    rc, said = run()
    assert rc == 1 and "prefill-0: answered '" in said and "where the reference is '" in said
    (faults / str(vllm.port)).write_text("hang-rank=1\n")
    rc, said = run()
    assert rc == 1 and "prefill-0: 1 of 2 canaries failed: no answer within 2 s" in said
    (faults / str(vllm.port)).unlink()
    assert run()[0] == 0, "back once fixed"


# --- the engine's start: phases and the autotune cache (startup.py) ----------------------------------


def engine_lines(text: str, phrase: str) -> list[str]:
    return [line for line in text.splitlines() if phrase in line]


def init_seconds(text: str) -> list[float]:
    return [float(m) for m in re.findall(r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) s", text)]


def stop_instance(instance: Instance) -> None:
    instance.process.send_signal(signal.SIGTERM)
    instance.process.wait(30)


def test_a_cold_start_tunes_and_caches_and_a_restart_reads_the_cache(launch, tmp_path):
    """vLLM 0.33.0's lines for GLM-5.2, in order, once per DP engine: a cold start runs the FlashInfer
    autotune and writes one file per engine under VLLM_CACHE_ROOT; the restart finds them, skips the
    tuning and is ready that much sooner. Graph capture runs at both starts (nothing caches it)."""
    env = {"GLM_SIM_KERNEL_WARMUP_SECONDS": "1.5", "GLM_SIM_GRAPH_CAPTURE_SECONDS": "0.2"}
    cold = launch("-dp", "2", gpus="0,1", env=env).wait_healthy()
    text = cold.log.read_text()
    order = ["Auto-enabling VLLM_USE_BREAKABLE_CUDAGRAPH=1", "Loading weights took", "Using FlashInfer autotune cache file",
             "Running FlashInfer autotune with", "Graph capturing finished in", "init engine (profile"]
    positions = [text.index(phrase) for phrase in order]
    assert positions == sorted(positions), text
    assert len(engine_lines(text, "Running FlashInfer autotune")) == 2
    assert "torch.compile" not in text, "GLM-5.2 is not compiled by vLLM 0.33.0"
    files = sorted((tmp_path / "vllm-cache" / "flashinfer_autotune_cache").rglob("autotune_configs_*.json"))
    assert [f.name for f in files] == ["autotune_configs_dp0_rank0.json", "autotune_configs_dp1_rank0.json"]
    assert all(s >= 1.5 for s in init_seconds(text)), text
    stop_instance(cold)

    warm = launch("-dp", "2", gpus="0,1", env=env).wait_healthy()
    text = warm.log.read_text()
    assert len(engine_lines(text, "Using FlashInfer autotune cache file")) == 2
    assert not engine_lines(text, "Running FlashInfer autotune"), text
    assert len(engine_lines(text, "Graph capturing finished in")) == 2
    assert all(s < 1.5 for s in init_seconds(text)), text


def test_the_autotune_cache_is_keyed_by_what_reaches_vllms_config_hash(launch, tmp_path, model_dir):
    """Another port or memory share hits the cache (vLLM does not hash them); another batch size or
    another config.json misses it, and the engine tunes again."""
    launch("--max-num-batched-tokens", "1024").wait_healthy()
    hit = launch("--max-num-batched-tokens", "1024", "--gpu-memory-utilization", "0.8").wait_healthy()
    assert not engine_lines(hit.log.read_text(), "Running FlashInfer autotune")
    miss = launch("--max-num-batched-tokens", "2048").wait_healthy()
    assert engine_lines(miss.log.read_text(), "Running FlashInfer autotune with 2048 tokens")
    (model_dir / "config.json").write_text('{"architectures": ["GlmMoeDsaForCausalLM"], "num_hidden_layers": 2}')
    other = launch("--max-num-batched-tokens", "1024").wait_healthy()
    assert engine_lines(other.log.read_text(), "Running FlashInfer autotune")
    folders = {f.parent for f in (tmp_path / "vllm-cache").rglob("autotune_configs_*.json")}
    assert len(folders) == 3


def test_a_corrupt_cache_file_is_tuned_again_and_rewritten(launch, tmp_path):
    launch().wait_healthy()
    (cached,) = (tmp_path / "vllm-cache").rglob("autotune_configs_dp0_rank0.json")
    cached.write_text("{")
    again = launch().wait_healthy()
    assert engine_lines(again.log.read_text(), "Running FlashInfer autotune")
    assert "_metadata" in json.loads(cached.read_text())


def test_an_engine_that_cannot_write_its_cache_never_serves_and_the_process_exits(launch, tmp_path):
    """Fails closed: an engine whose autotune cache cannot be written (VLLM_CACHE_ROOT is a file here) does
    not start, the port never answers, and the process exits 1 naming the cause, as vLLM's does."""
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    instance = launch(env={"VLLM_CACHE_ROOT": str(blocked)})
    assert instance.process.wait(30) == 1
    text = instance.log.read_text()
    assert "Engine core initialization failed. See root cause above." in text
    assert str(blocked) in text and not answers(instance.port)
