"""One wait per round for the Pulumi Python SDK's outstanding outputs, instead of one per output.

After a program's body has run, ``pulumi.runtime.stack.wait_for_rpcs`` waits for every pending output
with ``asyncio.wait(pending, return_when=FIRST_COMPLETED)``, puts the unfinished ones back and waits
again: each wait adds and removes a callback on every pending output, and it runs again after each
completion, so the cost grows with the square of the outputs. A 96-host stack (3408 resources) spent
66 s of a 193-s preview there (cProfile in the language host), and the preview took 216.8 s; with one
wait per round it took 55 s (docs/PERFORMANCE.md, "Fleet-sized preview").

``install()`` makes that one call wait for the whole round (every output pending when it started),
returning early as soon as any output fails: one of the round's (``FIRST_EXCEPTION``) or one created
while the round runs (they land in ``SETTINGS.outputs``, which a watcher looks through every
``WATCH_S``; the SDK's own loop would have picked them up at its next completion). A round costs one
callback per output; a failure surfaces within ``WATCH_S`` however slow the rest of the round is.
It replaces only the ``asyncio`` name inside ``pulumi.runtime.stack`` with a view of ``asyncio``
whose ``wait`` changes that one mode; nothing else in the SDK changes.

Opt-in: glm-infra's own program (``__main__.py``) installs it; a program that uses the components
calls ``glm_infra.sdk_wait.install()`` itself, first thing. It installs only on the SDK versions in
``TESTED`` (``tests/test_sdk_wait.py`` ran there) and otherwise warns and leaves the SDK as it is;
``GLM_INFRA_SDK_WAIT=sdk`` leaves it alone too. Remove this module once the SDK waits linearly
(a test fails then, saying so).
"""

from __future__ import annotations

import asyncio
import os
import types
import warnings
from importlib import metadata

import pulumi
import pulumi.runtime.stack as _stack
from pulumi.runtime import settings as _settings

# The pulumi SDK versions whose ``wait_for_rpcs`` this was tested against (constraints.txt pins one).
TESTED = frozenset({"3.272.0"})
WATCH_S = 0.05  # how often a round looks for a failed output created after it started


def _failed(tasks) -> set[asyncio.Future]:
    return {t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None}


class _RoundWaitAsyncio(types.ModuleType):
    """``asyncio`` as ``pulumi.runtime.stack`` sees it: the same module but for ``wait``."""

    def __getattr__(self, name: str):
        return getattr(asyncio, name)

    @staticmethod
    async def wait(fs, *, timeout=None, return_when=asyncio.ALL_COMPLETED):
        if return_when != asyncio.FIRST_COMPLETED:
            return await asyncio.wait(fs, timeout=timeout, return_when=return_when)
        fs = set(fs)
        round_ = asyncio.ensure_future(asyncio.wait(fs, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION))
        try:
            while True:
                finished, _ = await asyncio.wait({round_}, timeout=WATCH_S)
                if finished:
                    return round_.result()
                # The SDK keeps a failed output in SETTINGS.outputs (it only drops the ones that succeed):
                # handing it back as done makes wait_for_rpcs await it, and raise, as it would have.
                with _settings.SETTINGS.lock:
                    created = list(_settings.SETTINGS.outputs)
                failed = _failed(created)
                if failed:
                    done = {f for f in fs if f.done()}
                    return done | failed, fs - done
        finally:
            round_.cancel()  # stops waiting; the outputs themselves go on


def installed() -> bool:
    return isinstance(getattr(_stack, "asyncio", None), _RoundWaitAsyncio)


def _warn(why: str) -> None:
    """In a Pulumi run, on the CLI's warning channel; elsewhere (a test, a script) as a Python warning."""
    message = f"glm_infra.sdk_wait: the Pulumi SDK's wait left as it is: {why}"
    if _settings.get_engine() is not None:
        pulumi.log.warn(message)
    else:
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def install() -> bool:
    """Make the SDK's wait for outstanding outputs one wait per round (idempotent). Returns whether it
    is in place. Not when ``GLM_INFRA_SDK_WAIT=sdk`` (asked for: silent), nor, with a warning that
    says why, on an SDK version not in ``TESTED`` or one whose stack module has no ``asyncio`` to
    replace. Call it before registering resources (glm-infra's ``__main__.py`` does)."""
    if os.environ.get("GLM_INFRA_SDK_WAIT") == "sdk":
        return False
    if installed():
        return True
    try:
        version = metadata.version("pulumi")
    except metadata.PackageNotFoundError:
        version = "unknown"
    if version not in TESTED:
        _warn(f"pulumi {version} is not a version it was tested with ({', '.join(sorted(TESTED))})")
        return False
    if getattr(_stack, "asyncio", None) is not asyncio:
        _warn("pulumi.runtime.stack has no asyncio of its own to replace")
        return False
    _stack.asyncio = _RoundWaitAsyncio("asyncio")  # type: ignore[attr-defined]
    return True


def uninstall() -> None:
    if installed():
        _stack.asyncio = asyncio  # type: ignore[attr-defined]
