"""One wait per round for the Pulumi Python SDK's outstanding outputs, instead of one per output.

After a program's body has run, ``pulumi.runtime.stack.wait_for_rpcs`` waits for every pending output
with ``asyncio.wait(pending, return_when=FIRST_COMPLETED)``, puts the unfinished ones back and waits
again: each wait adds and removes a callback on every pending output, and it runs again after each
completion, so the cost grows with the square of the outputs. A 96-host stack (3408 resources) spent
66 s of a 193-s preview there (cProfile in the language host), and the preview took 216.8 s; with one
wait per round it took 55 s (README, "Fleet-sized preview").

``install()`` makes that one call wait with ``FIRST_EXCEPTION`` instead: it returns when every output
of the round is done, or as soon as one fails, so an error still surfaces at once (the reason for
FIRST_COMPLETED) and a round costs one callback per output. It replaces only the ``asyncio`` name
inside ``pulumi.runtime.stack`` with a view of ``asyncio`` whose ``wait`` maps FIRST_COMPLETED to
FIRST_EXCEPTION; nothing else in the SDK or the program changes. The Cluster and Hosts components
install it; ``GLM_INFRA_SDK_WAIT=sdk`` leaves the SDK as it is. Remove it once the SDK waits linearly.
"""

from __future__ import annotations

import asyncio
import os
import types

import pulumi.runtime.stack as _stack


class _RoundWaitAsyncio(types.ModuleType):
    """``asyncio`` as ``pulumi.runtime.stack`` sees it: the same module but for ``wait``."""

    def __getattr__(self, name: str):
        return getattr(asyncio, name)

    @staticmethod
    async def wait(fs, *, timeout=None, return_when=asyncio.ALL_COMPLETED):
        if return_when == asyncio.FIRST_COMPLETED:
            return_when = asyncio.FIRST_EXCEPTION
        return await asyncio.wait(fs, timeout=timeout, return_when=return_when)


def installed() -> bool:
    return isinstance(getattr(_stack, "asyncio", None), _RoundWaitAsyncio)


def install() -> bool:
    """Make the SDK's wait for outstanding outputs one wait per round (idempotent). Returns whether it
    is in place: not when ``GLM_INFRA_SDK_WAIT=sdk``, nor when this SDK's stack module has no
    ``asyncio`` to replace."""
    if os.environ.get("GLM_INFRA_SDK_WAIT") == "sdk":
        return False
    if not installed() and getattr(_stack, "asyncio", None) is asyncio:
        _stack.asyncio = _RoundWaitAsyncio("asyncio")  # type: ignore[attr-defined]
    return installed()


def uninstall() -> None:
    if installed():
        _stack.asyncio = asyncio  # type: ignore[attr-defined]
