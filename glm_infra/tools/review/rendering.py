"""One stack's rendering as the review reads it: the review tree of ``glm-infra render`` (its files and
each step's commands, parsed back) and who runs where; and what restarts when a step re-runs
(``restarted_units``), read off the steps themselves."""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

STEPS_DIR = "_steps"  # hostplan.STEPS_DIR, read back from trees of any revision
STACK_FILE = re.compile(r"Pulumi\.(.+)\.ya?ml")
MAX_DIFF_LINES = 200  # per file in the summaries (the JSON keeps every line)


class ReviewError(Exception):
    """A review that could not run (a bad revision, a revision that cannot render)."""


class InvalidStack(Exception):
    """A stack file of the working tree that does not validate: ``str()`` is validate's message."""


# --- one rendering -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Instance:
    name: str
    pool: str
    host: str
    unit: str


@dataclass(frozen=True)
class Rendering:
    """One stack as one revision renders it: the review tree (``<host>/<path>`` → (content, mode))
    and who runs where."""

    files: Mapping[str, tuple[str, int]]
    hosts: Mapping[str, str]  # name → address
    instances: Mapping[str, Instance]
    router: tuple[str, str] | None = None  # (host, unit)

    def hosts_named(self, resource: str) -> list[str]:
        """The hosts a resource's name names (glm-b300-1-firewall-nftables: b300-1), as ``-HOST-`` inside it."""
        return [h for h in self.hosts if f"-{h}-" in f"-{resource}-"]

    def host_files(self, host: str) -> dict[str, tuple[str, int]]:
        prefix = f"{host}/"
        return {k[len(host):]: v for k, v in self.files.items()
                if k.startswith(prefix) and not k.startswith(f"{prefix}{STEPS_DIR}/")}

    def steps(self, host: str) -> dict[str, "StepText"]:
        prefix = f"{host}/{STEPS_DIR}/"
        out = {}
        for k, (content, _) in sorted(self.files.items()):
            if k.startswith(prefix) and k.endswith(".sh"):
                s = parse_step(content, k[len(prefix):], self, host)
                out[s.name] = s
        return out

    def owner(self, host: str, step: str) -> tuple[str | None, str | None]:
        """(instance, pool) a step of ``host`` belongs to: ``<instance>-…`` or ``router-…``."""
        for inst in self.instances.values():
            if inst.host == host and step.startswith(f"{inst.name}-"):
                return inst.name, inst.pool
        if self.router and self.router[0] == host and step.startswith("router-"):
            return "router", "router"
        return None, None


@dataclass(frozen=True)
class StepText:
    """A step as the review tree writes it (hostplan.step_text), read back."""

    name: str
    triggers: tuple[str, ...]
    stdin_path: str | None  # the host file it writes/reads, or None (or a _steps/*.stdin of its own)
    stdin: str | None
    create: str
    update: str | None
    delete: str | None
    check: str | None
    local: bool

    def inputs(self) -> dict[str, object]:
        """What the engine compares: a change of any re-runs the step (check, timeout, retention, its
        position and its delete command do not: a deployed step keeps the delete it was created with,
        see components/remote_step.run_step)."""
        return {"command": self.create, "update command": self.update,
                "stdin": self.stdin, "triggers": self.triggers, "where it runs": self.local}

    @property
    def on_update(self) -> str:
        return self.update if self.update is not None else self.create


_HEADER = re.compile(r"# (?P<host>\S+) step (?P<index>\d+): (?P<name>\S+) \(runs on (?P<where>.*)\)$")
_SECTIONS = {"# create:": "create", "# update:": "update", "# delete:": "delete", "# check:": "check"}


