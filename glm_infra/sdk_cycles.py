"""The Pulumi Python SDK's dependency-cycle check without the walks that cannot find a cycle.

For every dependency it records (``depends_on``, a component's children, an input's resources), the SDK asks
whether the new edge FROM → TO closes a cycle by walking everything TO depends on, transitively, looking for
FROM (``pulumi.runtime.resource_cycle_breaker``). The walk grows with the graph, and a stack's long chains
(each host's steps, the rolling turns across hosts, the weights relay) make the sum quadratic: a 96-host
preview spent 90 of its program's 168 profiled seconds in it (196 million generator steps).

A cycle through FROM → TO needs a path from TO back to FROM, whose last edge ends at FROM: when no edge
recorded so far ends at FROM, there is none, and the edge is recorded without a walk. ``install()`` marks each
recorded edge's target and walks (the SDK's own walk) only for a FROM that is one: the same answers, the same
graph, the same error on a real cycle (``tests/test_sdk_cycles.py`` checks it against the SDK's own on random
graphs). Opt-in, as ``sdk_wait``: glm-infra's ``__main__.py`` installs it before any resource (edges recorded
before it are not marked); ``GLM_INFRA_SDK_CYCLES=sdk`` leaves the SDK as it is.
"""

from __future__ import annotations

import os
import warnings

import pulumi
import pulumi.runtime.resource_cycle_breaker as _breaker
import pulumi.runtime.rpc as _rpc
from pulumi.runtime import settings as _settings

DEPENDED_ON = "_glm_infra_depended_on"  # set on a resource once a recorded edge ends at it
_SDK_DECLARE = _breaker.declare_dependency


def declare_dependency(from_resource, to_resource) -> bool:
    """``resource_cycle_breaker.declare_dependency``: records FROM → TO and returns True, or returns False when
    it would close a cycle; walks the graph only when an edge already ends at FROM."""
    if from_resource is to_resource:
        return False  # a resource on itself: the SDK's walk finds FROM at once
    if getattr(from_resource, DEPENDED_ON, False):
        if not _SDK_DECLARE(from_resource, to_resource):
            return False
    else:
        _breaker._add_dep(from_resource, to_resource)
    setattr(to_resource, DEPENDED_ON, True)
    return True


def installed() -> bool:
    return _rpc.declare_dependency is declare_dependency


def install() -> bool:
    """Use ``declare_dependency`` for the SDK's cycle check (idempotent); returns whether it is in place. Not
    when ``GLM_INFRA_SDK_CYCLES=sdk``, nor, with a warning, on an SDK whose check is not where it was."""
    if os.environ.get("GLM_INFRA_SDK_CYCLES") == "sdk":
        return False
    if installed():
        return True
    if _rpc.declare_dependency is not _SDK_DECLARE or not callable(getattr(_breaker, "_add_dep", None)):
        message = "glm_infra.sdk_cycles: the Pulumi SDK's cycle check left as it is: it is not where it was"
        if _settings.get_engine() is not None:
            pulumi.log.warn(message)
        else:
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        return False
    _rpc.declare_dependency = declare_dependency  # type: ignore[assignment]
    return True


def uninstall() -> None:
    if installed():
        _rpc.declare_dependency = _SDK_DECLARE  # type: ignore[assignment]
