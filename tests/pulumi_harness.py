"""Run the real ``__main__.py`` under Pulumi mocks and record what it registers.

The recording monitor keeps each RegisterResource request: type, name, parent, dependencies and
which inputs were sent as secrets — what the engine would receive from the program.
"""

from __future__ import annotations

import json
import runpy
from dataclasses import dataclass, field
from pathlib import Path

import pulumi
import yaml
from google.protobuf.json_format import MessageToDict
from pulumi.runtime import mocks as pmocks

from conftest import ROOT

SECRET_SIG = "1b47061264138c4ac30d75fd1eb44270"


@dataclass
class Registered:
    type: str
    name: str
    urn: str
    parent: str
    dependencies: list[str]
    inputs: dict
    secret_inputs: set[str] = field(default_factory=set)
    retain_on_delete: bool = False


class _Mocks(pulumi.runtime.Mocks):
    def new_resource(self, args: pulumi.runtime.MockResourceArgs):
        return [f"{args.name}-id", dict(args.inputs)]

    def call(self, args: pulumi.runtime.MockCallArgs):
        return {}


class RecordingMonitor(pmocks.MockMonitor):
    def __init__(self, mocks):
        super().__init__(mocks)
        self.registered: list[Registered] = []

    def RegisterResource(self, request):
        resp = super().RegisterResource(request)
        if request.type != "pulumi:pulumi:Stack":
            raw = MessageToDict(request.object)
            secret = {k for k, v in raw.items() if isinstance(v, dict) and SECRET_SIG in v.values()}
            inputs = {k: (v.get("value") if k in secret else v) for k, v in raw.items()}
            self.registered.append(
                Registered(request.type, request.name, resp.urn, request.parent, list(request.dependencies), inputs,
                           secret, bool(request.retainOnDelete))
            )
        return resp


@dataclass
class Run:
    resources: list[Registered]
    exports: dict

    def by_type(self, t: str) -> list[Registered]:
        return [r for r in self.resources if r.type == t]

    def get(self, name: str) -> Registered:
        (r,) = [r for r in self.resources if r.name == name]
        return r

    def urn(self, name: str) -> str:
        return self.get(name).urn


def pulumi_config(stack_path: Path, key_file: Path, secrets: dict[str, str] | None = None) -> tuple[dict, list]:
    """The config map the engine would hand the program: JSON strings, secrets decrypted and listed."""
    cfg = yaml.safe_load(stack_path.read_text())["config"]
    secret_keys = []
    for key, value in cfg.items():
        if isinstance(value, dict):
            for sub, v in list(value.items()):
                if isinstance(v, dict) and set(v) == {"secure"}:
                    value[sub] = (secrets or {}).get(f"{key}.{sub}", "decrypted-" + sub)
                    secret_keys.append(key)
    if "privateKeyPath" in cfg.get("glm-infra:ssh", {}):
        cfg["glm-infra:ssh"]["privateKeyPath"] = str(key_file)
    return {k: (v if isinstance(v, str) else json.dumps(v)) for k, v in cfg.items()}, secret_keys


def run_program(stack_path: Path, key_file: Path, stack: str = "test", secrets: dict | None = None) -> Run:
    config, secret_keys = pulumi_config(stack_path, key_file, secrets)
    pulumi.runtime.set_all_config(config, secret_keys)
    monitor = RecordingMonitor(_Mocks())
    pulumi.runtime.set_mocks(_Mocks(), project="glm-infra", stack=stack, preview=False, monitor=monitor)
    exports: dict = {}

    @pulumi.runtime.test
    def program():
        ns = runpy.run_path(str(ROOT / "__main__.py"), run_name="__pulumi_main__")
        cluster = ns["cluster"]
        return pulumi.Output.all(cluster.router_url, *[s.service.id for s in cluster.services.values()]).apply(
            lambda v: exports.update(routerUrl=v[0])
        )

    program()
    return Run(monitor.registered, exports)
