"""NVIDIA's aiconfigurator, the ``glm-infra[planner]`` extra: its estimates for ``glm-infra predict``,
``validate`` and the SLA gate, its search for ``glm-infra propose``. Imported lazily, here only: the
library, the component package and ``pulumi up`` never need it. What to ask and what the answers mean
against the SLA are glm_infra/plan/prediction.py's.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import warnings
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

from glm_infra.plan import prediction
from glm_infra.spec.config import StackConfig

INSTALL = "pip install 'glm-infra[planner]'"


class PlannerMissing(RuntimeError):
    """aiconfigurator is not installed."""


class CannotPredict(RuntimeError):
    """A stack aiconfigurator cannot model (its GPU, its model), or data it does not have: the message
    names the key."""


def api() -> Any:
    """aiconfigurator.cli.api, or PlannerMissing naming the install command."""
    try:
        from aiconfigurator.cli import api as aic_api
    except ImportError as e:
        raise PlannerMissing(f"predicting needs NVIDIA's aiconfigurator, the planner extra: {INSTALL} "
                             f"(import failed: {e})") from None
    return aic_api


def available() -> bool:
    try:
        api()
    except PlannerMissing:
        return False
    return True


def predictor_label() -> str:
    return f"aiconfigurator {metadata.version('aiconfigurator')} (aiconfigurator-core " \
           f"{metadata.version('aiconfigurator-core')})"


class _Notes(logging.Handler):
    """aiconfigurator's warnings during an estimate (a data fallback, a memory warning), kept once each."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        # Paths into the installed package, without the machine's prefix (the goldens hold them).
        msg = re.sub(r"\S*/site-packages/", "", " ".join(record.getMessage().split()))
        if msg not in self.seen:
            self.seen.append(msg)


@contextlib.contextmanager
def _quiet() -> Iterator[_Notes]:
    """Keep aiconfigurator's log lines and prints out of our output; hand its warnings back as notes."""
    notes = _Notes()
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    root.handlers, root.level = [notes], logging.WARNING
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
                warnings.catch_warnings():
            # Its sweep warns that aisimulate replaces it in 0.13.0 (a stub that fails here): we pin 0.12.
            warnings.simplefilter("ignore", DeprecationWarning)
            yield notes
    finally:
        root.handlers, root.level = saved


def backend_version(aic: Any, t: prediction.Target) -> str:
    if t.backend_version is not None:
        return t.backend_version
    from aiconfigurator.sdk.perf_database import get_latest_database_version

    version = get_latest_database_version(system=t.system, backend=t.backend)
    if version is None:
        raise CannotPredict(f"aiconfigurator {metadata.version('aiconfigurator')} has no {t.backend} data for "
                            f"{t.system}")
    return str(version)


def predict(stack: StackConfig, name: str) -> prediction.Prediction:
    """aiconfigurator's estimate of every SLA bucket of the stack (PlannerMissing without the extra)."""
    t = prediction.target(stack)
    if isinstance(t, prediction.Problem):
        raise CannotPredict(f"{name}: cannot predict: {t.path}: {t.message}")
    aic = api()
    version = backend_version(aic, t)
    buckets = []
    with _quiet() as notes:
        for req in prediction.requests(stack):
            try:
                result = aic.cli_estimate(t.model, t.system, backend_name=t.backend, backend_version=version,
                                          database_mode=t.database_mode, **req.estimate_kwargs())
            except (RuntimeError, ValueError) as e:
                buckets.append(prediction.BucketPrediction(context=req.context, error=" ".join(str(e).split())))
                continue
            buckets.append(prediction.from_estimate(req, result.raw))
            if result.kv_cache_warning:
                notes.seen.append(f"{prediction.bucket_label(req.context)}: {result.kv_cache_warning}")
    return prediction.Prediction(stack=name, target=t, buckets=buckets, notes=notes.seen,
                                 labels={"predictor": predictor_label(), "backend_version": version})


def for_gate(stack: StackConfig, name: str, contexts: list[int], concurrency: int,
             output_tokens: int) -> tuple[dict[str, Any], str]:
    """The prediction of the SLA gate's own buckets and load, shown beside what it measures (it never
    decides the verdict), and a line saying what it is; without the planner extra, or for a stack
    aiconfigurator cannot model, the report says why there is none."""
    asked = stack.model_copy(update={"sla": stack.sla.model_copy(update={
        "contexts": contexts, "concurrency": concurrency, "output_tokens": output_tokens})})
    try:
        p = predict(asked, name)
    except (PlannerMissing, CannotPredict) as e:
        return {"error": str(e), "buckets": {}}, f"no prediction to compare with: {e}"
    summary = f"predicted by {p.labels['predictor']} ({p.target.system}, {p.target.backend} " \
              f"{p.labels['backend_version']} data): " + "; ".join(
                  f"{prediction.bucket_label(b.context)} " + (f"TTFT {b.ttft_ms / 1000:.2f} s, TPOT {b.tpot_ms:.1f} ms"
                                                              if b.error is None else "none") for b in p.buckets)
    return {"predictor": p.labels["predictor"], "backend_version": p.labels["backend_version"],
            "system": p.target.system, "database_mode": p.target.database_mode,
            "mtp_acceptance_rate": p.target.mtp_acceptance_rate, "notes": p.notes,
            "buckets": {b.context: {"ttft_seconds": None if b.ttft_ms is None else round(b.ttft_ms / 1000, 4),
                                    "tpot_seconds": None if b.tpot_ms is None else round(b.tpot_ms / 1000, 6),
                                    "error": b.error} for b in p.buckets}}, summary


def search_cache(experiment: dict[str, Any], top_n: int) -> Path:
    """Where a search's ranking is kept: by the experiment, the count and aiconfigurator's version (its data
    and engine come with it), under $GLM_INFRA_CACHE/planner/ (default ~/.cache/glm-infra)."""
    key = json.dumps({"experiment": experiment, "top_n": top_n, "predictor": predictor_label()}, sort_keys=True)
    root = Path(os.environ.get("GLM_INFRA_CACHE", Path.home() / ".cache" / "glm-infra"))
    return root / "planner" / f"search-{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def search(experiment: dict[str, Any], top_n: int, fresh: bool = False) -> tuple[list[dict[str, Any]], Path | None]:
    """aiconfigurator's ranked configurations for one experiment (best first; empty when none meets its
    SLA), each a row of its result table; and the cache file when they came from an earlier search of the
    same (``fresh``: search again)."""
    cached = search_cache(experiment, top_n)
    if cached.is_file() and not fresh:
        return json.loads(cached.read_text()), cached
    aic = api()
    from aiconfigurator.sdk.errors import NoFeasibleConfigError

    with _quiet():
        try:
            result = aic.cli_exp(config={"glm_infra": experiment}, top_n=top_n)
            table = result.best_configs.get("glm_infra")
        except NoFeasibleConfigError:
            table = None
    # Through pandas' JSON: numpy numbers become plain ones, a cached ranking reads back as the fresh one.
    rows = [] if table is None else json.loads(table.to_json(orient="records", default_handler=str))
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(rows))
    os.replace(tmp, cached)
    return rows, None
