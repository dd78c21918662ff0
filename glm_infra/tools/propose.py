"""``glm-infra propose --from STACK --out FILE``: NVIDIA's aiconfigurator searches the P/D configurations
of the base stack's hosts for an SLA and a traffic shape (ISL/OSL); the best one glm-infra deploys becomes
a stack file, the base stack's with its pools, router and SLA replaced, validated before it is kept
(the ``glm-infra[planner]`` extra)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import yaml

from glm_infra.plan import prediction, proposal
from glm_infra.stack import StackError, load_file, resolve_stack_file

from . import planner

EXIT_OK, EXIT_NONE, EXIT_USAGE = 0, 1, 2


def run(args: argparse.Namespace) -> int:
    base_path = resolve_stack_file(args.base)
    loaded = load_file(base_path)
    cfg = loaded.config
    out = Path(args.out)
    if out.exists() and not args.force:
        print(f"{out}: exists (use --force to replace it)", file=sys.stderr)
        return EXIT_USAGE
    if not out.parent.is_dir():
        print(f"{out}: no folder {out.parent} to write it in", file=sys.stderr)
        return EXIT_USAGE
    hosts = cfg.hosts[: args.hosts] if args.hosts else cfg.hosts
    if args.hosts and args.hosts > len(cfg.hosts):
        print(f"{loaded.source}: --hosts {args.hosts}: the stack has {len(cfg.hosts)}", file=sys.stderr)
        return EXIT_USAGE
    gpus_per_host = min(h.gpus for h in hosts)
    target = prediction.target(cfg)
    if isinstance(target, prediction.Problem):
        raise StackError(loaded.source, [target])
    ttft, tpot = args.ttft or cfg.sla.ttft_seconds, args.tpot or cfg.sla.tpot_seconds
    decode_mtp = args.mtp if args.mtp is not None else (cfg.decode.speculative_tokens if cfg.decode else 3)
    prefill_mtp = cfg.prefill.speculative_tokens if cfg.prefill else 1
    try:
        version = planner.backend_version(planner.api(), target)
    except (planner.PlannerMissing, planner.CannotPredict) as e:
        print(f"{loaded.source}: {e}", file=sys.stderr)
        return EXIT_USAGE
    total = gpus_per_host * len(hosts)
    exp = proposal.experiment(target.model, target.system, target.backend, version, target.database_mode, total,
                              gpus_per_host, args.isl, args.osl, ttft * 1000, tpot * 1000, decode_mtp,
                              round(cfg.prediction.mtp_acceptance_rate * decode_mtp, 4))
    print(f"searching {total} {hosts[0].gpu_model} GPUs ({len(hosts)} hosts of {loaded.source}) for ISL {args.isl}, "
          f"OSL {args.osl}, mean TTFT ≤ {ttft:g} s, mean TPOT ≤ {tpot * 1000:g} ms with "
          f"{planner.predictor_label()} ({target.system}, {target.backend} {version} data); half a minute or so…",
          file=sys.stderr)
    rows, cached = planner.search(exp, args.top, fresh=args.fresh)
    if cached is not None:
        print(f"  aiconfigurator's ranking of this same search, from {cached} (--fresh searches again)",
              file=sys.stderr)
    # The longest request the SLA promises, unless the base stack says: a prefill rank needs room for one.
    max_model_len = cfg.model.max_model_len or args.max_model_len or max(
        max(cfg.sla.contexts) + cfg.sla.output_tokens, args.isl + args.osl)
    base_doc = yaml.safe_load(base_path.read_text())
    best, doc = None, {}
    for row_rank, row in enumerate(rows, 1):
        c = proposal.Candidate.from_row(row_rank, row, total)
        reason = proposal.why_not_candidate(c, gpus_per_host, len(hosts))
        if reason is None:
            doc = proposal.stack_document(base_doc, cfg.model_copy(update={"hosts": hosts}), c, gpus_per_host,
                                          {"ttftSeconds": ttft, "tpotSeconds": tpot}, decode_mtp, prefill_mtp,
                                          max_model_len)
            reason = _refusal(doc)
        if reason is None:
            best = c
            break
        print(f"  not deployable: {proposal.describe(c)}: {reason}", file=sys.stderr)
    if best is None:
        print(f"{loaded.source}: no configuration of the {len(rows)} that meet the SLA can glm-infra deploy on "
              f"{len(hosts)} hosts" + ("" if rows else " (none meets it: loosen --ttft/--tpot or give more hosts)"),
              file=sys.stderr)
        return EXIT_NONE
    asked = f"propose --from {args.base} --hosts {len(hosts)} --isl {args.isl} --osl {args.osl} --ttft {ttft:g} " \
            f"--tpot {tpot:g} --mtp {decode_mtp}"
    header = (f"# Proposed by `glm-infra {asked}`: {planner.predictor_label()}, {target.system}, "
              f"{target.backend} {version} data ({target.database_mode}).\n"
              f"# Its #{best.rank} for ISL {args.isl} / OSL {args.osl}, mean TTFT ≤ {ttft:g} s, mean TPOT ≤ "
              f"{tpot * 1000:g} ms: predicted TTFT {best.ttft_ms / 1000:.2f} s, TPOT {best.tpot_ms:.1f} ms, "
              f"{best.tokens_per_s_per_gpu:.1f} tokens/s per GPU at {best.concurrency:g} in flight.\n"
              f"# model.maxModelLen {max_model_len}: the longest request the SLA promises (--max-model-len).\n"
              f"# The rest is {loaded.source}'s: hosts, SSH, model, platform. Review with `glm-infra plan` and "
              f"`glm-infra predict`.\n")
    _write_validated(out, header + yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))
    print(f"wrote {out}: prefill {best.prefill.label} × {doc['config']['glm-infra:prefill']['instancesPerHost']} "
          f"per host on {', '.join(doc['config']['glm-infra:prefill']['hosts'])}; decode {best.decode.label} × "
          f"{doc['config']['glm-infra:decode']['instancesPerHost']} per host on "
          f"{', '.join(doc['config']['glm-infra:decode']['hosts'])}; predicted TTFT {best.ttft_ms / 1000:.2f} s, "
          f"TPOT {best.tpot_ms:.1f} ms, {best.tokens_per_s_per_gpu:.1f} tokens/s per GPU")
    return EXIT_OK


def _refusal(doc: dict) -> str | None:
    """validate's first problem with a proposed document, or None."""
    with tempfile.TemporaryDirectory(prefix="glm-propose-") as d:
        path = Path(d) / "Pulumi.proposed.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        try:
            load_file(path)
        except StackError as e:
            return f"validate: {e.problems[0].path}: {e.problems[0].message}"
    return None


