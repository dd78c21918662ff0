"""The SLA gate's plot: mean, p50 and p99 TTFT and TPOT against the context length, with the SLA lines
and each failing bucket marked (a bucket that measured nothing has no point). Runs in the SLA client's
environment (matplotlib), on sla.json:

    python sla_plot.py sla.json sla.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(report_path: str, png_path: str) -> int:
    report = json.loads(open(report_path).read())
    buckets = report["buckets"]
    x = [b["context"] for b in buckets]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    for ax, key, target_key, scale, unit, title in (
        (axes[0], "ttft_seconds", "ttft_seconds", 1.0, "s", "Time to first token"),
        (axes[1], "tpot_seconds", "tpot_seconds", 1000.0, "ms", "Time per output token"),
    ):
        for stat, style in (("mean", "o-"), ("p50", "s--"), ("p99", "^:")):
            ax.plot(x, [_value(b[key], stat) * scale for b in buckets], style, label=stat)
        if key == "ttft_seconds":
            seen = [(b["context"], b["prometheus"]["ttft_mean"]) for b in buckets
                    if b.get("prometheus") and "ttft_mean" in b["prometheus"]]
            if seen:
                ax.plot([c for c, _ in seen], [v for _, v in seen], "x", color="grey", label="mean (Prometheus)")
        predicted = [(b["context"], b["predicted"][key]) for b in buckets
                     if b.get("predicted") and b["predicted"].get(key) is not None]
        if predicted:
            who = report.get("prediction", {}).get("predictor", "aiconfigurator")
            ax.plot([c for c, _ in predicted], [v * scale for _, v in predicted], "d-.", color="purple",
                    label=f"mean, predicted ({who.split(' (')[0]})")
        target = report["targets"][target_key] * scale
        ax.axhline(target, color="red", linewidth=1.5, label=f"SLA (mean ≤ {target:g} {unit})")
        failed = [b for b in buckets if b[key] and any(("TTFT" if key == "ttft_seconds" else "TPOT") in f
                                                       for f in b["failures"])]
        if failed:
            ax.plot([b["context"] for b in failed], [b[key]["mean"] * scale for b in failed], "o", markersize=14,
                    markerfacecolor="none", markeredgecolor="red", label="fails the SLA")
        ax.set_xscale("log", base=2)
        ax.set_xlim(min(x) / 1.5, max(x) * 1.5)  # not from the data: a bucket may have none
        ax.set_xticks(x, [b["name"] for b in buckets])
        ax.set_xlabel("input tokens")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    verdict = "PASS" if report["pass"] else "FAIL: " + "; ".join(report["failures"][:3])
    fig.suptitle(f"{report['stack']}: {report['settings']['requests']} requests per bucket at concurrency "
                 f"{report['settings']['concurrency']}, {report['settings']['output_tokens']} output tokens — {verdict}",
                 fontsize=10)
    fig.savefig(png_path, dpi=110)
    return 0


def _value(stat: dict[str, float] | None, key: str) -> float:
    return stat[key] if stat else float("nan")  # not measured: a gap in the line


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
