"""Run the real ``__main__.py`` under Pulumi mocks and record what it registers.

The recording monitor keeps each RegisterResource request: type, name, parent, dependencies and
which inputs were sent as secrets — what the engine would receive from the program.
"""

from __future__ import annotations

import json
import logging
import runpy
from dataclasses import dataclass, field
from pathlib import Path

import pulumi
import yaml
from google.protobuf.json_format import MessageToDict
from pulumi.runtime import mocks as pmocks
from pulumi.runtime.stack import massage

from conftest import ROOT
from glm_infra.components.remote_step import RELAY_KEY_COMMAND, TRIGGER_KEY_COMMAND

SECRET_KEY = "4dabf18193072939515e22adb298388d"  # the Pulumi wire format's "special value" key
SECRET_SIG = "1b47061264138c4ac30d75fd1eb44270"  # ... whose value marks a secret


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
    raw_inputs: dict = field(default_factory=dict)  # as sent, secrets still wrapped in their markers
    additional_secret_outputs: list[str] = field(default_factory=list)
    custom_timeouts: dict = field(default_factory=dict)  # {"create": "5m", "update": "5m"} as sent
    outputs: dict = field(default_factory=dict)  # what the mocks answered (the engine marks secret the
    # outputs whose input was secret and those in additional_secret_outputs)
    ignore_changes: list[str] = field(default_factory=list)
    aliases: list = field(default_factory=list)  # as sent: URNs (aliasURNs) or specs (aliases)
    on_error: list[str] = field(default_factory=list)  # the names of its error hooks


class _Mocks(pulumi.runtime.Mocks):
    # What a StackReference reads under the mocks: {stack name: outputs} (set by a test).
    stack_outputs: dict[str, dict] = {}
    # What the trigger key's command (remote_step.TRIGGER_KEY_COMMAND: 32 random bytes as 64 hex digits,
    # made once and kept in the stack's state) prints: the same in every run, as a deployed stack's is.
    trigger_key: str = "7f3c" * 16
    # What the relay key's command (remote_step.RELAY_KEY_COMMAND) prints: another stack secret, the same in every run.
    relay_key: str = "5e1a" * 16
    router_ca: str = "-----BEGIN CERTIFICATE-----\nmock\n-----END CERTIFICATE-----\n"

    def new_resource(self, args: pulumi.runtime.MockResourceArgs):
        if args.typ == "pulumi:pulumi:StackReference":
            name = args.inputs.get("name", args.name)
            return [name, {"name": name, "outputs": self.stack_outputs.get(name, {})}]
        outputs = dict(args.inputs)
        # A local command that echoes a value (an inventory lookup in the tests) answers it on stdout.
        create = outputs.get("create")
        if args.typ == "command:local:Command" and isinstance(create, str) and create.startswith("echo "):
            outputs["stdout"] = create.removeprefix("echo ")
        if args.typ == "command:local:Command" and create == TRIGGER_KEY_COMMAND:
            outputs["stdout"] = self.trigger_key
        if args.typ == "command:local:Command" and create == RELAY_KEY_COMMAND:
            outputs["stdout"] = self.relay_key
        if args.typ == "command:remote:Command" and args.name.endswith("-ca-export"):
            outputs["stdout"] = self.router_ca  # router.host's CA, read on the host (roles/router/ha.py)
        return [f"{args.name}-id", outputs]

    def call(self, args: pulumi.runtime.MockCallArgs):
        return {}


class RecordingMonitor(pmocks.MockMonitor):
    def __init__(self, mocks):
        super().__init__(mocks)
        self.registered: list[Registered] = []
        self.outputs: dict[str, dict] = {}  # urn -> registered outputs (components and the stack)

    def RegisterResourceOutputs(self, request):
        self.outputs[request.urn] = MessageToDict(request.outputs)
        return super().RegisterResourceOutputs(request)

    def RegisterResource(self, request):
        resp = super().RegisterResource(request)
        if request.type != "pulumi:pulumi:Stack":
            raw = MessageToDict(request.object)
            secret = {k for k, v in raw.items() if isinstance(v, dict) and SECRET_SIG in v.values()}
            inputs = {k: (v.get("value") if k in secret else v) for k, v in raw.items()}
            self.registered.append(
                Registered(request.type, request.name, resp.urn, request.parent, list(request.dependencies), inputs,
                           secret, bool(request.retainOnDelete), raw, list(request.additionalSecretOutputs),
                           {k: v for k, v in MessageToDict(request.customTimeouts).items() if v},
                           MessageToDict(resp.object), list(request.ignoreChanges),
                           [*request.aliasURNs, *(MessageToDict(a) for a in request.aliases)],
                           list(request.hooks.on_error))
            )
        return resp


