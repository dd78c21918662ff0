"""Loading a stack: from a ``stacks/Pulumi.<stack>.yaml`` file (CLI, offline) or from the config a
Pulumi run hands the program. Both paths end in the same model and the same rules, and both report
problems as ``file: line: key path: reason`` without a traceback.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from .plan.model_checks import GPU_COMPUTE_CAPABILITY, capacity_warnings, unpinned_revision
from .plan.ports import firewall_warnings
from .plan.startup import single_host_warnings
from .plan.validate import Problem, check
from .spec import pins
from .spec.config import NAMESPACE, SECRET_PATHS, STACK_KEYS, StackConfig

PROJECT_DIR = Path(__file__).resolve().parent.parent


@dataclass
class StackError(Exception):
    """A stack that must not be applied. ``str()`` is the message users see."""

    source: str
    problems: list[Problem]
    lines: dict[str, int] = field(default_factory=dict)

    def __str__(self) -> str:
        out = [f"{self.source}: invalid stack ({len(self.problems)} problem{'s' if len(self.problems) != 1 else ''})"]
        for p in self.problems:
            line = _line_for(self.lines, p.path)
            where = f"{self.source}:{line}" if line else self.source
            out.append(f"  {where}: {p.path}: {p.message}")
        return "\n".join(out)


@dataclass(frozen=True)
class LoadedStack:
    config: StackConfig
    source: str
    warnings: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The stack's name: ``prod-b300`` for ``stacks/Pulumi.prod-b300.yaml`` (a file of another name:
        its stem)."""
        base = Path(self.source).name
        m = re.fullmatch(r"Pulumi\.(.+)\.ya?ml", base)
        return m[1] if m else Path(base).stem


def resolve_stack_file(stack: str, project_dir: Path | None = None) -> Path:
    """A stack name (``prod-b300``) or a path to a stack file.

    Names are looked up in ``stacks/`` of the project around the current directory (the nearest
    folder with a Pulumi.yaml), then of this source tree.
    """
    p = Path(stack)
    if p.suffix in (".yaml", ".yml") or os.sep in stack:
        return p
    name = f"Pulumi.{stack}.yaml"
    candidates = [project_dir] if project_dir else []
    cwd = Path.cwd()
    candidates += [d for d in (cwd, *cwd.parents) if (d / "Pulumi.yaml").is_file()][:1]
    candidates.append(PROJECT_DIR)
    for d in candidates:
        if (d / "stacks" / name).is_file():
            return _display(d / "stacks" / name)
    return _display(candidates[0] / "stacks" / name)


def _display(p: Path) -> Path:
    """``p`` relative to the current directory when it is below it (shorter messages)."""
    try:
        return p.resolve().relative_to(Path.cwd())
    except ValueError:
        return p


