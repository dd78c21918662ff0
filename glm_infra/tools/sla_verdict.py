"""The SLA gate's settings and buckets, and its verdict on one bucket: what fails (each naming the bucket
and the metric), whether Prometheus's view agrees with the client's, and the line the gate prints.
The verdict fails closed: a metric absent, partial or unreadable (named in ``Bucket.missing`` by
sla_aiperf.py, or simply not measured), fewer requests than asked for, a Prometheus view that could not
be read or held against the client's, each fails the bucket, naming it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from glm_infra.plan.prediction import bucket_label as bucket_name  # noqa: F401  (the gate's name for it)


@dataclass
class Settings:
    """One run of the gate."""

    url: str
    model: str
    tokenizer: str
    tokenizer_revision: str | None
    contexts: list[int]
    output_tokens: int
    concurrency: int
    requests: int
    ttft_target: float
    tpot_target: float
    tolerance: float
    stack_label: str
    prometheus: str | None
    scrape_interval_s: float
    disaggregated: bool
    ca_cert: str | None = None  # what the client trusts for the router's certificate (None: the system's)


@dataclass
class Bucket:
    context: int
    ttft: dict[str, float] | None  # seconds: mean, p50, p99; None: not measured (``missing`` says why)
    tpot: dict[str, float] | None
    requests: int  # answered
    errors: int  # failed
    error_summary: list[Any] = field(default_factory=list)
    prometheus: dict[str, Any] | None = None
    failures: list[str] = field(default_factory=list)
    predicted: dict[str, Any] | None = None  # aiconfigurator's, beside the measurement; never the verdict
    output_tokens: float | None = None  # the shortest answer's, as the server counted them
    missing: list[str] = field(default_factory=list)  # what the client's output lacks, each naming file and key

    @property
    def name(self) -> str:
        return bucket_name(self.context)


# The client's TTFT includes what Prometheus's (vLLM's own, at the server) does not: TLS, the nginx front
# and the router's hop, about 35-40 ms here at every context length (sim, 16K to 256K). A share alone
# would call that a disagreement at short contexts (seen: 0.154 s against 0.191 s at 16K, -19%).
PROMETHEUS_FLOOR_MS = 50
PROMETHEUS_FLOOR_S = PROMETHEUS_FLOOR_MS / 1000
TTFT_HISTOGRAM = "vllm:time_to_first_token_seconds"  # vLLM's, per instance: _sum and _count


def measured(stat: dict[str, float] | None) -> TypeGuard[dict[str, float]]:
    """Whether a latency was measured: mean, p50 and p99 each a finite number of seconds above 0 (no
    request answers in no time: 0 is a metric that was not there)."""
    return stat is not None and all(_positive(stat.get(k)) for k in ("mean", "p50", "p99"))


def _positive(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def prometheus_agrees(server_mean: float, client_mean: float, tolerance: float) -> tuple[float, bool]:
    """Prometheus's mean TTFT against the client's: the difference as a share of the client's, and whether
    it is within ``tolerance`` of it or within PROMETHEUS_FLOOR_S seconds. A client mean that is not a
    time above 0 agrees with nothing (difference NaN)."""
    if not _positive(client_mean):
        return math.nan, False
    difference = (server_mean - client_mean) / client_mean
    return difference, abs(difference) <= tolerance or abs(server_mean - client_mean) <= PROMETHEUS_FLOOR_S


def hold_prometheus(view: dict[str, Any], b: Bucket, tolerance: float) -> dict[str, Any]:
    """Prometheus's view of a bucket with the comparison added: ``difference`` and ``agrees``, or
    ``unchecked`` saying why there was nothing to compare (the verdict fails the bucket for it)."""
    if "error" in view:
        return view
    if not _positive(view.get("ttft_mean")):
        return {**view, "unchecked": f"Prometheus's mean TTFT is {view.get('ttft_mean')!r}, not a time"}
    ttft = b.ttft
    if not measured(ttft):
        return {**view, "unchecked": "the client measured no TTFT to hold it against"}
    difference, agrees = prometheus_agrees(view["ttft_mean"], ttft["mean"], tolerance)
    return {**view, "difference": difference, "agrees": agrees}


class PrometheusViewError(ValueError):
    """Prometheus's answer is not one to trust as the bucket's view (its text completes "Prometheus (URL) …")."""


def pool_ttft_mean(pool: str, start: dict[str, Any], end: dict[str, Any]) -> float:
    """One pool's mean TTFT over a bucket from Prometheus's instant answers at its start and its end
    (``{"sum": result, "count": result}``, a series per instance): Δsum/Δcount, every series checked.
    A series missing or not a number, the set of series changing, or a counter going backwards (an
    instance restarted: its requests are not all counted) raises PrometheusViewError naming it."""
    count = _increase(pool, f"{TTFT_HISTOGRAM}_count", start.get("count"), end.get("count"))
    total = _increase(pool, f"{TTFT_HISTOGRAM}_sum", start.get("sum"), end.get("sum"))
    if count <= 0:
        raise PrometheusViewError(f"saw no {pool} request between the bucket's start and end")
    if total <= 0:
        raise PrometheusViewError(f"saw {count:g} {pool} requests and no time to their first tokens "
                                  f"({TTFT_HISTOGRAM}_sum grew by {total:g})")
    return total / count


def _increase(pool: str, metric: str, start: Any, end: Any) -> float:
    before, after = _series(pool, metric, start, "start"), _series(pool, metric, end, "end")
    if before.keys() != after.keys():
        gone, came = sorted(before.keys() - after.keys()), sorted(after.keys() - before.keys())
        raise PrometheusViewError(f"saw the {pool} series of {metric} change during the bucket (gone: "
                                  f"{', '.join(gone) or 'none'}; new: {', '.join(came) or 'none'}): an instance "
                                  "restarted, came or went")
    for labels, value in before.items():
        if after[labels] < value:
            raise PrometheusViewError(f"saw {metric}{{{labels}}} go backwards during the bucket ({value:g} → "
                                      f"{after[labels]:g}): the instance restarted, its requests are not all counted")
    return sum(after[labels] - value for labels, value in before.items())


def _series(pool: str, metric: str, result: Any, when: str) -> dict[str, float]:
    if not isinstance(result, list) or not result:
        raise PrometheusViewError(f"has no {metric} series of {pool} at the bucket's {when}")
    out = {}
    for s in result:
        try:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s["metric"].items()) if k != "__name__")
            text = s["value"][1]
            value = float(text)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError):
            raise PrometheusViewError(f"answered {metric} of {pool} at the bucket's {when} with {str(s)[:200]}, "
                                      "not a sample") from None
        if not math.isfinite(value):
            raise PrometheusViewError(f"has {metric}{{{labels}}} at the bucket's {when} = {text}, not a number")
        out[labels] = value
    return out


def judge(b: Bucket, s: Settings) -> list[str]:
    """What fails in one bucket, each naming the bucket and the metric: what the client's output lacks,
    failed requests, fewer (or more) requests than asked for, a metric not measured or past its target,
    answers shorter than asked for, and Prometheus's view not read, not compared or not agreeing."""
    out = [f"{b.name}: {m}" for m in b.missing]
    counted = b.requests + b.errors
    if b.errors:
        out.append(f"{b.name}: {b.errors} of {counted} requests failed{_error_text(b.error_summary)}")
    if counted < s.requests:
        out.append(f"{b.name}: {counted} of the {s.requests} requests asked for were counted (the run was cut short)")
    if counted > s.requests:
        out.append(f"{b.name}: {counted} requests were counted where {s.requests} were asked for "
                   "(not this bucket's run)")
    # A latency not measured fails (named once: by the reader when it knows why). The output tokens are
    # the reader's to name when AIPerf's summary lacks them; a bucket made without them is judged without.
    unmeasured = [what for what, stat in (("TTFT", b.ttft), ("TPOT", b.tpot)) if not measured(stat)]
    if b.requests and unmeasured and not b.missing:
        out.append(f"{b.name}: {' and '.join(unmeasured)} not measured")
    ttft, tpot = b.ttft, b.tpot
    if measured(ttft) and ttft["mean"] > s.ttft_target:
        out.append(f"{b.name}: mean TTFT {ttft['mean']:.3f} s > {s.ttft_target:g} s")
    if measured(tpot) and tpot["mean"] > s.tpot_target:
        out.append(f"{b.name}: mean TPOT {tpot['mean'] * 1000:.1f} ms > {s.tpot_target * 1000:g} ms")
    if b.output_tokens is not None and b.output_tokens < s.output_tokens:
        out.append(f"{b.name}: the shortest answer had {b.output_tokens:g} output tokens where {s.output_tokens} "
                   "were asked for (TPOT over fewer tokens is not the SLA's)")
    out += _prometheus_failures(b, s)
    return out


