"""``glm-infra fleet preview | up | status FLEET_FILE``."""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..review.preview import summarize_preview
from . import progress
from .engine import AutomationStacks, StackFailure, Stacks
from .gate import run_gate
from .report import blast_radius, preview_text, rendering_now, status_text
from .rollout import Rollout
from .spec import Fleet, FleetError, load_fleet

EXIT_OK, EXIT_FAILED, EXIT_INVALID, EXIT_INTERRUPTED = 0, 1, 2, 130


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fleet", help="roll the stacks a fleet file names wave by wave (preview, up, status)")
    p.add_argument("action", choices=("preview", "up", "status"))
    p.add_argument("file", metavar="FLEET_FILE", help="the fleet file (waves of stacks, the gate's arguments)")
    p.add_argument("--restart", action="store_true", help="up: forget the recorded progress, roll every wave again")
    p.set_defaults(func=run)


def _say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace, stacks: Stacks | None = None) -> int:
    try:
        fleet = load_fleet(args.file)
    except FleetError as e:
        print(e, file=sys.stderr)
        return EXIT_INVALID
    engine = stacks or AutomationStacks(fleet.project)
    try:
        if args.action == "preview":
            return preview(fleet, engine)
        if args.action == "status":
            return status(fleet, engine)
        return up(fleet, engine, args.restart)
    except progress.ProgressError as e:
        print(f"glm-infra fleet: {e}", file=sys.stderr)
        return EXIT_INVALID
    except KeyboardInterrupt:  # pulumi got the signal too: its update stops as after Ctrl-C, the lock released
        print(f"glm-infra fleet: interrupted; `glm-infra fleet {args.action} {args.file}` again resumes",
              file=sys.stderr)
        return EXIT_INTERRUPTED


def preview(fleet: Fleet, stacks: Stacks) -> int:
    def one(stack: str):
        data = stacks.preview(stack)
        if isinstance(data, str):
            return stack, data, None
        rendering = rendering_now(fleet, stack)
        summary = summarize_preview(stack, data, rendering)
        return stack, summary, blast_radius(summary, rendering)

    _say(f"previewing {len(fleet.stacks)} stacks")
    with ThreadPoolExecutor(max_workers=max(w.parallel for w in fleet.waves)) as pool:
        done = list(pool.map(one, fleet.stacks))
    previews = {s: p for s, p, _ in done}
    radii = {s: r for s, _, r in done if r is not None}
    sys.stdout.write(preview_text(fleet, previews, radii))
    failed = [s for s, p in previews.items() if isinstance(p, str) or p.errors]
    if failed:
        _say(f"no preview of {', '.join(failed)}")
        return EXIT_FAILED
    return EXIT_OK


def status(fleet: Fleet, stacks: Stacks) -> int:
    records = progress.read(fleet)
    targets = {s: progress.target_digest(fleet.project, s) for s in fleet.stacks}
    latest: dict[str, tuple[str, str] | None | str] = {}
    for s in fleet.stacks:
        try:
            latest[s] = stacks.latest(s)
        except StackFailure as e:
            latest[s] = str(e)
    sys.stdout.write(status_text(fleet, records, targets, latest))
    return EXIT_OK


def up(fleet: Fleet, stacks: Stacks, restart: bool = False) -> int:
    def gate(stack: str, outputs: dict, out: Path, log: Path):
        return run_gate(fleet.project, stack, outputs, out, log, fleet.doctor_args, fleet.sla_args)

    start = time.monotonic()
    result = Rollout(fleet, stacks, gate, _say, restart).run()
    took = time.monotonic() - start
    for o in result.outcomes:
        print(f"{o.stack}: {o.status}" + (f" ({o.seconds:.0f} s)" if o.seconds else "")
              + (f": {o.reason.splitlines()[0]}" if o.reason else ""))
    if result.ok:
        print(f"fleet {fleet.name}: every wave passed in {took:.0f} s")
        return EXIT_OK
    print(f"fleet {fleet.name}: stopped at wave {result.stopped_at} after {took:.0f} s; fix it and run "
          f"`glm-infra fleet up {fleet.source}` again (stacks already gated are skipped)")
    return EXIT_FAILED