def _write_validated(out: Path, text: str) -> None:
    """Keep the file only if it loads as a stack: a refused proposal leaves nothing behind."""
    fd, tmp = tempfile.mkstemp(prefix=".proposed-", suffix=".yaml", dir=out.parent if str(out.parent) else ".")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        load_file(Path(tmp))
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _number(text: str, kind: type, least: float, what: str):
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or value < least or value != value:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def _positive(text: str) -> int:
    return _number(text, int, 1, "a positive whole number")


def _count(text: str) -> int:
    return _number(text, int, 0, "a whole number, 0 or more")


def _seconds(text: str) -> float:
    value = _number(text, float, 0, "a positive number of seconds")
    if value == 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("propose", help="search P/D configurations for an SLA with aiconfigurator and write the best "
                                       "deployable one as a stack file (glm-infra[planner])")
    p.add_argument("--from", dest="base", required=True, metavar="STACK",
                   help="the stack whose hosts, SSH, model and platform the proposal keeps")
    p.add_argument("--out", required=True, metavar="FILE", help="the stack file to write")
    p.add_argument("--hosts", type=_positive, metavar="N", help="use the first N hosts of the base stack (default: all)")
    p.add_argument("--isl", type=_positive, default=16384, help="input tokens per request (default 16384)")
    p.add_argument("--osl", type=_positive, default=1024, help="output tokens per request (default 1024)")
    p.add_argument("--ttft", type=_seconds, metavar="SECONDS", help="mean TTFT target (default: the base's sla)")
    p.add_argument("--tpot", type=_seconds, metavar="SECONDS", help="mean TPOT target (default: the base's sla)")
    p.add_argument("--mtp", type=_count, metavar="N", help="decode's MTP draft tokens (default: the base's decode)")
    p.add_argument("--max-model-len", type=_positive, metavar="TOKENS",
                   help="model.maxModelLen when the base stack sets none (default: the longest request the SLA "
                        "promises: its longest context plus its output tokens, or ISL + OSL)")
    p.add_argument("--top", type=_positive, default=40, help="how many of aiconfigurator's ranking to consider")
    p.add_argument("--force", action="store_true", help="replace FILE if it exists")
    p.add_argument("--fresh", action="store_true", help="search again rather than reuse the ranking of the same "
                                                        "search (same hosts, SLA, ISL/OSL, MTP and aiconfigurator)")
    p.set_defaults(func=run)
