"""Rolling host changes: the roll groups and what the plan says of them (pure), the turn lease run as real
processes on this machine (two hosts wanting one slot, a slot whose run is gone, the bounded wait), and
roll.sh's drain and return against a stub PATH with a stand-in router metrics page."""

from __future__ import annotations

import dataclasses
import http.server
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import stack_config, stack_file
from stubs import StubPath, in_root, isolated

from glm_infra import hostplan
from glm_infra.plan.topology import plan, roll_predecessors, rolling, rolling_notes
from glm_infra.roles import roll, vllm
from glm_infra.roles.roll import runs
from glm_infra.stack import load_file


def config(write_stack, change) -> object:
    cfg = stack_config("prod-b300")
    change(cfg)
    return load_file(write_stack(cfg)).config


def six_hosts(cfg: dict) -> None:
    """prod-b300 grown to six hosts: prefill on b300-1…4, decode on b300-5 and b300-6."""
    cfg["glm-infra:hosts"] += [dict(cfg["glm-infra:hosts"][0], name=f"b300-{i}", address=f"10.0.0.{10 + i}")
                               for i in (4, 5, 6)]
    cfg["glm-infra:prefill"]["hosts"] = ["b300-1", "b300-2", "b300-3", "b300-4"]
    cfg["glm-infra:decode"]["hosts"] = ["b300-5", "b300-6"]
    cfg["glm-infra:router"]["host"] = "b300-6"


# --- planning --------------------------------------------------------------------------------------


def test_each_pool_rolls_in_turns_of_its_max_unavailable(write_stack):
    def change(cfg):
        six_hosts(cfg)
        cfg["glm-infra:prefill"]["maxUnavailable"] = 2

    stack = config(write_stack, change)
    groups = {g.pool: g for g in rolling(stack, plan(stack))}
    assert groups["prefill"].turns == (("b300-1", "b300-2"), ("b300-3", "b300-4"))
    assert groups["decode"].turns == (("b300-5",), ("b300-6",)) and not groups["decode"].interrupting
    assert roll_predecessors(tuple(groups.values()), "b300-3") == ("b300-1", "b300-2")
    assert roll_predecessors(tuple(groups.values()), "b300-1") == ()
    assert rolling_notes(stack, plan(stack)) == [
        "prefill: 4 hosts, 2 at a time (maxUnavailable 2), each drained and healthy again before the next: "
        "b300-1 + b300-2, then b300-3 + b300-4",
        "decode: 2 hosts, 1 at a time (maxUnavailable 1), each drained and healthy again before the next: "
        "b300-5, then b300-6",
    ]
    assert rolling_notes(stack, plan(stack), interrupting=True) == []


def test_a_host_serving_two_pools_takes_the_strictest(write_stack):
    def change(cfg):
        six_hosts(cfg)
        cfg["glm-infra:prefill"].update(maxUnavailable=3, instancesPerHost=1)
        cfg["glm-infra:decode"].update(hosts=["b300-4", "b300-5", "b300-6"], dp=4)

    stack = config(write_stack, change)
    groups = {g.pool: g for g in rolling(stack, plan(stack))}
    assert groups["prefill"].max_unavailable == 1 and groups["prefill"].own == 3  # b300-4 also serves decode
    assert len(groups["prefill"].turns) == 4
    assert "(maxUnavailable 3, 1 on a host another pool shares)" in rolling_notes(stack, plan(stack))[0]


def test_a_pool_of_one_host_or_as_wide_as_its_turn_is_interrupted(write_stack):
    stack = load_file(stack_file("prod-b300")).config
    assert rolling_notes(stack, plan(stack), interrupting=True) == [
        "decode: interrupted: its only host, b300-3, goes down; nothing serves decode until it is back"]
    stack = config(write_stack, lambda c: c["glm-infra:prefill"].update(maxUnavailable=2))
    notes = rolling_notes(stack, plan(stack), interrupting=True)
    assert notes[0] == ("prefill: interrupted: maxUnavailable 2 ≥ its 2 hosts: b300-1, b300-2 go down together; "
                        "nothing serves prefill until they are back")


def test_max_unavailable_is_checked(write_stack):
    from glm_infra.stack import StackError

    cfg = stack_config("prod-b300")
    cfg["glm-infra:decode"]["maxUnavailable"] = 0
    with pytest.raises(StackError) as e:
        load_file(write_stack(cfg))
    assert "glm-infra:decode.maxUnavailable" in str(e.value)


