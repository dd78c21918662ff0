"""A stack's gate after its up: ``glm-infra doctor STACK`` (every step on every host as the stack says) and then
``glm-infra sla STACK`` (AIPerf through the router, its canaries, Prometheus beside it), each in the project,
with the stack's own router URL, CA certificate and API key taken from its outputs: the key reaches the
gate through its environment, the certificate through a file only the caller reads."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

API_KEY_ENV = "GLM_INFRA_API_KEY"
GATE_TIMEOUT_S = 3600


@dataclass(frozen=True)
class Verdict:
    passed: bool
    reason: str  # the line that says why (the gate's verdict, or its last words)


def _last_words(p: subprocess.CompletedProcess, lines: int = 8) -> str:
    kept = [ln for ln in (p.stderr + "\n" + p.stdout).splitlines() if ln.strip()]
    return "\n".join(kept[-lines:]) or f"exit {p.returncode}"


def _verdict_line(stdout: str, prefix: str) -> str | None:
    return next((ln.strip() for ln in stdout.splitlines() if ln.strip().startswith(prefix)), None)


def run_gate(project: Path, stack: str, outputs: dict[str, Any], out: Path, log: Path,
             doctor_args: Sequence[str], sla_args: Sequence[str]) -> Verdict:
    """Doctor, then the SLA gate when doctor passes; their output appended to ``log``, the SLA report in ``out``."""
    cli = [sys.executable, "-m", "glm_infra.tools.cli"]
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    key = outputs.get("routerApiKey")
    if key:
        env[API_KEY_ENV] = str(key)
    with open(log, "a") as f, tempfile.TemporaryDirectory(prefix="glm-infra-fleet-") as tmp:
        def run(cmd: list[str]) -> subprocess.CompletedProcess:
            f.write(f"$ glm-infra {' '.join(cmd[len(cli):])}\n")
            f.flush()
            p = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=GATE_TIMEOUT_S)
            f.write(p.stdout + p.stderr + f"(exit {p.returncode})\n")
            return p

        try:
            d = run([*cli, "doctor", stack, *doctor_args])
            if d.returncode != 0:
                return Verdict(False, f"doctor found drift (exit {d.returncode}):\n{_last_words(d)}")
            sla = [*cli, "sla", stack, "--out", str(out), "--api-key-env", API_KEY_ENV]
            ca = outputs.get("routerCaCertificate")
            if ca:
                ca_file = Path(tmp) / "router-ca.pem"  # the folder is the caller's alone (0700)
                ca_file.write_text(str(ca))
                sla += ["--cacert", str(ca_file)]
            s = run([*sla, *sla_args])
        except subprocess.TimeoutExpired as e:
            return Verdict(False, f"{' '.join(map(str, e.cmd[len(cli):len(cli) + 2]))} ran over {GATE_TIMEOUT_S} s")
        if s.returncode != 0:
            fails = [ln.strip() for ln in s.stdout.splitlines() if ln.strip().startswith("FAIL")]
            why = "; ".join(fails) if fails else f"(exit {s.returncode}):\n{_last_words(s)}"
            return Verdict(False, f"the SLA gate failed: {why}")
        return Verdict(True, _verdict_line(s.stdout, "PASS") or "doctor and the SLA gate passed")
