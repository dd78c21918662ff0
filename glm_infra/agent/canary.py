#!/usr/bin/env python3
"""Canaries: a deterministic request to each vLLM instance (and through the router) whose answer must
be the one recorded when the instance first answered (stdlib only; runs on a host).

    canary.py run --targets FILE --state DIR [--metrics FILE] [--flags DIR] [--timeout SECONDS] [--check]

FILE (JSON): {"identity": what the answers depend on (model revision, vLLM version), "model": the
served model name, "api_key_file": an EnvironmentFile with the API key (read here, never on a command
line; optional), "api_key_name": its variable (default VLLM_API_KEY), "targets": [{"name", "role",
"url", "requests", "per_rank", "gate"}]}. Each target gets ``requests``
canaries at once (one per DP rank: vLLM spreads concurrent requests over its ranks, so a rank that hangs
holds one of them past the timeout): POST URL/v1/completions with the fixed prompt, temperature 0 and a
few tokens; with "per_rank": true, request i on DP rank i (vLLM's X-data-parallel-rank header).

The first answer of a target under an identity is recorded in DIR/<name>.json and is its reference
from then on; a new identity (another model revision or vLLM) records it again. A target fails when a
canary errs, times out, or answers other than its reference. One line per target on stdout
("HOST: canary: NAME ok …") or stderr (what failed), the Prometheus text format in --metrics
(replaced whole), and exit 1 when any target failed.

--flags DIR: for each target with "gate": true (an instance the router reaches through its gate), the
file DIR/NAME.failing while its canary fails, so the gate answers the router's health checks with 503
and the router takes it out of rotation until it passes again. A canary takes an instance out, never a
whole pool: when no instance of a role passes, none of that role is flagged (the failure is still
reported, and alerted on). An instance that refuses the connection or answers 503 (stopped, starting,
draining) is the router's own health checks' to see: its flag stays as it was.

--check: judge only (glm-infra doctor, the SLA gate): no reference recorded (a target without one
fails), no metrics, no flags.
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


def reference_path(state: str, name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        raise ValueError(f"target name {name!r}: letters, digits, '.', '_' and '-' only")
    return os.path.join(state, f"{name}.json")


def write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def check_target(target: dict, identity: str, model: str, api_key: str | None, state: str,
                 timeout: float, record: bool = True) -> dict:
    """{"name", "role", "ok", "seconds", "line"}: the target's canaries against its reference."""
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
    seconds = time.monotonic() - start
    name = target["name"]
    out = {"name": name, "role": target["role"], "ok": False, "seconds": seconds}
    failed = [(r, a) for r, a in zip(ranks, answers) if isinstance(a, CanaryError)]
    if failed:
        rank, error = failed[0]
        where = "" if rank is None else f"DP rank {rank}: "
        out["line"] = f"{name}: {len(failed)} of {n} canaries failed: {where}{error}"
        out["down"] = any(e.down for _, e in failed)
        return out
    texts = sorted(set(answers))  # type: ignore[arg-type]
    path = reference_path(state, name)
    try:
        with open(path) as f:
            reference = json.load(f)
        if not isinstance(reference, dict) or not isinstance(reference.get("text"), str):
            raise ValueError("no recorded text")
    except FileNotFoundError:
        reference = None
    except (OSError, ValueError) as e:  # a damaged reference is not replaced by whatever answers now
        out["line"] = f"{name}: its reference {path} cannot be read ({e}): remove it to record again"
        return out
    if len(texts) > 1:
        out["line"] = f"{name}: its {n} canaries answered differently: {', '.join(repr(t) for t in texts)}"
        return out
    if not record and reference is None:
        out["line"] = f"{name}: no reference recorded yet (the canary timer records it on its first run)"
        return out
    if not record and reference.get("identity") != identity:
        out["line"] = (f"{name}: its reference is of {reference.get('identity')!r}, not {identity!r} (the canary "
                       "timer records it again on its next run)")
        return out
    if reference is None or reference.get("identity") != identity:
        write_atomic(path, json.dumps({"identity": identity, "text": texts[0], "recorded": int(time.time())}) + "\n")
        out.update(ok=True, line=f"{name} ok: reference recorded ({texts[0]!r}, {seconds:.2f} s)")
        return out
    if texts[0] != reference.get("text"):
        out["line"] = f"{name}: answered {texts[0]!r} where its reference is {reference.get('text')!r}"
        return out
    out.update(ok=True, line=f"{name} ok ({seconds:.2f} s)")
    return out


