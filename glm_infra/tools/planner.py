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
from dataclasses import dataclass
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


# What a cached ranking is, besides its search: a file of another layout is searched again, not read.
SEARCH_FORMAT = 2


@dataclass(frozen=True)
class Ranking:
    """aiconfigurator's ranked configurations for one search, best first, each a row of its result table;
    ``cached``: the file they were read from (None: searched now); ``note``: why a cached file was not
    used, or could not be written."""

    rows: list[dict[str, Any]]
    cached: Path | None = None
    note: str | None = None


def _search_key(experiment: dict[str, Any], top_n: int, strict: bool) -> dict[str, Any]:
    return {"experiment": experiment, "top_n": top_n, "strict_sla": strict, "predictor": predictor_label(),
            "format": SEARCH_FORMAT}


def search_cache(experiment: dict[str, Any], top_n: int, strict: bool) -> Path:
    """Where a search's ranking is kept: by the experiment, the count, whether it is strict (only what meets
    the SLA, or the closest when nothing does) and aiconfigurator's version (its data and engine come with
    it), under $GLM_INFRA_CACHE/planner/ (default ~/.cache/glm-infra)."""
    key = json.dumps(_search_key(experiment, top_n, strict), sort_keys=True)
    root = Path(os.environ.get("GLM_INFRA_CACHE", Path.home() / ".cache" / "glm-infra"))
    return root / "planner" / f"search-{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def _read_cached(path: Path, key: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of a cached ranking, or ValueError saying why it is not one: unreadable, not JSON, the
    ranking of another search (its name is a digest, its content says what it is) or not a list of rows."""
    try:
        kept = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(kept, dict) or kept.get("search") != key:
        raise ValueError("not the ranking of this search")
    rows = kept.get("rows")
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError("its rows are not a list of rows")
    return rows


def _sweep(experiment: dict[str, Any], top_n: int) -> dict[bool, list[dict[str, Any]]]:
    """One sweep of aiconfigurator's disaggregated configurations for the experiment, ranked twice by its
    own picking (``process_experiment_result``, which ``aiconfigurator cli exp`` runs): strict (its
    ``strict_sla``: only what is predicted to meet the SLA, as ``--strict-sla`` does) and not (when
    nothing meets it, the closest configurations instead)."""
    api()
    from aiconfigurator.cli.main import build_experiment_tasks
    from aiconfigurator.cli.utils import process_experiment_result
    from aiconfigurator.sdk.errors import NoFeasibleConfigError

    with _quiet() as notes:
        task = build_experiment_tasks(config={"glm_infra": experiment}).get("glm_infra")
        if task is None:  # it logs why and leaves the experiment out
            raise CannotPredict("aiconfigurator could not set the search up: "
                                + ("; ".join(notes.seen) or "it says nothing why"))
        try:
            swept = task.run()
        except NoFeasibleConfigError:  # no worker meets the SLA at all (its TTFT is kept at the sweep)
            swept = None
        except Exception as e:  # its error, named, rather than "nothing meets the SLA"
            raise CannotPredict(f"aiconfigurator's search failed: {type(e).__name__}: {e}") from None
        rankings = {}
        for strict in (True, False):
            table = None if swept is None or swept.empty else process_experiment_result(
                task, {"pareto_df": swept}, top_n, strict_sla=strict)[0]
            # Through pandas' JSON: numpy numbers become plain ones, a cached ranking reads back as the fresh one.
            rankings[strict] = [] if table is None or table.empty else json.loads(
                table.to_json(orient="records", default_handler=str))
    return rankings


def search(experiment: dict[str, Any], top_n: int, *, strict: bool, fresh: bool = False) -> Ranking:
    """aiconfigurator's ranked configurations for one experiment: ``strict``, only those predicted to meet
    its SLA (empty when none does); otherwise the closest when none does. From the cache when the same
    search was made (``fresh``: search again); a cached file that is not the ranking of this search is
    searched again, and the Ranking's note says so. One sweep keeps both rankings."""
    key = _search_key(experiment, top_n, strict)
    cached = search_cache(experiment, top_n, strict)
    note = None
    if not fresh and cached.exists():
        try:
            return Ranking(_read_cached(cached, key), cached)
        except ValueError as e:
            note = f"{cached}: {e}: searched again"
    rankings = _sweep(experiment, top_n)
    for each, rows in rankings.items():
        path = search_cache(experiment, top_n, each)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"search": _search_key(experiment, top_n, each), "rows": rows}))
            os.replace(tmp, path)
        except OSError as e:  # a ranking not kept is searched again next time; this one is still good
            note = "; ".join(filter(None, [note, f"{path}: not kept ({e})"]))
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
    return Ranking(rankings[strict], None, note)
