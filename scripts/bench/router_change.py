"""A router change under load on the simulated cluster (issue 40, "Measure"): what a change of the router's
flags (or, the same restart, of its worker list) costs the clients of today's single router.

    venv/bin/python scripts/bench/router_change.py [--rate 4] [--runs 1]

The sim stack (P/D: prefill on sim-1 and sim-2, decode and the router on sim-3) is deployed from a copy of
the project with its own state; then, while a client sends --rate chat completions a second through the
router's public port (TLS, API key), `router.healthCheckInterval` moves between 2 and 3 and `pulumi up`
applies it: the router's unit changes and the router restarts. Printed per run: requests sent during the
up, how many failed and how (status or error), the longest a request took, and the longest gap between two
answered requests (what a client sees as a stall). The hosts are booted fresh and always brought down.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import _repo  # noqa: F401  (the repository on sys.path)
import yaml

from testbed.bench.common import ROOT, Project, sim

ROUTER = "https://10.88.0.13:8000"


@dataclass
class Client:
    """Requests at a steady rate in a thread: (start, end, outcome) of each."""

    url: str
    key: str
    context: ssl.SSLContext
    rate: float
    results: list[tuple[float, float, str]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def one(self, n: int) -> None:
        body = json.dumps({"model": "glm-5.2", "messages": [{"role": "user", "content": f"request {n}"}]}).encode()
        req = urllib.request.Request(f"{self.url}/v1/chat/completions", data=body, headers={
            "content-type": "application/json", "authorization": f"Bearer {self.key}"})
        start = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=120, context=self.context) as r:
                json.load(r)
                outcome = "ok"
        except urllib.error.HTTPError as e:
            outcome = f"HTTP {e.code}"
        except (urllib.error.URLError, OSError, ValueError) as e:
            outcome = type(getattr(e, "reason", e)).__name__
        self.results.append((start, time.monotonic(), outcome))

    def run(self) -> None:
        n = 0
        threads = []
        while not self._stop.is_set():
            n += 1
            t = threading.Thread(target=self.one, args=(n,), daemon=True)  # at a rate, not one after another
            t.start()
            threads.append(t)
            self._stop.wait(1 / self.rate)
        for t in threads:
            t.join(timeout=150)

    def __enter__(self) -> Client:
        self._thread = threading.Thread(target=self.run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=200)


def summary(results: list[tuple[float, float, str]]) -> dict:
    answered = sorted(end for _, end, outcome in results if outcome == "ok")
    failed: dict[str, int] = {}
    for _, _, outcome in results:
        if outcome != "ok":
            failed[outcome] = failed.get(outcome, 0) + 1
    return {
        "sent": len(results),
        "failed": sum(failed.values()),
        "failures": failed,
        "longest_request_s": round(max((end - start for start, end, _ in results), default=0), 2),
        "longest_gap_between_answers_s": round(max((b - a for a, b in zip(answered, answered[1:])), default=0), 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=4.0, help="requests a second (default 4)")
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    project = Project()
    config = yaml.safe_load((ROOT / "stacks/Pulumi.sim.yaml").read_text())["config"]
    # The benchmark runs pulumi with a HOME of its own: the sim key by its absolute path.
    config["glm-infra:ssh"]["privateKeyPath"] = os.path.expanduser(config["glm-infra:ssh"]["privateKeyPath"])
    stack_file = project.write_stack("sim", config)
    try:
        sim("up", stack_file)
        project.init("sim")
        took, _ = project.pulumi("up -s sim --yes --skip-preview --non-interactive")
        print(f"first up: {took:.0f} s", file=sys.stderr)
        outputs = json.loads(project.pulumi("stack output -s sim --json --show-secrets")[1].stdout)
        context = ssl.create_default_context(cadata=outputs["routerCaCertificate"])
        for run in range(args.runs):
            interval = 3 if run % 2 == 0 else 2
            project.pulumi(f"config set -s sim --path glm-infra:router.healthCheckInterval {interval}")
            with Client(ROUTER, outputs["routerApiKey"], context, args.rate) as client:
                time.sleep(10)  # steady before the change
                took, up = project.pulumi("up -s sim --yes --skip-preview --non-interactive")
                time.sleep(10)
            restarted = "glm-router-service" in up.stdout
            print(json.dumps({"run": run + 1, "change": f"router.healthCheckInterval -> {interval}",
                              "router_restarted": restarted, "up_s": round(took, 1), **summary(client.results)}))
    finally:
        sim("down", stack_file)
        project.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
