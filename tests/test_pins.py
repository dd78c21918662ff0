"""glm_infra/spec/pins.py: every closed set of choices is what the pinned release's own command line takes.

The sets are rebuilt here from the released packages, never from pins.py: vLLM's wheel (read as a zip
of source files and parsed with ``ast``; vLLM is never installed nor imported) and vllm-router's
parser (installed in the venv as a test dependency). A new pin, or a pin whose sets moved, fails
until pins.py says what that release takes.

The vLLM wheel (336 MB for 0.33.0) is downloaded once with ``pip download`` into
``~/.cache/glm-infra/wheels/`` (``GLM_INFRA_WHEEL_CACHE`` moves it) and read from there afterwards.
"""

from __future__ import annotations

import argparse
import ast
import fcntl
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from glm_infra.spec import pins

CACHE = Path(os.environ.get("GLM_INFRA_WHEEL_CACHE", Path.home() / ".cache" / "glm-infra" / "wheels"))


# --- the wheel ------------------------------------------------------------------------------------


def vllm_wheel(version: str) -> Path:
    """vLLM ``version``'s wheel from the cache, downloaded (without its dependencies) when missing.

    The Python sources are the same in every platform's wheel; the x86_64 one is asked for so the
    download does not depend on the machine. A download that fails is a test failure that names it."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one download, whoever asks first
        found = sorted(CACHE.glob(f"vllm-{version}-*.whl"))
        if found:
            return found[0]
        with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
            argv = [sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps",
                    "--only-binary=:all:", "--platform", "manylinux_2_28_x86_64", "--quiet", "-d", tmp]
            run = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
            wheels = sorted(Path(tmp).glob(f"vllm-{version}-*.whl"))
            if run.returncode != 0 or not wheels:
                pytest.fail(f"cannot download vLLM {version}'s wheel into {CACHE} ({' '.join(argv[1:])}): "
                            f"rc {run.returncode}: {(run.stderr or run.stdout).strip()[-600:]}")
            target = CACHE / wheels[0].name
            os.replace(wheels[0], target)  # whole or not at all: the next run never reads half a wheel
            return target


class Wheel:
    """The ``.py`` files of a wheel, parsed on demand."""

    def __init__(self, path: Path) -> None:
        self.zip = zipfile.ZipFile(path)
        self._trees: dict[str, ast.Module] = {}

    def source(self, name: str) -> str:
        return self.zip.read(name).decode()

    def tree(self, name: str) -> ast.Module:
        if name not in self._trees:
            self._trees[name] = ast.parse(self.source(name), name)
        return self._trees[name]

    def files(self, prefix: str) -> Iterator[str]:
        return (n for n in self.zip.namelist() if n.startswith(prefix) and n.endswith(".py"))


def _assigned(tree: ast.Module, name: str) -> ast.expr:
    """The value a module assigns to ``name`` at its top level."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node.value
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name \
                and node.value is not None:
            return node.value
    raise LookupError(name)


