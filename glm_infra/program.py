"""What ``__main__.py`` needs from a Pulumi run: the stack file's keys, validated with file and line
in the messages, as the ``ClusterArgs`` of a ``Cluster`` (secrets as secret Outputs).

A bad stack stops the program here, before any resource is registered, with the same messages as
``glm-infra validate``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pulumi

from . import state_backend
from .args import ClusterArgs
from .plan import capacity
from .spec.config import PROGRAM_KEYS, SECRET_PATHS, StackConfig, snake
from .stack import StackError, load_pulumi_config

if TYPE_CHECKING:
    from .components.cluster import Cluster


def load() -> ClusterArgs:
    try:
        loaded = load_pulumi_config()
    except StackError as e:
        raise pulumi.RunError(str(e)) from None
    for w in loaded.warnings:
        pulumi.log.warn(w)
    found = state_backend.verdict(pulumi.get_stack(), loaded.config.state_in_checkout, pulumi.runtime.is_dry_run())
    if found and found[0] == "error":
        raise pulumi.RunError(found[1])
    if found:
        pulumi.log.warn(found[1])
    return cluster_args(loaded.config)


def cluster_args(stack: StackConfig) -> ClusterArgs:
    """A validated stack as Cluster args: snake_case keys, each secret a secret Output (a secret read
    offline, without its plaintext, is left out: give it yourself)."""
    out: dict[str, Any] = stack.model_dump(exclude_none=True, exclude=set(PROGRAM_KEYS))
    for top, sub in SECRET_PATHS:
        block = getattr(stack, top)
        field = snake(sub)
        value = getattr(block, field, None) if block is not None else None
        if value is None:
            continue
        if value.plaintext is None:
            out[top].pop(field, None)
            continue
        out[top][field] = pulumi.Output.secret(value.plaintext)
    return out  # type: ignore[return-value]


def capacity_output(cluster: Cluster) -> pulumi.Output[dict[str, Any]]:
    """The stack output ``capacity`` (glm_infra/plan/capacity.py): each pool's KV room per rank, from the
    hosts' preflight GPU memory once their facts are read (the GPU table before)."""
    stack = cluster.stack
    return cluster.facts.apply(lambda facts: capacity.as_output(stack, facts))
