"""NVIDIA's aiconfigurator, the ``glm-infra[planner]`` extra: its estimates for ``glm-infra predict``,
``validate`` and the SLA gate, its search for ``glm-infra propose``. Imported lazily, here only: the
library, the component package and ``pulumi up`` never need it. What to ask and what the answers mean
against the SLA are glm_infra/plan/prediction.py's.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
from collections.abc import Iterator
from importlib import metadata
from typing import Any

from glm_infra.plan import prediction
from glm_infra.spec.config import StackConfig
from glm_infra.stack import StackError

INSTALL = "pip install 'glm-infra[planner]'"


class PlannerMissing(RuntimeError):
    """aiconfigurator is not installed."""


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
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield notes
    finally:
        root.handlers, root.level = saved


def backend_version(aic: Any, t: prediction.Target) -> str:
    if t.backend_version is not None:
        return t.backend_version
    from aiconfigurator.sdk.perf_database import get_latest_database_version

    version = get_latest_database_version(system=t.system, backend=t.backend)
    if version is None:
        raise StackError(f"aiconfigurator {metadata.version('aiconfigurator')} has no {t.backend} data for "
                         f"{t.system}")
    return str(version)


def predict(stack: StackConfig, name: str) -> prediction.Prediction:
    """aiconfigurator's estimate of every SLA bucket of the stack (PlannerMissing without the extra)."""
    t = prediction.target(stack)
    if isinstance(t, prediction.Problem):
        raise StackError(f"{name}: cannot predict: {t.path}: {t.message}")
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
