"""A problem of a stack, named by its key path: what validation rules return, and what the CLI and
``pulumi up`` print."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    path: str  # e.g. "glm-infra:prefill.hosts[1]"
    message: str


def key_path(top: str, rest: str = "") -> str:
    return f"glm-infra:{top}{rest}"
