"""What `glm-infra render` shows for review is what deploys: for every stack, the commands and stdin
every resource sends (the Pulumi program under mocks) equal the rendered tree, byte for byte."""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from conftest import STACKS, stack_file
from pulumi_harness import _Mocks, run_program

from glm_infra import hostplan, render
from glm_infra.plan import validate
from glm_infra.plan.topology import plan
from glm_infra.roles.router import ha
from glm_infra.stack import load_file
from glm_infra.steps import DRAIN_STDIN, TRIGGERS_TOKEN
from glm_infra.tools.cli import main as cli

STACK_KEYS = ("glm-trigger-key", "glm-relay-key")  # the stack's own keys (remote_step): no host's step

TRIGGERS = re.compile(r"^: glm-infra-triggers=([0-9a-f]{16}); ")


def as_rendered(command: str) -> str:
    """A command as sent, as the review tree shows it: without the triggers prefix, and with the
    triggers token where the component filled in the digest."""
    m = TRIGGERS.match(command)
    return command[m.end():].replace(m[1], TRIGGERS_TOKEN) if m else command


@pytest.fixture
def key_file(tmp_path):
    k = tmp_path / "id_test"
    k.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nnot-a-real-key\n-----END OPENSSH PRIVATE KEY-----\n")
    return k


def read_tree(root: Path) -> dict[str, Counter]:
    """host → the steps its review tree shows, each as (create, update, delete, stdin)."""
    out: dict[str, Counter] = {}
    for host_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        steps = Counter()
        for f in sorted((host_dir / hostplan.STEPS_DIR).glob("*.sh")):
            sections: dict[str, list[str]] = {}
            current = None
            stdin_ref = None
            for line in f.read_text().splitlines():
                if line.startswith("# stdin: "):
                    stdin_ref = line[len("# stdin: "):]
                elif line in ("# create:", "# update:", "# delete:", "# check:"):
                    current = line[2:-1]
                    sections[current] = []
                elif line.startswith("# ") and current is None:
                    continue
                elif current is not None:
                    sections[current].append(line)
            create = "\n".join(sections["create"])
            stdin = None
            if stdin_ref is not None:
                ref = host_dir / stdin_ref.lstrip("/") if stdin_ref.startswith("/") else host_dir / hostplan.STEPS_DIR / stdin_ref
                stdin = ref.read_text()
            steps[(create, "\n".join(sections.get("update", sections["create"])),
                   "\n".join(sections["delete"]) if "delete" in sections else None, stdin)] += 1
        out[host_dir.name] = steps
    return out


@pytest.mark.parametrize("stack", STACKS)
def test_every_resource_sends_what_the_render_shows(stack, key_file, tmp_path, capsys, monkeypatch):
    cfg = load_file(stack_file(stack)).config
    # Secrets as the review tree shows them: the placeholders (which no secret may look like, so the
    # rules on secret values are off here).
    monkeypatch.setattr(validate, "SECRET_VALUE_RULES", {})
    monkeypatch.setattr(_Mocks, "relay_key", render.placeholders(cfg)["relay_key"])  # the stack makes its own
    monkeypatch.setattr(_Mocks, "router_ca", ha.CA_REVIEWED)  # router.host makes it when up runs
    secrets = {key.removeprefix("glm-infra:"): value for key, value in
               ((k, render.placeholders(cfg)[n]) for n, k in render.configured_secrets(cfg).items())}
    run = run_program(stack_file(stack), key_file, stack=stack, secrets={f"glm-infra:{k}": v for k, v in secrets.items()})
    assert cli(["render", str(stack_file(stack)), "--out", str(tmp_path / "tree")]) == 0
    capsys.readouterr()
    shown = read_tree(tmp_path / "tree")

    addresses = {h.address: h.name for h in cfg.hosts}
    sent: dict[str, Counter] = {h: Counter() for h in shown}
    for r in run.resources:
        if r.type not in ("command:remote:Command", "command:local:Command") or r.name in STACK_KEYS:
            continue  # the key of the secret triggers' digests and the relay key (remote_step): the stack's
        if r.type == "command:local:Command":  # the wait for a reboot, the turns: named after their host
            (host,) = [h for h in shown if r.name.startswith(f"glm-{h}-")]
        else:
            host = addresses[r.inputs["connection"]["host"]]
        create = as_rendered(r.inputs["create"])
        update = as_rendered(r.inputs["update"])
        sent[host][(create, update, r.inputs.get("delete"), r.inputs.get("stdin"))] += 1
    for host in shown:
        missing = shown[host] - sent[host]
        extra = sent[host] - shown[host]
        assert not missing and not extra, (host, list(missing)[:2], list(extra)[:2])
    assert sum(sum(c.values()) for c in shown.values()) == len(
        [r for r in run.resources if r.type.startswith("command:") and r.name not in STACK_KEYS])


def _write_stdin(command: str, data: bytes) -> BaseException | None:
    """Run ``command`` under bash as sshd would, writing ``data`` to its stdin the way the provider's
    SSH client does (all of it, then close); what the write met, if anything."""
    p = subprocess.Popen(["bash", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    try:
        p.stdin.write(data)
        p.stdin.close()
        return None
    except BrokenPipeError as e:  # the command exited before reading it: the client's EOF
        return e
    finally:
        p.wait(timeout=30)


@pytest.mark.parametrize("name", STACKS)
def test_every_remote_delete_with_stdin_reads_all_of_it_first(name):
    """pulumi-command writes a step's stdin to its delete as well; a delete that exits before the whole
    of it is written (``rm -f``) fails the destroy with "EOF" although it ran (pulumi-command#553, seen
    here on the simulated hosts under load). Every remote delete that is sent stdin reads it to its end
    before it does anything else, which ends the race; the others run as written."""
    stack = load_file(stack_file(name)).config
    plans = hostplan.plan_all(stack, plan(stack), stack_name=name)
    sent = 0
    for host, hp in plans.items():
        for step in hp.steps.values():
            if step.delete is None:
                continue
            if step.stdin is not None and not step.local:
                assert step.delete_command == DRAIN_STDIN + step.delete, (host, step.name)
                sent += 1
            else:
                assert step.delete_command == step.delete, (host, step.name)
    assert sent > 0
    # More than a pipe holds, as a script or a unit file may be: the drain takes it all and the
    # delete still runs; without it the writer meets a closed pipe.
    big = b"x" * (4 << 20)
    assert _write_stdin(DRAIN_STDIN + "exit 0", big) is None
    assert isinstance(_write_stdin("exit 0", big), BrokenPipeError)
    # An empty stdin (the provider then writes none and closes it at once): the drain returns, it
    # does not wait (a hang would raise TimeoutExpired in _write_stdin).
    assert _write_stdin(DRAIN_STDIN + "exit 0", b"") is None
