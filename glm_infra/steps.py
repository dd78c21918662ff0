"""Remote steps: what one ``command:remote:Command`` (or, rarely, ``command:local:Command``) runs, as
plain data.

The per-host plan (``hostplan``) is made of these; components turn each into a resource and the
review tree (``glm-infra render``) writes each out, so what is reviewed is what deploys. A step is
idempotent: its ``create`` is also its ``update``, so a changed input re-runs the step in place
instead of replacing it (a replacement would run the old ``delete`` after the new ``create`` and
undo it).
"""

from __future__ import annotations

import hashlib
import hmac
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .spec import paths

# Stands in a step's commands for the digest of its triggers (filled in by the component), so a host
# script can tell "re-run with the same triggers" (a new SSH key, a new dial timeout: nothing to
# restart) from "re-run because a trigger changed".
TRIGGERS_TOKEN = "@glm-infra-triggers@"

# Reads a step's stdin to its end (see Step.delete_command).
DRAIN_STDIN = "cat >/dev/null; "


def digest(*parts: str) -> str:
    """A short digest of public values (not of a secret: anyone can compute it from a guess)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


TRIGGER_KEY_MIN = 32  # hex digits (128 bits) at least in the key of ``keyed_digest``


def keyed_digest(key: str, *parts: str) -> str:
    """``digest`` keyed with a secret (HMAC-SHA256): of values that include a secret, it may be seen
    (in state, logs, argv) because without ``key`` nobody can check a guessed secret against it."""
    if len(key.strip()) < TRIGGER_KEY_MIN:
        raise ValueError(f"the trigger key is missing or shorter than {TRIGGER_KEY_MIN} characters")
    h = hmac.new(key.strip().encode(), digestmod=hashlib.sha256)
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class RenderedFile:
    """A file a step writes on a host."""

    path: str
    content: str
    mode: int = 0o644
    secret: bool = False

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.content.encode()).hexdigest()


@dataclass(frozen=True)
class Step:
    """One named operation on one host.

    ``create`` runs on create; ``update`` (default: ``create`` again) on every input change; both
    read ``stdin``. ``delete`` runs on destroy; pulumi-command sends it ``stdin`` too, so what runs is
    ``delete_command``, which reads it first. ``triggers`` are values known when planning whose change
    runs ``update``; components add the outputs of other steps.
    """

    name: str
    create: str
    delete: str | None = None
    stdin: str | None = None
    triggers: tuple[str, ...] = ()
    secret: bool = False  # stdin holds a secret: keep it encrypted in state, never log it
    secret_output: bool = False  # stdout holds a secret too (kept encrypted in state)
    update: str | None = None
    timeout: str | None = None  # how long create/update may run ("30m")
    retain: bool = False  # keep what it made on destroy (delete never runs)
    local: bool = False  # runs on the machine running pulumi, not on the host
    files: tuple[RenderedFile, ...] = field(default=())  # what it writes on the host
    # The stdin with real secret values: ``secret_render(secrets)`` (stdin holds placeholders), the role's
    # renderer of that file.
    secret_render: Callable[[Mapping[str, str]], str] | None = None
    # A read-only command that succeeds only if what the step made is still in place (glm-infra
    # doctor runs it, beside a check of every file in ``files``).
    check: str | None = None

    @property
    def delete_command(self) -> str | None:
        """``delete`` as it runs on the host: after reading all of ``stdin`` when the step has one.
        pulumi-command writes a step's stdin to its delete as well, and a command that exits before
        the whole of it is written (``rm -f``) fails the delete with "EOF" although it ran
        (pulumi/pulumi-command#553): a race its SSH client loses under load. A local step has no
        such race (Go's os/exec ignores a pipe the command closed)."""
        if self.delete is None or self.stdin is None or self.local:
            return self.delete
        return f"{DRAIN_STDIN}{self.delete}"


@dataclass(frozen=True)
class ScriptStep:
    """A host script (rendered from a template) installed under LIBEXEC and run with an action.

    ``create``: install the script from stdin, run ``SCRIPT apply``. ``delete``: run ``SCRIPT remove``
    if the script is there, then remove it. The script stays on the host between runs so operators
    can re-run it (``SCRIPT check``) and so ``delete`` needs no stdin.
    """

    name: str
    script: str
    args: tuple[str, ...] = ()
    removable: bool = True
    triggers: tuple[str, ...] = field(default=())
    action: str = "apply"
    # What doctor runs (the step's check): ``check`` unless the script's ``check`` serves another caller too
    # (a unit's ExecStartPre) and the step checks more.
    check_action: str = "check"

    @property
    def path(self) -> str:
        return paths.script(self.name)

    def step(self, key: str | None = None, timeout: str | None = None) -> Step:
        args = "".join(" " + shlex.quote(a) for a in self.args)
        create = f"install -D -m 0755 /dev/stdin {self.path} && {self.path} {self.action}{args}"
        if self.removable:
            delete = f"if [ -x {self.path} ]; then {self.path} remove{args}; fi && rm -f {self.path}"
        else:
            delete = f"rm -f {self.path}"
        return Step(key or self.name, create, delete, self.script, self.triggers, timeout=timeout,
                    files=(RenderedFile(self.path, self.script, 0o755),), check=f"{self.path} {self.check_action}{args}")


def file_step(name: str, path: str, content: str, mode: int = 0o644, secret: bool = False,
              secret_render: Callable[[Mapping[str, str]], str] | None = None) -> Step:
    """Write ``content`` to ``path`` atomically (root-owned, ``mode``); remove it on destroy."""
    q = shlex.quote(path)
    d = shlex.quote(path.rsplit("/", 1)[0] or "/")
    create = (
        f"set -e; umask 077; mkdir -p {d}; tmp=$(mktemp {q}.XXXXXX); cat > \"$tmp\"; "
        f"chmod {mode:o} \"$tmp\"; if cmp -s \"$tmp\" {q}; then rm -f \"$tmp\"; chmod {mode:o} {q}; echo unchanged {q}; "
        f"else mv -f \"$tmp\" {q}; echo wrote {q}; fi"
    )
    delete = f"rm -f {q}"
    if path.startswith(paths.ETC + "/"):  # glm-infra's own folders go with their last file
        delete += f"; rmdir --ignore-fail-on-non-empty {d} {paths.ETC} 2>/dev/null || true"
    return Step(name, create, delete, content, (), secret, files=(RenderedFile(path, content, mode, secret),),
                secret_render=secret_render)


def seconds(timeout: str | None, default: int) -> int:
    """A step's timeout ("30m", "780s", "24h") in seconds; ``default`` when it has none."""
    if not timeout:
        return default
    return int(timeout[:-1]) * {"s": 1, "m": 60, "h": 3600}[timeout[-1]]


def command(*argv: str) -> str:
    """argv as one shell command line."""
    return " ".join(shlex.quote(a) for a in argv)