def _literal(tree: ast.Module, node: ast.expr) -> list[str]:
    """The strings of a ``Literal[...]`` (nested Literals and aliases of this module flattened, in order)."""
    if isinstance(node, ast.Name):
        return _literal(tree, _assigned(tree, node.id))
    assert isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "Literal", \
        ast.unparse(node)
    items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
    out: list[str] = []
    for item in items:
        if isinstance(item, ast.Constant) and isinstance(item.value, str):
            out.append(item.value)
        else:
            out += _literal(tree, item)
    return out


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    (found,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    return found


def _field(cls: ast.ClassDef, name: str) -> ast.expr:
    """The annotation of the dataclass field ``name``."""
    (found,) = [n.annotation for n in cls.body if isinstance(n, ast.AnnAssign)
                and isinstance(n.target, ast.Name) and n.target.id == name]
    return found


def _registry(wheel: Wheel, package: str, table: str, manager: str) -> list[str]:
    """A parser registry's names: the lazy table in ``package/__init__.py`` and every
    ``Manager.register_module("name")`` / ``register_lazy_module("name", ...)`` with a literal name."""
    names = [k.value for k in _assigned(wheel.tree(f"{package}/__init__.py"), table).keys]  # type: ignore[attr-defined]
    for f in wheel.files(f"{package}/"):
        if "register_" not in wheel.source(f):
            continue
        for node in ast.walk(wheel.tree(f)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == manager \
                    and node.func.attr in ("register_module", "register_lazy_module") \
                    and node.args and isinstance(node.args[0], ast.Constant):
                names.append(node.args[0].value)
    return names


def _cli_flag(wheel: Wheel, flag: str) -> tuple[str, str]:
    """``parser.add_argument("--flag", **KWARGS["field"])`` in EngineArgs.add_cli_args: (KWARGS, field).
    Fails when the flag takes a ``choices=`` or ``type=`` of its own (then the field's type is not what
    the command line checks)."""
    for node in ast.walk(wheel.tree("vllm/engine/arg_utils.py")):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument" \
                and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == flag:
            (spread,) = [k.value for k in node.keywords if k.arg is None]
            assert not [k.arg for k in node.keywords if k.arg is not None], f"{flag} has arguments of its own"
            assert isinstance(spread, ast.Subscript) and isinstance(spread.value, ast.Name)
            return spread.value.id, spread.slice.value  # type: ignore[attr-defined]
    raise LookupError(flag)


def _removed_choices(wheel: Wheel, kwargs: str, field: str) -> list[str]:
    """What add_cli_args takes out of a field's choices: ``KWARGS["field"]["choices"].remove(X)``, X a
    string or a module-level constant of vllm/config/."""
    constants: dict[str, str] = {}
    for f in wheel.files("vllm/config/"):
        for node in wheel.tree(f).body:
            target = node.target if isinstance(node, ast.AnnAssign) else (
                node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
            if isinstance(target, ast.Name) and isinstance(getattr(node, "value", None), ast.Constant):
                constants[target.id] = node.value.value  # type: ignore[union-attr]
    choices = ast.unparse(ast.parse(f'{kwargs}["{field}"]["choices"]', mode="eval"))
    out = []
    for node in ast.walk(wheel.tree("vllm/engine/arg_utils.py")):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "remove" \
                and ast.unparse(node.func.value) == choices:
            (arg,) = node.args
            out.append(arg.value if isinstance(arg, ast.Constant) else constants[arg.id])  # type: ignore[attr-defined]
    return out


def vllm_cli_choices(wheel: Wheel) -> dict[str, list[str]]:
    """What ``vllm serve`` takes for each setting glm-infra passes it, from the wheel's sources (the
    file and symbol each comes from beside it)."""
    parallel = wheel.tree("vllm/config/parallel.py")
    kwargs, field = _cli_flag(wheel, "--all2all-backend")
    assert (kwargs, field) == ("parallel_kwargs", "all2all_backend")
    # get_kwargs(ParallelConfig) makes a Literal field's choices; add_cli_args removes some.
    removed = _removed_choices(wheel, kwargs, field)
    all2all = [c for c in _literal(parallel, _field(_class(parallel, "ParallelConfig"), field)) if c not in removed]

    cache = wheel.tree("vllm/config/cache.py")
    assert _cli_flag(wheel, "--kv-cache-dtype") == ("cache_kwargs", "cache_dtype")
    # `CacheDType | str`: the parser takes any string (a metavar, not choices) and CacheConfig refuses a
    # name neither in CacheDType nor registered with register_kv_cache_dtype (none in the wheel: checked).
    annotation = _field(_class(cache, "CacheConfig"), "cache_dtype")
    assert ast.unparse(annotation) == "CacheDType | str", ast.unparse(annotation)
    registered = [f for f in wheel.files("vllm/") if "register_kv_cache_dtype(" in wheel.source(f)
                  and any(isinstance(n, ast.Call) and ast.unparse(n.func).endswith("register_kv_cache_dtype")
                          for n in ast.walk(wheel.tree(f)))]
    assert registered == [], f"KV cache dtypes registered at run time in {registered}: read them too"

    assert _cli_flag(wheel, "--reasoning-parser") == ("structured_outputs_kwargs", "reasoning_parser")

    spec = wheel.tree("vllm/config/speculative.py")
    # --speculative-config is JSON validated as SpeculativeConfig: its method field.
    assert ast.unparse(_field(_class(spec, "SpeculativeConfig"), "method")) == "SpeculativeMethod | None"

    front = wheel.tree("vllm/entrypoints/common/cli_args.py")
    base = _class(front, "BaseFrontendArgs")
    content_format = _field(base, "chat_template_content_format")
    assert ast.unparse(content_format) == "ChatTemplateContentFormatOption"

    compilation = wheel.tree("vllm/config/compilation.py")
    # --compilation-config's cudagraph_mode: `CUDAGraphMode[value.upper()]`, the enum's member names.
    graph_modes = [t.id for n in _class(compilation, "CUDAGraphMode").body if isinstance(n, ast.Assign)
                   for t in n.targets if isinstance(t, ast.Name)]
    assert "CUDAGraphMode[value.upper()]" in wheel.source("vllm/config/compilation.py")

    return {
        "toolCallParser": _registry(wheel, "vllm/tool_parsers", "_TOOL_PARSERS_TO_REGISTER", "ToolParserManager"),
        # "none" is also taken (the same as leaving it out; glm-infra leaves it out).
        "reasoningParser": _registry(wheel, "vllm/reasoning", "_REASONING_PARSERS_TO_REGISTER",
                                     "ReasoningParserManager"),
        "all2allBackend": all2all,
        "speculativeMethod": _literal(spec, ast.Name("SpeculativeMethod")),
        "fingerprintMode": _literal(front, _field(base, "fingerprint_mode")),
        "chatTemplateContentFormat": _literal(wheel.tree("vllm/renderers/chat_utils/types.py"), content_format),
        "cudagraphMode": graph_modes,
        "kvCacheDtype": _literal(cache, ast.Name("CacheDType")),
    }


@pytest.fixture(scope="module", params=sorted(pins.VLLM_CHOICES))
def vllm_release(request) -> tuple[str, dict[str, list[str]]]:
    return request.param, vllm_cli_choices(Wheel(vllm_wheel(request.param)))


def test_vllm_choices_are_what_vllm_serve_takes(vllm_release):
    version, wheel_sets = vllm_release
    ours = pins.VLLM_CHOICES[version]
    assert set(ours) == set(wheel_sets), "pins.py and this test name different settings"
    drift = {k: {"pins only (vllm serve refuses)": sorted(set(ours[k]) - set(v)),
                 "vllm serve only": sorted(set(v) - set(ours[k]))}
             for k, v in wheel_sets.items() if set(ours[k]) != set(v)}
    assert drift == {}, f"vLLM {version}: pins.VLLM_CHOICES drifted from the wheel: {drift}"
    assert all(len(v) == len(set(v)) for v in ours.values()), "a choice listed twice"


def test_passthrough_is_no_all2all_backend_of_the_command_line(vllm_release):
    """The value that was wrong: in ParallelConfig's All2AllBackend, but add_cli_args removes it from
    --all2all-backend's choices (--moe-backend selects it)."""
    version, wheel_sets = vllm_release
    assert "passthrough" not in wheel_sets["all2allBackend"]
    assert "passthrough" not in pins.VLLM_CHOICES[version]["all2allBackend"]


# --- vllm-router ----------------------------------------------------------------------------------


def router_cli_choices() -> dict[str, list[str]]:
    """vllm-router's own parser (the installed package, its version checked against the pin)."""
    from importlib.metadata import version

    from vllm_router.router_args import RouterArgs

    assert version("vllm-router") == pins.VLLM_ROUTER, "the venv's vllm-router is not the pinned one"
    parser = argparse.ArgumentParser()
    RouterArgs.add_cli_args(parser)
    (policy,) = [a for a in parser._actions if "--policy" in a.option_strings]
    return {"policy": list(policy.choices or ())}


def test_router_choices_are_what_vllm_router_takes():
    assert set(pins.ROUTER_CHOICES) == {pins.VLLM_ROUTER}, "only the installed vllm-router can be read here"
    ours = pins.ROUTER_CHOICES[pins.VLLM_ROUTER]
    theirs = router_cli_choices()
    assert set(ours) == set(theirs)
    assert {k: sorted(v) for k, v in ours.items()} == {k: sorted(v) for k, v in theirs.items()}
