"""``glm-infra propose --from STACK --out FILE``: NVIDIA's aiconfigurator searches the P/D configurations
of the base stack's hosts for an SLA and a traffic shape (ISL/OSL); the best one glm-infra deploys becomes
a stack file, the base stack's with its pools, router and SLA replaced, validated before it is kept
(the ``glm-infra[planner]`` extra).

Only a configuration predicted to meet the SLA is proposed: aiconfigurator's strict ranking (its
``strict_sla``), and glm-infra's own check of each row (a TTFT and TPOT present, finite and within the
SLA; anything else is never a candidate). When none is, nothing is written unless ``--closest`` asks for
the closest one glm-infra can deploy, written marked as predicted to miss the SLA, with an exit status
of its own (EXIT_STATUSES): a script that goes on only on 0 never deploys it unawares."""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from glm_infra.plan import prediction, proposal
from glm_infra.stack import StackError, load_file, resolve_stack_file

from . import planner

SUMMARY = ("search P/D configurations for an SLA with aiconfigurator and write the best deployable one predicted to "
           "meet it as a stack file (glm-infra[planner])")
EXIT_OK, EXIT_NONE, EXIT_USAGE, EXIT_MISSES = 0, 1, 2, 3
EXIT_STATUSES = (f"exit status: {EXIT_OK} wrote a stack predicted to meet the SLA; {EXIT_NONE} refused, nothing "
                 "written: nothing it can deploy is predicted to meet the SLA (with --closest: nothing it can "
                 f"deploy was predicted at all), or the base stack is invalid; {EXIT_USAGE} bad arguments, an --out "
                 "that exists (without --force) or has no folder, no planner extra, or aiconfigurator could not "
                 f"search; {EXIT_MISSES} --closest wrote the closest configuration, predicted to MISS the SLA")


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
    hosts = cfg.hosts[: args.hosts]
    if args.hosts and args.hosts > len(cfg.hosts):
        print(f"{loaded.source}: --hosts {args.hosts}: the stack has {len(cfg.hosts)}", file=sys.stderr)
        return EXIT_USAGE
    gpus_per_host = min(h.gpus for h in hosts)
    target = prediction.target(cfg)
    if isinstance(target, prediction.Problem):
        raise StackError(loaded.source, [target])
    ttft, tpot = args.ttft or cfg.sla.ttft_seconds, args.tpot or cfg.sla.tpot_seconds
    slo = _Sla(ttft * 1000, tpot * 1000, args.isl, args.osl)
    decode_mtp = args.mtp if args.mtp is not None else (cfg.decode.speculative_tokens if cfg.decode else 3)
    prefill_mtp = cfg.prefill.speculative_tokens if cfg.prefill else 1
    try:
        version = planner.backend_version(planner.api(), target)
    except (planner.PlannerMissing, planner.CannotPredict) as e:
        print(f"{loaded.source}: {e}", file=sys.stderr)
        return EXIT_USAGE
    total = gpus_per_host * len(hosts)
    exp = proposal.experiment(target.model, target.system, target.backend, version, target.database_mode, total,
                              gpus_per_host, args.isl, args.osl, slo.ttft_ms, slo.tpot_ms, decode_mtp,
                              round(cfg.prediction.mtp_acceptance_rate * decode_mtp, 4))
    print(f"searching {total} {hosts[0].gpu_model} GPUs ({len(hosts)} hosts of {loaded.source}) for {slo} with "
          f"{planner.predictor_label()} ({target.system}, {target.backend} {version} data); half a minute or so…",
          file=sys.stderr)
    # The longest request the SLA promises, unless the base stack says: a prefill rank needs room for one.
    max_model_len = cfg.model.max_model_len or args.max_model_len or max(
        max(cfg.sla.contexts) + cfg.sla.output_tokens, args.isl + args.osl)
    base_doc = yaml.safe_load(base_path.read_text())
    tried: dict[tuple, dict[str, Any] | None] = {}

    def deployable(c: proposal.Candidate) -> dict[str, Any] | None:
        """The stack document of a candidate glm-infra can deploy on these hosts, or None, saying why not (once
        for each topology: the rows of one differ only in their load)."""
        topology = (c.prefill, c.decode, c.replicas)
        if topology not in tried:
            doc, reason = None, proposal.why_not_candidate(c, gpus_per_host, len(hosts))
            if reason is None:  # it fits the first hosts: the document names those
                doc = proposal.stack_document(base_doc, cfg, c, gpus_per_host,
                                              {"ttftSeconds": ttft, "tpotSeconds": tpot}, decode_mtp, prefill_mtp,
                                              max_model_len)
                reason = _refusal(doc, out.name)
            if reason is not None:
                doc = None
                print(f"  not deployable: {proposal.describe(c)}: {reason}", file=sys.stderr)
            tried[topology] = doc
        return tried[topology]

    def first_deployable(candidates: list[proposal.Candidate]) -> tuple[proposal.Candidate | None, Any]:
        return next(((c, d) for c in candidates if (d := deployable(c)) is not None), (None, None))

    def ranking(strict: bool, quiet: bool = False) -> planner.Ranking:
        """aiconfigurator's ranking, strict or closest-first, saying where it came from (planner.CannotPredict:
        none)."""
        found = planner.search(exp, args.top, strict=strict, fresh=args.fresh and strict)
        if found.note is not None:
            print(f"  {found.note}", file=sys.stderr)
        if found.cached is not None and not quiet:
            print(f"  aiconfigurator's {'strict' if strict else 'closest-first'} ranking of this same search, from "
                  f"{found.cached} (--fresh searches again)", file=sys.stderr)
        return found

    try:
        # aiconfigurator's strict ranking (what it predicts meets the SLA), each row checked again all the same.
        strict = ranking(strict=True)
        meeting = [c for c in _whole_predictions(strict.rows, total) if slo.met_by(c)]
        best, doc = first_deployable(meeting)
        if best is None:
            # The same sweep as aiconfigurator ranks it without strict_sla (the closest first when none meets; kept
            # by the strict search's sweep, so not said again to come from the cache when that one was made now):
            # the closest is the one least over the SLA, by the larger of its two ratios.
            loose = ranking(strict=False, quiet=strict.cached is None)
            seen = sorted(_whole_predictions(loose.rows, total), key=slo.shortfall)
            best, doc = first_deployable(seen)
            if best is None or (slo.misses(best) and not args.closest):
                print(_refusal_message(loaded.source, slo, f"{total} {hosts[0].gpu_model} GPUs on {len(hosts)} hosts",
                                       meeting, seen, best), file=sys.stderr)
                return EXIT_NONE
    except (planner.PlannerMissing, planner.CannotPredict) as e:
        print(f"{loaded.source}: {e}", file=sys.stderr)
        return EXIT_USAGE
    misses = "; ".join(slo.misses(best))
    asked = f"propose --from {args.base} --hosts {len(hosts)} --isl {args.isl} --osl {args.osl} --ttft {ttft:g} " \
            f"--tpot {tpot:g} --mtp {decode_mtp}" + (" --closest" if misses else "")
    header = (("" if not misses else
               f"# PREDICTED TO MISS THE SLA: {misses}. Written because --closest asked for the closest\n"
               f"# configuration: none glm-infra can deploy on these hosts is predicted to meet {slo}.\n")
              + f"# Proposed by `glm-infra {asked}`: {planner.predictor_label()}, {target.system}, "
              f"{target.backend} {version} data ({target.database_mode}).\n"
              + (f"# Its #{best.rank} for {slo}: " if not misses else
                 f"# The closest, #{best.rank} of its ranking without strict_sla, for {slo}: ")
              + f"predicted TTFT {best.ttft_ms / 1000:.2f} s, TPOT {best.tpot_ms:.1f} ms, "
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
    if misses:
        print(f"warning: {out} is predicted to MISS the SLA asked ({slo}): {misses}; written because --closest "
              f"asked for the closest configuration (exit status {EXIT_MISSES})", file=sys.stderr)
        return EXIT_MISSES
    return EXIT_OK


@dataclass(frozen=True)
class _Sla:
    """The SLA asked, in aiconfigurator's milliseconds, held against a candidate's prediction."""

    ttft_ms: float
    tpot_ms: float
    isl: int
    osl: int

    def __str__(self) -> str:
        return (f"ISL {self.isl}, OSL {self.osl}, mean TTFT ≤ {self.ttft_ms / 1000:g} s, "
                f"mean TPOT ≤ {self.tpot_ms:g} ms")

    def misses(self, c: proposal.Candidate) -> list[str]:
        return proposal.sla_misses(c, self.ttft_ms, self.tpot_ms)

    def shortfall(self, c: proposal.Candidate) -> float:
        return proposal.shortfall(c, self.ttft_ms, self.tpot_ms)

    def met_by(self, c: proposal.Candidate) -> bool:
        misses = self.misses(c)
        if misses:  # aiconfigurator's strict ranking should not hold it: its filter is not trusted alone
            print(f"  predicted to miss the SLA: {proposal.describe(c)}: {'; '.join(misses)}", file=sys.stderr)
        return not misses


def _whole_predictions(rows: list[dict[str, Any]], total_gpus: int) -> list[proposal.Candidate]:
    """The rows that are whole predictions, as candidates; each other one named and left out (fail closed:
    a missing or non-numeric TTFT or TPOT never meets an SLA)."""
    candidates = []
    for rank, row in enumerate(rows, 1):
        try:
            candidates.append(proposal.Candidate.from_row(rank, row, total_gpus))
        except proposal.BadRow as e:
            print(f"  not a prediction: #{rank} of aiconfigurator's ranking: {e}", file=sys.stderr)
    return candidates


def _refusal_message(source: str, slo: _Sla, gpus: str, meeting: list[proposal.Candidate],
                     seen: list[proposal.Candidate], closest: proposal.Candidate | None) -> str:
    """Why nothing is written: what was asked, the closest prediction seen and how to ask for it."""
    if meeting:
        lines = [f"{source}: none of the {len(meeting)} configurations predicted to meet the SLA asked ({slo}) "
                 f"can glm-infra deploy on {gpus}; nothing written"]
    else:
        lines = [f"{source}: no configuration of {gpus} is predicted to meet the SLA asked ({slo}); nothing written"]
    if closest is not None:
        lines += [f"  the closest glm-infra can deploy: {proposal.describe(closest)}: predicted TTFT "
                  f"{closest.ttft_ms / 1000:.2f} s, TPOT {closest.tpot_ms:.1f} ms: {'; '.join(slo.misses(closest))}",
                  "  to write it all the same, marked as predicted to miss the SLA: the same command with --closest "
                  f"(exit status {EXIT_MISSES}); or loosen --ttft/--tpot, or give more hosts"]
        return "\n".join(lines)
    if not meeting:
        lines.append(f"  the closest prediction: {proposal.describe(seen[0])}: predicted TTFT "
                     f"{seen[0].ttft_ms / 1000:.2f} s, TPOT {seen[0].tpot_ms:.1f} ms: {'; '.join(slo.misses(seen[0]))}"
                     if seen else "  aiconfigurator predicted no configuration at all (none within the TTFT, or the "
                                  "model does not fit)")
    lines.append("  nothing glm-infra can deploy on these hosts was predicted, so --closest has nothing to write "
                 "either: give more hosts, or loosen --ttft/--tpot")
    return "\n".join(lines)


def _refusal(doc: dict, name: str) -> str | None:
    """validate's first problem with a proposed document, or None (checked in a folder of its own, removed)."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / name
        path.write_text(yaml.safe_dump(doc))
        try:
            load_file(path)
        except StackError as e:
            return f"validate: {e.problems[0].path}: {e.problems[0].message}"
    return None


def _write_validated(out: Path, text: str) -> None:
    """Keep the file only if it loads as a stack: written as a hidden file beside it (the same filesystem) and
    renamed over it once it does, so it is there whole or not at all; a refused proposal leaves nothing."""
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
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
    if value == 0 or value == math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("propose", help=SUMMARY, description=SUMMARY, epilog=EXIT_STATUSES)
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
    p.add_argument("--closest", action="store_true",
                   help="when no configuration is predicted to meet the SLA, write the closest one glm-infra can "
                        "deploy (the least over the SLA), marked in its header and on stderr as predicted to miss "
                        f"it; exit status {EXIT_MISSES}")
    p.add_argument("--force", action="store_true", help="replace FILE if it exists")
    p.add_argument("--fresh", action="store_true", help="search again rather than reuse the ranking of the same "
                                                        "search (same hosts, SLA, ISL/OSL, MTP and aiconfigurator)")
    p.set_defaults(func=run)
