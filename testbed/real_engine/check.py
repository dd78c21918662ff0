"""The real-engine check: serve the lines `glm-infra real-engine` wrote, on this machine, and prove what they do
(issue 41). Standard library only, so it runs on a GPU machine with nothing but Python and the payload.

    python3 testbed/real_engine/check.py --lines DIR --model DIR --out DIR [--bin DIR] [--timeout S]
                                         [--expect-metrics FILE] [--metrics-wait S] [--wrong-model DIR]
                                         [--env NAME=VALUE ...]

DIR (--lines) is `glm-infra real-engine`'s output: each instance's and the router's argv and environment.
They start in order (prefill, then decode once prefill answers, then the router), each in its own session
with its log in --out, with ``vllm`` and ``vllm-router`` taken from --bin (default: beside this Python),
else from PATH.
Then, each printed and recorded in --out/results.json and the transcript --out/TRANSCRIPT.md:

- every instance and the router answer /health;
- a chat completion through the router, not streamed and streamed;
- decode pulled KV over NIXL (transfers > 0) and none failed;
- every metric --expect-metrics lists (JSON {metric: [who reads it]}: glm-infra's rules and dashboard,
  from ``monitoring.read_metrics``; `glm-infra real-engine` writes it beside the lines) that a vLLM
  instance or the router should serve is served (read again each second for --metrics-wait seconds: the
  engines' stats reach /metrics at their next logging step), or named missing; whether any ``process_*``
  metric is served (vLLM serves none with several API servers);
- glm-infra's canary (glm_infra/agent/canary/, bundled as the router's host gets it) passes against the
  instances, which agree on its reference (a checkpoint whose greedy answer is visible text is needed: a
  random one's detokenizes to nothing, and the canary fails closed), and fails against a planted instance
  serving --wrong-model, naming it;
- the startup phases each instance logged, with their seconds (weights, graph capture, init engine).

Everything started is stopped at the end, also on failure. Exit 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import functools
import http.client
import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

PLACEHOLDER = re.compile(r"\$\{([A-Z_]+)\}")
# The startup phases as vLLM 0.33.0 logs them (and the stand-in, which follows it).
PHASES = {
    "weights": re.compile(r"Loading weights took ([0-9.]+) s"),
    "model loading": re.compile(r"Model loading took [0-9.]+ GiB (?:memory )?and ([0-9.]+) s"),
    "graph capture": re.compile(r"Graph capturing finished in ([0-9.]+) secs"),
    "init engine": re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) s"),
}
# glm-infra's canary program is a package bundled into one file, as the router's host gets it; the bundler is
# stdlib only and loaded by its path (glm_infra's own dependencies are not on the GPU machine).
BUNDLE = Path(__file__).resolve().parents[2] / "glm_infra" / "agent" / "bundle.py"


@functools.cache
def canary_program(out: Path) -> Path:
    """glm-infra's canary program, written to OUT/canary.py as the router's host gets it (once per run)."""
    spec = importlib.util.spec_from_file_location("glm_infra_agent_bundle", BUNDLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = out / "canary.py"
    path.write_text(module.program("canary"))
    return path
NIXL_TRANSFERS = ("vllm:nixl_xfer_time_seconds_count", "vllm:nixl_bytes_transferred_count")
NIXL_FAILED = "vllm:nixl_num_failed_transfers_total"


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class Service:
    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    process: subprocess.Popen | None = None

    def start(self) -> None:
        out = self.log.open("w")
        self.process = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        out.close()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@dataclass
class Run:
    out: Path
    checks: list[Check] = field(default_factory=list)
    facts: dict = field(default_factory=dict)

    def record(self, name: str, ok: bool, detail: str) -> bool:
        self.checks.append(Check(name, ok, detail))
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
        return ok


def substitute(value: str, values: dict[str, str]) -> str:
    def one(m: re.Match) -> str:
        if m.group(1) not in values:
            raise KeyError(f"nothing sets ${{{m.group(1)}}}")
        return values[m.group(1)]
    return PLACEHOLDER.sub(one, value)


def load_service(lines: Path, role: str, values: dict[str, str], binaries: Path, out: Path,
                 extra: dict[str, str]) -> Service | None:
    argv_file = lines / f"{role}.argv.json"
    if not argv_file.exists():
        return None
    argv = [substitute(a, values) for a in json.loads(argv_file.read_text())]
    env = {k: substitute(v, values) for k, v in json.loads((lines / f"{role}.env.json").read_text()).items()}
    found = binaries / argv[0] if (binaries / argv[0]).exists() else shutil.which(argv[0])
    if found is None:
        raise SystemExit(f"check: {argv[0]} is neither in {binaries} nor on PATH")
    argv[0] = str(found)
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "CUDA_HOME", "LD_LIBRARY_PATH",
                                                         "TMPDIR", "NO_PROXY", "no_proxy")}
    base["PATH"] = f"{binaries}:{base.get('PATH', '/usr/bin:/bin')}"
    return Service(role, argv, {**base, **extra, **env}, out / f"{role}.log")


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def get(url: str, timeout: float = 10, headers: dict | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, OSError, http.client.HTTPException):
        return 0, ""


def wait_healthy(run: Run, service: Service, url: str, timeout: float) -> bool:
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if not service.alive():
            return run.record(f"{service.name} healthy", False,
                              f"exited {service.process.returncode}:\n{service.tail()}")
        if get(url, timeout=5)[0] == 200:
            return run.record(f"{service.name} healthy", True, f"{url} 200 after {time.monotonic() - began:.0f} s")
        time.sleep(2)
    return run.record(f"{service.name} healthy", False, f"{url} not 200 within {timeout:.0f} s:\n{service.tail()}")


def chat(run: Run, router: str, key: str, model: str, stream: bool) -> None:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Count: 1, 2, 3,"}],
                       "max_tokens": 8, "temperature": 0, "stream": stream}).encode()
    req = urllib.request.Request(f"{router}/v1/chat/completions", data=body, headers={
        "content-type": "application/json", "authorization": f"Bearer {key}"})
    name = f"chat through the router ({'streamed' if stream else 'not streamed'})"
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            text = r.read().decode(errors="replace")
            status = r.status
    except urllib.error.HTTPError as e:
        run.record(name, False, f"HTTP {e.code}: {e.read().decode(errors='replace')[:300]}")
        return
    except (urllib.error.URLError, OSError) as e:
        run.record(name, False, f"no answer: {e}")
        return
    if stream:
        events = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
        ok = status == 200 and len(events) >= 2 and events[-1] == "[DONE]"
        run.record(name, ok, f"{status}, {len(events)} events, last {events[-1] if events else None!r}")
    else:
        try:
            choice = json.loads(text)["choices"][0]
            ok = status == 200 and choice.get("finish_reason") in ("stop", "length")
            run.record(name, ok, f"{status}, finish_reason {choice.get('finish_reason')}, "
                                 f"text {choice['message'].get('content')!r}")
        except (ValueError, KeyError, IndexError) as e:
            run.record(name, False, f"{status}, not a chat completion ({e}): {text[:300]}")


def samples(exposition: str) -> dict[str, float]:
    """Metric name → the sum of its samples (labels dropped)."""
    out: dict[str, float] = {}
    for line in exposition.splitlines():
        if not line or line.startswith("#"):
            continue
        name = re.split(r"[{ ]", line, 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        except ValueError:
            continue
    return out


def families(exposition: str) -> set[str]:
    names = set()
    for line in exposition.splitlines():
        if line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, 1)[0])
    return names


def served_families(expositions: dict[str, str]) -> set[str]:
    """Every family any service serves (a histogram's or counter's samples carry suffixes its name does not)."""
    return set().union(*(families(t) for t in expositions.values())) if expositions else set()


def engine_metrics(expected: dict[str, list[str]]) -> dict[str, list[str]]:
    """The expected metrics a vLLM instance or the router serves (the rest are other exporters'), with their readers."""
    return {m: who for m, who in expected.items() if m.startswith(("vllm:", "vllm_router_"))}


def scrape(services: list, expected: dict[str, list[str]], timeout: float) -> dict[str, str]:
    """Every service's /metrics, read again until it serves every expected family and a NIXL transfer, or
    until timeout: the engines' stats reach /metrics at their next logging step, later on a loaded machine."""
    deadline = time.monotonic() + timeout
    wanted = set(engine_metrics(expected))
    while True:
        expositions = {}
        for s in services:
            port = flag(s.argv, "--prometheus-port") if s.name == "router" else flag(s.argv, "--port")
            status, text = get(f"http://127.0.0.1:{port}/metrics", timeout=30)
            expositions[s.name] = text if status == 200 else ""
        served = served_families(expositions)
        decode = samples(expositions.get("decode", ""))
        if (wanted <= served and any(decode.get(n) for n in NIXL_TRANSFERS)) or time.monotonic() > deadline:
            return expositions
        time.sleep(1)


def metric_checks(run: Run, expositions: dict[str, str], expected: dict[str, list[str]]) -> None:
    decode = samples(expositions.get("decode", ""))
    transfers = next((decode[n] for n in NIXL_TRANSFERS if n in decode), None)
    failed = decode.get(NIXL_FAILED)
    run.facts["nixl"] = {"transfers": transfers, "failed": failed,
                         "bytes": decode.get("vllm:nixl_bytes_transferred_sum")}
    run.record("KV over NIXL", bool(transfers) and failed == 0,
               f"{transfers} transfers, {failed} failed" if transfers is not None else
               f"decode serves none of {', '.join(NIXL_TRANSFERS)}")
    served = served_families(expositions)
    wanted = engine_metrics(expected)
    missing = sorted(m for m in wanted if m not in served)
    run.facts["metrics_missing"] = {m: wanted[m] for m in missing}
    run.record("metrics the rules and panels read", not missing,
               f"{len(wanted) - len(missing)} of {len(wanted)} served" +
               (f"; missing: {', '.join(f'{m} (read by {wanted[m][0]})' for m in missing)}" if missing else ""))
    process = sorted(n for role, t in expositions.items() if role != "router" for n in families(t)
                     if n.startswith("process_"))
    run.facts["process_metrics"] = process
    print(f"NOTE process_* metrics served by the instances: {', '.join(process) or 'none'}", flush=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def canary(out: Path, key: str, model: str, targets: list[dict], record: bool) -> subprocess.CompletedProcess:
    """glm-infra's own canary (glm_infra/agent/canary/, bundled as the router's host runs it) against ``targets``."""
    keyfile = out / "canary-key.env"
    keyfile.write_text(f"VLLM_API_KEY={key}\n")
    keyfile.chmod(0o600)
    spec = out / "canary-targets.json"
    spec.write_text(json.dumps({"identity": "real-engine-check", "model": model, "api_key_file": str(keyfile),
                                "targets": targets}))
    return subprocess.run([sys.executable, str(canary_program(out)), "run", "--targets", str(spec),
                           "--state", str(out / "canary"), "--timeout", "120", *([] if record else ["--check"])],
                          capture_output=True, text=True, timeout=900)


def canary_checks(run: Run, services: list[Service], key: str, model: str, wrong_model: str | None,
                  timeout: float) -> None:
    """The canary passes against the instances (their agreed answer recorded as its reference), and fails
    against a planted instance serving another checkpoint, naming it."""
    def target(s: Service, gate: bool) -> dict:
        return {"name": s.name, "role": s.name, "url": f"http://127.0.0.1:{flag(s.argv, '--port')}", "requests": 1,
                "per_rank": False, "gate": gate}

    targets = [target(s, s.name != "router") for s in services]
    p = canary(run.out, key, model, targets, record=True)
    reference = next((line.split("canary: ", 1)[1] for line in p.stdout.splitlines() if "canary: reference of" in line),
                     "")
    run.facts["canary"] = (p.stdout + p.stderr).strip().splitlines()
    if not run.record("canary against the instances", p.returncode == 0,
                      reference or (p.stderr.strip().splitlines() or ["no output"])[-1]):
        return
    if wrong_model is None:
        run.record("canary against a planted wrong instance", False, "not run: no --wrong-model given")
        return
    first = services[0]
    argv = list(first.argv)
    argv[2] = wrong_model
    for name in ("--port", "--data-parallel-rpc-port"):
        if name in argv:
            argv[argv.index(name) + 1] = str(free_port())
    env = dict(first.env)
    if "VLLM_NIXL_SIDE_CHANNEL_PORT" in env:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
    wrong = Service("wrong", argv, env, run.out / "wrong.log")
    wrong.start()
    try:
        if not wait_healthy(run, wrong, f"http://127.0.0.1:{flag(argv, '--port')}/health", timeout):
            return
        p = canary(run.out, key, model, [*targets, target(wrong, True)], record=False)
        named = [line for line in p.stderr.splitlines() if ": canary: wrong" in line]
        run.facts["canary_wrong"] = (p.stdout + p.stderr).strip().splitlines()
        run.record("canary against a planted wrong instance", p.returncode == 1 and bool(named),
                   named[0].split("canary: ", 1)[1] if named else f"exit {p.returncode}, the wrong instance not named")
    finally:
        wrong.stop()


def phases(log: str) -> dict[str, float]:
    """Each phase's seconds, summed over the times it is logged (with MTP the draft model loads and captures too)."""
    out = {}
    for name, pattern in PHASES.items():
        found = pattern.findall(log)
        if found:
            out[name] = round(sum(float(x) for x in found), 2)
    return out


def transcript(run: Run, started: str, machine: str) -> str:
    rows = [f"# Real-engine check, {started}", "", f"Machine: {machine}", "",
            "| check | result | detail |", "| --- | --- | --- |"]
    rows += [f"| {c.name} | {'pass' if c.ok else 'FAIL'} | {c.detail.splitlines()[0] if c.detail else ''} |"
             for c in run.checks]
    rows += ["", "Startup phases (seconds, as each instance logged them):", ""]
    for role, ph in run.facts.get("phases", {}).items():
        rows.append(f"- {role}: " + (", ".join(f"{k} {v:g}" for k, v in ph.items()) or "none logged"))
    rows += ["", f"process_* metrics served: {', '.join(run.facts.get('process_metrics') or []) or 'none'}", ""]
    return "\n".join(rows)


def machine() -> str:
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        gpu = ""
    return f"{os.uname().nodename}, {gpu or 'no nvidia-smi'}, Python {sys.version.split()[0]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", required=True, type=Path)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--bin", type=Path, default=Path(sys.executable).parent)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for each to answer /health")
    parser.add_argument("--expect-metrics", type=Path, help="default: LINES/expected-metrics.json")
    parser.add_argument("--metrics-wait", type=float, default=60,
                        help="seconds after the chats for the expected metrics and a NIXL transfer to be served")
    parser.add_argument("--wrong-model", help="another checkpoint: a planted instance serving it must fail the canary")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="more environment for every service (the machine's own needs)")
    args = parser.parse_args(argv)
    extra = dict(e.split("=", 1) for e in args.env)
    args.out.mkdir(parents=True, exist_ok=True)
    home = args.out / "home"
    home.mkdir(exist_ok=True)
    key = secrets.token_hex(16)
    values = {"GLM_CHECK_API_KEY": key, "GLM_CHECK_HOME": str(home), "GLM_CHECK_MODEL": args.model}
    run = Run(args.out)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    services = [s for role in ("prefill", "decode", "colocated", "router")
                if (s := load_service(args.lines, role, values, args.bin, args.out, extra)) is not None]
    if not services:
        print(f"check: {args.lines} holds no lines (glm-infra real-engine STACK --out DIR writes them)",
              file=sys.stderr)
        return 2
    expect = args.expect_metrics or args.lines / "expected-metrics.json"
    expected = json.loads(expect.read_text()) if expect.exists() else {}
    try:
        ready = True
        for s in services:
            s.start()
            if not wait_healthy(run, s, f"http://127.0.0.1:{flag(s.argv, '--port')}/health", args.timeout):
                ready = False
                break
        if ready:
            router = next((s for s in services if s.name == "router"), None)
            served = flag(services[0].argv, "--served-model-name")
            target = (f"http://127.0.0.1:{flag(router.argv, '--port')}" if router else
                      f"http://127.0.0.1:{flag(services[0].argv, '--port')}")
            chat(run, target, key, served, stream=False)
            chat(run, target, key, served, stream=True)
            metric_checks(run, scrape(services, expected, args.metrics_wait), expected)
            canary_checks(run, services, key, served, args.wrong_model, args.timeout)
    finally:
        for s in reversed(services):
            s.stop()
    run.facts["phases"] = {s.name: phases(s.log.read_text(errors="replace")) for s in services
                           if s.name != "router" and s.log.exists()}
    (args.out / "results.json").write_text(json.dumps(
        {"started": started, "machine": machine(), "checks": [c.__dict__ for c in run.checks], **run.facts},
        indent=1) + "\n")
    (args.out / "TRANSCRIPT.md").write_text(transcript(run, started, machine()))
    failed = [c.name for c in run.checks if not c.ok]
    print(f"{len(run.checks) - len(failed)} of {len(run.checks)} checks passed"
          + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed or not run.checks else 0


if __name__ == "__main__":
    sys.exit(main())
