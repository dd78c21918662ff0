"""``glm-infra validate | plan | render | diff | schema``: review a stack without the Pulumi engine;
``glm-infra sla`` (the SLA gate) and ``glm-infra doctor`` (the drift check) on a deployed one; ``glm-infra fleet``
(stacks rolled in waves, gated by those two)."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from glm_infra import hostplan
from glm_infra.plan import model_checks, topology
from glm_infra.stack import LoadedStack, StackError, load_file, resolve_stack_file

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2


def _load(stack: str) -> LoadedStack:
    return load_file(resolve_stack_file(stack))


def _n(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def cmd_validate(args: argparse.Namespace) -> int:
    status = EXIT_OK
    for name in args.stacks:
        try:
            loaded = _load(name)
        except StackError as e:
            print(e, file=sys.stderr)
            status = EXIT_INVALID
            continue
        if args.strict and (unpinned := model_checks.unpinned_revision(loaded.config)) is not None:
            print(f"{loaded.source}: invalid stack under --strict (1 problem)\n  {loaded.source}: {unpinned.path}: "
                  f"{unpinned.message}", file=sys.stderr)
            status = EXIT_INVALID
            continue
        missed = [] if args.no_predict else _predicted_misses(loaded, required=args.strict_sla)
        if missed is None or (args.strict_sla and missed):
            problems = missed or ["no prediction: the planner extra is not installed (pip install "
                                  "'glm-infra[planner]')"]
            print(f"{loaded.source}: invalid stack under --strict-sla ({_n(len(problems), 'problem')})", file=sys.stderr)
            for m in problems:
                print(f"  {loaded.source}: glm-infra:sla: {m}", file=sys.stderr)
            status = EXIT_INVALID
            continue
        p = topology.plan(loaded.config)
        print(
            f"{loaded.source}: ok ({_n(len(p.hosts), 'host')}, {_n(len(p.instances), 'vLLM instance')}, "
            f"{_n(sum(h.gpus_used for h in p.hosts), 'GPU')}{', router' if p.router else ''})"
        )
        for w in loaded.warnings:
            print(f"  warning: {w}", file=sys.stderr)
        for m in missed:
            print(f"  warning: glm-infra:sla: {m} (glm-infra predict {loaded.name})", file=sys.stderr)
    return status


def _predicted_misses(loaded: LoadedStack, required: bool) -> list[str] | None:
    """How aiconfigurator's prediction misses the stack's SLA; None when the planner extra is missing and
    --strict-sla needs it (without the flag a note says so and nothing is refused)."""
    from glm_infra.plan import prediction

    from . import planner

    try:
        p = planner.predict(loaded.config, loaded.name)
    except planner.PlannerMissing:
        if required:
            return None
        print(f"  note: no SLA prediction (the planner extra is not installed: {planner.INSTALL})", file=sys.stderr)
        return []
    except planner.CannotPredict as e:  # a stack aiconfigurator cannot model: advice missing, not a bad stack
        if required:
            return [str(e)]
        print(f"  note: no SLA prediction ({e})", file=sys.stderr)
        return []
    return [m for b in p.buckets for m in prediction.misses(loaded.config, b)]


def cmd_plan(args: argparse.Namespace) -> int:
    from glm_infra.plan import capacity, capacity_report, startup

    loaded = _load(args.stack)
    print(f"# {loaded.source}")
    print(topology.format_table(loaded.config, topology.plan(loaded.config)))
    print()
    print(capacity_report.format_report(loaded.config, capacity.compute(loaded.config)))
    print()
    print(startup.format_time_to_ready(loaded.config))
    return EXIT_OK


def cmd_capacity(args: argparse.Namespace) -> int:
    import os

    from glm_infra.plan import capacity, capacity_report
    from glm_infra.spec import checkpoint

    if args.action == "compare":
        rows = [(loaded.name, loaded.config) for loaded in map(_load, args.stacks)]
        print(capacity_report.trade_table(rows, args.pool))
        return EXIT_OK
    # fetch: read the facts from the checkpoint itself (stack loaded without the capacity rule, which
    # needs the very facts this writes).
    path = resolve_stack_file(args.stacks[0])
    stack = load_file(path, capacity=False).config
    m = stack.model
    if args.source_dir:
        src: checkpoint.Source = checkpoint.LocalSource(Path(args.source_dir))
    elif m.source == "mirror":
        src = checkpoint.HttpSource(f"{m.mirror_url}/{m.revision}")
    elif m.source == "huggingface":
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
        src = checkpoint.HttpSource(f"{endpoint}/{m.repo}/resolve/{m.revision}", token=os.environ.get("HF_TOKEN"))
    else:
        print(f"{path}: model.source local: the files are on the hosts; give --from DIR (a copy of them)",
              file=sys.stderr)
        return EXIT_USAGE
    try:
        snap = checkpoint.read_snapshot(src, m.repo, m.revision)
    except checkpoint.CheckpointError as e:
        print(f"{path}: capacity fetch: {e}", file=sys.stderr)
        return EXIT_INVALID
    out = Path(args.out) if args.out else capacity.snapshot_path(stack)
    checkpoint.write_snapshot(out, snap)
    total = sum(checkpoint.class_bytes(snap).values())
    print(f"{out}: {m.repo}@{m.revision}: {len(snap['files'])} safetensors files, {total / capacity.GB:.1f} GB "
          f"(from {src.description})")
    return EXIT_OK


def cmd_render(args: argparse.Namespace) -> int:
    loaded = _load(args.stack)
    out = Path(args.out)
    if out.exists():
        if not args.force and any(out.iterdir()):
            print(f"{out}: exists and is not empty (use --force to replace it)", file=sys.stderr)
            return EXIT_USAGE
        shutil.rmtree(out)
    steps = hostplan.plan_all(loaded.config, topology.plan(loaded.config), stack_name=loaded.name)
    written = hostplan.write_tree(out, steps)
    for path in written:
        print(path)
    print(f"{len(written)} files for {len(steps)} hosts under {out}: what lands on each host, and each step's "
          f"commands in <host>/{hostplan.STEPS_DIR}/ (secrets are placeholders)", file=sys.stderr)
    return EXIT_OK


def cmd_real_engine(args: argparse.Namespace) -> int:
    from . import real_engine

    loaded = _load(args.stack)
    if args.gpu_share is not None and not 0 < args.gpu_share <= 1:
        print(f"--gpu-share {args.gpu_share}: must be in (0, 1]", file=sys.stderr)
        return EXIT_USAGE
    from glm_infra.roles import monitoring

    lines = real_engine.lines(loaded.config, loaded.name, args.model, args.gpu_share)
    expected = monitoring.read_metrics(loaded.config, loaded.name)
    for path in real_engine.write(Path(args.out), loaded.name, lines, expected):
        print(path)
    return EXIT_OK


def cmd_sla(args: argparse.Namespace) -> int:
    from . import sla

    loaded = _load(args.stack)
    try:
        return sla.run(loaded.config, loaded.name, args)
    except sla.SlaError as e:
        print(f"{loaded.source}: sla: {e}", file=sys.stderr)
        return sla.EXIT_ERROR


def cmd_doctor(args: argparse.Namespace) -> int:
    from . import doctor

    loaded = _load(args.stack)
    return doctor.run(loaded.config, loaded.name, args)


def cmd_diff(args: argparse.Namespace) -> int:
    from . import review

    return review.run_diff(args)


def cmd_schema(args: argparse.Namespace) -> int:
    from . import schema

    sys.stdout.write(schema.dumps(schema.model_schema() if args.model else schema.stack_file_schema()))
    return EXIT_OK


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="glm-infra", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate", help="check stacks; exit 1 if any is invalid")
    v.add_argument("stacks", nargs="+", metavar="STACK", help="stack name (prod-b300) or path to a stack file")
    v.add_argument("--strict", action="store_true", help="also refuse a model.revision that is not a commit SHA "
                                                         "(a branch or tag deploys whatever it points to that day)")
    sla = v.add_mutually_exclusive_group()
    sla.add_argument("--strict-sla", action="store_true", help="also refuse a stack whose predicted TTFT or TPOT "
                                                               "(glm-infra predict) misses its SLA in any bucket")
    sla.add_argument("--no-predict", action="store_true", help="skip the SLA prediction (it needs the planner extra)")
    v.set_defaults(func=cmd_validate)
    p = sub.add_parser("plan", help="print hosts × instances × GPUs × ports")
    p.add_argument("stack", metavar="STACK")
    p.set_defaults(func=cmd_plan)
    c = sub.add_parser("capacity", help="fetch: write the checkpoint's facts snapshot (config.json and the "
                                        "safetensors headers, by range requests); compare: one pool's KV room across stacks")
    c.add_argument("action", choices=("fetch", "compare"))
    c.add_argument("stacks", nargs="+", metavar="STACK")
    c.add_argument("--out", metavar="FILE", help="fetch: where to write (default: capacity.facts, else "
                                                 "glm_infra/spec/checkpoints/<owner>--<name>.json)")
    c.add_argument("--from", dest="source_dir", metavar="DIR", help="fetch: read staged files in DIR instead")
    c.add_argument("--pool", default="prefill", help="compare: the pool (default prefill)")
    c.set_defaults(func=cmd_capacity)
    r = sub.add_parser("render", help="write every file and step that reaches each host under DIR/<host>/")
    r.add_argument("stack", metavar="STACK")
    r.add_argument("--out", required=True, metavar="DIR")
    r.add_argument("--force", action="store_true", help="replace DIR if it is not empty")
    r.set_defaults(func=cmd_render)
    e = sub.add_parser("real-engine", help="write the real-engine check's vllm lines: the stack's rendered units "
                                           "changed for one GPU, every change listed (DIR/CHANGES.md)")
    e.add_argument("stack", metavar="STACK")
    e.add_argument("--out", required=True, metavar="DIR")
    e.add_argument("--model", default="${GLM_CHECK_MODEL}", metavar="DIR",
                   help="the checkpoint the check serves (default: the runner's GLM_CHECK_MODEL)")
    e.add_argument("--gpu-share", type=float, metavar="F", help="GPU memory share of each instance")
    e.set_defaults(func=cmd_real_engine)
    from .review import add_parser as add_diff

    add_diff(sub)
    sub.choices["diff"].set_defaults(func=cmd_diff)
    s = sub.add_parser("schema", help="print the JSON Schema of a stack file (schemas/stack.schema.json is this "
                                      "output)")
    s.add_argument("--model", action="store_true", help="only the glm-infra keys' model (StackConfig), unprefixed")
    s.set_defaults(func=cmd_schema)
    from .doctor import add_parser as add_doctor
    from .fleet.cli import add_parser as add_fleet
    from .predict import add_parser as add_predict
    from .propose import add_parser as add_propose
    from .sla import add_parser as add_sla

    add_predict(sub)
    add_propose(sub)

    add_sla(sub)
    sub.choices["sla"].set_defaults(func=cmd_sla)
    add_doctor(sub)
    sub.choices["doctor"].set_defaults(func=cmd_doctor)
    add_fleet(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except StackError as e:
        print(e, file=sys.stderr)
        return EXIT_INVALID


if __name__ == "__main__":
    sys.exit(main())
