"""``glm-infra fleet up``: the fleet's waves in order, a wave's stacks in parallel up to its limit, each stack's
up then its gate; the first failure stops the rollout (the wave's stacks not yet started do not start, the
next waves neither) and says which stack and why. Resumable: a stack the progress shows rolled to today's
target, gated, and still at that update in its backend is skipped (``progress``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import progress
from .engine import StackFailure, Stacks
from .gate import Verdict
from .spec import Fleet

Gate = Callable[[str, dict[str, Any], Path, Path], Verdict]  # (stack, outputs, report folder, log) → verdict
Say = Callable[[str], None]


@dataclass(frozen=True)
class Outcome:
    stack: str
    status: str  # skipped | passed | failed | not started
    reason: str
    seconds: float = 0.0


@dataclass(frozen=True)
class Result:
    outcomes: list[Outcome]
    stopped_at: str | None  # the wave that failed, None when every wave passed

    @property
    def ok(self) -> bool:
        return self.stopped_at is None


def already_done(rec: progress.StackRecord | None, target: str, latest: tuple[str, str] | None) -> str | None:
    """Why a resume may skip the stack, or None: its record passed for this target, and the stack's latest
    update in its backend is the recorded one and succeeded (no update since, none failed)."""
    if rec is None or rec.phase != "passed" or rec.target != target or rec.update is None:
        return None
    if latest != (rec.update, "succeeded"):
        return None
    return f"rolled to this target by {rec.update} and gated ({rec.reason})"


class Rollout:
    def __init__(self, fleet: Fleet, stacks: Stacks, gate: Gate, say: Say, restart: bool = False):
        self.fleet, self.stacks, self.gate, self.say = fleet, stacks, gate, say
        self.restart = restart
        self.dir = progress.folder(fleet)
        self._lock = threading.Lock()
        self.records: dict[str, progress.StackRecord] = {}

    def _set(self, stack: str, rec: progress.StackRecord) -> None:
        with self._lock:
            self.records[stack] = rec
            progress.write(self.fleet, self.records)

    def run(self) -> Result:
        with progress.locked(self.fleet):
            self.records = {} if self.restart else progress.read(self.fleet)
            outcomes: list[Outcome] = []
            for i, wave in enumerate(self.fleet.waves, 1):
                self.say(f"wave {i}/{len(self.fleet.waves)} {wave.name}: {', '.join(wave.stacks)} "
                         f"(at most {wave.parallel} at once)")
                results = self._wave(wave.stacks, wave.parallel)
                outcomes += results
                failed = [o for o in results if o.status == "failed"]
                if failed:
                    for o in failed:
                        self.say(f"STOPPED at wave {wave.name}: {o.stack}: {o.reason}")
                    rest = [s for w in self.fleet.waves[i:] for s in w.stacks]
                    outcomes += [Outcome(s, "not started", f"wave {wave.name} failed") for s in rest]
                    if rest:
                        self.say(f"not started: {', '.join(rest)}")
                    return Result(outcomes, wave.name)
                self.say(f"wave {wave.name} passed")
            return Result(outcomes, None)

    def _wave(self, stacks: tuple[str, ...], parallel: int) -> list[Outcome]:
        stop = threading.Event()
        with ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="fleet") as pool:
            futures = [pool.submit(self._stack, s, stop) for s in stacks]
            return [f.result() for f in futures]

    def _stack(self, stack: str, stop: threading.Event) -> Outcome:
        if stop.is_set():
            return Outcome(stack, "not started", "another stack of its wave failed first")
        start = time.monotonic()
        try:
            outcome = self._roll(stack, start)
        except StackFailure as e:
            outcome = Outcome(stack, "failed", str(e), time.monotonic() - start)
        except Exception as e:  # noqa: BLE001 - one stack's surprise stops the rollout, named, not a traceback
            outcome = Outcome(stack, "failed", f"{type(e).__name__}: {e}", time.monotonic() - start)
        if outcome.status == "failed":
            stop.set()
            rec = self.records.get(stack)
            if rec is None or rec.phase != "failed":
                self._set(stack, progress.record("failed", rec.target if rec else "", rec.update if rec else None,
                                                 outcome.reason))
        return outcome

    def _roll(self, stack: str, start: float) -> Outcome:
        target = progress.target_digest(self.fleet.project, stack)
        done = already_done(self.records.get(stack), target, self.stacks.latest(stack))
        if done:
            self.say(f"  {stack}: skipped: {done}")
            return Outcome(stack, "skipped", done)
        log = self.dir / f"{stack}.log"
        self.say(f"  {stack}: pulumi up (log {log})")
        self._set(stack, progress.record("rolling", target, None, ""))
        with open(log, "a") as f:
            update = self.stacks.up(stack, f, lambda msg: self.say(f"  {stack}: {msg}"))
        self.say(f"  {stack}: {update} done after {time.monotonic() - start:.0f} s; gate: doctor, then sla")
        self._set(stack, progress.record("gating", target, update, ""))
        verdict = self.gate(stack, self.stacks.outputs(stack), self.dir / f"{stack}-sla", log)
        phase = "passed" if verdict.passed else "failed"
        self._set(stack, progress.record(phase, target, update, verdict.reason))
        seconds = time.monotonic() - start
        if verdict.passed:
            self.say(f"  {stack}: gate passed after {seconds:.0f} s: {verdict.reason}")
            return Outcome(stack, "passed", verdict.reason, seconds)
        return Outcome(stack, "failed", verdict.reason, seconds)
