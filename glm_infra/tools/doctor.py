"""``glm-infra doctor STACK``: the drift check. For every host of the stack, over SSH, every step of
the per-host plan is checked as it stands: each file a step writes is still the one glm-infra
rendered (content and mode; a secret file: present, root-owned, 0600), and the step's own read-only
``check`` passes (packages at their pins and held, services running and healthy, every weights file
present and matching its sha256, …). Prints per host and step ``ok`` or what differs; exits 1 on any
drift, 2 when a host cannot be reached. Changes nothing.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import os
import shlex
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field

from glm_infra import hostplan
from glm_infra.plan import topology
from glm_infra.spec.config import StackConfig
from glm_infra.steps import Step

EXIT_OK, EXIT_DRIFT, EXIT_UNREACHABLE = 0, 1, 2
BEGIN, END = "@@glm-doctor-begin", "@@glm-doctor-end"
SHOW = "@@glm-doctor-show "  # a line a check prints to be shown even when it passes (the canaries' reference)
MAX_LINES = 10  # of what a drifted step said (a service's check appends its journal)


def checks_of(step: Step) -> list[str]:
    """Bash lines that succeed only if the step's files and its own check hold."""
    lines = []
    for f in step.files:
        q = shlex.quote(f.path)
        if f.secret:  # its content is a secret doctor does not know: where, whose and how readable
            lines.append(f'secret_file {q}')
        else:
            lines.append(f"same_file {q} {hashlib.sha256(f.content.encode()).hexdigest()} {f.mode:o}")
    if step.check is not None:
        lines.append(f"( {step.check} ) || failed")  # a subshell: an exit in the check ends only the check
    return lines


def host_program(steps: dict[str, Step], quick: bool) -> str:
    """What runs on one host: each step's checks, its output framed by BEGIN/END lines."""
    out = [
        "set -u",
        "export LC_ALL=C" + (" GLM_DOCTOR_QUICK=1" if quick else ""),
        "rc=0",
        "failed() { rc=1; }",
        'same_file() {  # PATH SHA256 MODE',
        '  if [ ! -f "$1" ]; then echo "$1 is missing"; rc=1; return; fi',
        '  [ "$(sha256sum < "$1" | cut -d" " -f1)" = "$2" ] || { echo "$1 differs from what glm-infra wrote (edited by hand?)"; rc=1; }',
        '  [ "$(stat -c %a "$1")" = "$3" ] || { echo "$1 has mode $(stat -c %a "$1"), glm-infra writes $3"; rc=1; }',
        "}",
        'secret_file() {',
        '  if [ ! -s "$1" ]; then echo "$1 is missing or empty"; rc=1; return; fi',
        '  [ "$(stat -c "%a %U" "$1")" = "600 root" ] || { echo "$1 is $(stat -c "%a %U" "$1"), not 600 root"; rc=1; }',
        "}",
    ]
    for name, step in steps.items():
        lines = checks_of(step)
        if not lines:
            continue
        out.append(f"echo {BEGIN} {shlex.quote(name)}")
        out.append("rc=0")
        out.append("{")
        out += [f"  {line}" for line in lines]
        out.append("} 2>&1 </dev/null")
        out.append(f'echo "{END} {shlex.quote(name)} $rc"')
    return "\n".join(out) + "\n"


@dataclass
class StepResult:
    step: str
    ok: bool
    lines: list[str] = field(default_factory=list)


@dataclass
class HostResult:
    host: str
    steps: list[StepResult] = field(default_factory=list)
    error: str | None = None  # unreachable, or the program did not finish


def parse(host: str, output: str) -> HostResult:
    result = HostResult(host)
    current: StepResult | None = None
    for line in output.splitlines():
        if line.startswith(BEGIN + " "):
            current = StepResult(line[len(BEGIN) + 1:], False)
        elif line.startswith(END + " ") and current is not None:
            current.ok = line.rsplit(" ", 1)[1] == "0"
            result.steps.append(current)
            current = None
        elif current is not None and line.strip():
            current.lines.append(line)
    if current is not None:
        result.error = f"the checks stopped in step {current.step}"
    return result


def known_hosts(stack: StackConfig, folder: str) -> str:
    """A known_hosts file in ``folder`` with the host key of every host of the stack that gives one."""
    path = os.path.join(folder, "known_hosts")
    with open(path, "w") as f:
        for h in stack.hosts:
            if h.host_key is not None:  # (ssh looks a host on port 22 up by its name alone)
                f.write(f"{h.address if h.ssh_port == 22 else f'[{h.address}]:{h.ssh_port}'} {h.host_key}\n")
    return path


