#!/usr/bin/env python3
"""Canaries: a deterministic request to each vLLM instance (and through the router) whose answer must be
the reference its instances agreed on (stdlib only; runs on a host).

    canary.py run --targets FILE --state DIR [--metrics FILE] [--flags DIR] [--timeout SECONDS] [--check]
    canary.py accept --targets FILE --state DIR [--timeout SECONDS]

FILE (JSON): {"identity": what the answers depend on (model revision, vLLM version), "model": the
served model name, "api_key_file": an EnvironmentFile with the API key (read here, never on a command
line; optional), "api_key_name": its variable (default VLLM_API_KEY), "targets": [{"name", "role",
"url", "requests", "per_rank", "gate"}]}. Each target gets ``requests`` canaries at once (one per DP
rank: vLLM spreads concurrent requests over its ranks, so a rank that hangs holds one of them past the
timeout): POST URL/v1/completions with the fixed prompt, temperature 0 and a few tokens; with
"per_rank": true, request i on DP rank i (vLLM's X-data-parallel-rank header).

The reference (DIR/reference.json) is one answer for every target: every instance serves the same model
at the same revision with the same vLLM, and the router's answer (prefill, then decode) is theirs too.
It is never an instance's own first answer: under a new identity (the first run, another revision or
vLLM) it is recorded only when the instances (the targets with "gate": true) agree on it, at least two
of them and more than half of all; until then nothing is judged against it and every target fails
naming the answers. Once it is recorded, a target fails when a canary errs, times out, or answers other
than it; an instance that disagreed with the others is named like any other that answers wrongly.
``accept`` records the answer every instance that answers gives, however few (one instance cannot be
held against another: the operator confirms it).

DIR/transition.json ({"to": IDENTITY, "since": SECONDS}), written by glm-infra before it restarts the
instances onto another identity and removed once that identity's reference is recorded: meanwhile an
instance that answers other than the old reference is reported but not taken out of rotation (the
instances still on the old identity and those already on the new may differ by design).

One line per target on stdout ("HOST: canary: NAME ok …") or stderr (what failed), the reference on
stdout ("HOST: canary: reference of IDENTITY …"), the Prometheus text format in --metrics (replaced
whole), and exit 1 when any target failed.

--flags DIR: for each target with "gate": true (an instance the router reaches through its gate), the
file DIR/NAME.failing while its canary fails, so the gate answers the router's health checks with 503
and the router takes it out of rotation until it passes again. A canary takes an instance out, never a
whole pool: when no instance of a role passes, none of that role is flagged (the failure is still
reported, and alerted on). An instance that refuses the connection or answers 503 (stopped, starting,
draining), one judged against no reference, and one that differs during a transition keep their flag
as it was.

--check: judge only (glm-infra doctor, the SLA gate): no reference recorded (without one for the
identity every target fails), no metrics, no flags.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import re
import socket
import sys
import time
import urllib.parse

# A count: its next tokens win by such margins that vLLM's greedy answer does not move with batching,
# parallelism or kernels (its kernels are not batch-invariant), only when the model is served wrongly.
PROMPT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"
MAX_TOKENS = 8
DEFAULT_TIMEOUT_S = 30.0
REFERENCE = "reference.json"
TRANSITION = "transition.json"


class CanaryError(Exception):
    """A canary that did not answer: its reason, one line; ``down`` when nothing took the connection (the
    router's own health checks see that: no flag needed)."""

    def __init__(self, reason: str, down: bool = False) -> None:
        super().__init__(reason)
        self.down = down


def read_env_value(path: str, name: str) -> str | None:
    """NAME's value in an EnvironmentFile of NAME=value lines (quotes as systemd takes them)."""
    with open(path) as f:
        for line in f:
            key, sep, value = line.strip().partition("=")
            if sep and key == name:
                return value.strip().strip('"').strip("'")
    return None


def complete(url: str, model: str, api_key: str | None, timeout: float, rank: int | None = None) -> str:
    """The text of one canary completion from ``url`` (an instance's or the router's base URL); ``rank``:
    on that DP rank (vLLM's X-data-parallel-rank header, entrypoints/generate/base/serving.py in 0.33.0)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CanaryError(f"not an http(s) URL: {url!r}")
    conn_type = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_type(parts.hostname, parts.port, timeout=timeout)
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    if rank is not None:
        headers["X-data-parallel-rank"] = str(rank)
    try:
        conn.request("POST", parts.path.rstrip("/") + "/v1/completions", body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
    except (socket.timeout, TimeoutError):
        raise CanaryError(f"no answer within {timeout:g} s") from None
    except (ConnectionRefusedError, ConnectionResetError) as e:
        raise CanaryError(f"{type(e).__name__}: {e}", down=True) from None
    except OSError as e:
        raise CanaryError(f"{type(e).__name__}: {e}") from None
    finally:
        conn.close()
    if response.status != 200:  # 503: not serving (starting, stopping, its engine gone), as /health says
        raise CanaryError(f"HTTP {response.status}: {data[:200].decode(errors='replace').strip()}",
                          down=response.status == 503)
    try:
        text = json.loads(data)["choices"][0]["text"]
    except (ValueError, KeyError, IndexError, TypeError):
        text = None
    if not isinstance(text, str):
        raise CanaryError(f"not a completion: {data[:200].decode(errors='replace').strip()}")
    if not text.strip():
        raise CanaryError("answered nothing")  # 8 greedy tokens of a fixed prompt are never empty
    return text


def target_name_problem(name: object) -> str | None:
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        return f"target name {name!r}: letters, digits, '.', '_' and '-' only"
    return None


def write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def ask(target: dict, model: str, api_key: str | None, timeout: float) -> dict:
    """{"name", "role", "gate", "seconds", and "text" (what every canary of the target answered alike) or
    "line" (why not) and "down"}: the target's canaries, all at once."""
    start = time.monotonic()
    n = int(target.get("requests", 1))
    with concurrent.futures.ThreadPoolExecutor(max_workers=n) as pool:
        # An instance: one canary on each DP rank, named by the header (other traffic cannot take a rank's
        # turn); the router: n canaries wherever it sends them.
        ranks: list[int | None] = list(range(n)) if target.get("per_rank") else [None] * n
        futures = [pool.submit(complete, target["url"], model, api_key, timeout, r) for r in ranks]
        answers: list[str | CanaryError] = []
        for f in futures:
            try:
                answers.append(f.result())
            except CanaryError as e:
                answers.append(e)
    name = target["name"]
    out = {"name": name, "role": target["role"], "gate": bool(target.get("gate")),
           "seconds": time.monotonic() - start}
    failed = [(r, a) for r, a in zip(ranks, answers) if isinstance(a, CanaryError)]
    if failed:
        rank, error = failed[0]
        where = "" if rank is None else f"DP rank {rank}: "
        out["line"] = f"{name}: {len(failed)} of {n} canaries failed: {where}{error}"
        out["down"] = any(e.down for _, e in failed)
        return out
    texts = sorted(set(answers))  # type: ignore[arg-type]
    if len(texts) > 1:
        out["line"] = f"{name}: its {n} canaries answered differently: {', '.join(repr(t) for t in texts)}"
        return out
    out["text"] = texts[0]
    return out


def read_state(state: str, name: str, *keys: str) -> dict | None:
    """DIR/NAME as a JSON object with string ``keys``: None when there is none; ValueError (naming it) when
    it cannot be read or is not such an object: never taken for "none"."""
    path = os.path.join(state, name)
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read ({e})") from None
    if not isinstance(doc, dict) or not all(isinstance(doc.get(k), str) for k in keys):
        raise ValueError(f"{path} cannot be read (not an object with {', '.join(keys)})")
    return doc


def answers_of(asked: list[dict]) -> str:
    """Who answered what, for a line: "' 11, 12' from prefill-0, prefill-1; ' x' from decode-0"."""
    by: dict[str, list[str]] = {}
    for a in asked:
        if "text" in a:
            by.setdefault(a["text"], []).append(a["name"])
    return "; ".join(f"{t!r} from {', '.join(names)}" for t, names in sorted(by.items(), key=lambda x: -len(x[1])))


def agreed(asked: list[dict], voters: int, accept: bool = False) -> tuple[str, list[str]] | None:
    """The answer the instances agree on and who gave it: given by at least two of them and by more than
    half of the ``voters`` (every instance, answering or not); with ``accept``, the one answer every
    instance that answers gives, however few. None otherwise."""
    by: dict[str, list[str]] = {}
    for a in asked:
        if a["gate"] and "text" in a:
            by.setdefault(a["text"], []).append(a["name"])
    if accept:
        return (next(iter(by)), sorted(next(iter(by.values())))) if len(by) == 1 else None
    for text, names in by.items():
        if len(names) >= 2 and 2 * len(names) > voters:
            return text, sorted(names)
    return None


def utc(seconds: object) -> str:
    """A time a state file gives (seconds since the epoch), or "an unknown time"."""
    if type(seconds) not in (int, float):
        return "an unknown time"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))  # type: ignore[arg-type]