def _prometheus_failures(b: Bucket, s: Settings) -> list[str]:
    p = b.prometheus
    if p is None:
        return []
    if "error" in p:  # asked for and unreadable: the cross-check did not happen
        return [f"{b.name}: Prometheus's view could not be read ({p['error']}); --no-prometheus skips the cross-check"]
    if p.get("agrees") is True:
        return []
    if p.get("agrees") is False:
        ttft = b.ttft
        client = f"{ttft['mean']:.3f} s" if measured(ttft) else "none"
        return [f"{b.name}: Prometheus's mean TTFT {p['ttft_mean']:.3f} s is {p['difference']:+.0%} from the "
                f"client's {client} (tolerance {s.tolerance:.0%} or {PROMETHEUS_FLOOR_MS} ms)"]
    return [f"{b.name}: Prometheus's view was not held against the client's "
            f"({p.get('unchecked', 'no comparison was made')}); --no-prometheus skips the cross-check"]


def _error_text(summary: list[Any]) -> str:
    if not summary:
        return ""
    e = summary[0].get("error_details", summary[0]) if isinstance(summary[0], dict) else summary[0]
    if isinstance(e, dict):
        return f" ({' '.join(str(e[k]) for k in ('code', 'type') if e.get(k))}: {str(e.get('message', ''))[:200]})"
    return f" ({str(e)[:200]})"


def _stat_text(stat: dict[str, float] | None, scale: float, unit: str, digits: int) -> str:
    if not measured(stat):
        return "not measured"
    return (f"mean {stat['mean'] * scale:.{digits}f} {unit} (p50 {stat['p50'] * scale:.{digits}f}, "
            f"p99 {stat['p99'] * scale:.{digits}f})")


def line(b: Bucket, s: Settings) -> str:
    ok = "ok" if not b.failures else "FAIL"
    text = (f"{b.name}: TTFT {_stat_text(b.ttft, 1, 's', 3)}; TPOT {_stat_text(b.tpot, 1000, 'ms', 1)}; "
            f"{b.requests} ok, {b.errors} failed")
    p = b.prometheus
    if p is not None:
        text += (f"; Prometheus TTFT {p['ttft_mean']:.3f} s ({p['difference']:+.0%})" if "difference" in p
                 else f"; Prometheus: {p.get('error') or p.get('unchecked') or 'no view'}")
    q = b.predicted
    if q is not None and q.get("error") is None:
        text += f"; predicted TTFT {q['ttft_seconds']:.2f} s, TPOT {q['tpot_seconds'] * 1000:.1f} ms"
    return f"{text} — {ok}"
