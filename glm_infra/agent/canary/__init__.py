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

import http.client  # noqa: F401  (canary.http: what the tests reach the requests through)

from .cli import flag, load_targets, main, metrics, parser, run
from .judge import REFERENCE, TRANSITION, agreed, answers_of, judge, read_state, reference_line, utc, write_atomic
from .requests import (
    DEFAULT_TIMEOUT_S,
    MAX_TOKENS,
    PROMPT,
    CanaryError,
    ask,
    complete,
    read_env_value,
    target_name_problem,
)

__all__ = ["DEFAULT_TIMEOUT_S", "MAX_TOKENS", "PROMPT", "REFERENCE", "TRANSITION", "CanaryError", "agreed", "answers_of",
           "ask", "complete", "flag", "judge", "load_targets", "main", "metrics", "parser", "read_env_value",
           "read_state", "reference_line", "run", "target_name_problem", "utc", "write_atomic"]
