"""Pull-request review: what a change deploys, stack by stack, without the engine (``glm-infra diff``),
and what ``pulumi preview`` says of it (``scripts/pr-review``).

A stack is rendered twice, each time by its own code: at a git revision (the revision's
``glm_infra`` and ``stacks/``, extracted with ``git archive``) and at the working tree. Each
rendering is the review tree of ``glm-infra render`` (what deploys is exactly that) plus who runs
where (hosts, instances and their pools, the router). ``compare`` turns two renderings into a
``StackChange``: the hosts and pools touched, the files that change (with a unified diff), the steps
that re-run, and the services that restart. A restart is read off the steps themselves
(``restarted_units``): a step that re-runs and runs a unit's service script (``unit=…``: the vLLM
instances' and the router's) with ``apply``, or with ``rollout ARG`` and an ARG (its triggers) it did
not run with before; or a packaged service's script (``services=(…)``) with ``apply`` and a new
``config_digest``. Nothing here lists the services by hand.

``summarize_preview`` reads the JSON of ``pulumi preview --json``: its steps, its own
``changeSummary``, and which updates are service restarts (by the same script test, on the
resource's new ``update``/``create`` command).
"""

from __future__ import annotations

import argparse
import difflib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

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


# --- rendering a revision ------------------------------------------------------------------------

# Run with the revision's own glm_infra first on sys.path (argv: root, out, stack names), by this
# interpreter: render each stack as ``glm-infra render`` does and write who runs where beside it.
_EXPORT = r"""
import json, sys
from pathlib import Path
root, out = Path(sys.argv[1]).resolve(), Path(sys.argv[2])
sys.path.insert(0, str(root))
# An editable install of glm_infra (this venv's) would fill in any module the revision lacks.
sys.meta_path[:] = [f for f in sys.meta_path if not str(getattr(f, "__module__", "")).startswith("__editable__")]
try:
    import glm_infra
    from glm_infra import hostplan
    try:
        from glm_infra.plan import topology
    except ImportError:  # a revision from before the layer packages (glm_infra/topology.py)
        from glm_infra import topology
    from glm_infra.stack import StackError, load_file
    hostplan.write_tree, hostplan.plan_all
except (ImportError, AttributeError) as e:
    sys.exit(f"this revision's code cannot write the review tree ({e}): it predates glm-infra render's <host>/_steps")
where = getattr(glm_infra, "__file__", None)
if where is None or Path(where).resolve().parent != root / "glm_infra":
    sys.exit(f"imported glm_infra from {where or 'a namespace package'}, not from {root}/glm_infra/__init__.py")
for name in sys.argv[3:]:
    d = out / name
    d.mkdir(parents=True)
    f = Path("stacks") / f"Pulumi.{name}.yaml"
    if not f.is_file():
        (d / "absent").write_text("")
        continue
    try:
        loaded = load_file(f)
    except StackError as e:
        (d / "invalid").write_text(str(e))
        continue
    p = topology.plan(loaded.config)
    try:
        steps = hostplan.plan_all(loaded.config, p, stack_name=name)
    except TypeError:  # a revision from before the stack's name labelled its metrics
        steps = hostplan.plan_all(loaded.config, p)
    hostplan.write_tree(d / "tree", steps)
    (d / "plan.json").write_text(json.dumps({
        "hosts": {h.name: h.address for h in p.hosts},
        "instances": {i.name: {"pool": i.role, "host": i.host, "unit": i.unit} for i in p.instances},
        "router": [p.router.host, p.router.unit] if p.router else None,
    }))
strays = [m.__file__ for n, m in list(sys.modules.items()) if n.split(".")[0] == "glm_infra"
          and getattr(m, "__file__", None) and root not in Path(m.__file__).resolve().parents]
if strays:
    sys.exit(f"rendered with modules from outside {root}: {strays}")
"""


def _git(repo: Path, *args: str, binary: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=not binary)