def test_the_roll_steps_frame_the_disruptive_ones_and_only_on_serving_hosts():
    stack = load_file(stack_file("prod-b300")).config
    p = plan(stack)
    steps = list(hostplan.host_steps(stack, p, p.host("b300-1"), stack_name="prod-b300").steps)
    i = steps.index
    assert i("turn-acquire") < i("host-drain") < i("drivers-install") < i("rdma") < i("ucx-env") \
        < i("host-return") < i("turn-release") < i("runtime")
    hs = hostplan.host_steps(stack, p, p.host("b300-1"), stack_name="prod-b300").steps
    assert hs["turn-acquire"].local and hs["turn-release"].local and not hs["host-drain"].local
    assert hs["host-drain"].delete == ("rm -f /usr/local/libexec/glm-infra/roll.sh /var/lib/glm-infra/roll-drained "
                                       "/var/lib/glm-infra/roll-done /var/lib/glm-infra/roll.log")
    # The waits come from the step timeouts and the router's health checking, not constants.
    acquire_s = int(hs["turn-acquire"].timeout.removesuffix("s"))
    assert acquire_s > 1800 + 1200 + stack.drivers.reboot_timeout + vllm.SERVICE_START_TIMEOUT_S
    script = hs["host-drain"].stdin
    interval = stack.router.health_check_interval
    canary = stack.router.canary_interval + stack.router.canary_timeout  # one canary run, if it had taken one out
    assert f"down_s={(3 + 1) * (interval + 5) + 30}\n" in script and f"up_s={(2 + 1) * (interval + 5) + 30 + canary}\n" in script


# --- the turn lease, as real processes -------------------------------------------------------------


@pytest.fixture
def leases(tmp_path):
    stack = load_file(stack_file("prod-b300")).config
    p = plan(stack)
    root = tmp_path / "leases"

    def script(host: str, wait_s: int | None = None) -> Path:
        text = hostplan.host_steps(stack, p, p.host(host), stack_name="prod-b300").steps["turn-acquire"].stdin
        if wait_s is not None:
            text = text.replace(next(l for l in text.splitlines() if l.startswith("wait_s=")), f"wait_s={wait_s}")
        f = tmp_path / f"lease-{host}.sh"
        f.write_text(text)
        return f

    def run(host: str, action: str, wait_s: int | None = None, holder: int | None = None, background: bool = False):
        env = dict(os.environ, GLM_INFRA_LEASES=str(root))
        if holder is not None:
            env["GLM_INFRA_LEASE_PID"] = str(holder)
        cmd = ["bash", str(script(host, wait_s)), action, "0123456789abcdef"]
        if background:
            return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)

    run.root = root
    run.script = script
    return run


def slots(root: Path) -> dict[str, str]:
    return {f"{f.parent.name}/{f.name}": f.read_text().split()[0] for f in root.glob("*/*/slot-*")}


def test_two_hosts_of_a_pool_take_turns(leases):
    a = leases("b300-1", "acquire")
    assert a.returncode == 0, a.stderr
    assert slots(leases.root) == {"prefill/slot-0": "b300-1"}
    waiting = leases("b300-2", "acquire", background=True)
    time.sleep(3)
    assert waiting.poll() is None, "b300-2 waits while b300-1 holds prefill's only slot"
    assert leases("b300-3", "acquire").returncode == 0, "decode is another pool"
    assert leases("b300-1", "release").returncode == 0
    out, err = waiting.communicate(timeout=30)
    assert waiting.returncode == 0, err
    assert "waiting for a turn in prefill: slot-0: b300-1" in out and "prefill/slot-0 taken" in out
    assert slots(leases.root) == {"prefill/slot-0": "b300-2", "decode/slot-0": "b300-3"}
    assert leases("b300-2", "release").returncode == 0 and leases("b300-3", "release").returncode == 0
    assert slots(leases.root) == {}


def test_a_slot_whose_run_is_gone_is_taken_back(leases):
    run = subprocess.Popen(["sleep", "60"])
    try:
        assert leases("b300-1", "acquire", holder=run.pid).returncode == 0
    finally:
        run.kill()
        run.wait()  # the run holding the slot has ended
    r = leases("b300-2", "acquire", wait_s=10)
    assert r.returncode == 0, r.stderr
    assert "prefill/slot-0: taken back from b300-1 (its run, pid %d, is gone)" % run.pid in r.stdout
    assert slots(leases.root) == {"prefill/slot-0": "b300-2"}
    # A run whose start time cannot be read would write a slot naming no run: it takes no turn.
    r = leases("b300-3", "acquire", holder=run.pid)
    assert r.returncode == 1 and f"cannot read the start time of pid {run.pid}" in r.stderr
    assert slots(leases.root) == {"prefill/slot-0": "b300-2"}


def test_the_wait_for_a_turn_is_bounded_and_names_the_holder(leases):
    assert leases("b300-1", "acquire").returncode == 0  # held by this test's process: alive
    t0 = time.monotonic()
    r = leases("b300-2", "acquire", wait_s=3)
    # lease.sh counts whole seconds (date +%s): 3 of them can pass in a little over 2 s of real time.
    assert r.returncode == 1 and 2 <= time.monotonic() - t0 < 60, (r.stdout, r.stderr)
    assert f"b300-2: turn: no turn in prefill after 3s (one roll's step timeouts): slot-0: b300-1 (pid {os.getpid()}" \
        in r.stderr
    assert "rm " in r.stderr and str(leases.root) in r.stderr
    assert slots(leases.root) == {"prefill/slot-0": "b300-1"}, "the waiter took nothing"


def _failure_record(leases) -> Path:
    folder = roll.lease_folder(load_file(stack_file("prod-b300")).config, "prod-b300")
    return runs.lease_root(folder, {runs.LEASES: str(leases.root)})


