"""The shape of glm_infra, held by the tests: the layer contract of pyproject.toml ([tool.importlinter],
checked by import-linter's lint-imports) and the size of its modules."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
# The size a reader takes in at once: no module may pass it (issue 28 split the last three that did),
# and OVERSIZED would list one allowed to for a while, at most as long as it is then. Generated code
# (args.py) is exempt; the host programs are packages too (agent/bundle.py makes each one file for the host).
MAX_LINES = 400
OVERSIZED: dict[str, int] = {}
EXEMPT = {"args.py"}


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, capture_output=True, text=True,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})


def test_the_layer_contract_is_kept():
    p = lint_imports(ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "3 kept, 0 broken" in p.stdout, p.stdout


@pytest.mark.parametrize("module, line, broken", [
    ("spec/paths.py", "from glm_infra.tools import cli", "each layer imports only the layers below it"),
    ("plan/topology.py", "from glm_infra.roles import firewall", "each layer imports only the layers below it"),
    ("spec/pins.py", "from glm_infra.spec import config", "no import cycle"),
    ("agent/weights/peer.py", "from glm_infra.spec import paths", "the host agents are stdlib only"),
])
def test_an_import_against_the_layers_is_caught(tmp_path, module, line, broken):
    shutil.copytree(ROOT / "glm_infra", tmp_path / "glm_infra", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    target = tmp_path / "glm_infra" / module
    target.write_text(target.read_text() + f"\n{line}  # noqa\n")
    p = lint_imports(tmp_path)
    assert p.returncode != 0, p.stdout
    status = [line for line in p.stdout.splitlines() if line.endswith((" KEPT", " BROKEN"))]
    assert [line for line in status if line.endswith("BROKEN") and broken in line], p.stdout
    dotted = "glm_infra." + module.removesuffix(".py").replace("/", ".")
    assert f"{dotted} ->" in p.stdout or f".{dotted.rsplit('.', 1)[1]} ->" in p.stdout, p.stdout  # names the importer


def module_lines() -> dict[str, int]:
    base = ROOT / "glm_infra"
    return {str(f.relative_to(base)): len(f.read_text().splitlines()) for f in sorted(base.rglob("*.py"))}


def test_no_module_grows_past_what_a_reader_takes_in():
    lines = module_lines()
    over = {m: n for m, n in lines.items() if n > MAX_LINES and m not in EXEMPT}
    grown = {m: (n, OVERSIZED.get(m)) for m, n in over.items() if n > OVERSIZED.get(m, MAX_LINES)}
    assert not grown, f"over {MAX_LINES} lines (now, allowed): {grown}; split them"
    stale = {m: n for m, n in OVERSIZED.items() if lines.get(m, 0) <= MAX_LINES}
    assert not stale, f"back under {MAX_LINES} lines or gone: take them out of OVERSIZED: {stale}"