@dataclass
class Run:
    resources: list[Registered]
    exports: dict
    outputs: dict[str, dict] = field(default_factory=dict)
    logs: list[str] = field(default_factory=list)

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


def _mock(stack: str) -> tuple[RecordingMonitor, "_LogRecorder"]:
    monitor = RecordingMonitor(_Mocks())
    logs = _LogRecorder()
    logger = logging.getLogger(f"glm-infra-mocks-{id(logs)}")
    logger.addHandler(logs)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    pulumi.runtime.set_mocks(_Mocks(), project="glm-infra", stack=stack, preview=False, monitor=monitor,
                             logger=logger)
    return monitor, logs


def run_callable(fn, stack: str = "test", config: dict | None = None, secret_keys: list | None = None,
                 stack_outputs: dict | None = None) -> tuple[Run, object]:
    """Run ``fn()`` as a Pulumi program under the mocks; returns what was registered and what ``fn``
    returned (an Output is awaited). ``config``: the program's config (values as the engine passes
    them: JSON strings for objects); ``stack_outputs``: what StackReferences read."""
    pulumi.runtime.set_all_config({k: (v if isinstance(v, str) else json.dumps(v)) for k, v in (config or {}).items()},
                                  secret_keys or [])
    _Mocks.stack_outputs = stack_outputs or {}
    monitor, logs = _mock(stack)
    result: list = []

    @pulumi.runtime.test
    def program():
        value = fn()
        return pulumi.Output.from_input(value).apply(result.append) if value is not None else None

    program()
    return Run(monitor.registered, {}, monitor.outputs, logs.messages), (result[0] if result else None)


def run_program(stack_path: Path, key_file: Path, stack: str = "test", secrets: dict | None = None) -> Run:
    config, secret_keys = pulumi_config(stack_path, key_file, secrets)
    pulumi.runtime.set_all_config(config, secret_keys)
    monitor, logs = _mock(stack)
    exports: dict = {}

    @pulumi.runtime.test
    def program():
        root = pulumi.runtime.get_root_resource()
        root.outputs = {}  # the mocks keep one root stack per process
        ns = runpy.run_path(str(ROOT / "__main__.py"), run_name="__pulumi_main__")
        # The stack's exports, registered as the engine would get them at the end of a run.
        root.register_outputs(massage(root.outputs, []))
        cluster = ns["cluster"]
        return pulumi.Output.all(cluster.router_url, *[s.service.id for s in cluster.services.values()]).apply(
            lambda v: exports.update(routerUrl=v[0])
        )

    program()
    return Run(monitor.registered, exports, monitor.outputs, logs.messages)


class _LogRecorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _is_secret(value) -> bool:
    return isinstance(value, dict) and value.get(SECRET_KEY) == SECRET_SIG


def plaintext_places(value, needle: str, path: str = "") -> list[str]:
    """Where ``needle`` appears in ``value`` outside values marked secret (paths like ``.create``)."""
    if _is_secret(value):
        return []
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in plaintext_places(v, needle, f"{path}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in plaintext_places(v, needle, f"{path}[{i}]")]
    return [path or "."] if isinstance(value, str) and needle in value else []


def secret_fields(value) -> set[str]:
    """The top-level fields that are, or hold, a value marked secret."""
    def holds(v) -> bool:
        return _is_secret(v) or (isinstance(v, dict) and any(holds(x) for x in v.values())) or (
            isinstance(v, list) and any(holds(x) for x in v))
    return {k for k, v in value.items() if holds(v)}


def leaks(run: Run, needle: str) -> list[str]:
    """Every place the program handed ``needle`` to the engine in plaintext: resource names, types and
    inputs, component and stack outputs, log messages. Empty when it travels only as a secret."""
    out = []
    for r in run.resources:
        if needle in r.name or needle in r.urn:
            out.append(f"{r.name}: its name")
        out += [f"{r.name}: input {p.lstrip('.')}" for p in plaintext_places(r.raw_inputs, needle)]
    for urn, outputs in run.outputs.items():
        out += [f"{urn.rsplit('::', 1)[-1]}: output {p.lstrip('.')}" for p in plaintext_places(outputs, needle)]
    out += [f"log: {m[:80]}" for m in run.logs if needle in m]
    return out