def test_a_waiter_stops_once_its_run_has_failed_and_gives_back_what_it_took(leases):
    """pulumi waits for every running step after one fails, a turn-acquire waiting for its slot among them:
    when b300-1's turn fails, its slot stays taken for the rest of the run, and b300-2's wait (hours: one
    turn's step timeouts) held `pulumi up` that long. The program's error hook records the failure
    (runs.record_failure); the waiter of that run stops at its next poll, naming the step."""
    run = subprocess.Popen(["sleep", "120"])  # the pulumi run both turns belong to
    other = subprocess.Popen(["sleep", "120"])  # another run, alive
    try:
        assert leases("b300-1", "acquire", holder=run.pid).returncode == 0
        waiting = leases("b300-2", "acquire", holder=run.pid, background=True)
        time.sleep(3)
        assert waiting.poll() is None, "b300-2 waits for b300-1's turn"
        record = runs.record_failure(_failure_record(leases), runs.this_run({runs.LEASE_PID: str(run.pid)}),
                                     "glm-b300-1-host-return (update)")
        t0 = time.monotonic()
        out, err = waiting.communicate(timeout=30)
        assert waiting.returncode == 1 and time.monotonic() - t0 < 10, (out, err)
        assert (f"b300-2: turn: not taking a turn: this pulumi run (pid {run.pid}) failed at "
                "glm-b300-1-host-return (update); it ends once what is running has finished") in err
        assert slots(leases.root) == {"prefill/slot-0": "b300-1"}, "the holder's slot is left as it was"
        # The first failure is the one named; a later one leaves the record as it is.
        runs.record_failure(record.parent, runs.this_run({runs.LEASE_PID: str(run.pid)}), "glm-b300-3-rdma (update)")
        assert record.read_text() == "glm-b300-1-host-return (update)\n"
        # A turn of this run in a free pool stops too (pulumi would start nothing after it), taking nothing.
        r = leases("b300-3", "acquire", holder=run.pid)
        assert r.returncode == 1 and "failed at glm-b300-1-host-return (update)" in r.stderr
        assert slots(leases.root) == {"prefill/slot-0": "b300-1"}
        # Another run is not stopped by it: it waits for the slot, within its bound.
        r = leases("b300-2", "acquire", wait_s=3, holder=other.pid)
        assert r.returncode == 1 and "no turn in prefill after 3s" in r.stderr and "not taking" not in r.stderr
        # A record that names no step (empty, unreadable) stops the waiter all the same.
        record.write_text("")
        r = leases("b300-3", "acquire", holder=run.pid)
        assert r.returncode == 1 and f"failed at a step ({record} names none)" in r.stderr
    finally:
        for p in (run, other):
            p.kill()
            p.wait()
    # Once the run is gone, its record goes with the next acquire, and the slot is taken back.
    r = leases("b300-2", "acquire", wait_s=10)
    assert r.returncode == 0, r.stderr
    assert not record.exists() and "taken back from b300-1" in r.stdout


def test_the_program_and_lease_sh_name_the_same_run(leases, tmp_path):
    """Without overrides both sides name the run by the nearest `pulumi` process above them: the program
    (runs.this_run, under the language host) and lease.sh (under the command provider). A stand-in
    `pulumi` (bash by that name) runs both; the record the Python side writes stops the shell's wait."""
    fake = tmp_path / "bin" / "pulumi"
    fake.parent.mkdir()
    fake.symlink_to(shutil.which("bash"))
    root = _failure_record(leases)
    python = f"{shlex.quote(sys.executable)} -c " + shlex.quote(
        "import sys; from pathlib import Path; from glm_infra.roles.roll import runs; "
        "r = runs.this_run(); print(r); runs.record_failure(Path(sys.argv[1]), r, 'glm-b300-1-drivers-back (update)')")
    lease = leases.script("b300-2")
    script = (f"{shlex.quote(shutil.which('bash'))} {shlex.quote(str(leases.script('b300-1')))} acquire 0123456789abcdef; "
              f"{shlex.quote(shutil.which('bash'))} {lease} acquire 0123456789abcdef & waiter=$!; sleep 3; "
              f"{python} {shlex.quote(str(root))}; wait $waiter; echo rc=$?; echo pid=$$")
    env = {k: v for k, v in os.environ.items() if k != runs.LEASE_PID}
    env.update(GLM_INFRA_LEASES=str(leases.root), PYTHONPATH=str(Path(__file__).parents[1]))
    r = subprocess.run([str(fake), "-c", script], env=env, capture_output=True, text=True, timeout=60)
    pid = int(r.stdout.rsplit("pid=", 1)[1])
    assert f"({pid}, '" in r.stdout, (r.stdout, r.stderr)  # the program named the stand-in pulumi
    assert "rc=1" in r.stdout and f"this pulumi run (pid {pid}) failed at glm-b300-1-drivers-back (update)" in r.stderr, \
        (r.stdout, r.stderr)
    assert slots(leases.root) == {"prefill/slot-0": "b300-1"}, "b300-2 took nothing"


