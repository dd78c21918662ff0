"""The SLA gate's settings and buckets, and its verdict on one bucket: what fails (each naming the bucket
and the metric), whether Prometheus's view agrees with the client's, and the line the gate prints."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    ttft: dict[str, float]  # seconds: mean, p50, p99
    tpot: dict[str, float]
    requests: int
    errors: int
    error_summary: list[Any] = field(default_factory=list)
    prometheus: dict[str, Any] | None = None
    failures: list[str] = field(default_factory=list)
    predicted: dict[str, Any] | None = None  # aiconfigurator's, beside the measurement; never the verdict

    @property
    def name(self) -> str:
        return bucket_name(self.context)


# The client's TTFT includes what Prometheus's (vLLM's own, at the server) does not: TLS, the nginx front
# and the router's hop, about 35-40 ms here at every context length (sim, 16K to 256K). A share alone
# would call that a disagreement at short contexts (seen: 0.154 s against 0.191 s at 16K, -19%).
PROMETHEUS_FLOOR_S = 0.05


def prometheus_agrees(server_mean: float, client_mean: float, tolerance: float) -> tuple[float, bool]:
    """Prometheus's mean TTFT against the client's: the difference as a share of the client's, and whether
    it is within ``tolerance`` of it or within PROMETHEUS_FLOOR_S seconds."""
    difference = (server_mean - client_mean) / client_mean
    return difference, abs(difference) <= tolerance or abs(server_mean - client_mean) <= PROMETHEUS_FLOOR_S


def judge(b: Bucket, s: Settings) -> list[str]:
    """What fails in one bucket, each naming the bucket and the metric."""
    out = []
    if b.errors or b.requests == 0:
        out.append(f"{b.name}: {b.errors} of {b.requests + b.errors} requests failed{_error_text(b.error_summary)}")
    if b.requests and b.ttft["mean"] > s.ttft_target:
        out.append(f"{b.name}: mean TTFT {b.ttft['mean']:.3f} s > {s.ttft_target:g} s")
    if b.requests and b.tpot["mean"] > s.tpot_target:
        out.append(f"{b.name}: mean TPOT {b.tpot['mean'] * 1000:.1f} ms > {s.tpot_target * 1000:g} ms")
    p = b.prometheus
    if p is not None and "error" in p:  # asked for and unreadable: the cross-check did not happen
        out.append(f"{b.name}: Prometheus's view could not be read ({p['error']}); --no-prometheus skips the "
                   "cross-check")
    if p is not None and p.get("agrees") is False:
        out.append(f"{b.name}: Prometheus's mean TTFT {p['ttft_mean']:.3f} s is {p['difference']:+.0%} from the "
                   f"client's {b.ttft['mean']:.3f} s (tolerance {s.tolerance:.0%} or "
                   f"{PROMETHEUS_FLOOR_S * 1000:.0f} ms)")
    return out


def _error_text(summary: list[Any]) -> str:
    if not summary:
        return ""
    e = summary[0].get("error_details", summary[0]) if isinstance(summary[0], dict) else summary[0]
    if isinstance(e, dict):
        return f" ({' '.join(str(e[k]) for k in ('code', 'type') if e.get(k))}: {str(e.get('message', ''))[:200]})"
    return f" ({str(e)[:200]})"


def line(b: Bucket, s: Settings) -> str:
    ok = "ok" if not b.failures else "FAIL"
    text = (f"{b.name}: TTFT mean {b.ttft['mean']:.3f} s (p50 {b.ttft['p50']:.3f}, p99 {b.ttft['p99']:.3f}); "
            f"TPOT mean {b.tpot['mean'] * 1000:.1f} ms (p50 {b.tpot['p50'] * 1000:.1f}, p99 {b.tpot['p99'] * 1000:.1f}); "
            f"{b.requests} ok, {b.errors} failed")
    p = b.prometheus
    if p is not None:
        text += (f"; Prometheus TTFT {p['ttft_mean']:.3f} s ({p['difference']:+.0%})" if "difference" in p
                 else f"; Prometheus: {p.get('error', 'no view')}")
    q = b.predicted
    if q is not None and q.get("error") is None:
        text += f"; predicted TTFT {q['ttft_seconds']:.2f} s, TPOT {q['tpot_seconds'] * 1000:.1f} ms"
    return f"{text} — {ok}"
