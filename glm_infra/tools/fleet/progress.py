"""What a fleet rollout has done so far, kept beside the fleet file so an interrupted or stopped rollout
resumes: per stack, the target it was rolled to, the stack's update that did it, and its gate's verdict.

A record only lets a resume skip a stack when all of it still holds: the same target (the program and the
stack's file, hashed now), a gate that passed, and the stack's latest update in its own backend being the
very update recorded and a successful one. Anything else (no record, another target, an update since,
a record that does not parse) rolls the stack again: ``up`` of a stack already at its target changes nothing,
and its gate runs again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from .spec import Fleet

PROGRESS_FILE = "progress.json"
# What a target is made of, beside the stack's own file: the project's program and pins.
PROJECT_FILES = ("Pulumi.yaml", "__main__.py", "requirements.txt", "constraints.txt")
PACKAGE_SUFFIXES = (".py", ".j2", ".json", ".txt", ".sh")
PHASES = ("rolling", "gating", "passed", "failed")


class ProgressError(Exception):
    pass


@dataclass(frozen=True)
class StackRecord:
    target: str  # sha256 of what the stack was rolled to (target_digest)
    phase: str  # one of PHASES
    update: str | None  # the stack's update that rolled it (engine.update_id), None before one
    reason: str  # why it failed, or what passed
    at: float  # seconds since the epoch


def folder(fleet: Fleet) -> Path:
    """Where the fleet's progress, logs and SLA reports live: ``.glm-infra-fleet/<name>/`` beside the file."""
    return fleet.source.resolve().parent / ".glm-infra-fleet" / fleet.name


def _package_dir() -> Path:
    import glm_infra

    return Path(glm_infra.__file__).resolve().parent


def target_digest(project: Path, stack: str, package: Path | None = None) -> str:
    """sha256 of what ``stack`` rolls to: the project's Pulumi.yaml, program and pins, the stack's file, and
    glm_infra's code as this interpreter imports it (the project's venv: the program runs the same)."""
    h = hashlib.sha256()

    def add(label: str, data: bytes) -> None:
        h.update(f"{label}\0{len(data)}\0".encode())
        h.update(data)

    for label, name in [*((n, n) for n in PROJECT_FILES), ("the stack's file", f"stacks/Pulumi.{stack}.yaml")]:
        f = project / name
        add(label, f.read_bytes() if f.is_file() else b"(absent)")
    pkg = package or _package_dir()
    for f in sorted(pkg.rglob("*")):
        if f.is_file() and f.suffix in PACKAGE_SUFFIXES and "__pycache__" not in f.parts:
            add(f"glm_infra/{f.relative_to(pkg)}", f.read_bytes())
    return h.hexdigest()


def read(fleet: Fleet) -> dict[str, StackRecord]:
    """The records of ``fleet``'s stacks ({} before a first rollout). A file that does not parse is an error
    naming it: it is never guessed at (``--restart`` starts over)."""
    path = folder(fleet) / PROGRESS_FILE
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ProgressError(f"{path}: unreadable progress ({e}); `glm-infra fleet up --restart` starts over") from None
    try:
        if doc.get("fleet") != fleet.name:
            raise ValueError(f"it is fleet {doc.get('fleet')!r}'s, not {fleet.name!r}'s")
        out = {}
        for name, r in (doc.get("stacks") or {}).items():
            if r["update"] is not None and not isinstance(r["update"], str):
                raise ValueError(f"{name}: update {r['update']!r}")
            rec = StackRecord(str(r["target"]), str(r["phase"]), r["update"], str(r["reason"]), float(r["at"]))
            if rec.phase not in PHASES:
                raise ValueError(f"{name}: phase {rec.phase!r}")
            out[name] = rec
        return out
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise ProgressError(f"{path}: malformed progress ({e}); `glm-infra fleet up --restart` starts over") from None


def write(fleet: Fleet, records: dict[str, StackRecord]) -> None:
    """All records at once, atomically (a rename): an interruption leaves the old file or the new one."""
    d = folder(fleet)
    d.mkdir(parents=True, exist_ok=True)
    doc = {"fleet": fleet.name, "stacks": {k: asdict(v) for k, v in sorted(records.items())}}
    fd, tmp = tempfile.mkstemp(prefix=".progress-", dir=d)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    os.replace(tmp, d / PROGRESS_FILE)


def record(phase: str, target: str, update: str | None, reason: str) -> StackRecord:
    return StackRecord(target, phase, update, reason, time.time())


@contextmanager
def locked(fleet: Fleet) -> Iterator[None]:
    """One rollout of a fleet at a time on this machine (each stack's own lock guards its backend)."""
    d = folder(fleet)
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ProgressError(f"{fleet.source}: another `glm-infra fleet up` of fleet {fleet.name} is running "
                                f"(lock {d / 'lock'})") from None
        yield