def test_an_interrupted_acquire_gives_back_what_it_took(write_stack, tmp_path):
    """A host in two pools takes prefill's slot, then waits for decode's; killed meanwhile (the step's
    timeout, Ctrl-C), it gives prefill's slot back."""
    def change(cfg):
        cfg["glm-infra:prefill"].update(instancesPerHost=1)
        cfg["glm-infra:decode"].update(hosts=["b300-2", "b300-3"], dp=4)
    stack = config(write_stack, change)
    p = plan(stack)
    env = dict(os.environ, GLM_INFRA_LEASES=str(tmp_path / "l"))
    files = {}
    for h in ("b300-2", "b300-3"):
        files[h] = tmp_path / f"{h}.sh"
        files[h].write_text(hostplan.host_steps(stack, p, p.host(h), stack_name="t").steps["turn-acquire"].stdin)
    assert subprocess.run(["bash", str(files["b300-3"]), "acquire", "x"], env=env).returncode == 0
    w = subprocess.Popen(["bash", str(files["b300-2"]), "acquire", "x"], env=env, stdout=subprocess.PIPE, text=True)
    time.sleep(3)
    assert slots(tmp_path / "l") == {"prefill/slot-0": "b300-2", "decode/slot-0": "b300-3"}
    w.terminate()
    w.wait(timeout=10)
    assert slots(tmp_path / "l") == {"decode/slot-0": "b300-3"}


# --- roll.sh against stubs and a stand-in router ---------------------------------------------------


class _Metrics(http.server.BaseHTTPRequestHandler):
    page = ""

    def do_GET(self):  # noqa: N802
        body = type(self).page.encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_):
        pass


@pytest.fixture
def router():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def health_page(values: dict[str, int]) -> str:
    return "".join(f'vllm_router_worker_health{{worker="{u}"}} {v}\n' for u, v in values.items())


def test_drain_and_return(router, tmp_path):
    stack = load_file(stack_file("prod-b300")).config
    p = plan(stack)
    hs = hostplan.host_steps(stack, p, p.host("b300-2"), stack_name="t").steps
    metrics = f"http://127.0.0.1:{router.server_address[1]}/metrics"
    script = hs["host-drain"].stdin
    script = script.replace(next(l for l in script.splitlines() if l.startswith("metrics_url=")),
                            f"metrics_url={shlex.quote(metrics)}")
    for k in ("guard_s", "down_s", "up_s", "start_s"):
        script = script.replace(next(l for l in script.splitlines() if l.startswith(f"{k}=")), f"{k}=2")
    # The router knows each worker by its gate's URL.
    mine = [p.router.worker_url(i.name) for i in p.instances if i.host == "b300-2"]
    other = [p.router.worker_url(i.name) for i in p.instances if i.host == "b300-1"]
    s = StubPath(tmp_path / "stubs")
    s.add("systemctl", 'case "$1" in disable) rm -f "$STATE/active" ;; start) touch "$STATE/active" ;; esac; exit 0')
    s.add("journalctl")
    s.add("sleep", "exec /usr/bin/sleep 0.2")  # the bounds are seconds here: poll often within them
    real_curl = "/usr/bin/curl"
    s.add("curl", f'case "$*" in *metrics*) exec {real_curl} "$@" ;; *) [ -e "$STATE/active" ] ;; esac')
    run = lambda *a: isolated(s, script, list(a), ["/var/lib/glm-infra"], tmp_path)  # noqa: E731

    assert run("record", "aaaaaaaaaaaaaaaa").returncode == 0
    r = run("drain", "aaaaaaaaaaaaaaaa")  # the roll already done (a new SSH key re-ran the step)
    assert r.returncode == 0 and "nothing to drain" in r.stdout and not r.called("systemctl")

    # b300-1 not healthy in the router: draining b300-2 too would leave prefill without a host.
    _Metrics.page = health_page({**{u: 0 for u in other}, **{u: 1 for u in mine}})
    r = run("drain", "bbbbbbbbbbbbbbbb")
    assert r.returncode == 1 and "not draining: prefill on b300-1 is not healthy in the router after 2s" in r.stderr
    assert not r.called("systemctl disable")

    # b300-1 serves; the router never marks b300-2's workers down in time: a warning, not a failure.
    _Metrics.page = health_page({u: 1 for u in other + mine})
    r = run("drain", "bbbbbbbbbbbbbbbb")
    assert r.returncode == 0, r.stderr
    assert r.called("systemctl disable --now --quiet glm-vllm-prefill-2.service glm-vllm-prefill-3.service")
    assert "warning: the router still reports" in r.stderr and "carrying on (the instances are stopped)" in r.stderr
    assert in_root(tmp_path, "/var/lib/glm-infra/roll-drained").exists()
    check = run("check")
    assert check.returncode == 1 and "left drained by a roll that did not finish" in check.stderr

    # Back: started, healthy, then healthy in the router; the roll is done.
    r = run("return", "bbbbbbbbbbbbbbbb")
    assert r.returncode == 0, r.stderr
    assert r.called("systemctl start glm-vllm-prefill-2.service glm-vllm-prefill-3.service")
    assert "the router marks" in r.stdout and run("check").returncode == 0
    assert in_root(tmp_path, "/var/lib/glm-infra/roll-done").read_text().strip() == "bbbbbbbbbbbbbbbb"
    phases = [line.split()[2] for line in in_root(tmp_path, "/var/lib/glm-infra/roll.log").read_text().splitlines()]
    assert phases == ["drain-start", "drain-start", "stopped", "drained", "return-start", "returned"]

    # The router unreadable: the drain refuses before stopping anything (tests below: the message, the force).
    _Metrics.page = ""
    router.shutdown()
    router.server_close()  # refused, not left unanswered
    r = run("drain", "cccccccccccccccc")
    assert r.returncode == 1 and "cannot be read" in r.stderr and not r.called("systemctl")