def resolve_ref(repo: Path, ref: str) -> str:
    p = _git(repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    if p.returncode != 0:
        raise ReviewError(f"--against {ref}: not a commit in {repo} (a branch, tag or commit; "
                          f"a CI checkout needs the history: fetch-depth: 0)")
    return p.stdout.strip()


def stacks_at_ref(repo: Path, commit: str) -> list[str]:
    p = _git(repo, "ls-tree", "--name-only", commit, "stacks/")
    return [m[1] for n in p.stdout.split() if (m := STACK_FILE.fullmatch(n.rsplit("/", 1)[-1]))]


def stacks_in(root: Path) -> list[str]:
    return [m[1] for f in sorted((root / "stacks").glob("Pulumi.*.y*ml")) if (m := STACK_FILE.fullmatch(f.name))]


def extract(repo: Path, commit: str, dest: Path) -> None:
    """The revision's ``glm_infra/`` and ``stacks/`` under ``dest`` (nothing in the repository changes)."""
    p = _git(repo, "archive", "--format=tar", commit, "glm_infra", "stacks", binary=True)
    if p.returncode != 0:
        raise ReviewError(f"{commit[:12]} has no glm_infra/ and stacks/ to render: "
                          f"{p.stderr.decode(errors='replace').strip()}")
    with tarfile.open(fileobj=io.BytesIO(p.stdout)) as tar:
        tar.extractall(dest, filter="data")


def render_tree(root: Path, stacks: Sequence[str], out: Path, label: str) -> dict[str, Rendering | None | str]:
    """Each stack as the code and stack files under ``root`` render it: a Rendering, None (no such
    stack file there) or validate's message (the file does not validate)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    p = subprocess.run([sys.executable, "-c", _EXPORT, str(root), str(out), *stacks], cwd=root, env=env,
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise ReviewError(f"rendering at {label} failed (exit {p.returncode}):\n{p.stderr.strip()[-4000:]}")
    result: dict[str, Rendering | None | str] = {}
    for name in stacks:
        d = out / name
        if (d / "absent").exists():
            result[name] = None
        elif (d / "invalid").exists():
            result[name] = (d / "invalid").read_text()
        else:
            result[name] = read_rendering(d)
    return result


def read_rendering(d: Path) -> Rendering:
    plan = json.loads((d / "plan.json").read_text())
    tree = d / "tree"
    files = {str(f.relative_to(tree)): (f.read_text(), f.stat().st_mode & 0o7777)
             for f in sorted(tree.rglob("*")) if f.is_file()}
    instances = {n: Instance(n, v["pool"], v["host"], v["unit"]) for n, v in plan["instances"].items()}
    return Rendering(files, plan["hosts"], instances, tuple(plan["router"]) if plan["router"] else None)


@dataclass
class Review:
    against: str  # as given
    commit: str
    stacks: list[StackChange]
    notes: list[str] = field(default_factory=list)  # stacks that did not validate at the revision
    new: dict[str, Rendering] = field(default_factory=dict, repr=False)  # the working tree's renderings

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("new")
        return d


def diff(repo: Path, against: str, stacks: Sequence[str] | None) -> Review:
    """``stacks`` (None: every stack at the revision or in the working tree) rendered at ``against``
    and at the working tree of ``repo``, compared. Raises InvalidStack for a working-tree stack
    that does not validate, ReviewError when the revision cannot be rendered."""
    commit = resolve_ref(repo, against)
    names = list(stacks) if stacks else sorted(set(stacks_at_ref(repo, commit)) | set(stacks_in(repo)))
    for n in names:
        if "/" in n or n.endswith((".yaml", ".yml")):
            raise ReviewError(f"{n}: give a stack by its name (prod-b300): it is looked up in stacks/ at both sides")
    tmp = Path(tempfile.mkdtemp(prefix="glm-infra-diff-"))
    try:
        extract(repo, commit, tmp / "ref")
        old = render_tree(tmp / "ref", names, tmp / "old", f"{against} ({commit[:12]})")
        new = render_tree(repo, names, tmp / "new", "the working tree")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    invalid = [v for v in new.values() if isinstance(v, str)]
    if invalid:
        raise InvalidStack("\n".join(invalid))
    review = Review(against, commit, [])
    for n in names:
        a, b = old[n], new[n]
        if a is None and b is None:
            raise ReviewError(f"stacks/Pulumi.{n}.yaml: no such stack at {against} nor in the working tree")
        if isinstance(a, str):
            review.notes.append(f"{n}: did not validate at {against}, compared as if absent there:\n{a}")
            a = None
        review.stacks.append(compare(n, a, b))  # type: ignore[arg-type]
        if b is not None:
            review.new[n] = b  # type: ignore[assignment]
    return review


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
    name = f"-{str(step.get('urn', '')).rsplit('::', 1)[-1]}-"
    hosts = [h for h in rendering.hosts if f"-{h}-" in name] or list(rendering.hosts)

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


# --- output --------------------------------------------------------------------------------------

def _who(instance: str | None, pool: str | None) -> str:
    if instance == "router":
        return "the router"
    return f"{instance} of pool {pool}" if instance else ""


def headline(review: Review) -> str:
    by: dict[str, list[str]] = {}
    for s in review.stacks:
        by.setdefault(s.status, []).append(s.stack)
    parts = [f"{len(v)} {k} ({', '.join(v)})" for k, v in sorted(by.items(), key=lambda kv: _STATUS.index(kv[0]))]
    lead = f"against {review.against} ({review.commit[:12]}): "
    if not by.get("changed") and not by.get("added") and not by.get("removed"):
        return lead + "no rendered change: " + "; ".join(parts)
    return lead + "; ".join(parts)


_STATUS = ("changed", "added", "removed", "unchanged")


def restart_text(r: Restart) -> str:
    who = _who(r.instance, r.pool)
    return f"{r.host}: {r.unit}" + (f" ({who})" if who else "") + f" by step {r.step}"


def format_text(review: Review, diffs: bool = True) -> str:
    out = [f"glm-infra diff {headline(review)}"]
    for s in review.stacks:
        out.append("")
        out.append(f"{s.stack}: {s.status}")
        if s.status in ("added", "removed"):
            out.append(f"  hosts: {', '.join(s.hosts)}; pools: {', '.join(s.pools) or '-'}")
            continue
        if s.status == "unchanged":
            continue
        out.append(f"  hosts: {', '.join(s.hosts)}")
        if s.hosts_added or s.hosts_removed:
            out.append(f"  hosts added: {', '.join(s.hosts_added) or '-'}; removed: {', '.join(s.hosts_removed) or '-'}")
        out.append(f"  pools: {', '.join(s.pools) or '-'}" + (f" (instances {', '.join(s.instances)})" if s.instances else ""))
        out.append(f"  services that restart: {len(s.restarts)}")
        out += [f"    {restart_text(r)}" for r in s.restarts]
        out.append(f"  steps that re-run, added or removed: {len(s.steps)}")
        out += [f"    {c.host} {c.step}: {c.change}" + (f" ({', '.join(c.why)} changed)" if c.why else "")
                for c in s.steps]
        out.append(f"  files: {len(s.files)}")
        for f in s.files:
            out.append(f"    {f.host}:{f.path} ({f.kind}, {f.change})")
            if diffs:
                out += [f"      {line}" for line in _clip(f.diff)]
    for note in review.notes:
        out += ["", f"note: {note}"]
    return "\n".join(out) + "\n"


def _clip(lines: list[str]) -> list[str]:
    if len(lines) <= MAX_DIFF_LINES:
        return lines
    return lines[:MAX_DIFF_LINES] + [f"… {len(lines) - MAX_DIFF_LINES} more lines (glm-infra diff --format json has all)"]


def _code(items: Iterable[str]) -> str:
    return ", ".join(f"`{x}`" for x in items) or "-"


COMMENT_LIMIT = 60000  # characters: a pull-request comment takes 65536


def format_markdown(review: Review, previews: Mapping[str, PreviewSummary | str] | None = None,
                    limit: int | None = None, diffs: bool = True, lead: Sequence[str] = ()) -> str:
    """The summary in markdown (``lead``: lines under the title); past ``limit`` characters without
    the files' diffs, then cut."""
    text = _markdown(review, previews or {}, diffs, lead)
    if limit is None or len(text) <= limit:
        return text
    if diffs:
        return format_markdown(review, previews, limit, False, lead)
    return text[:limit] + "\n\n… cut here: the job summary has the rest\n"


def _markdown(review: Review, previews: Mapping[str, PreviewSummary | str], diffs: bool, lead: Sequence[str]) -> str:
    out = [TITLE, "", *lead, headline(review).replace("against ", "Against ", 1), ""]
    changed = [s for s in review.stacks if s.status != "unchanged"]
    if changed:
        cols = ["stack", "status", "hosts", "pools", "files", "steps", "restarts"]
        if previews:
            cols.append("pulumi preview")
        out += ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
        for s in changed:
            kinds: dict[str, int] = {}
            for f in s.files:
                kinds[f.kind] = kinds.get(f.kind, 0) + 1
            row = [f"`{s.stack}`", s.status, _code(s.hosts), _code(s.pools),
                   ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "-", str(len(s.steps)),
                   _code(f"{r.unit}@{r.host}" for r in s.restarts)]
            if previews:
                row.append(_preview_cell(previews.get(s.stack)))
            out.append("| " + " | ".join(row) + " |")
        out.append("")
    for s in changed:
        out.append(f"### `{s.stack}`: {s.status}")
        out.append("")
        if s.status in ("added", "removed"):
            out += [f"- hosts: {_code(s.hosts)}", f"- pools: {_code(s.pools)}", ""]
        else:
            out.append(f"- hosts: {_code(s.hosts)}" + (f" (added {_code(s.hosts_added)})" if s.hosts_added else "")
                       + (f" (removed {_code(s.hosts_removed)})" if s.hosts_removed else ""))
            out.append(f"- pools: {_code(s.pools)}" + (f", instances {_code(s.instances)}" if s.instances else ""))
            out.append("- services that restart: " + ("; ".join(restart_text(r) for r in s.restarts) or "none"))
            out.append("- files: " + ("; ".join(f"`{f.host}:{f.path}` ({f.kind}, {f.change})" for f in s.files) or "none"))
            out.append("- steps: " + ("; ".join(f"{c.host} `{c.step}` ({c.change}"
                                                          + (f": {', '.join(c.why)}" if c.why else "") + ")"
                                                          for c in s.steps) or "none"))
        p = previews.get(s.stack)
        if isinstance(p, PreviewSummary):
            out += _preview_lines(p)
        elif isinstance(p, str):
            out.append(f"- pulumi preview: {p}")
        if not diffs and any(f.diff for f in s.files):
            out += ["", "(the files' diffs are in the job summary: too long for a comment)"]
        elif any(f.diff for f in s.files):
            out += ["", "<details><summary>diff of the rendered files</summary>", "", "```diff"]
            for f in s.files:
                out += _clip(f.diff)
            out += ["```", "", "</details>"]
        out.append("")
    for note in review.notes:
        out += [f"> note: {note.splitlines()[0]}", ""]
    return "\n".join(out)


def _preview_cell(p: PreviewSummary | str | None) -> str:
    if p is None:
        return "-"
    if isinstance(p, str):
        return p
    return ", ".join(f"{p.counts[k]} {k}" for k in OPS) + (f", {len(p.errors)} errors" if p.errors else "")


def _preview_lines(p: PreviewSummary) -> list[str]:
    out = ["- pulumi preview: " + _preview_cell(p) + (f" (its own summary: {json.dumps(p.change_summary)})")]
    for op in OPS:
        if p.resources[op]:
            out.append(f"  - {op}: {_code(p.resources[op])}")
    out.append("  - service restarts: " + (_code(p.restarts) if p.restarts else "none"))
    out += [f"  - error: {e}" for e in p.errors]
    return out


# --- glm-infra diff ------------------------------------------------------------------------------

def project_dir() -> Path:
    """The project around the current directory (nearest Pulumi.yaml), else this source tree."""
    cwd = Path.cwd()
    for d in (cwd, *cwd.parents):
        if (d / "Pulumi.yaml").is_file() and (d / "stacks").is_dir():
            return d
    return Path(__file__).resolve().parents[2]


def add_parser(sub) -> None:
    d = sub.add_parser("diff", help="what a change deploys: stacks rendered at a git revision and now, compared")
    d.add_argument("stacks", nargs="*", metavar="STACK", help="stack names (prod-b300)")
    d.add_argument("--all", action="store_true", help="every stack in stacks/, at the revision or now")
    d.add_argument("--against", required=True, metavar="REF", help="git revision to compare with (main, origin/main, a commit)")
    d.add_argument("--format", choices=("text", "markdown", "json"), default="text")
    d.add_argument("--no-diff", action="store_true", help="text: leave the files' diffs out")


def run_diff(args: argparse.Namespace) -> int:
    if bool(args.stacks) == bool(args.all):
        print("glm-infra diff: give STACK names or --all", file=sys.stderr)
        return 2
    try:
        review = diff(project_dir(), args.against, None if args.all else args.stacks)
    except InvalidStack as e:
        print(e, file=sys.stderr)
        return 1
    except ReviewError as e:
        print(f"glm-infra diff: {e}", file=sys.stderr)
        return 1
    if args.format == "json":
        print(json.dumps(review.to_json(), indent=2))
    elif args.format == "markdown":
        print(format_markdown(review))
    else:
        print(format_text(review, diffs=not args.no_diff), end="")
    return 0


# --- scripts/pr-review ---------------------------------------------------------------------------

def preview(stack: str, repo: Path) -> dict | str:
    """``pulumi preview -s STACK --json``'s JSON, or why there is none."""
    try:
        p = subprocess.run(["pulumi", "preview", "-s", stack, "--json", "--non-interactive", "--suppress-progress"],
                           cwd=repo, capture_output=True, text=True, timeout=1800)
    except FileNotFoundError:
        return "not run: no pulumi on PATH"
    except subprocess.TimeoutExpired:
        return "failed: pulumi preview ran over 30 min"
    if p.returncode != 0 and f"no stack named '{stack}'" in p.stderr:
        return f"not run: the backend has no stack {stack} yet (`pulumi stack init {stack}` once, by whoever deploys)"
    try:
        data = json.loads(p.stdout)
    except ValueError:
        return f"failed (exit {p.returncode}): {(p.stderr or p.stdout).strip()[-1500:]}"
    if p.returncode != 0 and not data.get("diagnostics"):
        data["diagnostics"] = [{"severity": "error", "message": (p.stderr or "").strip()[-1500:] or f"exit {p.returncode}"}]
    return data


def ssh_key_paths(repo: Path) -> list[str]:
    """The SSH key files the stacks in ``repo``'s stacks/ name (``ssh.privateKeyPath``, expanded):
    the program reads the key when it runs, a preview too."""
    from glm_infra.stack import StackError, load_file

    out = set()
    for name in stacks_in(repo):
        try:
            path = load_file(repo / "stacks" / f"Pulumi.{name}.yaml").config.ssh.private_key_path
        except StackError:
            continue  # validate reports it
        if path:
            out.add(os.path.expanduser(path))
    return sorted(out)


def pr_main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/pr-review", description=(
        "validate every stack, diff the rendering of every stack against the base revision, pulumi preview "
        "the stacks whose rendering changed; one markdown summary to $GITHUB_STEP_SUMMARY (else stdout)"))
    ap.add_argument("--base", metavar="REF", help="the revision the change goes onto (a branch, tag or commit)")
    ap.add_argument("--stack", action="append", metavar="STACK", help="only these stacks (default: every stack)")
    ap.add_argument("--no-preview", action="store_true", default=os.environ.get("GLM_INFRA_REVIEW_NO_PREVIEW") == "1",
                    help="engine-free: no pulumi preview (also GLM_INFRA_REVIEW_NO_PREVIEW=1)")
    ap.add_argument("--summary", metavar="FILE", default=os.environ.get("GITHUB_STEP_SUMMARY") or None,
                    help="append the markdown here (default $GITHUB_STEP_SUMMARY, else stdout)")
    ap.add_argument("--markdown", metavar="FILE", help="also write the markdown here (for a PR comment)")
    ap.add_argument("--json", metavar="FILE", help="also write the whole review and the previews as JSON")
    ap.add_argument("--ssh-key-paths", action="store_true",
                    help="only print the SSH key files the stacks name (ssh.privateKeyPath), one a line")
    args = ap.parse_args(argv)
    repo = project_dir()
    if args.ssh_key_paths:
        print("\n".join(ssh_key_paths(repo)))
        return 0
    if not args.base:
        ap.error("--base REF is needed")
    outputs = [args.summary, args.markdown]
    names = stacks_in(repo)
    v = subprocess.run([sys.executable, "-m", "glm_infra.tools.cli", "validate", *names], cwd=repo, capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(repo)})
    sys.stderr.write(v.stdout + v.stderr)
    if v.returncode != 0:
        _emit(f"{TITLE}\n\n`glm-infra validate` refused a stack:\n\n```\n{v.stderr.strip()}\n```\n", *outputs)
        return 1
    try:
        review = diff(repo, args.base, args.stack)
    except (InvalidStack, ReviewError) as e:
        _emit(f"{TITLE}\n\nThe review could not run:\n\n```\n{e}\n```\n", *outputs)
        print(e, file=sys.stderr)
        return 1
    status = 0
    previews: dict[str, PreviewSummary | str] = {}
    touched = [s.stack for s in review.stacks if s.status in ("changed", "added")]
    if args.no_preview:
        previews = {s: "not run (--no-preview)" for s in touched}
    elif not os.environ.get("PULUMI_BACKEND_URL") and not os.environ.get("PULUMI_ACCESS_TOKEN"):
        previews = {s: "not run: no state backend configured (PULUMI_BACKEND_URL)" for s in touched}
    else:
        for s in touched:
            data = preview(s, repo)
            result = summarize_preview(s, data, review.new.get(s)) if isinstance(data, dict) else data
            previews[s] = result
            if (isinstance(result, str) and not result.startswith("not run")) or (
                    isinstance(result, PreviewSummary) and result.errors):
                status = 1
    lead = [f"`glm-infra validate`: {len(names)} stacks valid.", ""]
    _emit(format_markdown(review, previews, lead=lead), *outputs,
          comment=format_markdown(review, previews, COMMENT_LIMIT, lead=lead))
    if args.json:
        Path(args.json).write_text(json.dumps({"review": review.to_json(), "previews": {
            k: (asdict(v) if isinstance(v, PreviewSummary) else v) for k, v in previews.items()}}, indent=2))
    print(f"glm-infra pr-review: {headline(review)}", file=sys.stderr)
    return status


def _emit(markdown: str, summary: str | None, markdown_file: str | None = None, comment: str | None = None) -> None:
    """The summary to ``summary`` (appended) or stdout, and to ``markdown_file`` (``comment`` if given:
    the shorter text for a pull-request comment)."""
    if summary:
        with open(summary, "a") as f:
            f.write(markdown + "\n")
    else:
        print(markdown)
    if markdown_file:
        Path(markdown_file).write_text((comment if comment is not None else markdown) + "\n")


if __name__ == "__main__":
    sys.exit(pr_main())