def reference_line(reference: dict) -> str:
    when = utc(reference.get("recorded"))
    how = "accepted by the operator from" if reference.get("accepted") else "agreed by"
    names = reference.get("agreed") if isinstance(reference.get("agreed"), list) else []
    return (f"reference of {reference['identity']!r}: {reference['text']!r}, {how} {', '.join(map(str, names))} "
            f"({len(names)} of {reference.get('of', '?')} instances) on {when}")


def judge(asked: list[dict], identity: str, state: str, record: bool, accept: bool = False) -> tuple[list[dict], list[str]]:
    """Each target's result ({"name", "role", "ok", "seconds", "line", and "hold": its flag stays as it was})
    and lines about the reference (recorded, or why there is none)."""
    notes: list[str] = []
    results = [dict(a, ok=False) for a in asked]
    for r in results:
        r["hold"] = bool(r.get("down"))
    try:
        reference = read_state(state, REFERENCE, "identity", "text")
    except ValueError as e:  # a damaged reference is not replaced by whatever answers now
        for r in results:
            r.setdefault("line", f"{r['name']}: its reference {e}: remove it to record again")
            r["hold"] = True
        return results, []
    try:
        transition = read_state(state, TRANSITION, "to")
    except ValueError as e:
        transition = None  # (taken out of rotation as without one: the safer way)
        notes.append(f"the transition marker {e}: ignored")
    voters = sum(1 for a in asked if a["gate"])
    if reference is None or reference["identity"] != identity:
        vote = agreed(asked, voters, accept) if record else None
        if vote is None:
            why = (f"no reference of {identity!r} agreed yet" if reference is None else
                   f"its reference is of {reference['identity']!r}, not {identity!r}")
            if record:
                one = "; one cannot be held against another: canary.py accept takes its answer" if voters < 2 else ""
                why += (f": {answers_of(asked)} (at least 2 and more than half of the {voters} "
                        f"instances must agree{one})")
            for r in results:
                r.setdefault("line", f"{r['name']}: {why}")
                r["hold"] = True
            return results, notes
        text, names = vote
        reference = {"identity": identity, "text": text, "agreed": names, "of": voters, "recorded": int(time.time()),
                     **({"accepted": True} if accept else {})}
        write_atomic(os.path.join(state, REFERENCE), json.dumps(reference) + "\n")
        notes.append(f"{reference_line(reference)}: recorded")
        if transition is not None and transition["to"] == identity:
            os.remove(os.path.join(state, TRANSITION))
            transition = None
    else:
        notes.append(reference_line(reference))
    if transition is not None:
        notes.append(f"a change to {transition['to']!r} is rolling out (since {utc(transition.get('since'))}): an "
                     "instance that answers otherwise is not taken out of rotation until every one has rolled")
    for r in results:
        if "line" in r:
            continue
        if r["text"] != reference["text"]:
            r["line"] = f"{r['name']}: answered {r['text']!r} where the reference is {reference['text']!r}"
            r["hold"] = r["pending"] = transition is not None
        else:
            r.update(ok=True, line=f"{r['name']} ok ({r['seconds']:.2f} s)")
    return results, notes


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
    ap = argparse.ArgumentParser(prog="canary.py", description=__doc__,  # pragma: no mutate
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


if __name__ == "__main__":
    sys.exit(main())