# --- roll.sh as its steps run it: inputs unreadable, late or cut short --------------------------------

ROLL_DIRS = ["/var/lib/glm-infra", "/usr/local/libexec/glm-infra"]


class RollHost:
    """b300-2's host-drain and host-return run the way pulumi runs them: the step's own command (the
    roll's digest and, for a forced run, the variable in it), the roll script on its stdin (with the
    metrics URL pointed at loopback), in a mount namespace, against stub systemctl/curl."""

    def __init__(self, tmp: Path, metrics: str) -> None:
        self.tmp, self.metrics = tmp, metrics
        self.stubs = s = StubPath(tmp / "stubs")
        s.add("systemctl", 'case "$1" in disable) [ -e "$STATE/disable-fails" ] && exit 1; rm -f "$STATE/active" ;;\n'
                           '  start) touch "$STATE/active" ;; esac; exit 0')
        s.add("journalctl")
        s.add("sleep", "exec /usr/bin/sleep 0.2")
        s.add("curl", 'case "$*" in *metrics*) exec /usr/bin/curl "$@" ;; *) [ -e "$STATE/active" ] ;; esac')

    def steps(self) -> dict:
        stack = load_file(stack_file("prod-b300")).config
        p = plan(stack)
        return hostplan.host_steps(stack, p, p.host("b300-2"), stack_name="t").steps

    def run(self, key: str, create: bool = False):
        st = self.steps()[key]
        command = st.update if key == "host-drain" and not create else st.create
        self.roll = command.split()[-1]
        stdin = self.tmp / "stdin"
        text = self.steps()["host-drain"].stdin
        for line in text.splitlines():
            if line.startswith(("metrics_url=", "guard_s=", "down_s=", "up_s=", "start_s=")):
                value = shlex.quote(self.metrics) if line.startswith("metrics_url=") else "3"
                text = text.replace(line, f"{line.split('=')[0]}={value}")
        stdin.write_text(text if key == "host-drain" else "")
        return isolated(self.stubs, f"exec < {shlex.quote(str(stdin))}\n{command}\n", [], ROLL_DIRS, self.tmp)

    def file(self, path: str) -> Path:
        return in_root(self.tmp, path)


def closed_port_url() -> str:
    from conftest import free_port

    return f"http://127.0.0.1:{free_port()}/metrics"  # nothing listens: curl is refused at once


def test_the_drain_refuses_when_the_router_cannot_be_read(tmp_path, monkeypatch):
    monkeypatch.delenv("GLM_INFRA_ROLL_FORCE", raising=False)
    host = RollHost(tmp_path, closed_port_url())
    r = host.run("host-drain")
    assert r.returncode == 1, r.stdout + r.stderr
    assert (f"b300-2: roll: the router's metrics ({host.metrics}) cannot be read: whether the other prefill hosts "
            "serve is unknown (curl: (7)") in r.stderr
    assert "not going on blind" in r.stderr and "GLM_INFRA_ROLL_FORCE=1 pulumi up" in r.stderr
    assert not r.called("systemctl") and not host.file("/var/lib/glm-infra/roll-drained").exists()

    # Forced for one run (the variable set where pulumi runs): the step's command carries it to the host.
    monkeypatch.setenv("GLM_INFRA_ROLL_FORCE", "1")
    assert "GLM_INFRA_ROLL_FORCE=1 /usr/local/libexec/glm-infra/roll.sh drain" in host.steps()["host-drain"].update
    r = host.run("host-drain")
    assert r.returncode == 0, r.stderr
    assert "going on without it (GLM_INFRA_ROLL_FORCE=1)" in r.stderr
    assert r.called("systemctl disable --now --quiet glm-vllm-prefill-2.service glm-vllm-prefill-3.service")
    monkeypatch.setenv("GLM_INFRA_ROLL_FORCE", "yes")  # only 1 forces: anything else is the plain command
    assert "GLM_INFRA_ROLL_FORCE" not in host.steps()["host-drain"].update + host.steps()["host-return"].create


