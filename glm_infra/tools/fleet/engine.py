"""Each stack of a fleet through Pulumi's Automation API (the ``pulumi`` CLI on PATH, the caller's backend and
secrets environment): preview, up, the stack's latest update and its outputs. Each stack keeps its own state
and its own lock; a stack another update holds is a failure of that stack, never waited for."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TextIO

from glm_infra.plan import topology
from glm_infra.stack import load_file


class StackFailure(Exception):
    """A stack's operation failed; ``str()`` says which and why in one or a few lines."""


class Stacks(Protocol):
    def preview(self, stack: str) -> dict | str: ...  # preview --json's document, or why there is none
    def up(self, stack: str, log: TextIO, progress: Callable[[str], None]) -> str: ...  # the update's update_id
    def latest(self, stack: str) -> tuple[str, str] | None: ...  # (update_id, result) of the last update
    def outputs(self, stack: str) -> dict[str, Any]: ...


def update_id(summary: Any) -> str:
    """Which update of a stack ``summary`` (the Automation API's UpdateSummary) is: its version where the
    backend numbers them (Pulumi Cloud), and always its start and end (a file or cloud-storage backend numbers
    none: every version is 0), so that an update made since is never taken for the recorded one."""
    def at(t: Any) -> str:
        return t.strftime("%Y-%m-%dT%H:%M:%S") if t is not None else "unfinished"

    number = f"#{summary.version} " if summary.version else ""
    return f"{number}{summary.kind} {at(summary.start_time)}..{at(summary.end_time)}"


def _tail(text: str, lines: int = 6) -> str:
    kept = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return "\n".join(kept[-lines:])


def engine_parallel(project: Path, stack: str) -> int:
    """--parallel for the stack's up: the engine's default (4 per CPU), or what the stack needs if more
    (``topology.parallel_needed``: below it `up` is refused)."""
    loaded = load_file(project / "stacks" / f"Pulumi.{stack}.yaml")
    return max(4 * (os.cpu_count() or 1), topology.parallel_needed(loaded.config, topology.plan(loaded.config)))


class AutomationStacks:
    """The fleet's stacks of the Pulumi project at ``project`` (its Pulumi.yaml and stacks/)."""

    def __init__(self, project: Path):
        self.project = project
        self._select_lock = threading.Lock()  # `pulumi stack select` writes one workspace file

    def _stack(self, name: str):
        from pulumi import automation as auto

        try:
            with self._select_lock:
                return auto.select_stack(stack_name=name, work_dir=str(self.project))
        except auto.StackNotFoundError:
            raise StackFailure(f"{name}: the backend has no such stack (`pulumi stack init {name}` once, by whoever "
                               "deploys it)") from None
        except auto.CommandError as e:
            raise StackFailure(f"{name}: cannot select the stack: {_tail(e.stderr)}") from None

    def preview(self, stack: str) -> dict | str:
        import json

        from pulumi import automation as auto

        try:
            st = self._stack(stack)
        except StackFailure as e:
            return f"not run: {e}"
        try:
            result = st.preview(json=True, suppress_progress=True, color="never")
            out = result.stdout
        except auto.CommandError as e:
            out = e.stdout
            try:
                data = json.loads(out)
            except ValueError:
                return f"failed: {_tail(e.stderr) or _tail(e.stdout)}"
            if not data.get("diagnostics"):
                data["diagnostics"] = [{"severity": "error", "message": _tail(e.stderr) or "preview failed"}]
            return data
        try:
            return json.loads(out)
        except ValueError:
            return f"failed: preview printed no JSON: {_tail(out)}"

    def up(self, stack: str, log: TextIO, progress: Callable[[str], None]) -> str:
        from pulumi import automation as auto

        st = self._stack(stack)
        done = [0]
        last = [time.monotonic()]

        def on_event(ev) -> None:
            if ev.res_outputs_event is not None or ev.res_op_failed_event is not None:
                done[0] += 1
                if time.monotonic() - last[0] >= 15:
                    last[0] = time.monotonic()
                    progress(f"{done[0]} resources done")

        def on_output(line: str) -> None:
            log.write(line if line.endswith("\n") else line + "\n")
            log.flush()

        try:
            result = st.up(parallel=engine_parallel(self.project, stack), on_output=on_output, on_event=on_event,
                           suppress_progress=True, color="never", message="glm-infra fleet up")
        except auto.ConcurrentUpdateError:
            raise StackFailure(f"{stack}: another update holds the stack's lock (`pulumi cancel -s {stack}` if it is "
                               "a dead one)") from None
        except auto.CommandError as e:
            raise StackFailure(f"{stack}: pulumi up failed:\n{_tail(e.stderr, 12) or _tail(e.stdout, 12)}") from None
        if result.summary is None or result.summary.result != "succeeded":
            raise StackFailure(f"{stack}: pulumi up ended {result.summary.result if result.summary else 'unrecorded'}")
        return update_id(result.summary)

    def latest(self, stack: str) -> tuple[str, str] | None:
        history = self._stack(stack).history(page_size=1, show_secrets=False)
        if not history:
            return None
        return update_id(history[0]), str(history[0].result)

    def outputs(self, stack: str) -> dict[str, Any]:
        return {k: v.value for k, v in self._stack(stack).outputs().items()}
