"""One file of a host program made of a package of modules: what glm-infra copies to a host.

A host program (``canary/``) is a package here, its modules under 400 lines like the rest of glm_infra, and
one stdlib-only file on the host, run as ``python3 FILE ARGS``: the package's sources embedded as strings,
imported from there by a finder of its own, then its ``__main__`` run. The file is the same bytes for the
same sources (modules in name order), so a step's trigger changes only when a module does. Standard library
only, and importable on its own (``testbed/real_engine/check.py`` loads it by path on a GPU machine that has
none of glm_infra's dependencies).
"""

from __future__ import annotations

import ast
from pathlib import Path

AGENT = Path(__file__).resolve().parent

_LOADER = '''
import importlib.util
import runpy
import sys


# A finder and loader by their methods alone (what the import system calls): subclassing importlib.abc's
# would import importlib.resources with it, a third of a host program's start (about 13 ms of its 58).
class _Bundled:
    """The embedded modules, found before anything on sys.path."""

    def find_spec(self, name, path=None, target=None):
        if name in SOURCES:
            return importlib.util.spec_from_loader(name, self, is_package=name == PACKAGE)
        return None

    def create_module(self, spec):
        return None

    def is_package(self, name):
        return name == PACKAGE

    def get_source(self, name):  # tracebacks show the lines
        return SOURCES[name]

    def get_code(self, name):  # runpy runs __main__ from it
        return compile(SOURCES[name], FILES[name], "exec")

    def exec_module(self, module):
        module.__file__ = FILES[module.__name__]
        exec(self.get_code(module.__name__), module.__dict__)


sys.meta_path.insert(0, _Bundled())
runpy.run_module(PACKAGE, run_name="__main__", alter_sys=True)
'''


def program(package: str) -> str:
    """The single-file program of ``glm_infra/agent/<package>/`` (its ``__main__.py`` is what runs)."""
    folder = AGENT / package
    if not (folder / "__init__.py").is_file() or not (folder / "__main__.py").is_file():
        raise FileNotFoundError(f"{folder} is not a host program: it needs __init__.py and __main__.py")
    sources: dict[str, str] = {}
    files: dict[str, str] = {}
    for path in sorted(folder.glob("*.py")):
        name = package if path.stem == "__init__" else f"{package}.{path.stem}"
        sources[name] = path.read_text()
        files[name] = f"{package}/{path.name}"
    doc = _docstring(sources[package])
    return ("#!/usr/bin/env python3\n"
            f'"""{doc} (one file, bundled by glm_infra/agent/bundle.py from glm_infra/agent/{package}/)"""\n'
            f"PACKAGE = {package!r}\n"
            f"FILES = {files!r}\n"
            "SOURCES = {\n" + "".join(f"    {name!r}: {source!r},\n" for name, source in sources.items()) + "}\n"
            + _LOADER)


def _docstring(source: str) -> str:
    """The first line of a module's docstring, for the bundle's own."""
    doc = ast.get_docstring(ast.parse(source)) or ""
    return doc.splitlines()[0].replace('"""', "'''") if doc else "A glm-infra host program"
