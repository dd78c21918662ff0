"""A stack rendered at a git revision by that revision's own code (``git archive`` of its ``glm_infra`` and
``stacks/``) and at the working tree: the review of a change (``diff``)."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .compare import StackChange, compare
from .rendering import STACK_FILE, Instance, InvalidStack, Rendering, ReviewError

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
    except ImportError:  # a revision from before the layer packages (topology was a module of glm_infra itself)
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
