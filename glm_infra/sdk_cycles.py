"""The Pulumi Python SDK's dependency-cycle check, searched from both ends instead of walking everything.

For every dependency it records (``depends_on``, a component's children, an input's resources), the SDK asks
whether the new edge FROM → TO closes a cycle by walking everything TO depends on, transitively, looking for
FROM (``pulumi.runtime.resource_cycle_breaker``). The walk grows with the graph, and a stack's long chains
(each host's steps, the rolling turns across hosts, the weights relay) make the sum quadratic: a 96-host
preview spent 90 of its program's 168 profiled seconds in it (196 million generator steps).

A cycle through FROM → TO needs a path from TO back to FROM. ``install()`` also keeps, on each resource,
who depends on it, and searches for that path from both ends at once (TO's dependencies forward, FROM's
dependents backward, the smaller frontier first): a resource being registered has few dependents yet, so the
search usually ends after a step or two. The same answers, the same graph, the same error on a real cycle
(``tests/test_sdk_cycles.py`` checks it against the SDK's own on random graphs).

Opt-in, as ``sdk_wait``: glm-infra's ``__main__.py`` installs it before any resource (the dependents of edges
recorded before it are not known); ``GLM_INFRA_SDK_CYCLES=sdk`` leaves the SDK as it is.
"""

from __future__ import annotations

import os
import warnings

import pulumi
import pulumi.runtime.resource_cycle_breaker as _breaker
import pulumi.runtime.rpc as _rpc
from pulumi.runtime import settings as _settings

DEPENDENTS = "_glm_infra_dependents"  # on a resource: the resources whose recorded edges end at it
_SDK_DECLARE = _breaker.declare_dependency


def _dependents(res) -> set:
    return getattr(res, DEPENDENTS, set())


def _level(frontier: list, seen: set, other: set, neighbours) -> tuple[list, bool]:
    """One level further from FRONTIER over NEIGHBOURS: the next frontier (each added to SEEN), and whether
    a neighbour is in OTHER (the search from the other end met this one)."""
    nxt = []
    for r in frontier:
        for d in neighbours(r):
            if d in other:
                return nxt, True
            if d not in seen:
                seen.add(d)
                nxt.append(d)
    return nxt, False


def _reaches(start, goal) -> bool:
    """Whether the recorded graph has a path START ⇝ GOAL: searched from both ends at once (START's
    dependencies, GOAL's dependents), a level of the smaller frontier at a time, so the cost follows the
    smaller side instead of everything START depends on."""
    if start is goal:
        return True
    ahead, behind = {start}, {goal}  # reached from START, reaching GOAL
    ahead_frontier, behind_frontier = [start], [goal]
    while ahead_frontier and behind_frontier:
        if len(ahead_frontier) <= len(behind_frontier):
            ahead_frontier, met = _level(ahead_frontier, ahead, behind, _breaker._deps)
        else:
            behind_frontier, met = _level(behind_frontier, behind, ahead, _dependents)
        if met:
            return True
    return False


def declare_dependency(from_resource, to_resource) -> bool:
    """``resource_cycle_breaker.declare_dependency``: records FROM → TO and returns True, or returns False when
    TO already reaches FROM (the edge would close a cycle)."""
    if _reaches(to_resource, from_resource):
        return False
    _breaker._add_dep(from_resource, to_resource)
    dependents = getattr(to_resource, DEPENDENTS, None)
    if dependents is None:
        setattr(to_resource, DEPENDENTS, {from_resource})
    else:
        dependents.add(from_resource)  # in place: a resource many depend on is not copied for each
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
