"""Component Args that may hold values other resources produce (``pulumi.Input``): the plain part is
validated at once, with the same rules and messages as a stack file, and the resources are shaped
from it; the values that come later (host addresses, the mirror URL) are filled in when known, and
the secrets travel as secret Outputs only.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pulumi

from .plan import topology
from .plan.validate import Problem, secret_value_problem
from .spec.config import SECRETS, StackConfig, snake
from .stack import LoadedStack, StackError, load_dict

# Stand-ins while a value is unknown: TEST-NET-2 addresses, which no real host has.
_PLACEHOLDER_NET = "198.51.100."
_PLACEHOLDER_URL = "http://198.51.100.254/mirror"


def is_input(value: Any) -> bool:
    """A value another resource produces (known only when the program deploys)."""
    return isinstance(value, pulumi.Output) or inspect.isawaitable(value)


@dataclass
class SplitArgs:
    raw: dict  # plain, with stand-ins: what is validated and shapes the resources
    addresses: dict[str, pulumi.Input[str]] = field(default_factory=dict)  # host name → later address
    mirror_url: pulumi.Input[str] | None = None
    secrets: dict[str, pulumi.Input[str]] = field(default_factory=dict)  # template name → value
    private_key_path: str | None = None

    @property
    def later(self) -> bool:
        return bool(self.addresses) or self.mirror_url is not None


def _get(d: Mapping, *keys: str) -> Any:
    for k in keys:
        if isinstance(d, Mapping) and k in d:
            return d[k]
    return None


def split(args: Mapping[str, Any]) -> SplitArgs:
    """Separate the Inputs of Cluster/Hosts args from what can be judged now."""
    raw = {k: (copy.copy(v) if isinstance(v, dict) else v) for k, v in dict(args).items()}
    out = SplitArgs(raw)
    hosts = raw.get("hosts")
    if isinstance(hosts, (list, tuple)):
        raw["hosts"] = [dict(h) if isinstance(h, Mapping) else h for h in hosts]
        for i, h in enumerate(raw["hosts"]):
            if isinstance(h, dict) and is_input(h.get("address")):
                out.addresses[str(h.get("name"))] = h["address"]
                h["address"] = f"{_PLACEHOLDER_NET}{i + 1}"
    model = raw.get("model")
    if isinstance(model, dict):
        for key in ("mirror_url", "mirrorUrl"):
            if is_input(model.get(key)):
                out.mirror_url = model[key]
                model[key] = _PLACEHOLDER_URL
    for name, (top, camel) in SECRETS.items():
        block = raw.get(top)
        if not isinstance(block, dict):
            continue
        for key in (snake(camel), camel):
            value = block.get(key)
            if value is None:
                continue
            if isinstance(value, str) or is_input(value):
                out.secrets[name] = value  # the component wraps it as a secret Output
                block[key] = "<secret>"  # validated as set
    ssh = raw.get("ssh")
    if isinstance(ssh, dict):
        out.private_key_path = _get(ssh, "private_key_path", "privateKeyPath")
    return out


@dataclass(frozen=True)
class Resolved:
    stack: StackConfig
    plan: topology.Plan


def load(args: Mapping[str, Any], source: str, serve: bool = True) -> tuple[SplitArgs, LoadedStack]:
    """Validate what can be judged now; raise ``StackError`` (the same messages as ``glm-infra
    validate``) before any resource exists."""
    s = split(args)
    bad = [p for name, value in s.secrets.items() if isinstance(value, str) and (p := secret_value_problem(name, value))]
    try:
        loaded = load_dict(s.raw, source, serve)
    except StackError as e:
        raise StackError(source, e.problems + bad, e.lines) from None
    if bad:
        raise StackError(source, bad)
    return s, loaded


def checked_secret(name: str, value: pulumi.Input[str], source: str) -> pulumi.Output[str]:
    """A secret as a secret Output, checked once its value is known (config.SECRET_VALUE_RULES): for
    one another resource produces; one given as a string ``load`` checked already, before any resource."""

    def check(v: str) -> str:
        problem = secret_value_problem(name, v)
        if problem is not None:
            raise pulumi.RunError(str(StackError(source, [problem])))
        return v

    return pulumi.Output.secret(pulumi.Output.from_input(value).apply(check))


def resolve(loaded: LoadedStack, s: SplitArgs, source: str, serve: bool = True,
            runtime: bool = False) -> pulumi.Output[Resolved]:
    """The stack with every value known, once the resources producing them have run, checked again
    (an address known only now must still be unique)."""
    if not s.later:
        return pulumi.Output.from_input(Resolved(loaded.config, topology.plan(loaded.config, serve, runtime)))
    keys = sorted(s.addresses)
    values = [s.addresses[k] for k in keys] + ([s.mirror_url] if s.mirror_url is not None else [])

    def fill(vals: list) -> Resolved:
        addresses = dict(zip(keys, vals[: len(keys)]))
        raw = copy.deepcopy(s.raw)
        raw["hosts"] = [{**h, "address": addresses.get(h["name"], h["address"])} for h in raw["hosts"]]
        if s.mirror_url is not None:
            model = raw["model"]
            model["mirror_url" if "mirror_url" in model else "mirrorUrl"] = vals[-1]
        try:
            config = load_dict(raw, source, serve).config
        except StackError as e:
            raise pulumi.RunError(str(e)) from None
        if _shape(config, serve) != _shape(loaded.config, serve):  # cannot happen: counts come from plain values
            raise pulumi.RunError(f"{source}: the resolved stack has another shape")
        return Resolved(config, topology.plan(config, serve, runtime))

    return pulumi.Output.all(*values).apply(fill)


def _shape(config: StackConfig, serve: bool) -> tuple:
    p = topology.plan(config, serve)
    return tuple((h.name, tuple(i.name for i in h.instances), h.runs_router) for h in p.hosts)


def problems_of(e: StackError) -> list[Problem]:
    return e.problems
