"""The real-engine check's command lines, generated from what a stack renders (issue 41).

The check serves a stack's first prefill and first decode instance (or its first colocated one) with the
real vLLM, NIXL and vllm-router on one GPU. Each line is the rendered unit's ``ExecStart`` and environment
(its ``Environment=`` lines and the ``EnvironmentFile=`` files the plan writes), changed only where one GPU
and one machine force it; every change is listed with its reason, and what names hardware the machine lacks
is listed as left out. A flag added to the units reaches the check without editing it.

    glm-infra real-engine STACK --out DIR [--model DIR] [--gpu-share F]

writes DIR/<role>.argv.json and DIR/<role>.env.json (what the runner, testbed/real_engine/check.py, starts),
DIR/serve-<role>.sh (the same, for a person), DIR/CHANGES.md (every change and why) and
DIR/expected-metrics.json (every metric the stack's rules and dashboard read). Pure: nothing runs here.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from glm_infra import hostplan
from glm_infra.plan.topology import Instance, plan
from glm_infra.spec import paths
from glm_infra.spec.config import StackConfig

LOOPBACK = "127.0.0.1"
# What the check puts in VLLM_API_KEY (the rendered secrets file holds a placeholder offline).
CHECK_API_KEY_VAR = "GLM_CHECK_API_KEY"
# One GPU shared by the instances: each gets this share of its memory unless told otherwise.
DEFAULT_GPU_SHARE = {1: 0.85, 2: 0.40}
# UCX on a machine without RDMA NICs: TCP between the instances, CUDA copies and IPC on the one GPU.
SINGLE_MACHINE_UCX_TLS = "tcp,cuda_copy,cuda_ipc"
SEVERAL_API_SERVERS = 2
# Environment that names hardware the check's machine lacks: left out, listed.
HARDWARE_ENV = {
    "UCX_IB_GID_INDEX": "the RoCE GID of a compute NIC; the check's machine has no RDMA NIC",
    "VLLM_NIC_SELECTION_VARS": "vLLM picks each rank's compute NIC from nic-affinity.env; no compute NIC here",
    "VLLM_GPU_NIC_PCIE_MAPPING": "each GPU's nearest compute NIC (nvidia-smi topo -m at deploy); none here",
    "UCX_NET_DEVICES": "the compute NICs; none here",
    "NCCL_IB_HCA": "the compute NICs; none here",
}


@dataclass(frozen=True)
class Change:
    what: str
    rendered: str
    check: str
    why: str


@dataclass
class Line:
    """One instance as the check starts it."""

    role: str
    instance: str
    argv: list[str]
    env: dict[str, str]
    changes: list[Change] = field(default_factory=list)
    left_out: list[Change] = field(default_factory=list)

    @property
    def port(self) -> int:
        return int(self.argv[self.argv.index("--port") + 1])


def unit_lines(text: str) -> tuple[list[str], dict[str, str], list[str]]:
    """(ExecStart as argv, Environment= as a dict, EnvironmentFile= paths) of a rendered unit."""
    argv: list[str] = []
    env: dict[str, str] = {}
    files: list[str] = []
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key == "ExecStart":
            argv = shlex.split(value)
        elif key == "Environment":
            name, _, v = value.partition("=")
            env[name] = v
        elif key == "EnvironmentFile":
            files.append(value.lstrip("-"))
    if not argv:
        raise ValueError("the unit has no ExecStart")
    return argv, env, files


def env_file(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            name, _, value = line.partition("=")
            out[name] = value.strip().strip('"')
    return out


def _set_flag(line: Line, flag: str, value: str, why: str, aliases: tuple[str, ...] = ()) -> None:
    """FLAG VALUE (or FLAG=VALUE) in the argv set to ``value``, the change listed; absent: nothing."""
    for i, word in enumerate(line.argv):
        name, eq, given = word.partition("=")
        if name in (flag, *aliases):
            if eq:
                old, line.argv[i] = given, f"{name}={value}"
            else:
                old, line.argv[i + 1] = line.argv[i + 1], value
            if old != value:
                line.changes.append(Change(flag, old, value, why))
            return


def _set_env(line: Line, name: str, value: str, why: str) -> None:
    old = line.env.get(name)
    if old != value:
        line.env[name] = value
        line.changes.append(Change(name, old if old is not None else "(unset)", value, why))


def instance_line(inst: Instance, model: str, share: float,
                  files: dict[str, str]) -> Line:
    """``inst``'s rendered unit, changed for one GPU on one machine. ``files``: the host's rendered files by path."""
    argv, env, env_files = unit_lines(files[paths.unit(inst.unit)])
    line = Line(inst.role, inst.name, argv, dict(env))
    for path in env_files:
        if path == paths.VLLM_SECRETS:
            line.env["VLLM_API_KEY"] = f"${{{CHECK_API_KEY_VAR}}}"
            line.changes.append(Change(f"EnvironmentFile={path}", "the stack's router API key (a secret)",
                                       f"VLLM_API_KEY=${CHECK_API_KEY_VAR}", "a key the check makes"))
        elif path in files:
            for name, value in env_file(files[path]).items():
                if name in HARDWARE_ENV:
                    line.left_out.append(Change(name, value, "(unset)", HARDWARE_ENV[name]))
                else:
                    line.env[name] = value
        else:  # written on the host at deploy time from what it finds (nic-affinity.env)
            line.left_out.append(Change(f"EnvironmentFile={path}", "written at deploy from the host's topology",
                                        "(not applied)", "names the host's compute NICs; none here"))
    if argv[:2] != [argv[0], "serve"] or not argv[0].endswith("/vllm"):
        raise ValueError(f"{inst.unit}: ExecStart is not `vllm serve`: {argv[:3]}")
    old_model = argv[2]
    line.argv[0], line.argv[2] = "vllm", model
    line.changes.append(Change("model", old_model, model, "a tiny checkpoint of the model's architecture"))
    rendered_dp = next((int(argv[i + 1]) for i, w in enumerate(argv[:-1]) if w in ("-dp", "--data-parallel-size")), 1)
    _set_flag(line, "-dp", "1", "one GPU: one data-parallel rank", ("--data-parallel-size",))
    if rendered_dp > 1 and not any(w.startswith(("--api-server-count", "-asc")) for w in argv):
        # vLLM starts one API server per DP rank: the deployed mode (no process_* metrics, several servers).
        line.argv += ["--api-server-count", str(SEVERAL_API_SERVERS)]
        line.changes.append(Change("--api-server-count", f"(unset: {rendered_dp}, one per DP rank)",
                                   str(SEVERAL_API_SERVERS), "several API servers, as deployed"))
    _set_flag(line, "-tp", "1", "one GPU", ("--tensor-parallel-size",))
    _set_flag(line, "--gpu-memory-utilization", f"{share:.2f}", "the instances share the one GPU")
    _set_flag(line, "--host", LOOPBACK, "one machine: loopback")
    _set_env(line, "CUDA_VISIBLE_DEVICES", "0", "one GPU")
    if "VLLM_NIXL_SIDE_CHANNEL_HOST" in line.env:
        _set_env(line, "VLLM_NIXL_SIDE_CHANNEL_HOST", LOOPBACK, "one machine: loopback")
    if "UCX_TLS" in line.env:
        _set_env(line, "UCX_TLS", SINGLE_MACHINE_UCX_TLS, "no RDMA NIC: TCP between the instances")
    if "HOME" in line.env:
        _set_env(line, "HOME", "${GLM_CHECK_HOME}", "the check's own folder (its caches)")
    return line


def router_line(files: dict[str, str], unit: str, instances: list[Line]) -> Line:
    """The router's rendered unit with the check's instances as its only workers, its metrics on loopback."""
    argv, env, env_files = unit_lines(files[paths.unit(unit)])
    line = Line("router", "router", [], dict(env))
    workers = {"--prefill": [], "--decode": [], "--worker-urls": []}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in workers and i + 1 < len(argv):
            workers[argv[i]].append(argv[i + 1])
            i += 2
            continue
        rest.append(argv[i])
        i += 1
    line.argv = ["vllm-router", *rest[1:]]
    for x in instances:
        flag = {"prefill": "--prefill", "decode": "--decode"}.get(x.role, "--worker-urls")
        line.argv += [flag, f"http://{LOOPBACK}:{x.port}"]
        line.changes.append(Change(flag, ", ".join(workers[flag]) or "(none)", f"http://{LOOPBACK}:{x.port}",
                                   f"the check's {x.instance}, straight (the deployed router reaches each through "
                                   "its gate)"))
    _set_flag(line, "--prometheus-host", LOOPBACK, "one machine: loopback")
    _set_flag(line, "--host", LOOPBACK, "one machine: loopback")
    for path in env_files:
        if path == paths.ROUTER_SECRETS:
            line.env["OPENAI_API_KEY"] = f"${{{CHECK_API_KEY_VAR}}}"
            line.changes.append(Change(f"EnvironmentFile={path}", "the stack's router API key (a secret)",
                                       f"OPENAI_API_KEY=${CHECK_API_KEY_VAR}", "the key the check's instances take"))
    if "HOME" in line.env:
        _set_env(line, "HOME", "${GLM_CHECK_HOME}", "the check's own folder")
    return line


def lines(stack: StackConfig, stack_name: str, model: str, gpu_share: float | None = None) -> list[Line]:
    """The first prefill and first decode instance (P/D), else the first colocated one; then the router."""
    p = plan(stack)
    roles = ("prefill", "decode") if stack.disaggregated else ("colocated",)
    chosen = [next(i for i in p.instances if i.role == role) for role in roles]
    share = gpu_share or DEFAULT_GPU_SHARE[len(chosen)]
    steps = hostplan.plan_all(stack, p, stack_name=stack_name)
    out = [instance_line(inst, model, share,
                         {path: f.content for path, f in steps[inst.host].files().items()}) for inst in chosen]
    if p.router is not None:
        files = {path: f.content for path, f in steps[p.router.host].files().items()}
        out.append(router_line(files, p.router.unit, out))
    return out


def changes_text(stack_name: str, out: list[Line]) -> str:
    rows = [f"# The real-engine check's lines for {stack_name}, from `glm-infra render` (generated: do not edit)", ""]
    for line in out:
        rows += [f"## {line.instance} ({line.role})", "", "Changed for one GPU on one machine:", "",
                 "| what | rendered | in the check | why |", "| --- | --- | --- | --- |"]
        rows += [f"| `{c.what}` | `{c.rendered}` | `{c.check}` | {c.why} |" for c in line.changes]
        if line.left_out:
            rows += ["", "Left out (names hardware this machine lacks):", "", "| what | rendered | why |",
                     "| --- | --- | --- |"]
            rows += [f"| `{c.what}` | `{c.rendered}` | {c.why} |" for c in line.left_out]
        rows.append("")
    return "\n".join(rows)


def _sh_word(value: str) -> str:
    """A shell word: a placeholder the runner sets (``${NAME}``) expanded, anything else quoted."""
    return f'"{value}"' if re.fullmatch(r"\$\{[A-Z_]+\}", value) else shlex.quote(value)


def serve_script(line: Line) -> str:
    env = " ".join(f"{k}={_sh_word(v)}" for k, v in sorted(line.env.items()))
    return (f"#!/usr/bin/env bash\n# {line.instance}: the rendered unit's line for one GPU (CHANGES.md says what changed).\n"
            f"set -euo pipefail\nexec env {env} \\\n  {' '.join(_sh_word(w) for w in line.argv)}\n")


def write(out_dir: Path, stack_name: str, out: list[Line], expected_metrics: dict[str, list[str]] | None = None
          ) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if expected_metrics is not None:  # what the stack's alerts and panels read: the check says which are served
        (out_dir / "expected-metrics.json").write_text(json.dumps(expected_metrics, indent=1, sort_keys=True) + "\n")
        written.append(out_dir / "expected-metrics.json")
    for line in out:
        for name, text in ((f"{line.role}.argv.json", json.dumps(line.argv, indent=1) + "\n"),
                           (f"{line.role}.env.json", json.dumps(line.env, indent=1, sort_keys=True) + "\n"),
                           (f"serve-{line.role}.sh", serve_script(line))):
            (out_dir / name).write_text(text)
            written.append(out_dir / name)
    (out_dir / "CHANGES.md").write_text(changes_text(stack_name, out))
    written.append(out_dir / "CHANGES.md")
    return written
