"""``pulumi preview --json`` read: its steps, its own ``changeSummary``, and which updates are service
restarts (by the same script test as the review, on the resource's new command)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .rendering import Rendering, restarted_units

# --- pulumi preview --json -----------------------------------------------------------------------

OPS = ("create", "update", "replace", "delete")
TITLE = "## glm-infra: what this change deploys"


@dataclass
class PreviewSummary:
    stack: str
    counts: dict[str, int]  # create/update/replace/delete (replace: every create-replacement, delete-replaced… pair once)
    change_summary: dict[str, int]  # the preview's own
    resources: dict[str, list[str]]  # op → resource names (the URN's last part)
    restarts: list[str] = field(default_factory=list)  # "name: unit"
    errors: list[str] = field(default_factory=list)


def _op(op: str) -> str | None:
    if op in ("create", "update", "delete"):
        return op
    if op in ("replace", "create-replacement", "delete-replaced", "discard-replaced"):
        return "replace"
    return None  # same, read, refresh, import…


def _preview_restarts(step: Mapping, rendering: Rendering) -> list[str]:
    """The units a previewed update restarts (``restarted_units``): its new and old commands, the
    scripts it runs as the working tree renders them, the old script from the old state's stdin when
    the old command installed it from there."""
    new = (step.get("newState") or {}).get("inputs") or {}
    old = (step.get("oldState") or {}).get("inputs") or {}
    # An update runs the new update command (create when it has none); a replacement runs create.
    command = new.get("create") if step.get("op") != "update" else new.get("update") or new.get("create")
    old_command = old.get("update") or old.get("create")
    if not isinstance(command, str):
        return []
    # The connection is a secret ("[secret]" in the JSON): the host is the one the resource's name
    # names (glm-b300-1-firewall-nftables), else any host that has the script.
    hosts = rendering.hosts_named(str(step.get("urn", "")).rsplit("::", 1)[-1]) or list(rendering.hosts)

    def script(path: str) -> str | None:
        found = [c for h in hosts if (c := rendering.files.get(f"{h}{path}", (None, 0))[0]) is not None]
        return found[0] if len(found) == 1 else None

    def old_script(path: str) -> str | None:
        installed = f"/dev/stdin {path}" in str(old.get("create") or "")
        stdin = old.get("stdin")
        return stdin if installed and isinstance(stdin, str) else None

    return restarted_units(command, old_command if isinstance(old_command, str) else None, script, old_script)


def summarize_preview(stack: str, data: Mapping, rendering: Rendering | None = None) -> PreviewSummary:
    """The resources ``pulumi preview --json`` would create, update, replace and delete, and which
    updates restart a service (their new command runs a service script of ``rendering``)."""
    resources: dict[str, list[str]] = {k: [] for k in OPS}
    restarts: list[str] = []
    for s in data.get("steps") or []:
        op = _op(s.get("op", ""))
        name = s.get("urn", "").rsplit("::", 1)[-1]
        if op is None:
            continue
        if op == "replace" and name in resources["replace"]:
            continue  # the create-replacement and delete-replaced of one resource
        resources[op].append(name)
        if op in ("update", "replace") and rendering is not None:
            restarts += [f"{name}: {u}" for u in _preview_restarts(s, rendering)]
    errors = [d.get("message", "").strip() for d in data.get("diagnostics") or [] if d.get("severity") == "error"]
    return PreviewSummary(stack, {k: len(v) for k, v in resources.items()},
                          {k: v for k, v in (data.get("changeSummary") or {}).items()}, resources, restarts, errors)