def test_the_return_refuses_to_finish_when_the_router_cannot_be_read(tmp_path, monkeypatch):
    monkeypatch.setenv("GLM_INFRA_ROLL_FORCE", "1")
    host = RollHost(tmp_path, closed_port_url())
    assert host.run("host-drain").returncode == 0
    monkeypatch.delenv("GLM_INFRA_ROLL_FORCE")
    r = host.run("host-return")
    assert r.returncode == 1
    assert r.called("systemctl start glm-vllm-prefill-2.service glm-vllm-prefill-3.service"), "serving again"
    assert f"the router's metrics ({host.metrics}) cannot be read: whether it sends requests to" in r.stderr
    assert "GLM_INFRA_ROLL_FORCE=1 pulumi up" in r.stderr
    # Not done: the roll stays unfinished (check fails, the next up returns it again).
    assert host.file("/var/lib/glm-infra/roll-drained").exists()
    assert not host.file("/var/lib/glm-infra/roll-done").exists()
    monkeypatch.setenv("GLM_INFRA_ROLL_FORCE", "1")
    r = host.run("host-return")
    assert r.returncode == 0 and "going on without it" in r.stderr, r.stderr
    assert host.file("/var/lib/glm-infra/roll-done").read_text().strip() == host.roll
    assert not host.file("/var/lib/glm-infra/roll-drained").exists()


def test_a_drain_that_cannot_disable_the_instances_stops(router, tmp_path, monkeypatch):
    """Left enabled they would start with the boot, before RDMA is set up."""
    monkeypatch.delenv("GLM_INFRA_ROLL_FORCE", raising=False)
    stack = load_file(stack_file("prod-b300")).config
    _Metrics.page = health_page({u: 1 for u in plan(stack).router.prefill_urls + plan(stack).router.decode_urls})
    host = RollHost(tmp_path, f"http://127.0.0.1:{router.server_address[1]}/metrics")
    (host.stubs.state / "disable-fails").touch()
    r = host.run("host-drain")
    assert r.returncode == 1 and "b300-2: roll: could not stop and disable glm-vllm-prefill-2.service" in r.stderr
    assert not r.called("systemctl stop")


def test_a_return_after_a_drain_cut_short_starts_this_hosts_instances(router, tmp_path, monkeypatch):
    """The drain records what it stops before stopping; cut short while writing, the record is empty."""
    monkeypatch.delenv("GLM_INFRA_ROLL_FORCE", raising=False)
    stack = load_file(stack_file("prod-b300")).config
    _Metrics.page = health_page({u: 1 for u in plan(stack).router.prefill_urls + plan(stack).router.decode_urls})
    host = RollHost(tmp_path, f"http://127.0.0.1:{router.server_address[1]}/metrics")
    assert host.run("host-drain").returncode == 0
    drained = host.file("/var/lib/glm-infra/roll-drained")
    drained.write_text("")
    r = host.run("host-return")
    assert r.returncode == 0, r.stderr
    assert r.called("systemctl start glm-vllm-prefill-2.service glm-vllm-prefill-3.service")
    assert "roll-drained is empty" in r.stderr and not drained.exists()


# --- the turn lease, when a slot or its folder is not what it should be --------------------------------


def test_a_slot_that_names_no_run_is_held_not_taken(leases):
    assert leases("b300-3", "acquire").returncode == 0  # makes the stack's lease folder
    folder = next(leases.root.iterdir())
    slot = folder / "prefill" / "slot-0"
    slot.parent.mkdir()
    for partial in ("b300-1 4", "b300-1 4 5"):  # cut short: no start time and no date, or no date
        slot.write_text(partial)
        r = leases("b300-2", "acquire", wait_s=1)
        assert r.returncode == 1, partial
        assert f"slot-0: {slot} names no run" in r.stderr and "taken" not in r.stdout
        assert slot.read_text() == partial, "left for whoever holds it, or for an operator to remove"


def test_the_slot_names_the_pulumi_run_above_the_turn(leases, tmp_path):
    """The holder is the pulumi process the step runs under, found up the process tree (pulumi-command
    starts a shell, which starts bash), with its start time: not the shell right above the script."""
    fake = tmp_path / "pulumi"
    shutil.copy("/bin/bash", fake)  # a process whose name (comm) is pulumi
    env = {k: v for k, v in os.environ.items() if k != "GLM_INFRA_LEASE_PID"}
    env["GLM_INFRA_LEASES"] = str(leases.root)
    run = subprocess.Popen([str(fake), "-c", f'sh -c "bash {leases.script("b300-1")} acquire x; true"; read -r _'],
                           env=env, stdin=subprocess.PIPE, text=True)
    try:
        for _ in range(200):
            held = list(leases.root.glob("*/prefill/slot-0"))
            if held:
                break
            time.sleep(0.1)
        start = Path(f"/proc/{run.pid}/stat").read_text().rsplit(") ", 1)[1].split()[19]
        assert held and held[0].read_text().split()[:3] == ["b300-1", str(run.pid), start]
    finally:
        run.communicate("\n", timeout=30)


def test_a_turn_whose_slot_cannot_be_written_fails(leases):
    assert leases("b300-3", "acquire").returncode == 0
    folder = next(leases.root.iterdir())
    (folder / "prefill").write_text("a file where the pool's folder should be\n")
    r = leases("b300-2", "acquire", wait_s=2)
    assert r.returncode != 0 and "taken" not in r.stdout, (r.stdout, r.stderr)
    assert "prefill" in r.stderr