def ssh_argv(stack: StackConfig, host: str, identity: str | None, options: list[str], keys: str | None = None) -> list[str]:
    """ssh to ``host``, the program on its stdin. A host whose key the stack gives (hosts[].hostKey, in the
    known_hosts file ``keys``) must prove it holds it; otherwise the first key seen is kept, as ssh does."""
    h = stack.host(host)
    key = identity or (os.path.expanduser(stack.ssh.private_key_path) if stack.ssh.private_key_path else None)
    checked = ["-o", f"UserKnownHostsFile={keys}", "-o", "StrictHostKeyChecking=yes"] \
        if h.host_key is not None and keys is not None else ["-o", "StrictHostKeyChecking=accept-new"]
    argv = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", *checked, "-p", str(h.ssh_port)]
    for o in options:
        argv += ["-o", o]
    if key:
        argv += ["-i", key, "-o", "IdentitiesOnly=yes"]
    return [*argv, f"{stack.ssh.user}@{h.address}", "bash -s"]


def check_host(stack: StackConfig, host: str, steps: dict[str, Step], args: argparse.Namespace,
               report: threading.Lock) -> HostResult:
    proc = subprocess.Popen(ssh_argv(stack, host, args.identity, args.ssh_option or [], args.known_hosts),
                            stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(host_program(steps, args.quick))
        proc.stdin.close()
    except BrokenPipeError:  # ssh gave up before it read the program (refused, unreachable): its status says why
        pass
    lines = []
    for line in proc.stdout:  # progress: each step as it is checked
        lines.append(line)
        if line.startswith(END + " "):
            name, rc = line.split()[1:3]
            with report:
                print(f"  {host}: {name}: {'ok' if rc == '0' else 'DRIFT'}", file=sys.stderr, flush=True)
    err = proc.stderr.read() if proc.stderr else ""
    proc.wait()
    result = parse(host, "".join(lines))
    if proc.returncode == 255 and not result.steps:
        result.error = f"cannot reach {host} over SSH: {err.strip().splitlines()[-1] if err.strip() else 'ssh failed'}"
    # Every step with something to check must say how it stands: one it is silent about was not checked.
    expected = [name for name, step in steps.items() if checks_of(step)]
    silent = [name for name in expected if name not in {s.step for s in result.steps}]
    if silent and result.error is None:
        said = err.strip().splitlines()[-1] if err.strip() else f"exit {proc.returncode}"
        result.error = (f"the checks said nothing of {len(silent)} of {len(expected)} steps ({', '.join(silent[:3])}"
                        f"{' ...' if len(silent) > 3 else ''}): not checked ({said})")
    return result


def run(stack: StackConfig, stack_name: str, args: argparse.Namespace) -> int:
    plan = topology.plan(stack)
    all_steps = hostplan.plan_all(stack, plan, stack_name=stack_name)
    hosts = args.host or [h.name for h in plan.hosts]
    unknown = [h for h in hosts if h not in all_steps]
    if unknown:
        print(f"doctor: unknown host {unknown[0]!r} (hosts are: {', '.join(all_steps)})", file=sys.stderr)
        return EXIT_UNREACHABLE
    print(f"==> checking {len(hosts)} host(s) of {stack_name} against the stack (changes nothing)", file=sys.stderr)
    lock = threading.Lock()
    with tempfile.TemporaryDirectory(prefix="glm-doctor-") as folder, \
            concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(hosts))) as pool:
        args.known_hosts = known_hosts(stack, folder)
        results = list(pool.map(lambda h: check_host(stack, h, all_steps[h].steps, args, lock), hosts))
    status = EXIT_OK
    for r in results:
        if r.error:
            print(f"{r.host}: {r.error}")
            status = EXIT_UNREACHABLE
        drifted = [s for s in r.steps if not s.ok]
        for s in r.steps:
            if s.ok:
                print(f"{r.host}  {s.step:<24} ok")
                for line in s.lines:
                    if line.startswith(SHOW):
                        print(f"{r.host}  {'':<24} {line[len(SHOW):]}")
            else:
                lines = [line.removeprefix(SHOW) for line in s.lines]
                shown = lines[:MAX_LINES] or ["check failed (no output)"]
                if len(s.lines) > MAX_LINES:
                    shown.append(f"({len(s.lines) - MAX_LINES} more lines)")
                for i, line in enumerate(shown):
                    print(f"{r.host}  {(s.step if i == 0 else ''):<24} {line}")
        if drifted and status == EXIT_OK:
            status = EXIT_DRIFT
    drift = sum(1 for r in results for s in r.steps if not s.ok)
    checked = sum(len(r.steps) for r in results)
    print(f"{drift} of {checked} steps drifted on {sum(1 for r in results if any(not s.ok for s in r.steps))} "
          f"of {len(results)} hosts" if drift else f"no drift: {checked} steps on {len(results)} hosts as the stack says",
          file=sys.stderr)
    return status


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="check every step on every host over SSH; exit 1 on drift (changes nothing)")
    p.add_argument("stack", metavar="STACK")
    p.add_argument("--host", action="append", metavar="NAME", help="only this host (repeatable)")
    p.add_argument("--identity", metavar="FILE", help="SSH key (default: ssh.privateKeyPath of the stack, else "
                                                       "your SSH agent and keys)")
    p.add_argument("--ssh-option", action="append", metavar="OPTION", help="an ssh -o option (repeatable)")
    p.add_argument("--quick", action="store_true", help="weights: sizes only, no sha256 of every file")