def metrics(results: list[dict], now: float, out_of_rotation: set[str] | frozenset[str] = frozenset()) -> str:
    """The results in Prometheus' text format (node exporter's textfile collector reads it)."""
    lines = ["# HELP glm_canary_ok 1 when every canary of the target answered its reference in time.",
             "# TYPE glm_canary_ok gauge"]
    lines += [f'glm_canary_ok{{target="{r["name"]}",role="{r["role"]}"}} {int(r["ok"])}' for r in results]
    lines += ["# HELP glm_canary_seconds How long the target's canaries took, all of them.",
              "# TYPE glm_canary_seconds gauge"]
    lines += [f'glm_canary_seconds{{target="{r["name"]}",role="{r["role"]}"}} {r["seconds"]:.3f}' for r in results]
    lines += ["# HELP glm_canary_out_of_rotation 1 while the target's gate keeps it out of the router's rotation.",
              "# TYPE glm_canary_out_of_rotation gauge"]
    lines += [f'glm_canary_out_of_rotation{{target="{r["name"]}",role="{r["role"]}"}} '
              f'{int(r["name"] in out_of_rotation)}' for r in results]
    lines += ["# HELP glm_canary_last_run_timestamp_seconds When the canaries last ran.",
              "# TYPE glm_canary_last_run_timestamp_seconds gauge", f"glm_canary_last_run_timestamp_seconds {now:.0f}"]
    return "\n".join(lines) + "\n"


def flag(results: list[dict], gated: set[str], folder: str) -> list[str]:
    """Raise FOLDER/NAME.failing for each gated target that failed, drop it for each that passed, unless
    no gated target of its role passed (a canary never takes a whole pool out). Lines saying what."""
    os.makedirs(folder, exist_ok=True)
    passing_roles = {r["role"] for r in results if r["name"] in gated and r["ok"]}
    lines = []
    for r in results:
        if r["name"] not in gated:
            continue
        path = os.path.join(folder, f"{r['name']}.failing")
        was = os.path.exists(path)
        if r.get("down"):
            continue  # the router sees a stopped instance itself; a flag it had stays until it passes
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


def run(args: argparse.Namespace) -> int:
    host = socket.gethostname()
    try:
        with open(args.targets) as f:
            spec = json.load(f)
        targets = spec["targets"]
        if not isinstance(targets, list) or not targets:
            raise ValueError("no targets: a run that checks nothing passes nothing")
        for t in targets:
            reference_path(args.state, t["name"])
            if not isinstance(t["role"], str) or not isinstance(t["url"], str):
                raise ValueError(f"target {t['name']}: role and url are strings")
            if not isinstance(t.get("requests", 1), int) or t.get("requests", 1) < 1:
                raise ValueError(f"target {t['name']}: requests is a whole number of at least 1")
        if not isinstance(spec["identity"], str) or not isinstance(spec["model"], str):
            raise ValueError("identity and model are strings")
        key_name = spec.get("api_key_name", "VLLM_API_KEY")
        api_key = read_env_value(spec["api_key_file"], key_name) if spec.get("api_key_file") else None
        if spec.get("api_key_file") and not api_key:
            raise ValueError(f"{spec['api_key_file']} has no {key_name}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"{host}: canary: {args.targets}: {e}", file=sys.stderr)
        return 2
    if not args.check:
        os.makedirs(args.state, exist_ok=True)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(targets))) as pool:
        results = list(pool.map(lambda t: check_target(t, spec["identity"], spec["model"], api_key, args.state,
                                                       args.timeout, record=not args.check), targets))
    for r in results:
        print(f"{host}: canary: {r['line']}", file=sys.stdout if r["ok"] else sys.stderr)
    out: set[str] = set()
    if args.flags and not args.check:
        for line in flag(results, {t["name"] for t in targets if t.get("gate")}, args.flags):
            print(f"{host}: canary: {line}")
        out = {r["name"] for r in results if os.path.exists(os.path.join(args.flags, f"{r['name']}.failing"))}
    if args.metrics and not args.check:
        os.makedirs(os.path.dirname(args.metrics) or ".", exist_ok=True)
        write_atomic(args.metrics, metrics(results, time.time(), out))
    return 0 if all(r["ok"] for r in results) else 1


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="canary.py", description=__doc__,  # pragma: no mutate
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--targets", required=True)
    r.add_argument("--state", required=True)
    r.add_argument("--metrics")
    r.add_argument("--flags")
    r.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    r.add_argument("--check", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    return run(parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
