"""``glm-infra sla STACK``: the SLA gate. NVIDIA AIPerf drives the router's public port with synthetic
prompts, one bucket per context length (default 16K, 64K, 128K, 256K input tokens) at the stack's
concurrency; each bucket's mean/p50/p99 TTFT and TPOT are judged against the stack's targets (the
SLA is on the means), and Prometheus's view of the same run (prefill's plus decode's mean TTFT) is
held against the client's. Writes ``sla.json`` and ``sla.png`` (latency against context length with
the SLA lines); exits 1 naming each bucket and metric that failed, and each bucket whose data is absent,
partial, cut short or unreadable (sla_aiperf.py reads AIPerf's; sla_verdict.py judges).
Before and after the buckets the canaries run once on the router's host over SSH (tools/canaries.py): a
mismatch fails the gate, whatever the latencies (``--no-canary``: a machine without SSH to the hosts).

AIPerf (and matplotlib for the plot) run in an environment of their own, made once under
``$GLM_INFRA_CACHE/sla/`` from ``sla-client.txt`` (exact versions). TPOT is AIPerf's inter-token
latency: (request latency − TTFT) / (output tokens − 1), vLLM's definition.

The API key comes from an environment variable (default ``GLM_INFRA_API_KEY``), never from the command
line; AIPerf reads it from its own environment.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from glm_infra.plan import topology
from glm_infra.roles import router
from glm_infra.spec import paths
from glm_infra.spec.config import StackConfig

from . import planner
from .canaries import CanaryUnreachable, canary_check, canary_failures
from .sla_aiperf import RECORDS, SUMMARY, failed_records, read_records, read_result, read_summary  # noqa: F401
from .sla_verdict import (  # noqa: F401  (the gate's names)
    PROMETHEUS_FLOOR_S,
    TTFT_HISTOGRAM,
    Bucket,
    PrometheusViewError,
    Settings,
    bucket_name,
    hold_prometheus,
    judge,
    line,
    pool_ttft_mean,
    prometheus_agrees,
)

HERE = Path(__file__).resolve().parent
CLIENT_REQUIREMENTS = HERE / "sla-client.txt"
PLOT_SCRIPT = HERE / "sla_plot.py"
EXIT_PASS, EXIT_FAIL, EXIT_ERROR = 0, 1, 2


class SlaError(Exception):
    """The gate could not run (no client, no key, the client failed): exit 2."""


def cache_dir() -> Path:
    return Path(os.environ.get("GLM_INFRA_CACHE", Path.home() / ".cache" / "glm-infra"))


def say(msg: str) -> None:
    print(f"==> {msg}", file=sys.stderr, flush=True)


def client_env() -> Path:
    """The benchmark client's environment (made once, remade when ``sla-client.txt`` changes); its
    python."""
    lock = CLIENT_REQUIREMENTS.read_bytes()
    env = cache_dir() / "sla" / f"client-{hashlib.sha256(lock).hexdigest()[:12]}"
    python = env / "bin" / "python"
    if (env / ".complete").is_file():
        return python
    env.parent.mkdir(parents=True, exist_ok=True)
    with open(env.parent / ".lock", "w") as held:  # two gates at once: the second waits, then uses it
        fcntl.flock(held, fcntl.LOCK_EX)
        if (env / ".complete").is_file():
            return python
        return _make_client_env(env, python, lock)


def _make_client_env(env: Path, python: Path, lock: bytes) -> Path:
    say(f"SLA client: installing NVIDIA AIPerf into {env} (once; a few hundred MB)")
    shutil.rmtree(env, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
    uv = shutil.which("uv")
    cmd = ([uv, "pip", "install", "--quiet", "--python", str(python)] if uv else
           [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"])
    p = subprocess.run([*cmd, "-r", str(CLIENT_REQUIREMENTS)], capture_output=True, text=True)
    if p.returncode != 0:
        raise SlaError(f"could not install the SLA client from {CLIENT_REQUIREMENTS.name}: {p.stderr.strip()[-1500:]}")
    (env / ".complete").write_text(lock.decode())
    return python


def aiperf_config(s: Settings, context: int, out: Path) -> dict[str, Any]:
    tokenizer: dict[str, Any] = {"name": s.tokenizer}
    if s.tokenizer_revision:
        tokenizer["revision"] = s.tokenizer_revision
    return {
        "schemaVersion": "2.0",
        "randomSeed": 42,
        "benchmark": {
            "model": s.model,
            "endpoint": {
                "url": s.url, "type": "chat", "streaming": True,
                "api_key": "${OPENAI_API_KEY}",  # from the client's environment, never written here
                "use_server_token_count": True, "timeout": 3600, "extra": {"ignore_eos": True},
            },
            "tokenizer": tokenizer,
            "dataset": {"type": "synthetic", "entries": s.requests,
                        "prompts": {"isl": {"mean": context, "stddev": 0}, "osl": {"mean": s.output_tokens, "stddev": 0}}},
            "phases": {"type": "concurrency", "concurrency": s.concurrency, "requests": s.requests},
            "artifacts": {"dir": str(out)},
        },
    }


def run_client(python: Path, s: Settings, context: int, out: Path, api_key: str, progress: bool) -> Bucket:
    """One bucket: AIPerf with its config in ``out``; its output in ``out/aiperf.log``."""
    import yaml

    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "artifacts", ignore_errors=True)  # an earlier run's results are not this one's
    (out / "aiperf.yaml").write_text(yaml.safe_dump(aiperf_config(s, context, out / "artifacts"), sort_keys=False))
    aiperf = python.parent / "aiperf"
    argv = [str(aiperf), "profile", "-f", str(out / "aiperf.yaml"), "--no-server-metrics", "--no-gpu-telemetry",
            "--ui-type", "simple" if progress else "none"]
    env = dict(os.environ, OPENAI_API_KEY=api_key)
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):  # AIPerf then refuses a local tokenizer folder
        env.pop(var, None)
    # AIPerf leaves its dataset folders (aiperf_mmap_*) in the temp directory: one of the run's own,
    # short (its ZMQ sockets live there, and a socket's path is limited to 107 characters).
    scratch = Path(tempfile.mkdtemp(prefix="glm-sla-"))
    env.update(TMPDIR=str(scratch), AIPERF_DATASET_MMAP_BASE_PATH=str(scratch))
    if s.ca_cert:  # AIPerf's HTTP client (aiohttp) verifies against OpenSSL's default file
        env["SSL_CERT_FILE"] = s.ca_cert
    try:
        return _run_client(argv, env, out, context, progress)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run_client(argv: list[str], env: dict[str, str], out: Path, context: int, progress: bool) -> Bucket:
    with open(out / "aiperf.log", "w") as log:
        proc = subprocess.Popen(argv, stdout=None if progress else log, stderr=subprocess.STDOUT if not progress else None,
                                env=env, start_new_session=True)
        start, done = time.monotonic(), threading.Event()

        def heartbeat() -> None:
            while not done.wait(15):
                say(f"    {bucket_name(context)}: running for {time.monotonic() - start:.0f} s")

        if not progress:
            threading.Thread(target=heartbeat, daemon=True).start()
        try:
            rc = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        finally:
            done.set()
    result = out / "artifacts" / SUMMARY
    records = out / "artifacts" / RECORDS
    if result.exists():
        b = read_result(result, context)
    elif records.exists():  # AIPerf writes no summary when every request failed
        b = failed_records(records, context)
    else:
        tail = (out / "aiperf.log").read_text()[-1500:] if (out / "aiperf.log").is_file() else ""
        raise SlaError(f"{bucket_name(context)}: AIPerf exited {rc} without results ({out / 'aiperf.log'}):\n{tail}")
    if rc != 0:  # what it wrote may be partial
        b.missing.append(f"AIPerf exited {rc} ({out / 'aiperf.log'})")
    return b


# --- Prometheus's view -----------------------------------------------------------------------------


def prometheus_query(base: str, query: str, at: float) -> Any:
    """The result of an instant query (checked by pool_ttft_mean, which names what it lacks)."""
    url = f"{base.rstrip('/')}/api/v1/query?" + urllib.parse.urlencode({"query": query, "time": f"{at:.3f}"})
    with urllib.request.urlopen(url, timeout=30) as r:
        try:
            body = json.load(r)
        except ValueError as e:
            raise SlaError(f"Prometheus ({base}) answered {query!r} with no JSON ({e})") from None
    if not isinstance(body, dict) or body.get("status") != "success":
        why = body.get("error") if isinstance(body, dict) else body
        raise SlaError(f"Prometheus ({base}) refused {query!r}: {why}")
    data = body.get("data")
    return data.get("result") if isinstance(data, dict) else None


def pools_of(s: Settings) -> tuple[str, ...]:
    return ("prefill", "decode") if s.disaggregated else ("colocated",)


def prometheus_ttft(s: Settings, start: float, end: float) -> dict[str, Any]:
    """The mean TTFT Prometheus saw between ``start`` and ``end``: per pool Δsum/Δcount of vLLM's
    TTFT histogram (each instance's series apart, so a restart shows), summed over the pools a request
    crosses (prefill, then decode)."""
    assert s.prometheus is not None
    by_pool: dict[str, float] = {}
    for pool in pools_of(s):
        at_start: dict[str, Any] = {}
        at_end: dict[str, Any] = {}
        for part in ("sum", "count"):
            q = f'{TTFT_HISTOGRAM}_{part}{{stack="{s.stack_label}",pool="{pool}"}}'
            at_start[part], at_end[part] = (prometheus_query(s.prometheus, q, t) for t in (start, end))
        try:
            by_pool[pool] = pool_ttft_mean(pool, at_start, at_end)
        except PrometheusViewError as e:
            raise SlaError(f"Prometheus ({s.prometheus}) {e}") from None
    return {"ttft_mean": sum(by_pool.values()), "by_pool": by_pool}


# --- the gate --------------------------------------------------------------------------------------


def settings(stack: StackConfig, stack_name: str, args: argparse.Namespace) -> Settings:
    plan = topology.plan(stack)
    if plan.router is None:
        raise SlaError("the stack has no router: nothing to drive")
    sla, m = stack.sla, stack.monitoring
    prometheus = None
    if m.enabled and not args.no_prometheus:
        mon = stack.host(stack.monitoring_host)  # type: ignore[arg-type]
        prometheus = args.prometheus or f"http://{paths.url_host(mon.address)}:{m.prometheus_port}"
    ca_cert = os.path.expanduser(args.cacert) if args.cacert else None
    if ca_cert is not None and not Path(ca_cert).is_file():
        raise SlaError(f"--cacert {args.cacert}: no such file")
    if ca_cert is None and not args.url and router.tls_generated(stack):
        raise SlaError("the router's certificate is signed by glm-infra's own CA: pass --cacert FILE (pulumi stack "
                       f"output routerCaCertificate -s {stack_name} > router-ca.pem)")
    tokenizer = args.tokenizer or sla.tokenizer or stack.model.repo
    if tokenizer.startswith(("~", "/", ".")) and not Path(os.path.expanduser(tokenizer)).is_dir():
        raise SlaError(f"the tokenizer folder {tokenizer} (sla.tokenizer or --tokenizer) does not exist"
                       " (the sim stack's: scripts/sim tokenizer)")
    return Settings(
        url=args.url or plan.router.url,
        model=stack.model.served_model_name,
        tokenizer=os.path.expanduser(tokenizer) if tokenizer.startswith(("~", "/", ".")) else tokenizer,
        tokenizer_revision=None if (args.tokenizer or sla.tokenizer) else stack.model.revision,
        contexts=sorted(args.contexts or sla.contexts),
        output_tokens=args.output_tokens or sla.output_tokens,
        concurrency=args.concurrency or sla.concurrency,
        requests=args.requests or sla.requests_per_context,
        ttft_target=sla.ttft_seconds,
        tpot_target=sla.tpot_seconds,
        tolerance=sla.prometheus_tolerance,
        stack_label=m.stack_label or stack_name,
        prometheus=prometheus,
        scrape_interval_s=_seconds(m.scrape_interval),
        disaggregated=plan.disaggregated,
        ca_cert=ca_cert,
    )


def _seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    for suffix in ("ms", "s", "m", "h", "d", "w", "y"):
        if duration.endswith(suffix):
            return float(duration[: -len(suffix)]) * units[suffix]
    raise ValueError(duration)


def canaries_now(stack: StackConfig, args: argparse.Namespace, when: str) -> dict[str, Any]:
    try:
        view = canary_check(stack, args.identity, args.ssh_option or [])
    except CanaryUnreachable as e:
        raise SlaError(f"{e} (--no-canary skips them)") from None
    say(f"canaries {when}: " + ("every instance and the router answer their reference" if view["pass"]
                               else "; ".join(view["lines"])))
    return view


def run(stack: StackConfig, stack_name: str, args: argparse.Namespace) -> int:
    s = settings(stack, stack_name, args)
    api_key = os.environ.get(args.api_key_env)
    if stack.router is not None and stack.router.api_key is not None and not api_key:
        raise SlaError(f"the router wants its API key: set {args.api_key_env} (e.g. export {args.api_key_env}="
                       f"$(pulumi stack output routerApiKey --show-secrets -s {stack_name}))")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    python = client_env()
    progress = sys.stderr.isatty() and not args.quiet
    say(f"SLA gate of {stack_name} through {s.url}: {len(s.contexts)} buckets "
        f"({', '.join(bucket_name(c) for c in s.contexts)} input tokens), {s.requests} requests each at concurrency "
        f"{s.concurrency}, {s.output_tokens} output tokens; targets mean TTFT ≤ {s.ttft_target:g} s, "
        f"mean TPOT ≤ {s.tpot_target * 1000:g} ms" + (f"; Prometheus {s.prometheus}" if s.prometheus else ""))
    predicted, summary = planner.for_gate(stack, stack_name, s.contexts, s.concurrency, s.output_tokens)
    say(summary)
    canaries: dict[str, Any] = {}
    if stack.router is not None and not args.no_canary:
        canaries["before"] = canaries_now(stack, args, "before")
    buckets: list[Bucket] = []
    started = time.time()
    for n, context in enumerate(s.contexts, 1):
        say(f"[{n}/{len(s.contexts)}] {bucket_name(context)}: {s.requests} requests")
        t0 = time.time()
        b = run_client(python, s, context, out / bucket_name(context), api_key or "", progress)
        t1 = time.time()
        if s.prometheus:
            time.sleep(s.scrape_interval_s * 2 + 1)  # the last samples of the bucket, scraped
            t_end = time.time()
            try:
                view = prometheus_ttft(s, t0 - 0.001, t_end)
            except (OSError, urllib.error.URLError, SlaError) as e:
                view = {"error": str(e)}
            b.prometheus = hold_prometheus(view, b, s.tolerance)
        b.failures = judge(b, s)
        b.predicted = predicted["buckets"].get(context)
        buckets.append(b)
        say(f"    {line(b, s)}  ({t1 - t0:.0f} s)")
    if canaries:
        canaries["after"] = canaries_now(stack, args, "after")
    failures = [f for b in buckets for f in b.failures]
    failures += [f for when, view in canaries.items() for f in canary_failures(view, when)]
    report = {
        "stack": stack_name, "url": s.url, "model": s.model, "tokenizer": s.tokenizer,
        "started": started, "finished": time.time(),
        "targets": {"ttft_seconds": s.ttft_target, "tpot_seconds": s.tpot_target},
        "settings": {"output_tokens": s.output_tokens, "concurrency": s.concurrency, "requests": s.requests,
                     "prometheus": s.prometheus, "prometheus_tolerance": s.tolerance},
        "buckets": [{"context": b.context, "name": b.name, "requests": b.requests, "errors": b.errors,
                     "error_summary": b.error_summary, "ttft_seconds": b.ttft, "tpot_seconds": b.tpot,
                     "output_tokens_min": b.output_tokens, "missing": b.missing,
                     "prometheus": b.prometheus, "predicted": b.predicted, "pass": not b.failures,
                     "failures": b.failures} for b in buckets],
        "prediction": {k: v for k, v in predicted.items() if k != "buckets"},
        "canaries": canaries or None,
        "pass": not failures,
        "failures": failures,
    }
    (out / "sla.json").write_text(json.dumps(report, indent=2) + "\n")
    plot = subprocess.run([str(python), str(PLOT_SCRIPT), str(out / "sla.json"), str(out / "sla.png")],
                          capture_output=True, text=True)
    if plot.returncode != 0:
        raise SlaError(f"the plot failed: {plot.stderr.strip()[-1000:]}")
    say(f"wrote {out / 'sla.json'} and {out / 'sla.png'}")
    if failures:
        for f in failures:
            print(f"FAIL {f}")
        return EXIT_FAIL
    print(f"PASS: every bucket within mean TTFT {s.ttft_target:g} s and mean TPOT {s.tpot_target * 1000:g} ms")
    return EXIT_PASS


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return value


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sla", help="drive the router with AIPerf per context length; exit 1 if the SLA fails")
    p.add_argument("stack", metavar="STACK")
    p.add_argument("--out", default="sla-report", metavar="DIR", help="where sla.json, sla.png and the client's "
                                                                        "files go (default: sla-report)")
    p.add_argument("--url", help="the router's public URL (default: from the stack)")
    p.add_argument("--cacert", metavar="FILE", help="CA certificate (PEM) the router's certificate is checked against "
                                                    "(the stack output routerCaCertificate; default: the system's)")
    p.add_argument("--api-key-env", default="GLM_INFRA_API_KEY", metavar="VAR",
                   help="environment variable holding the router's API key (default: GLM_INFRA_API_KEY)")
    p.add_argument("--contexts", type=_positive, nargs="+", metavar="TOKENS", help="input lengths (default: sla.contexts)")
    p.add_argument("--requests", type=_positive, metavar="N", help="requests per bucket (default: sla.requestsPerContext)")
    p.add_argument("--concurrency", type=_positive, metavar="N", help="requests in flight (default: sla.concurrency)")
    p.add_argument("--output-tokens", type=_positive, metavar="N", help="output tokens per request (default: sla.outputTokens)")
    p.add_argument("--tokenizer", help="tokenizer folder or hub repository (default: sla.tokenizer, else the model's)")
    p.add_argument("--prometheus", metavar="URL", help="Prometheus to compare with (default: the stack's)")
    p.add_argument("--no-prometheus", action="store_true", help="skip the comparison with Prometheus")
    p.add_argument("--quiet", action="store_true", help="no AIPerf progress display, a line every 15 s instead")
    p.add_argument("--no-canary", action="store_true", help="skip the canaries (run over SSH on the router's host)")
    p.add_argument("--identity", metavar="FILE", help="SSH key for the canaries (default: as glm-infra doctor)")
    p.add_argument("--ssh-option", action="append", metavar="OPTION", help="an ssh -o option (repeatable)")
