"""The canaries, once, on the router's host over SSH (its canary script's ``judge``: every instance and
the router answer the reference recorded when they first turned healthy; records nothing). The SLA
gate runs it before and after its buckets; ``glm-infra doctor`` runs the same as part of the
router-canary step's check."""

from __future__ import annotations

import re
import subprocess
import tempfile
from typing import Any

from glm_infra.plan import topology
from glm_infra.roles import router
from glm_infra.spec import paths
from glm_infra.spec.config import StackConfig

from .doctor import known_hosts, ssh_argv


class CanaryUnreachable(Exception):
    """The router's host could not be reached over SSH."""


def canary_check(stack: StackConfig, identity: str | None, options: list[str]) -> dict[str, Any]:
    """{"pass": every canary answered its reference, "lines": what the check said about each target
    (every instance and the router)}. A check that says nothing about any target passes nothing, whatever
    its exit status: the view then says so."""
    assert stack.router is not None
    script = paths.script(router.CANARY_SCRIPT)
    with tempfile.TemporaryDirectory(prefix="glm-canaries-") as folder:
        proc = subprocess.run(ssh_argv(stack, stack.router.host, identity, options, known_hosts(stack, folder)),
                              input=f"{script} judge\n", capture_output=True, text=True, timeout=600)
    lines = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if ": canary: " in ln]
    if proc.returncode == 255 and not lines:
        raise CanaryUnreachable(f"cannot reach {stack.router.host} over SSH for the canaries: "
                                f"{(proc.stderr.strip().splitlines() or ['ssh failed'])[-1]}")
    if not lines:
        said = proc.stderr.strip()[-500:]
        return {"pass": False, "lines": [f"the check on {stack.router.host} exited {proc.returncode} and named no "
                                         "instance or router: nothing was checked" + (f" ({said})" if said else "")]}
    # Every target the plan gives (each instance and the router) must be named ok: one the check is silent
    # about was not checked, whatever its exit status.
    expected = {i.name for i in topology.plan(stack).instances} | {router.CANARY_ROUTER_TARGET}
    ok = {m[1] for ln in lines if (m := re.search(r": canary: ([A-Za-z0-9_.-]+) ok( |$)", ln))}
    unchecked = sorted(expected - ok - {m[1] for ln in lines if (m := re.search(r": canary: ([A-Za-z0-9_.-]+): ", ln))})
    if unchecked:
        lines.append(f"the check on {stack.router.host} said nothing of {', '.join(unchecked)}: not checked")
    return {"pass": proc.returncode == 0 and expected <= ok, "lines": lines}


def canary_failures(view: dict[str, Any], when: str) -> list[str]:
    """The gate's failure lines for one check ("before" or "after" the buckets)."""
    return [] if view["pass"] else [f"canary ({when}): " + "; ".join(view["lines"])]