def parse_step(text: str, filename: str, rendering: Rendering, host: str) -> StepText:
    lines = text.rstrip("\n").split("\n")
    m = _HEADER.fullmatch(lines[0]) if lines else None
    if m is None:
        raise ReviewError(f"{host}/{STEPS_DIR}/{filename}: not a step of the review tree (first line {lines[:1]})")
    triggers: tuple[str, ...] = ()
    stdin_path = None
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in lines[1:]:
        if line in _SECTIONS:
            current = sections.setdefault(_SECTIONS[line], [])
        elif current is not None:
            current.append(line)
        elif line.startswith("# re-runs when any of these change: "):
            triggers = tuple(line.split(": ", 1)[1].split(", "))
        elif line.startswith("# stdin: "):
            stdin_path = line.split(": ", 1)[1]
    stdin = None
    if stdin_path is not None:
        key = f"{host}{stdin_path}" if stdin_path.startswith("/") else f"{host}/{STEPS_DIR}/{stdin_path}"
        stdin = rendering.files.get(key, (None, 0))[0]
        if not stdin_path.startswith("/"):
            stdin_path = None  # a .stdin beside the step: no file on the host
    joined = {k: "\n".join(v) for k, v in sections.items()}
    return StepText(m["name"], triggers, stdin_path, stdin, joined.get("create", ""), joined.get("update"),
                    joined.get("delete"), joined.get("check"), m["where"] != host)


# --- what restarts -------------------------------------------------------------------------------

# A host script run with an action that (re)starts what it manages: ``apply`` always does; ``rollout
# ARG`` does unless the unit already runs with ARG (the digest of the step's triggers).
# ``drain ARG`` (roll.sh) stops the host's instances (``units=(…)``), which its return starts again,
# unless the host already did the roll ARG.
_RUNS = re.compile(r"(/[\w./-]+) (apply|rollout|drain)\b(?: (\S+))?")
_TOKEN = re.compile(r"@[\w-]+@")  # a placeholder the components fill in (the triggers' digest)


def _assignment(script: str, var: str) -> str | None:
    m = re.search(rf"^{var}=(.*)$", script, re.M)
    return m[1] if m else None


def expand(command: str, triggers: Sequence[str]) -> str:
    """``command`` with each placeholder standing for what it is filled with: the step's triggers."""
    return _TOKEN.sub(lambda _: "triggers[" + ",".join(triggers) + "]", command)


def restarted_units(command: str, old_command: str | None, script: Callable[[str], str | None],
                    old_script: Callable[[str], str | None] | None = None) -> list[str]:
    """The units a step restarts when it runs ``command`` on update where it ran ``old_command``.

    Each ``SCRIPT apply`` or ``SCRIPT rollout ARG`` in ``command``, where SCRIPT (``script(path)``:
    its content) is a service script (``unit=NAME``) restarts NAME: ``apply`` always, ``rollout
    ARG`` unless ``old_command`` ran the same ``rollout ARG`` (the unit then runs with it); ``drain ARG``
    of a roll script (``units=(A B)``) restarts A and B unless ``old_command`` drained for the same ARG. A
    packaged service's script (``services=(A B)`` with a ``config_digest``) restarts them on
    ``apply`` when the digest differs from ``old_script(path)``'s, or when that is not known."""
    before = set(_RUNS.findall(old_command or ""))
    units: list[str] = []
    for path, action, arg in _RUNS.findall(command):
        new = script(path) or ""
        drained = _assignment(new, "units")
        if action == "drain" and drained is not None and drained.startswith("("):
            if (path, action, arg) not in before:
                units += shlex.split(drained.strip("()"))
            continue
        unit = _assignment(new, "unit")
        if unit is not None:
            if action == "apply" or (path, action, arg) not in before:
                units += shlex.split(unit)
            continue
        services, config = _assignment(new, "services"), _assignment(new, "config_digest")
        if action != "apply" or services is None or config is None or not (services.startswith("(") and services.endswith(")")):
            continue
        old = old_script(path) if old_script is not None else None
        if old is None or _assignment(old, "config_digest") != config:
            units += [u if "." in u else f"{u}.service" for u in shlex.split(services[1:-1])]
    return units
