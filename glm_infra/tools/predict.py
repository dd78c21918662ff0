"""``glm-infra predict STACK``: aiconfigurator's TTFT, TPOT, throughput and memory per SLA bucket of a
stack, before any host serves (the ``glm-infra[planner]`` extra). A table, ``--json``, ``--plot``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from glm_infra.plan import prediction
from glm_infra.stack import LoadedStack, load_file, resolve_stack_file

from . import planner

EXIT_OK, EXIT_MISSES, EXIT_NO_PLANNER = 0, 1, 2  # 2 also: a stack aiconfigurator cannot model
# The recipe's measured result (docs/RECIPE.md): 3 × 8 B300, the prod-b300 topology.
SEED_RESULT = {"tpot_ms": 17.0, "tpot_context": 16384, "ttft_max_s": 2.5, "contexts": (16384, 262144)}


def run(args: argparse.Namespace) -> int:
    loaded: LoadedStack = load_file(resolve_stack_file(args.stack))
    try:
        p = planner.predict(loaded.config, loaded.name)
    except (planner.PlannerMissing, planner.CannotPredict) as e:
        print(f"{loaded.source}: {e}", file=sys.stderr)
        return EXIT_NO_PLANNER
    report = p.to_json(loaded.config)
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        print(f"# {loaded.source}")
        print(prediction.format_table(loaded.config, p))
    if args.plot:
        from .predict_plot import plot

        plot(report, Path(args.plot), seed=SEED_RESULT if args.seed_result else None)
        print(f"wrote {args.plot}", file=sys.stderr)
    missed = [m for b in report["buckets"] for m in b["misses"]]
    return EXIT_MISSES if missed and args.strict else EXIT_OK


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("predict", help="aiconfigurator's TTFT/TPOT per SLA bucket of a stack (glm-infra[planner])")
    p.add_argument("stack", metavar="STACK")
    p.add_argument("--json", action="store_true", help="print the prediction as JSON")
    p.add_argument("--plot", metavar="PNG", help="also draw predicted TTFT and TPOT against the context length")
    p.add_argument("--seed-result", action="store_true",
                   help="mark the seed write-up's measured result on the plot (mean TPOT 17 ms at 16K, mean TTFT "
                        "≤ 2.5 s over 16K–256K, the prod-b300 topology)")
    p.add_argument("--strict", action="store_true", help="exit 1 when a bucket's prediction misses the SLA")
    p.set_defaults(func=run)
