"""The Pulumi Python SDK's own debug chatter kept inside the program.

The SDK's runtime logs about five debug lines for every resource it registers ("registering resource…",
"resource registration prepared…", "beginning rpc…") and sends each one to the engine as a synchronous
``Log`` RPC: the program blocks on the engine for every line, and the engine handles each as a diagnostic
event that only ``pulumi --debug`` would show. A 24-host preview (1,054 resources) sent 5,007 of them; without
them its CPU-seconds fell from 18.1 to 14.1 (the program 8.5 → 6.0, the engine 7.8 → 6.4; docs/PERFORMANCE.md,
"Fleet-sized preview").

``quiet()`` gives the SDK's runtime modules (``pulumi.runtime.*``, which ``from .. import log``) a view of
``pulumi.log`` whose ``debug`` drops the line; ``info``, ``warn`` and ``error``, and ``pulumi.log.debug`` as a
program (glm_infra's components included) calls it, are untouched. Opt-in, as ``sdk_wait``: glm-infra's
``__main__.py`` calls it; ``GLM_INFRA_SDK_DEBUG=1`` keeps the chatter (with ``pulumi --debug``, to debug the SDK).
"""

from __future__ import annotations

import importlib
import os
import types

import pulumi.log

# The SDK's runtime modules that log through ``pulumi.log`` (each ``from .. import log``).
RUNTIME_MODULES = ("pulumi.runtime.resource", "pulumi.runtime.rpc", "pulumi.runtime.rpc_manager",
                   "pulumi.runtime.stack", "pulumi.runtime.invoke", "pulumi.runtime._callbacks")


class _QuietLog(types.ModuleType):
    """``pulumi.log`` as the SDK's runtime sees it: the same module but for ``debug``."""

    def __getattr__(self, name: str):
        return getattr(pulumi.log, name)

    @staticmethod
    def debug(*args, **kwargs) -> None:
        return None


def _modules() -> list[types.ModuleType]:
    out = []
    for name in RUNTIME_MODULES:
        try:
            out.append(importlib.import_module(name))
        except ImportError:
            continue  # an SDK without this module: nothing of it to quiet
    return out


def quiet() -> list[str]:
    """Drop the SDK runtime's debug lines (idempotent); returns the modules quieted (none when
    ``GLM_INFRA_SDK_DEBUG=1``). Call it before registering resources."""
    if os.environ.get("GLM_INFRA_SDK_DEBUG") == "1":
        return []
    done = []
    for m in _modules():
        if getattr(m, "log", None) is pulumi.log:
            m.log = _QuietLog("pulumi.log")  # type: ignore[attr-defined]
        if isinstance(getattr(m, "log", None), _QuietLog):
            done.append(m.__name__)
    return done


def restore() -> None:
    for m in _modules():
        if isinstance(getattr(m, "log", None), _QuietLog):
            m.log = pulumi.log  # type: ignore[attr-defined]
