"""A canary request: the fixed prompt, one completion from an instance or the router, a target's canaries at once."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import re
import socket
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


def target_name_problem(name: object) -> str | None:
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        return f"target name {name!r}: letters, digits, '.', '_' and '-' only"
    return None


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
