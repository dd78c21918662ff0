"""Rolling host changes: the roll groups and what the plan says of them (pure), the turn lease run as real
processes on this machine (two hosts wanting one slot, a slot whose run is gone, the bounded wait), and
roll.sh's drain and return against a stub PATH with a stand-in router metrics page."""

from __future__ import annotations

import http.server
import os
import shlex
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import stack_config, stack_file
from glm_infra import hostplan, render
from glm_infra.stack import load_file
from glm_infra.topology import plan, roll_predecessors, rolling, rolling_notes
from stubs import StubPath
from test_host_scripts import in_root, isolated


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
    assert acquire_s > 1800 + 1200 + stack.drivers.reboot_timeout + render.SERVICE_START_TIMEOUT_S
    script = hs["host-drain"].stdin
    interval = stack.router.health_check_interval
    assert f"down_s={(3 + 1) * (interval + 5) + 30}\n" in script and f"up_s={(2 + 1) * (interval + 5) + 30}\n" in script


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
    gone = subprocess.Popen(["sleep", "0"])
    gone.wait()
    assert leases("b300-1", "acquire", holder=gone.pid).returncode == 0  # held by a run that has ended
    r = leases("b300-2", "acquire", wait_s=10)
    assert r.returncode == 0, r.stderr
    assert "prefill/slot-0: taken back from b300-1 (its run, pid %d, is gone)" % gone.pid in r.stdout
    assert slots(leases.root) == {"prefill/slot-0": "b300-2"}


def test_the_wait_for_a_turn_is_bounded_and_names_the_holder(leases):
    assert leases("b300-1", "acquire").returncode == 0  # held by this test's process: alive
    t0 = time.monotonic()
    r = leases("b300-2", "acquire", wait_s=3)
    assert r.returncode == 1 and 3 <= time.monotonic() - t0 < 60, (r.stdout, r.stderr)
    assert f"b300-2: turn: no turn in prefill after 3s (one roll's step timeouts): slot-0: b300-1 (pid {os.getpid()}" \
        in r.stderr
    assert "rm " in r.stderr and str(leases.root) in r.stderr
    assert slots(leases.root) == {"prefill/slot-0": "b300-1"}, "the waiter took nothing"


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
        script = script.replace(next(l for l in script.splitlines() if l.startswith(f"{k}=")), f"{k}=4")
    mine = [i.url for i in p.instances if i.host == "b300-2"]
    other = [i.url for i in p.instances if i.host == "b300-1"]
    s = StubPath(tmp_path / "stubs")
    s.add("systemctl", 'case "$1" in disable) rm -f "$STATE/active" ;; start) touch "$STATE/active" ;; esac; exit 0')
    s.add("journalctl")
    real_curl = "/usr/bin/curl"
    s.add("curl", f'case "$*" in *metrics*) exec {real_curl} "$@" ;; *) [ -e "$STATE/active" ] ;; esac')
    run = lambda *a: isolated(s, script, list(a), ["/var/lib/glm-infra"], tmp_path)  # noqa: E731

    assert run("record", "aaaaaaaaaaaaaaaa").returncode == 0
    r = run("drain", "aaaaaaaaaaaaaaaa")  # the roll already done (a new SSH key re-ran the step)
    assert r.returncode == 0 and "nothing to drain" in r.stdout and not r.called("systemctl")

    # b300-1 not healthy in the router: draining b300-2 too would leave prefill without a host.
    _Metrics.page = health_page({**{u: 0 for u in other}, **{u: 1 for u in mine}})
    r = run("drain", "bbbbbbbbbbbbbbbb")
    assert r.returncode == 1 and "not draining: prefill on b300-1 is not healthy in the router after 4s" in r.stderr
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

    # The router unreadable: the drain goes on (warning), the return too.
    _Metrics.page = ""
    router.shutdown()
    r = run("drain", "cccccccccccccccc")
    assert r.returncode == 0 and "cannot be read" in r.stderr


def test_lease_and_roll_scripts_are_shellcheck_clean(tmp_path):
    from stubs import shellcheck

    stack = load_file(stack_file("prod-b300")).config
    p = plan(stack)
    hs = hostplan.host_steps(stack, p, p.host("b300-1"), stack_name="prod-b300").steps
    for key in ("turn-acquire", "host-drain"):
        r = shellcheck(hs[key].stdin, tmp_path)
        assert r.returncode == 0, f"{key}\n{r.stdout}"
