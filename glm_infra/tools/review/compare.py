"""Two renderings of a stack compared: the hosts and pools touched, the files that change (with a unified
diff), the steps that re-run, the services that restart."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .rendering import Rendering, StepText, expand, restarted_units

# --- comparing two renderings --------------------------------------------------------------------

@dataclass
class FileChange:
    host: str
    path: str
    kind: str  # unit | env | script | config
    change: str  # changed | added | removed | mode
    diff: list[str] = field(default_factory=list)


@dataclass
class StepChange:
    host: str
    step: str
    change: str  # re-runs | added | removed
    why: list[str] = field(default_factory=list)  # which of the step's inputs changed
    instance: str | None = None
    pool: str | None = None


@dataclass
class Restart:
    host: str
    unit: str
    step: str
    instance: str | None
    pool: str | None


@dataclass
class StackChange:
    stack: str
    status: str  # changed | unchanged | added | removed
    hosts: list[str] = field(default_factory=list)
    pools: list[str] = field(default_factory=list)  # prefill, decode, colocated, router
    instances: list[str] = field(default_factory=list)
    files: list[FileChange] = field(default_factory=list)
    steps: list[StepChange] = field(default_factory=list)
    restarts: list[Restart] = field(default_factory=list)
    hosts_added: list[str] = field(default_factory=list)
    hosts_removed: list[str] = field(default_factory=list)


def file_kind(path: str) -> str:
    if path.startswith("/etc/systemd/system/"):
        return "unit"
    if path.endswith(".env") or path.startswith("/etc/default/"):
        return "env"
    if path.startswith("/usr/local/libexec/"):
        return "script"
    return "config"


def unified(old: str | None, new: str | None, label: str) -> list[str]:
    return list(difflib.unified_diff((old or "").splitlines(), (new or "").splitlines(),
                                     f"a/{label}" if old is not None else "/dev/null",
                                     f"b/{label}" if new is not None else "/dev/null", lineterm=""))


def compare(stack: str, old: Rendering | None, new: Rendering | None) -> StackChange:
    """What deploying ``new`` over ``old`` changes (``None``: the stack file is absent there)."""
    if old is None or new is None:
        status = "added" if old is None else "removed"
        side = new or old
        assert side is not None
        return StackChange(stack, status, hosts=sorted(side.hosts),
                           pools=sorted({i.pool for i in side.instances.values()} | ({"router"} if side.router else set())),
                           instances=sorted(side.instances))
    out = StackChange(stack, "unchanged")
    out.hosts_added = sorted(set(new.hosts) - set(old.hosts))
    out.hosts_removed = sorted(set(old.hosts) - set(new.hosts))
    touched: set[str] = set()
    owners: set[tuple[str | None, str | None]] = set()
    for host in sorted(set(old.hosts) | set(new.hosts)):
        of, nf = old.host_files(host), new.host_files(host)
        for path in sorted(set(of) | set(nf)):
            a, b = of.get(path), nf.get(path)
            if a == b:
                continue
            change = "added" if a is None else "removed" if b is None else "changed" if a[0] != b[0] else "mode"
            diff = unified(a[0] if a else None, b[0] if b else None, f"{host}{path}")
            if change == "mode":
                diff = [f"mode {a[1]:o} → {b[1]:o}"] if a and b else []
            out.files.append(FileChange(host, path, file_kind(path), change, diff))
            touched.add(host)
        os_, ns = old.steps(host), new.steps(host)
        for name in sorted(set(os_) | set(ns), key=lambda n: _order(n, ns, os_)):
            a_, b_ = os_.get(name), ns.get(name)
            side = new if b_ is not None else old
            inst, pool = side.owner(host, name)
            if a_ is None or b_ is None:
                out.steps.append(StepChange(host, name, "added" if a_ is None else "removed", [], inst, pool))
            else:
                ai, bi = a_.inputs(), b_.inputs()
                why = [k for k in ai if ai[k] != bi[k]]
                if not why:
                    continue
                out.steps.append(StepChange(host, name, "re-runs", why, inst, pool))
                for unit in restarted_units(expand(b_.on_update, b_.triggers), expand(a_.on_update, a_.triggers),
                                            _reader(nf), _reader(of)):
                    out.restarts.append(Restart(host, unit, name, inst, pool))
            touched.add(host)
            owners.add((inst, pool))
    out.hosts = sorted(touched)
    out.pools = sorted({p for _, p in owners if p})
    out.instances = sorted({i for i, p in owners if i and i != "router"})
    if out.files or out.steps or out.hosts_added or out.hosts_removed:
        out.status = "changed"
    return out


def _reader(files: Mapping[str, tuple[str, int]]) -> Callable[[str], str | None]:
    return lambda path: files[path][0] if path in files else None


def _order(name: str, *sides: Mapping[str, StepText]) -> tuple[int, str]:
    for side in sides:
        if name in side:
            return list(side).index(name), name
    return 0, name
