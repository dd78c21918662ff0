"""What ``__main__.py`` needs from a Pulumi run: the validated stack, its plan and its secrets.

A bad stack stops the program here, before any resource is registered, with the same messages as
``glm-infra validate``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pulumi

from . import topology
from .config import StackConfig
from .stack import StackError, load_pulumi_config
from .validate import Problem


@dataclass
class Deployment:
    stack: StackConfig
    plan: topology.Plan
    private_key: pulumi.Output[str]
    secrets: dict[str, pulumi.Output[str]]


def load() -> Deployment:
    try:
        loaded = load_pulumi_config()
        for w in loaded.warnings:
            pulumi.log.warn(w)
        stack = loaded.config
        return Deployment(
            stack=stack,
            plan=topology.plan(stack),
            private_key=pulumi.Output.secret(_private_key(stack, loaded.source)),
            secrets=_secrets(stack),
        )
    except StackError as e:
        raise pulumi.RunError(str(e)) from None


def _private_key(stack: StackConfig, source: str) -> str:
    ssh = stack.ssh
    if ssh.private_key is not None:
        assert ssh.private_key.plaintext is not None  # decrypted by the engine
        return ssh.private_key.plaintext
    assert ssh.private_key_path is not None
    path = os.path.expanduser(ssh.private_key_path)
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        raise StackError(source, [Problem("glm-infra:ssh.privateKeyPath", f"cannot read {path}: {e.strerror}")]) from None


def _secrets(stack: StackConfig) -> dict[str, pulumi.Output[str]]:
    out: dict[str, pulumi.Output[str]] = {}
    if stack.router is not None and stack.router.api_key is not None and stack.router.api_key.plaintext is not None:
        out["router_api_key"] = pulumi.Output.secret(stack.router.api_key.plaintext)
    if stack.model.hf_token is not None and stack.model.hf_token.plaintext is not None:
        out["hf_token"] = pulumi.Output.secret(stack.model.hf_token.plaintext)
    return out