def load_file(path: Path, capacity: bool = True) -> LoadedStack:
    """``capacity=False``: without the KV-room rule (``capacity fetch`` writes the facts it needs)."""
    source = str(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise StackError(source, [Problem("(file)", f"cannot read: {e.strerror}")]) from None
    try:
        doc = yaml.safe_load(text)
        lines = _key_lines(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        reason = getattr(e, "problem", None) or str(e)
        raise StackError(source, [Problem("(yaml)", f"YAML syntax error at {where}: {reason}")]) from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise StackError(source, [Problem("(file)", "a stack file is a mapping with a 'config' key")])
    cfg = doc.get("config") or {}
    if not isinstance(cfg, dict):
        raise StackError(source, [Problem("config", "must be a mapping of keys to values")], lines)
    raw, problems = _namespace(cfg)
    problems += _secret_problems(raw, encrypted_ok=True, secret_keys=None)
    return _build(raw, source, problems, lines, capacity=capacity)


def load_pulumi_config(project: str = NAMESPACE) -> LoadedStack:
    """The stack as the running Pulumi program sees it (secrets decrypted, still marked secret)."""
    import pulumi
    from pulumi.runtime import config as rt

    source = f"stacks/Pulumi.{pulumi.get_stack()}.yaml"
    all_cfg: dict[str, Any] = dict(rt.CONFIG.get() or {})
    env_cfg = rt.get_config_env() or {}
    all_cfg.update({k: v for k, v in env_cfg.items() if k not in all_cfg})
    cfg: dict[str, Any] = {}
    for k, v in all_cfg.items():
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError:
                pass
        cfg[k] = v
    raw, problems = _namespace(cfg)
    secret_keys = {k.split(":", 1)[1] for k in all_cfg if rt.is_config_secret(k) and k.startswith(f"{project}:")}
    problems += _secret_problems(raw, encrypted_ok=False, secret_keys=secret_keys)
    lines: dict[str, int] = {}
    try:
        lines = _key_lines(Path(source).read_text())
    except (OSError, yaml.YAMLError):
        pass  # line numbers are a courtesy; the engine already parsed the file
    return _build(raw, source, problems, lines)


def _namespace(cfg: dict[str, Any]) -> tuple[dict[str, Any], list[Problem]]:
    raw: dict[str, Any] = {}
    problems: list[Problem] = []
    for k, v in cfg.items():
        ns, _, key = str(k).partition(":")
        if ns != NAMESPACE or not key:
            continue  # other namespaces (pulumi:, command:) are not ours to judge
        if key not in STACK_KEYS:
            hint = _closest(key, STACK_KEYS)
            problems.append(Problem(f"{NAMESPACE}:{key}", f"unknown key{hint}"))
            continue
        raw[key] = v
    return raw, problems


def _secret_problems(raw: dict[str, Any], *, encrypted_ok: bool, secret_keys: set[str] | None) -> list[Problem]:
    out = []
    for top, sub in SECRET_PATHS:
        block = raw.get(top)
        if not isinstance(block, dict) or sub not in block or block[sub] is None:
            continue
        value = block[sub]
        path = f"{NAMESPACE}:{top}.{sub}"
        hint = f"set it with: pulumi config set --secret --path '{path}' < FILE"
        if encrypted_ok:
            if not (isinstance(value, dict) and "secure" in value):
                out.append(Problem(path, f"is plaintext in the stack file; it must be a secret ({hint})"))
        elif secret_keys is not None and top not in secret_keys:
            out.append(Problem(path, f"is not a secret; {hint}"))
    return out


def unprefixed(config: dict[str, Any]) -> dict[str, Any]:
    """A stack file's ``config`` as load_dict takes it: its glm-infra:* keys without the prefix (other
    namespaces left out)."""
    return {str(k)[len(NAMESPACE) + 1:]: v for k, v in config.items() if str(k).startswith(f"{NAMESPACE}:")}


def load_dict(raw: dict[str, Any], source: str, serve: bool = True) -> LoadedStack:
    """A stack given as the ``glm-infra:*`` keys without their prefix (``{"hosts": [...], ...}``, keys
    camelCase or snake_case), as components get it: the same model, rules and messages as a file."""
    if not isinstance(raw, dict):
        raise StackError(source, [Problem("(args)", "must be a mapping of glm-infra keys to values")])
    problems = [Problem(f"{NAMESPACE}:{k}", f"unknown key{_closest(str(k), STACK_KEYS)}")
                for k in raw if k not in STACK_KEYS and _snake_to_camel(str(k)) not in STACK_KEYS]
    return _build({k: v for k, v in raw.items() if k in STACK_KEYS or _snake_to_camel(str(k)) in STACK_KEYS},
                  source, problems, {}, serve)


def _snake_to_camel(key: str) -> str:
    head, *rest = key.split("_")
    return head + "".join(w.title() for w in rest)


def _build(raw: dict[str, Any], source: str, problems: list[Problem], lines: dict[str, int],
           serve: bool = True, capacity: bool = True) -> LoadedStack:
    config: StackConfig | None = None
    try:
        config = StackConfig.model_validate(raw)
    except ValidationError as e:
        problems = problems + [_from_pydantic(err) for err in e.errors()]
    if config is not None and not problems:
        problems = check(config, serve, capacity)
    if problems:
        raise StackError(source, problems, lines)
    assert config is not None
    return LoadedStack(config=config, source=source, warnings=tuple(_warnings(config, serve, capacity)))


def monitoring_warnings(stack: StackConfig, serve: bool = True) -> list[str]:
    """What leaves the stack's own failures unpaged: no dead man's switch (the monitoring host down pages
    nobody), and Prometheus on the router's host (its reboot is an outage that no alert reports)."""
    host = stack.monitoring_host
    if host is None:
        return []
    out = []
    if stack.monitoring.dead_mans_switch_url is None:
        out.append(f"{NAMESPACE}:monitoring.deadMansSwitchUrl is not set: when {host} (Prometheus and Alertmanager), "
                   "or either of them, is down, no alert fires and nothing pages; set a dead man's switch, a "
                   "heartbeat service outside the stack that pages when the Watchdog alert stops arriving")
    if serve and stack.router is not None and host in (stack.router.host, *stack.router.standby_hosts):
        stops = ("every alert while the other router host serves" if stack.router.standby_hosts
                 else "serving and every alert at once")
        out.append(f"{NAMESPACE}:monitoring.host: {host} also runs the router, so its reboot stops {stops}; put "
                   "Prometheus and Alertmanager on another host (monitoring.host)")
    return out


def _warnings(stack: StackConfig, serve: bool = True, capacity: bool = True) -> list[str]:
    out = capacity_warnings(stack) if serve and capacity else []
    out += single_host_warnings(stack) if serve else []
    out += firewall_warnings(stack, serve)
    out += monitoring_warnings(stack, serve)
    unchecked = [h.name for h in stack.hosts if h.host_key is None]
    if unchecked:
        out.append(f"{NAMESPACE}:hosts[].hostKey is not set for {', '.join(unchecked)}: whatever answers SSH on their "
                   "addresses is taken for them (and gets the steps' secret files); set each host's public key "
                   "(its /etc/ssh/ssh_host_ed25519_key.pub, read over a path you trust)")
    if stack.router is not None and stack.router.api_key is None:
        out.append(f"{NAMESPACE}:router.apiKey is not set: the router's public port accepts any client")
    if (unpinned := unpinned_revision(stack)) is not None:
        out.append(f"{unpinned.path}: {unpinned.message}")
    for key, version, known, what in (
        ("runtime.vllmVersion", stack.runtime.vllm_version, pins.VLLM_CHOICES, "the model's parsers, the all2all backend, "
         "the CUDA graph mode"),
        ("runtime.routerVersion", stack.runtime.router_version, pins.ROUTER_CHOICES, "router.policy"),
    ):
        if pins.release(version) not in known:
            out.append(f"{NAMESPACE}:{key}: glm-infra knows the choices of {', '.join(known)} only; {what} are not "
                       f"checked against {version} (glm_infra/spec/pins.py)")
    for i, h in enumerate(stack.hosts):
        model = h.gpu_model.removeprefix("NVIDIA ").split()[0].upper()
        if stack.model.weight_format is not None and model not in GPU_COMPUTE_CAPABILITY:
            out.append(f"{NAMESPACE}:hosts[{i}].gpuModel: {h.gpu_model!r} is not a GPU glm-infra knows; the "
                       f"{stack.model.weight_format.upper()} weights are not checked against it")
    return out


def _from_pydantic(err: dict[str, Any]) -> Problem:
    loc = [x for x in err.get("loc", ()) if not (isinstance(x, str) and x.startswith("function-"))]
    # Drop pydantic's union/tag markers such as 'function-before[...]'.
    path = NAMESPACE + ":"
    first = True
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += ("" if first else ".") + str(part)
        first = False
    if not loc:
        path += "(root)"
    msg = err.get("msg", "invalid")
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        msg = "unknown key"
    elif kind == "missing":
        msg = "required key is missing"
    elif msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if kind not in ("extra_forbidden", "missing") and "input" in err and not isinstance(err["input"], (dict, list)):
        # Never echo what was given for a secret (a mistyped one may still be the real value).
        # Nor a host key that is not one: a private key pasted there is the likeliest mistake.
        if not any(path == f"{NAMESPACE}:{top}.{sub}" or path.startswith(f"{NAMESPACE}:{top}.{sub}[")
                   for top, sub in SECRET_PATHS) and not path.endswith(".hostKey"):
            msg += f" (got {err['input']!r})"
    return Problem(path, msg)


def _closest(key: str, choices: tuple[str, ...]) -> str:
    import difflib

    m = difflib.get_close_matches(key, choices, n=1)
    return f" (did you mean {NAMESPACE}:{m[0]}?)" if m else f" (known keys: {', '.join(choices)})"


def _key_lines(text: str) -> dict[str, int]:
    """Map each config key path (``glm-infra:prefill.hosts[1]``) to its 1-based line in the file."""
    out: dict[str, int] = {}
    root = yaml.compose(text)
    if not isinstance(root, yaml.MappingNode):
        return out
    for k, v in root.value:
        if k.value == "config" and isinstance(v, yaml.MappingNode):
            _walk(v, "", out, top=True)
    return out


def _walk(node: yaml.Node, prefix: str, out: dict[str, int], top: bool = False) -> None:
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            path = k.value if top else f"{prefix}.{k.value}"
            out[path] = k.start_mark.line + 1
            _walk(v, path, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            path = f"{prefix}[{i}]"
            out[path] = item.start_mark.line + 1
            _walk(item, path, out)


def _line_for(lines: dict[str, int], path: str) -> int | None:
    """The line of ``path`` or of its nearest ancestor that is in the file."""
    while path:
        if path in lines:
            return lines[path]
        cut = max(path.rfind("."), path.rfind("["))
        if cut <= path.find(":"):
            return lines.get(path)
        path = path[:cut]
    return None
