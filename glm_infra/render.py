"""Rendering of everything that lands on a host: systemd units, environment files, host scripts.

Pure and deterministic: the same stack gives byte-identical files. Secret values are never part of
what this module renders for review; secret files are rendered from a ``secrets`` mapping that the
offline CLI fills with placeholders and the Pulumi program fills inside ``Output.apply``.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import jinja2

from .agent import bundle
from .spec import paths
from .spec.config import SECRETS, StackConfig, snake
from .spec.paths import (  # noqa: F401  (re-exported: where things land, for callers of render)
    FRONT_CONF,
    FRONT_KEYS,
    HF_SECRETS,
    HOSTCHECK,
    ROUTER_SECRETS,
    SECRETS_DIR,
    UCX_ENV,
    UNIT_DIR,
    VLLM_SECRETS,
    WEIGHTS,
)
from .steps import RenderedFile, ScriptStep, Step, digest

# The templates the roles share (apt, file writes, a service's start); each role keeps its own in
# roles/<role>/templates. One namespace: a name is unique across them (tests/test_render.py).
TEMPLATES = Path(__file__).parent / "templates"
TEMPLATE_DIRS = (TEMPLATES, *sorted((Path(__file__).parent / "roles").glob("*/templates")))
HOST_PROGRAMS = Path(__file__).resolve().parent / "agent"


def configured_secrets(stack: StackConfig) -> dict[str, str]:
    """The secrets this stack sets that reach hosts (all but the SSH key), by template name, mapped
    to their stack key."""
    out = {}
    for name, (top, sub) in SECRETS.items():
        block = getattr(stack, top)
        if name != "private_key" and block is not None and getattr(block, snake(sub)) is not None:
            out[name] = f"glm-infra:{top}.{sub}"
    return out


def placeholders(stack: StackConfig) -> dict[str, str]:
    """What offline rendering writes in place of each secret (the relay key: made by the stack, in its state)."""
    return {**{name: f"<secret {key}>" for name, key in configured_secrets(stack).items()},
            "relay_key": "<secret: the stack's relay key, made once and kept in its state>"}


def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader([str(d) for d in TEMPLATE_DIRS]),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
        # Bash uses "{#" (${#array[@]}); templates have no Jinja comments.
        comment_start_string="<%#",
        comment_end_string="#%>",
    )
    env.filters["q"] = lambda v: shlex.quote(str(v))  # shell-quote a value for host scripts
    env.globals["paths"] = paths
    return env


_ENV = _env()


def template_files() -> list[Path]:
    """Every template, shared and the roles' own."""
    return sorted((f for d in TEMPLATE_DIRS for f in d.glob("*.j2")), key=lambda f: (f.name, str(f)))


def template_file(name: str) -> Path:
    """Where the template ``name`` is (the one the renderer loads)."""
    for d in TEMPLATE_DIRS:
        if (d / name).is_file():
            return d / name
    raise FileNotFoundError(f"no template {name!r} in {', '.join(str(d) for d in TEMPLATE_DIRS)}")


def render_template(name: str, **context: object) -> str:
    return _ENV.get_template(name).render(**context)


_SAFE_WORD = re.compile(r"^[A-Za-z0-9_./:=,@+\[\]-]+$")


def systemd_quote(args: list[str]) -> str:
    """Join arguments into an ``ExecStart=`` line that systemd splits back into the same words.

    systemd only honours quotes that wrap a whole word, so ``--flag='{...}'`` must be written as two
    words. Arguments were validated not to hold single quotes, backslashes, '%' or '$'.
    """
    out = []
    for a in args:
        if any(c in a for c in "'\\%$\n"):
            raise ValueError(f"argument cannot be written to a unit: {a!r}")
        out.append(a if _SAFE_WORD.match(a) else f"'{a}'")
    return " ".join(out)


# --- host scripts: one function each, used by the components and by offline render --------------


def hostcheck_source() -> str:
    return bundle.program("hostcheck")


def weights_source() -> str:
    return bundle.program("weights")


def canary_source() -> str:
    return bundle.program("canary")


def unit_memory_source() -> str:
    return (HOST_PROGRAMS / "unit_memory.py").read_text()


# --- a service of a package, on glm-infra's files (the monitoring, the firewall) ---------------------

PACKAGE_SERVICE_WAIT_S = 60
_SYSTEM_DIRS = {"/etc", "/etc/default", paths.UNIT_DIR}  # never removed, even if empty


def systemd_units(units: list[str], files: list[RenderedFile]) -> list[str]:
    """``units`` and every other unit one of ``files`` is, or is a drop-in of: what systemd must have
    reloaded before they run on ``files``."""
    out = [u if "." in u else f"{u}.service" for u in units]
    for f in files:
        folder, _, name = f.path.rpartition("/")
        parent, _, dropins = folder.rpartition("/")
        if folder == paths.UNIT_DIR:
            out.append(name)
        elif parent == paths.UNIT_DIR and dropins.endswith(".d"):
            out.append(dropins.removesuffix(".d"))
    return list(dict.fromkeys(out))


def package_service_step(key: str, what: str, host: str, packages: list[str], units: list[str], urls: list[str],
                         files: list[RenderedFile], config_check: str = "", runtime_digest: tuple[str, ...] = (),
                         live_check: str = "", reload: bool = False) -> Step:
    """A step that installs ``packages`` if missing, writes ``files`` (embedded in its script, so its
    check sees a hand edit), (re)starts ``units`` when they changed and waits for ``urls``;
    ``live_check``: a command that must also succeed once they run (failing before, it (re)starts
    them too); ``reload``: reload active units instead of restarting them (units others require)."""
    for f in files:
        assert f.content.endswith("\n") and "GLM_INFRA_FILE_END" not in f.content, f.path
    script = render_template(
        "package-service.sh.j2", step_name=key, what=what, host=host, packages=packages,
        services=[u.removesuffix(".service") for u in units], urls=urls, files=files,
        units=systemd_units(units, files),
        config_check=config_check, wait_seconds=PACKAGE_SERVICE_WAIT_S, runtime_digest=runtime_digest,
        live_check=live_check, restart="reload-or-restart" if reload else "restart",
        config_digest=digest(*packages, *(f"{f.path}\0{f.mode:o}\0{f.content}" for f in files)),
        dirs=sorted({f.path.rsplit("/", 1)[0] for f in files} - _SYSTEM_DIRS, key=lambda d: (-d.count("/"), d)),
    )
    step = ScriptStep(key, script).step(key, timeout="20m")
    return Step(**{**step.__dict__, "files": (*step.files, *files)})