def test_lease_and_roll_scripts_are_shellcheck_clean(tmp_path):
    from stubs import shellcheck

    stack = load_file(stack_file("prod-b300")).config
    p = plan(stack)
    hs = hostplan.host_steps(stack, p, p.host("b300-1"), stack_name="prod-b300").steps
    for key in ("turn-acquire", "host-drain"):
        r = shellcheck(hs[key].stdin, tmp_path)
        assert r.returncode == 0, f"{key}\n{r.stdout}"


def test_without_a_router_the_drain_asks_the_other_hosts_health(tmp_path, monkeypatch):
    """No router to read: the other hosts of the pool must answer /health themselves."""
    monkeypatch.delenv("GLM_INFRA_ROLL_FORCE", raising=False)
    host = RollHost(tmp_path, "")
    stack = load_file(stack_file("prod-b300")).config
    p = plan(stack)  # (the stack has a router, whose gates stand for the instances here)
    b300_1 = [p.router.worker_url(i.name).split("//")[1] for i in p.instances if i.host == "b300-1"]
    host.stubs.add("curl", f'case "$*" in *{b300_1[0]}/health*|*{b300_1[1]}/health*) [ -e "$STATE/others-up" ] ;; '
                           '*) [ -e "$STATE/active" ] ;; esac')
    r = host.run("host-drain")
    assert r.returncode == 1 and "not draining: prefill on b300-1 is not healthy (its /health, no router)" in r.stderr
    assert not r.called("systemctl")
    (host.stubs.state / "others-up").touch()
    r = host.run("host-drain")
    assert r.returncode == 0 and "no router: nothing to wait for" in r.stdout, r.stderr
    assert r.called("systemctl disable --now --quiet glm-vllm-prefill-2.service glm-vllm-prefill-3.service")


def test_a_roll_or_turn_command_with_a_bad_argument_fails(leases, tmp_path):
    """A roll digest that is not one, or an action the scripts do not know: usage, exit 2, nothing done."""
    host = RollHost(tmp_path, closed_port_url())
    st = host.steps()["host-drain"]
    host.steps = lambda: {"host-drain": dataclasses.replace(st, update=st.update.replace(" drain ", " drain x-"))}
    r = host.run("host-drain")
    assert r.returncode == 2 and "usage:" in r.stderr and "16 hex digits" in r.stderr and not r.called("systemctl")
    host.steps = lambda: {"host-drain": dataclasses.replace(st, update=st.update.replace(" drain ", " bogus "))}
    r = host.run("host-drain")
    assert r.returncode == 2 and "usage:" in r.stderr and not r.called("systemctl")
    r = leases("b300-1", "bogus")
    assert r.returncode == 2 and "usage:" in r.stderr and slots(leases.root) == {}


def test_the_drain_waits_for_the_other_host_and_the_return_for_the_router(router, tmp_path, monkeypatch):
    """Late, not unreadable: b300-1 is back in the router a moment after the drain starts, and the router
    marks b300-2 healthy a moment after its instances answer: both steps wait and go on."""
    monkeypatch.delenv("GLM_INFRA_ROLL_FORCE", raising=False)
    host = RollHost(tmp_path, f"http://127.0.0.1:{router.server_address[1]}/metrics")
    p = plan(load_file(stack_file("prod-b300")).config)
    other = [p.router.worker_url(i.name) for i in p.instances if i.host == "b300-1"]
    mine = [p.router.worker_url(i.name) for i in p.instances if i.host == "b300-2"]

    def later(page: str) -> threading.Timer:
        t = threading.Timer(1.0, lambda: setattr(_Metrics, "page", page))
        t.start()
        return t

    _Metrics.page = health_page({**{u: 0 for u in other}, **{u: 1 for u in mine}})
    t = later(health_page({**{u: 1 for u in other}, **{u: 0 for u in mine}}))
    try:
        r = host.run("host-drain")
    finally:
        t.cancel()
    assert r.returncode == 0, r.stderr
    assert "the router marks http://127.0.0.1:8012 http://127.0.0.1:8013 down" in r.stdout and "warning" not in r.stderr
    t = later(health_page({u: 1 for u in other + mine}))
    try:
        r = host.run("host-return")
    finally:
        t.cancel()
    assert r.returncode == 0, r.stderr
    assert "the router marks http://127.0.0.1:8012 http://127.0.0.1:8013 healthy" in r.stdout


def test_a_first_deploy_records_the_roll_and_returns_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("GLM_INFRA_ROLL_FORCE", raising=False)
    host = RollHost(tmp_path, closed_port_url())
    r = host.run("host-drain", create=True)
    assert r.returncode == 0 and "recorded (first deploy)" in r.stdout and not r.calls
    r = host.run("host-return")
    assert r.returncode == 0 and "nothing drained" in r.stdout and not r.called("systemctl"), r.stderr
    assert host.file("/var/lib/glm-infra/roll-done").read_text().strip() == host.roll


