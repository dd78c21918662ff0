"""The stand-in host of scripts/bench/fleet_noop.py (testbed/bench/standin-host.sh, sshd's
ForceCommand there): it refuses nothing, runs nothing it is sent, and answers what the program reads
to go on. Fast: the script runs directly, as sshd would run it; nothing boots."""

from __future__ import annotations

import subprocess

import pytest
from stubs import shellcheck

from glm_infra import hostplan, state_backend
from glm_infra.components.host import _last_json
from glm_infra.plan.topology import plan
from glm_infra.roles import drivers
from glm_infra.stack import load_dict, unprefixed
from testbed.bench.common import b300_fleet
from testbed.bench.fleet import STANDIN_SCRIPT as STANDIN
from testbed.bench.fleet import standin_config


def standin(command: str, stdin: str = "", env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", str(STANDIN)], input=stdin, capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "SSH_ORIGINAL_COMMAND": command, **(env or {})})


def standin_stack(n: int):
    cfg = standin_config(n, 2222, "/nonexistent/key")
    return load_dict(unprefixed(cfg), "fleet_noop").config


def test_the_benchmark_stack_may_keep_its_state_in_its_own_folder(tmp_path):
    """Its hosts are throwaway stand-ins: `up` with the state in the benchmark's folder is not refused (it
    was, once `up` refused the checkout's state, and the benchmark stopped at its first `up`)."""
    stack = standin_stack(4)
    assert stack.state_in_checkout
    state = f"file://{tmp_path}/state"
    assert state_backend.verdict("b300-4h-standin", stack.state_in_checkout, False, env={"PULUMI_BACKEND_URL": state},
                                 cwd=tmp_path, home=tmp_path) is None
    assert state_backend.verdict("b300-4h-standin", False, False, env={"PULUMI_BACKEND_URL": state},
                                 cwd=tmp_path, home=tmp_path)[0] == "error", "what it would meet without the key"


def test_the_standin_is_shellcheck_clean(tmp_path):
    r = shellcheck(STANDIN.read_text(), tmp_path, STANDIN.name)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_command_sent_to_the_standin_never_runs(tmp_path):
    made = tmp_path / "made"
    for command in (f"touch {made}", f": glm-infra-triggers=0123; touch {made} && echo ran",
                    "bash -s", f"rm -rf {tmp_path}"):
        r = standin(command, stdin=f"touch {made}\necho ran\n")
        assert r.returncode == 0, r.stderr
        assert "ran" not in r.stdout and r.stderr == ""
        assert not made.exists()
    assert tmp_path.is_dir()


def test_every_step_of_a_fleet_host_is_accepted_and_answered_as_the_program_needs(tmp_path):
    """Every create and delete command of the router's host (the host with the most steps) of the
    benchmark's own stack: exit 0; "no-reboot" for the reboot step (so the local wait step waits for
    no new boot), facts the program parses as {} for preflight and facts, nothing for the rest."""
    stack = standin_stack(16)
    p = plan(stack)
    steps = hostplan.plan_all(stack, p, stack_name="b300-16h-standin")[p.router.host].steps
    assert {"preflight", "drivers-reboot", "facts", "weights-stage", "router-front-tls"} <= set(steps)
    wait = steps["drivers-wait"]
    assert wait.local  # the one step that runs here: glm-infra's own wait, fed the stand-in's answer
    for name, step in steps.items():
        if step.local:
            continue
        r = standin(step.create, step.stdin or "")
        assert r.returncode == 0, (name, r.stderr)
        if name == "drivers-reboot":
            assert r.stdout == "no-reboot\n"
        elif name in ("preflight", "facts"):
            assert _last_json(r.stdout) == {} and r.stdout == "{}\n", name
        else:
            assert r.stdout == "", (name, r.stdout)
        if step.delete_command is not None:
            d = standin(step.delete_command, step.stdin or "")
            assert (d.returncode, d.stdout) == (0, ""), name
    # What the wait step does with that answer: returns at once, contacting nothing.
    w = subprocess.run(["bash", "-s"], input=wait.stdin, capture_output=True, text=True, timeout=10,
                       env={"PATH": "/usr/bin:/bin", "REBOOT_STATUS": "no-reboot"})
    assert w.returncode == 0 and "no reboot needed" in w.stdout


def test_the_reboot_answer_comes_from_the_reboot_script_alone():
    """The reboot step's command is `bash -s` like other steps': its answer keys on the script sent."""
    assert standin(": glm-infra-triggers=ab12; bash -s", drivers.reboot_script("b300-000")).stdout == "no-reboot\n"
    assert standin("bash -s", drivers.back_script("b300-000")).stdout == ""


def test_the_standin_reads_all_of_a_large_stdin_and_logs_one_line_per_command(tmp_path):
    """The provider writes a step's whole stdin: a stand-in that stopped reading early would fail
    the write (SIGPIPE, 141 here)."""
    log = tmp_path / "commands.log"
    r = subprocess.run(
        ["bash", "-c", f'head -c 4000000 /dev/zero | tr "\\0" x | "$0"; echo "${{PIPESTATUS[*]}}"', str(STANDIN)],
        capture_output=True, text=True, timeout=30,
        env={"PATH": "/usr/bin:/bin", "SSH_ORIGINAL_COMMAND": "bash -s", "GLM_STANDIN_LOG": str(log)})
    assert r.stdout.split() == ["0", "0", "0"], r.stdout + r.stderr
    standin("true", env={"GLM_STANDIN_LOG": str(log)})
    assert log.read_text().splitlines() == ["command", "command"]


@pytest.mark.parametrize("n, prefill, decode", [(96, 64, 32), (16, 10, 6)])
def test_the_benchmark_fleet_is_a_valid_stack_on_loopback_addresses(n, prefill, decode):
    stack = standin_stack(n)
    assert [h.name for h in stack.hosts] == [f"b300-{i:03d}" for i in range(n)]
    assert len(stack.prefill.hosts) == prefill and len(stack.decode.hosts) == decode
    assert stack.router.host == stack.decode.hosts[0]
    addresses = [h.address for h in stack.hosts]
    assert len(set(addresses)) == n
    assert all(a.startswith("127.77.") for a in addresses)
    # The 96-host preview's stack (pulumi_timing.py) is the same fleet on its 10.0.x.y addresses.
    assert b300_fleet(96)["glm-infra:hosts"][95]["address"] == "10.0.0.105"
