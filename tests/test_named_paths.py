"""Every repository path a doc, a script, a config or the code names exists: a move that leaves one behind
fails here, not in a reader's hands (scripts/mutation once named a moved module and measured nothing).

- docs (README, docs/, examples/, testbed/ and provider/ pages): each path in backticks that starts at the
  repository's top (``glm_infra/…``, ``scripts/…``) or at one of glm_infra's packages (``roles/…``,
  ``agent/…``); ``tests/x.py::name`` also needs the test, ``a/b.c`` the module ``a/b.py``;
- scripts, CI, testbed, pyproject.toml and glm_infra's code and templates: each such path anywhere in the
  text (a path built at run time, ``stacks/Pulumi.{stack}.yaml``, is no path).

Globs must match something; placeholders (``<stack>``, ``$VAR``, ``{x}``) are skipped."""

from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest
from conftest import ROOT

TOP = ("glm_infra", "tests", "testbed", "scripts", "docs", "stacks", "schemas", "examples", "provider", ".github",
       ".ci")
PACKAGES = tuple(p.name for p in (ROOT / "glm_infra").iterdir() if (p / "__init__.py").exists() or p.name == "templates")
ANYWHERE = re.compile(rf"(?<![\w./$:@-])(?:{'|'.join(re.escape(t) for t in TOP)})/[\w./*-]*[\w*](?![{{<$\w]|\.[{{<$])")
TEXT = (".py", ".j2", ".sh", ".md", ".yaml", ".yml", ".toml", ".ts", ".txt", ".cfg", "")


def doc_files() -> list[Path]:
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    for folder in ("examples", "testbed", "provider"):
        pages += [p for p in (ROOT / folder).rglob("*.md") if "node_modules" not in p.parts]
    return pages


def text_files() -> list[Path]:
    out = [ROOT / "pyproject.toml", ROOT / "Pulumi.yaml", ROOT / "__main__.py"]
    for folder in ("scripts", ".github", ".ci", "testbed", "glm_infra"):
        out += [p for p in (ROOT / folder).rglob("*") if p.is_file() and p.suffix in TEXT
                and not {"__pycache__", "node_modules", "checkpoints"} & set(p.parts)]
    return out


def exists(word: str, also: tuple[Path, ...] = ()) -> bool:
    path, _, test = word.partition("::")
    path = path.rstrip(".")
    for base in (ROOT, *also):
        if "*" in path:
            if glob.glob(str(base / path)):
                return True
            continue
        target = base / path
        if target.exists():
            name = test.split("[")[0]
            return not name or bool(re.search(rf"^(async )?def {re.escape(name.split('.')[-1])}\b|^class "
                                              rf"{re.escape(name.split('.')[0])}\b", target.read_text(), re.M))
        if re.fullmatch(r".*/\w+\.\w+", path) and (base / (path.rsplit(".", 1)[0] + ".py")).exists():
            return True  # a module's attribute: tests/pulumi_harness.run_program
    return False


def doc_paths(page: Path) -> list[str]:
    found = []
    for span in re.findall(r"`([^`\n]+)`", page.read_text()):
        words = span.split()
        for before, word in zip(["", *words], words):
            word = word.strip("()[],;'\"").removesuffix(":")
            if before in (">", "--out", "-o"):
                continue  # a file the command writes
            if re.search(r"[<>{}$~]|://", word) or word.startswith(("/", "-")):
                continue
            first = word.split("/", 1)[0]
            if "/" in word and (first in TOP or first in PACKAGES):
                found.append(word)
    return found


@pytest.mark.parametrize("page", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_doc_names_exists(page):
    missing = [w for w in doc_paths(page) if not exists(w, (ROOT / "glm_infra",))]
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_every_path_a_script_config_or_module_names_exists():
    missing = sorted({f"{f.relative_to(ROOT)}: {m.group(0)}" for f in text_files()
                      for m in ANYWHERE.finditer(f.read_text(errors="replace")) if not exists(m.group(0))})
    assert not missing, f"paths named that do not exist: {missing}"


def test_the_check_finds_a_moved_path(tmp_path):
    """The check itself: a path that is not there is caught, one that is there passes."""
    page = tmp_path / "PAGE.md"
    page.write_text("See `glm_infra/roles/firewall.py`, `roles/firewall/__init__.py`, "
                    "`tests/test_named_paths.py::test_the_check_finds_a_moved_path` and `tests/test_engine.py::nope`.")
    assert [w for w in doc_paths(page) if not exists(w, (ROOT / "glm_infra",))] == [
        "glm_infra/roles/firewall.py", "tests/test_engine.py::nope"]
    assert [m.group(0) for m in ANYWHERE.finditer("only_mutate = ['glm_infra/roles/firewall.py'] stacks/Pulumi.{s}.yaml "
                                                  "x/tests/conftest.py NVIDIA/x@1:scripts/a.sh")] == [
        "glm_infra/roles/firewall.py"]


def layout_entries() -> dict[str, str]:
    """docs/ARCHITECTURE.md's Layout block: each ``glm_infra/…`` entry → its text (continuation lines joined)."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    entries: dict[str, str] = {}
    head = None
    for line in block.splitlines():
        if line.startswith("glm_infra/"):
            head, _, rest = line.partition(" ")
            entries[head] = rest
        elif line.startswith(" ") and head:
            entries[head] += " " + line.strip()
        else:
            head = None
    return entries


def test_the_layout_names_every_module_and_package_of_glm_infra():
    """ARCHITECTURE's layout mirrors the package: every module and sub-package is named in its folder's entry
    (or has an entry of its own), and every entry exists."""
    entries = layout_entries()
    assert [h for h in entries if not (ROOT / h).exists()] == []
    named = " ".join(f"{h} {t}" for h, t in entries.items())
    unnamed = []
    for child in sorted((ROOT / "glm_infra").iterdir()):
        if child.name in ("__init__.py", "__pycache__", "py.typed"):
            continue
        if child.is_file() and f"glm_infra/{child.name}" not in named:
            unnamed.append(f"glm_infra/{child.name}")
        if child.is_dir():
            text = entries.get(f"glm_infra/{child.name}/")
            if text is None:  # named inside another entry (the shared templates), or not at all
                if f"glm_infra/{child.name}/" not in named:
                    unnamed.append(f"glm_infra/{child.name}/")
                continue
            for sub in sorted(child.iterdir()):
                word = sub.name if sub.is_file() else sub.name.rstrip("/")
                if sub.name in ("__init__.py", "__pycache__") or sub.suffix == ".pyc":
                    continue
                if not re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text):
                    unnamed.append(f"glm_infra/{child.name}/{sub.name}")
    assert unnamed == [], "not in docs/ARCHITECTURE.md's layout"
