"""The command line: the targets file read, each target asked and judged, the metrics and the router's flags."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import socket
import sys
import time

from .judge import TRANSITION, judge, write_atomic
from .requests import DEFAULT_TIMEOUT_S, ask, read_env_value, target_name_problem


def metrics(results: list[dict], now: float, out_of_rotation: set[str] | frozenset[str] = frozenset(),
            transition: bool = False) -> str:
    """The results in Prometheus' text format (node exporter's textfile collector reads it)."""
    lines = ["# HELP glm_canary_ok 1 when every canary of the target answered the agreed reference in time.",
             "# TYPE glm_canary_ok gauge"]
    lines += [f'glm_canary_ok{{target="{r["name"]}",role="{r["role"]}"}} {int(r["ok"])}' for r in results]
    lines += ["# HELP glm_canary_seconds How long the target's canaries took, all of them.",
              "# TYPE glm_canary_seconds gauge"]
    lines += [f'glm_canary_seconds{{target="{r["name"]}",role="{r["role"]}"}} {r["seconds"]:.3f}' for r in results]
    lines += ["# HELP glm_canary_out_of_rotation 1 while the target's gate keeps it out of the router's rotation.",
              "# TYPE glm_canary_out_of_rotation gauge"]
    lines += [f'glm_canary_out_of_rotation{{target="{r["name"]}",role="{r["role"]}"}} '
              f'{int(r["name"] in out_of_rotation)}' for r in results]
    lines += ["# HELP glm_canary_transition 1 while the instances roll onto another model revision or vLLM.",
              "# TYPE glm_canary_transition gauge", f"glm_canary_transition {int(transition)}"]
    lines += ["# HELP glm_canary_transition_pending 1 when the target answered otherwise than the old reference "
              "while they roll (not taken out of rotation; judged once every instance has rolled).",
              "# TYPE glm_canary_transition_pending gauge"]
    lines += [f'glm_canary_transition_pending{{target="{r["name"]}",role="{r["role"]}"}} {int(bool(r.get("pending")))}'
              for r in results]
    lines += ["# HELP glm_canary_last_run_timestamp_seconds When the canaries last ran.",
              "# TYPE glm_canary_last_run_timestamp_seconds gauge", f"glm_canary_last_run_timestamp_seconds {now:.0f}"]
    return "\n".join(lines) + "\n"


def flag(results: list[dict], folder: str) -> list[str]:
    """Raise FOLDER/NAME.failing for each gated target that failed, drop it for each that passed, unless
    no gated target of its role passed (a canary never takes a whole pool out); a target on "hold" keeps
    its flag as it was. Lines saying what."""
    os.makedirs(folder, exist_ok=True)
    passing_roles = {r["role"] for r in results if r["gate"] and r["ok"]}
    lines = []
    for r in results:
        if not r["gate"] or r.get("hold"):
            continue
        path = os.path.join(folder, f"{r['name']}.failing")
        was = os.path.exists(path)
        if not r["ok"] and r["role"] in passing_roles:
            if not was:
                write_atomic(path, r["line"] + "\n")
                lines.append(f"{r['name']}: out of the router's rotation until its canary passes")
        else:
            if was:
                os.remove(path)
                lines.append(f"{r['name']}: back in the router's rotation")
            if not r["ok"]:
                lines.append(f"{r['name']}: left in rotation: no {r['role']} instance passes its canary")
    return lines


def load_targets(path: str) -> tuple[dict, list[dict], str | None]:
    """The targets file, checked whole (ValueError, KeyError, TypeError, OSError naming what)."""
    with open(path) as f:
        spec = json.load(f)
    targets = spec["targets"]
    if not isinstance(targets, list) or not targets:
        raise ValueError("no targets: a run that checks nothing passes nothing")
    for t in targets:
        if problem := target_name_problem(t["name"]):
            raise ValueError(problem)
        if not isinstance(t["role"], str) or not isinstance(t["url"], str):
            raise ValueError(f"target {t['name']}: role and url are strings")
        if type(t.get("requests", 1)) is not int or t.get("requests", 1) < 1:
            raise ValueError(f"target {t['name']}: requests is a whole number of at least 1")
    if len({t["name"] for t in targets}) != len(targets):
        raise ValueError("a target name is given twice")
    if not isinstance(spec["identity"], str) or not spec["identity"] or not isinstance(spec["model"], str):
        raise ValueError("identity and model are strings, identity not empty")
    key_name = spec.get("api_key_name", "VLLM_API_KEY")
    api_key = read_env_value(spec["api_key_file"], key_name) if spec.get("api_key_file") else None
    if spec.get("api_key_file") and not api_key:
        raise ValueError(f"{spec['api_key_file']} has no {key_name}")
    return spec, targets, api_key


def run(args: argparse.Namespace) -> int:
    host = socket.gethostname()
    accept = args.cmd == "accept"
    try:
        spec, targets, api_key = load_targets(args.targets)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"{host}: canary: {args.targets}: {e}", file=sys.stderr)
        return 2
    record = not args.check
    if record:
        os.makedirs(args.state, exist_ok=True)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(targets))) as pool:
        asked = list(pool.map(lambda t: ask(t, spec["model"], api_key, args.timeout), targets))
    results, notes = judge(asked, spec["identity"], args.state, record, accept)
    for note in notes:
        print(f"{host}: canary: {note}")
    for r in results:
        print(f"{host}: canary: {r['line']}", file=sys.stdout if r["ok"] else sys.stderr)
    out: set[str] = set()
    if args.flags and record:
        for line in flag(results, args.flags):
            print(f"{host}: canary: {line}")
        out = {r["name"] for r in results if os.path.exists(os.path.join(args.flags, f"{r['name']}.failing"))}
    if args.metrics and record:
        if os.path.dirname(args.metrics):
            os.makedirs(os.path.dirname(args.metrics), exist_ok=True)
        transition = os.path.exists(os.path.join(args.state, TRANSITION))
        write_atomic(args.metrics, metrics(results, time.time(), out, transition))
    return 0 if all(r["ok"] for r in results) else 1


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="canary.py", description=sys.modules[__package__].__doc__,  # pragma: no mutate
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("run", "accept"):
        r = sub.add_parser(name)
        r.add_argument("--targets", required=True)
        r.add_argument("--state", required=True)
        r.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
        if name == "run":
            r.add_argument("--metrics")
            r.add_argument("--flags")
            r.add_argument("--check", action="store_true")
        else:
            r.set_defaults(metrics=None, flags=None, check=False)
    return ap


def main(argv: list[str] | None = None) -> int:
    return run(parser().parse_args(argv))