def test_the_return_waits_for_health_and_fails_when_it_never_comes(router, tmp_path, monkeypatch):
    monkeypatch.delenv("GLM_INFRA_ROLL_FORCE", raising=False)
    _Metrics.page = health_page({g.url: 1 for g in plan(load_file(stack_file("prod-b300")).config).router.gates})
    host = RollHost(tmp_path, f"http://127.0.0.1:{router.server_address[1]}/metrics")
    assert host.run("host-drain").returncode == 0
    host.stubs.add("curl", 'case "$*" in *metrics*) exec /usr/bin/curl "$@" ;; esac; exit 7')  # never
    r = host.run("host-return")
    assert r.returncode == 1 and "glm-vllm-prefill-2.service did not answer http://10.0.0.12:8100/health within 3s" in r.stderr
    assert host.file("/var/lib/glm-infra/roll-drained").exists(), "not done: the next up returns it again"
    # /health answers from the third look on (a vLLM loading its weights): the return waits for it.
    host.stubs.add("curl", 'case "$*" in *metrics*) exec /usr/bin/curl "$@" ;; esac\n'
                           'n=$(cat "$STATE/looks" 2>/dev/null || echo 0); echo $((n + 1)) > "$STATE/looks"; [ "$n" -ge 2 ]')
    r = host.run("host-return")
    assert r.returncode == 0 and "healthy" in r.stdout, r.stderr
    assert not host.file("/var/lib/glm-infra/roll-drained").exists()


def test_a_release_leaves_a_slot_taken_back_meanwhile(leases):
    """release reads the slots, then removes its own under the pool's lock, looking again: a slot another
    host took back in between (its holder's run was gone) stays that host's."""
    import fcntl

    assert leases("b300-3", "acquire").returncode == 0  # makes the stack's lease folder
    pool = next(leases.root.iterdir()) / "prefill"
    pool.mkdir()
    slot = pool / "slot-0"
    slot.write_text("b300-1 4 5 6\n")
    with open(pool / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        release = leases("b300-1", "release", background=True)
        time.sleep(1.5)  # it has read the slot and waits for the lock
        slot.write_text(f"b300-2 {os.getpid()} 1 6\n")
        fcntl.flock(lock, fcntl.LOCK_UN)
    out, err = release.communicate(timeout=30)
    assert release.returncode == 0, err
    assert slot.read_text().split()[0] == "b300-2"


def test_with_two_routers_the_roll_waits_for_both_and_refuses_blind_on_either(router, tmp_path, monkeypatch):
    """prod-b300 runs two routers, each checking the workers itself: a host is drained once both mark its workers
    down and back once both mark them healthy; one router that cannot be read stops the roll, naming it."""
    monkeypatch.delenv("GLM_INFRA_ROLL_FORCE", raising=False)
    stack = load_file(stack_file("prod-b300")).config
    p = plan(stack)
    urls = hostplan.host_steps(stack, p, p.host("b300-2"), stack_name="t").steps["host-drain"].stdin
    assert "metrics_url='http://10.0.0.13:29000/metrics http://10.0.0.12:29000/metrics'" in urls, "both router hosts'"

    class Standby(_Metrics):
        page = ""

    standby = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Standby)
    threading.Thread(target=standby.serve_forever, daemon=True).start()
    try:
        host = RollHost(tmp_path, " ".join(f"http://127.0.0.1:{s.server_address[1]}/metrics" for s in (router, standby)))
        workers = p.router.prefill_urls + p.router.decode_urls
        mine = [p.router.worker_url(i.name) for i in p.instances if i.host == "b300-2"]
        others = [u for u in p.router.prefill_urls if u not in mine]
        _Metrics.page = health_page({u: 1 for u in workers})
        Standby.page = health_page({**{u: 1 for u in workers}, **{u: 0 for u in others}})  # b300-1 down there
        r = host.run("host-drain")
        assert r.returncode == 1 and "not draining: prefill on b300-1 is not healthy in the router" in r.stderr, r.stderr
        assert not r.called("systemctl disable")
        # Both see b300-1 serving; only the first sees b300-2 go: the drain waits for the second, then warns.
        Standby.page = health_page({u: 1 for u in workers})
        r = host.run("host-drain")
        assert r.returncode == 0 and "warning: the router still reports" in r.stderr, r.stderr
        # Back: the first router marks them healthy, the second does not yet: not done.
        _Metrics.page = health_page({u: 1 for u in workers})
        Standby.page = health_page({**{u: 1 for u in workers}, **{u: 0 for u in mine}})
        r = host.run("host-return")
        assert r.returncode == 1 and "does not report" in r.stderr and "healthy" in r.stderr, r.stderr
        assert not host.file("/var/lib/glm-infra/roll-done").exists()
        Standby.page = health_page({u: 1 for u in workers})
        r = host.run("host-return")
        assert r.returncode == 0 and "the router marks" in r.stdout, r.stderr
    finally:
        standby.shutdown()
        standby.server_close()
    # The second router unreadable (its host down): the roll stops, naming it.
    dead = closed_port_url()
    host = RollHost(tmp_path / "blind", f"http://127.0.0.1:{router.server_address[1]}/metrics {dead}")
    r = host.run("host-drain")
    assert r.returncode == 1 and f"{dead}: curl: (7)" in r.stderr and "not going on blind" in r.stderr, r.stderr
    assert not r.called("systemctl")
