"""Where a stack's Pulumi state lives, and whether it may live there.

scripts/lib/pulumi-env.sh falls back to a file backend inside the checkout (``.pulumi-state``, ignored by
git) so the simulated cluster runs with nothing set. For hosts that matter that is a trap: a re-clone or
``git clean -xfd`` deletes the only record of what pulumi made on them. So the program refuses ``up`` with
its state inside the checkout unless the stack file says its hosts are disposable
(``glm-infra:stateInCheckout: true``), and a preview warns. The backend is the one the CLI uses:
``PULUMI_BACKEND_URL`` when set, else the one ``pulumi login`` chose (``$PULUMI_HOME/credentials.json``).
Pure: the program passes the environment and folders in.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import unquote

CHOOSE = ("choose a backend that outlives the checkout (docs/DEPLOYING.md, \"Where the state lives\"): "
          "export PULUMI_BACKEND_URL=postgres://… (a team's PostgreSQL), s3://…, or file:// outside the "
          "checkout, or `pulumi login` to one; then move this stack there (pulumi stack export/import). "
          "A stack of disposable hosts (the simulated cluster) says glm-infra:stateInCheckout: true")


class UnknownBackend(ValueError):
    """The login's file is there but cannot be read as the CLI writes it: where the state lives is unknown."""


def backend_url(env: Mapping[str, str], home: Path) -> tuple[str, str] | None:
    """(url, where it came from) as the CLI resolves it; None when neither is set (Pulumi Cloud: no login file,
    or one that names no current backend). UnknownBackend naming the file when it is there but cannot be read
    or is not the CLI's JSON: never taken for Pulumi Cloud."""
    if env.get("PULUMI_BACKEND_URL"):
        return env["PULUMI_BACKEND_URL"], "PULUMI_BACKEND_URL"
    credentials = (Path(env["PULUMI_HOME"]) if env.get("PULUMI_HOME") else home / ".pulumi") / "credentials.json"
    try:
        login = json.loads(credentials.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise UnknownBackend(f"{credentials} cannot be read ({e})") from None
    current = login.get("current") if isinstance(login, dict) else login
    current = "" if current is None else current  # null or absent: none, as the CLI reads it
    if not isinstance(login, dict) or not isinstance(current, str):
        raise UnknownBackend(f"{credentials} is not a login the CLI wrote (an object whose \"current\" is a URL)")
    return (current, f"`pulumi login` ({credentials})") if current else None


def checkout(folder: Path) -> Path:
    """The git work tree holding folder (the project's), else folder itself."""
    folder = folder.resolve()
    for candidate in (folder, *folder.parents):
        if (candidate / ".git").exists():
            return candidate
    return folder


def state_folder(url: str, cwd: Path, home: Path) -> Path | None:
    """The folder of a file:// backend (``~`` and relative paths as the CLI reads them); None for others."""
    if not url.startswith("file://"):
        return None
    raw = unquote(url[len("file://"):].split("?", 1)[0])
    path = Path(str(home) + raw[1:]) if raw.startswith("~") else Path(raw)
    return (path if path.is_absolute() else cwd / path).resolve()


def verdict(stack: str, allowed: bool, dry_run: bool, env: Mapping[str, str] | None = None,
            cwd: Path | None = None, home: Path | None = None) -> tuple[str, str] | None:
    """("error", why) for an ``up`` whose state would live inside the checkout or whose backend cannot be told
    (a login file that cannot be read), ("warning", why) for its preview; None when the state lives elsewhere
    (Pulumi Cloud included) or the stack allows it."""
    if allowed:
        return None
    env = os.environ if env is None else env
    cwd = Path.cwd() if cwd is None else cwd
    home = Path.home() if home is None else home
    try:
        found = backend_url(env, home)
    except UnknownBackend as e:
        why = f"stack {stack}: cannot tell where its state lives: {e}. "
        return ("warning", why + "`pulumi up` refuses it: " + CHOOSE) if dry_run else ("error", why + "Refused: " + CHOOSE)
    if found is None:
        return None
    url, source = found
    folder = state_folder(url, cwd, home)
    tree = checkout(cwd)
    if folder is None or not folder.is_relative_to(tree):
        return None
    why = (f"stack {stack}: its state would live in {folder}, inside the checkout {tree} (backend {url} from "
           f"{source}); a re-clone or `git clean -xfd` deletes it and with it what pulumi knows of the hosts. ")
    if dry_run:
        return "warning", why + "`pulumi up` refuses it: " + CHOOSE
    return "error", why + "Refused: " + CHOOSE
