"""The plot of ``glm-infra predict --plot``: predicted mean TTFT and TPOT against the context length, with
the SLA lines, the buckets aiconfigurator could not predict, and optionally a measured result beside it.
matplotlib comes with the planner extra."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from glm_infra.plan.prediction import bucket_label


def plot(report: dict[str, Any], png: Path, seed: dict[str, Any] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    buckets = report["buckets"]
    contexts = [b["context"] for b in buckets]
    ok = [b for b in buckets if b["error"] is None]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    for ax, key, scale, unit, title, target in (
        (axes[0], "ttft_ms", 1 / 1000, "s", "Time to first token (mean)", report["sla"]["ttft_seconds"]),
        (axes[1], "tpot_ms", 1.0, "ms", "Time per output token (mean)", report["sla"]["tpot_seconds"] * 1000),
    ):
        ax.plot([b["context"] for b in ok], [b[key] * scale for b in ok], "o-", label="predicted")
        ax.axhline(target, color="red", linewidth=1.5, label=f"SLA (mean ≤ {target:g} {unit})")
        for b in buckets:
            if b["error"] is not None:
                ax.axvline(b["context"], color="grey", linestyle=":", linewidth=1)
        if any(b["error"] is not None for b in buckets):
            ax.plot([], [], color="grey", linestyle=":", label="no prediction (see the table)")
        if seed is not None:
            if key == "tpot_ms":
                ax.plot([seed["tpot_context"]], [seed["tpot_ms"]], "*", markersize=14, color="green",
                        label=f"seed, measured: {seed['tpot_ms']:g} ms")
            else:
                lo, hi = seed["contexts"]
                ax.hlines(seed["ttft_max_s"], lo, hi, colors="green", linestyles="--", linewidth=3, alpha=0.5,
                          label=f"seed, measured: ≤ {seed['ttft_max_s']:g} s")
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [bucket_label(c) for c in contexts])
        ax.set_xlabel("input tokens")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    t = report["target"]
    fig.suptitle(f"{report['stack']}: predicted by {report['labels']['predictor']}, {t['system']} "
                 f"{t['backend']} {report['labels']['backend_version']} ({t['database_mode']}), "
                 f"{t['concurrency']} in flight", fontsize=10)
    fig.savefig(png, dpi=110)
    plt.close(fig)
