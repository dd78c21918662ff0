"""A driver upgrade that reboots rolls through each pool, under load through the router: within branch 580,
then across the 590 rename (the stand-ins carry both namings, glm_infra/spec/packages.py).

The sim stack laid out so that every pool has two hosts: prefill and decode both on sim-1 and sim-2 (one
DP4 instance of each per host, 8 GPUs per host), the router and the monitoring on sim-3 (which runs no
instance, so nothing rolls there). A client sends ~2 requests/s through the router's public port while
the driver moves to the stand-in repository's other version; each host drains (its instances stopped,
the router marking them down), reboots, comes back healthy in the router, and only then does the next
host start. The failed requests are counted and printed (goal 0).

Then (issue 40) a second router and a virtual address join the running stack, a router change rolls the two
routers one at a time, the router host holding the address loses power, and two hosts join the stack (a prefill
and a decode host) and one leaves, each under load.
"""

from __future__ import annotations

import json
import re
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from e2e.harness import COLD, ROOT, on_host, power_back, power_cut, router_chat, set_host_keys, sh, steady_load

ROUTER = "https://10.88.0.13:8000"
ROLLING = ("sim-1", "sim-2")
NEW_DRIVER = "580.172.08"  # the stand-in apt repository's second driver version
RENAMED_DRIVER = "595.71.05"  # its branch 595, under NVIDIA's names from 590 on
CLIENT: dict = {}


def chat(text: str, timeout: int = 60) -> dict:
    return router_chat(ROUTER, CLIENT["key"], ssl.create_default_context(cadata=CLIENT["ca"]), text, timeout)


def roll_records(host: str) -> list[tuple[float, str]]:
    """roll.sh's record of each phase on ``host``: (time, phase)."""
    out = on_host(host, "cat /var/lib/glm-infra/roll.log 2>/dev/null || true")
    return [(float(t), phase) for t, _, phase, _ in (line.split() for line in out.splitlines() if line.strip())]


def booted_at(host: str) -> float:
    """When the host's systemd last started (the reboot)."""
    return float(on_host(host, "date -d \"$(systemctl show -p UserspaceTimestamp --value)\" +%s").strip())


def plan_text() -> str:
    p = sh(f"{ROOT}/venv/bin/python -c 'import sys; sys.argv = [\"glm-infra\", \"plan\", \"sim\"]; "
           "from glm_infra.tools.cli import main; sys.exit(main())'")
    return p.stdout


MIRROR = ("/etc/apt/sources.list.d/glm-sim-mirror.list", "/usr/share/keyrings/glm-sim-mirror.gpg")


@pytest.fixture
def router_host_mirror():
    """sim-3 serves no model, so no driver step adds the stand-in repository there: give it the machine's
    repository as its distribution mirror (nginx, nftables, Prometheus), as a real router host has one
    (unless an earlier module's driver step left it there: destroy keeps the held driver's repository)."""
    added = on_host("sim-3", "grep -rqs 10.88.0.1:8088/apt /etc/apt/sources.list.d/ && echo kept || { "
                             "curl -fsSL http://10.88.0.1:8088/apt/glm-sim-archive.pub | gpg --dearmor 2>/dev/null > "
                             f"{MIRROR[1]} && echo 'deb [signed-by={MIRROR[1]}] http://10.88.0.1:8088/apt/ ./' > "
                             f"{MIRROR[0]} && apt-get update -qq && echo added; }}").strip() == "added"
    try:
        yield
    finally:
        if added:
            on_host("sim-3", f"rm -f {' '.join(MIRROR)}", check=False)


def roll_driver(stack, version: str) -> str:
    """The driver moved to ``version`` under ~2 requests/s through the router's public port: each host of a pool
    drained, rebooted and back healthy in the router before the next one's turn, no request failed. pulumi's
    output."""
    boots = {h: booted_at(h) for h in ROLLING}
    stack.config_set("glm-infra:drivers.version", version)
    preview = stack.preview_json()
    changed = {s["urn"].split("::")[-1] for s in preview.get("steps", []) if s.get("op") not in ("same", "read")}
    for h in ROLLING:
        assert {f"glm-{h}-{k}" for k in ("turn-acquire", "host-drain", "drivers-install", "host-return",
                                         "turn-release")} <= changed, changed
    assert not any(k.endswith(("-unit", "-rollout")) for k in changed), "no instance is restarted by a resource"

    t_up = time.time()
    with steady_load(chat) as load:  # ~2 requests/s through the router's public port while the hosts roll
        up = stack.up()
        time.sleep(2)
    took = time.time() - t_up
    print(f"\nrolling driver upgrade to {version}: {load.sent} requests in {took:.0f} s, {len(load.failures)} failed",
          file=sys.stderr)
    for f in load.failures:
        print(f"  {f}", file=sys.stderr)

    # Each host rebooted once, inside its own turn; the turns did not overlap, in pool order.
    phases = {h: dict((p, t) for t, p in roll_records(h) if t >= t_up) for h in ROLLING}
    for h in ROLLING:
        ph = phases[h]
        assert {"drain-start", "stopped", "drained", "return-start", "returned"} <= set(ph), (h, ph)
        boot = booted_at(h)
        assert boot > boots[h], f"{h} rebooted"
        assert ph["stopped"] < boot < ph["return-start"] < ph["returned"], (h, ph, boot)
        assert on_host(h, "nvidia-smi --query-gpu=driver_version --format=csv,noheader | sort -u").strip() == version
    for h in ROLLING:  # the timeline, seconds from the start of the up
        print(f"  {h}: " + ", ".join(f"{p} {t - t_up:.1f}" for p, t in sorted(phases[h].items(), key=lambda x: x[1]))
              + f", boot {booted_at(h) - t_up:.1f}", file=sys.stderr)
    for line in up.stdout.splitlines():
        if ": roll: " in line or ": turn: " in line:
            print(f"  {line.strip()[-160:]}", file=sys.stderr)
    first_host, second_host = sorted(ROLLING, key=lambda h: phases[h]["drain-start"])
    assert first_host == "sim-1", "in pool order"
    assert phases[first_host]["returned"] < phases[second_host]["drain-start"], \
        f"no two hosts of a pool down together: {phases}"
    assert up.stdout.count(f"the loaded kernel module is not {version}: reboot required") == 2
    for h in ROLLING:
        assert re.search(rf"{h}: roll: the router marks (http://\S+ )+down", up.stdout), f"{h}: drained in the router"
        assert re.search(rf"{h}: roll: the router marks (http://\S+ )+healthy", up.stdout), f"{h}: back in the router"
        assert f"{h}: turn: prefill/slot-0 taken" in up.stdout
    assert load.sent >= 20
    assert not load.failures, f"{len(load.failures)} of {load.sent} requests failed during the roll: {load.failures[:10]}"

    # Nothing pending, nothing left drained, no turn left held.
    sh("pulumi preview -s sim --expect-no-changes --non-interactive")
    for h in ROLLING:
        assert "nothing drained" in on_host(h, "/usr/local/libexec/glm-infra/roll.sh check")
    chat("after the upgrade")
    return up.stdout


def installed(host: str) -> dict[str, str]:
    """Package -> version of what ``host`` has installed."""
    out = on_host(host, "dpkg-query -W -f='${db:Status-Status} ${Package} ${Version}\\n'")
    return {n: v for s, n, v in (line.split() for line in out.splitlines() if line.strip()) if s == "installed"}


def test_rolling_driver_upgrade_under_load(stack, router_host_mirror):
    for key, value in (("prefill.instancesPerHost", "1"), ("decode.hosts[0]", "sim-1"),
                       ("decode.hosts[1]", "sim-2"), ("decode.dp", "4")):
        stack.config_set(f"glm-infra:{key}", value)
    plan = plan_text()
    assert "prefill: 2 hosts, 1 at a time (maxUnavailable 1), each drained and healthy again before the next: " \
           "sim-1, then sim-2" in plan, plan
    assert "decode: 2 hosts, 1 at a time" in plan and "interrupted" not in plan, plan
    first = stack.up()
    assert "interrupted" not in first.stdout, "no pool is interrupted: no warning"
    out = stack.outputs()
    CLIENT.update(key=out["routerApiKey"], ca=out["routerCaCertificate"])
    deadline = time.monotonic() + 120
    while True:  # the router sees every worker healthy
        try:
            chat("before the upgrade")
            break
        except (urllib.error.URLError, OSError):
            assert time.monotonic() < deadline, "the router serves after the first up"
            time.sleep(2)
    roll_driver(stack, NEW_DRIVER)
    for h in ROLLING:  # exactly the new release, though the stand-in repository has a newer 580
        got = installed(h)
        assert got["nvidia-utils-580"] == got["nvidia-driver-580-open"] == f"{NEW_DRIVER}-1ubuntu1"
        assert [p for p in got if p.startswith("nvidia-driver-pinning-")] == [f"nvidia-driver-pinning-{NEW_DRIVER}"]


def test_rolling_driver_upgrade_across_the_590_rename_under_load(stack, router_host_mirror):
    """580 -> 595 (the stack of the test above, at NEW_DRIVER): NVIDIA's packages lose the branch from their
    names at 590. Each host, in its turn: the 580 tree goes in an apt run of its own, the 595 tree comes at
    exactly 595.71.05 (the repository also has a newer 595), one pinning package, the fabric manager at the
    driver's version; rebooted, healthy, back in the router; no request lost."""
    if not CLIENT:
        pytest.skip("needs the stack of test_rolling_driver_upgrade_under_load")
    out = roll_driver(stack, RENAMED_DRIVER)
    for h in ROLLING:
        assert f"{h}: drivers: removing the driver tree of another branch first:" in out
        got = installed(h)
        assert not {"nvidia-driver-580-open", "nvidia-utils-580", "nvidia-dkms-580-open"} & set(got), got
        for p in ("nvidia-driver-open", "nvidia-utils", "nvidia-compute-utils", "nvidia-dkms-open", "nvidia-fabricmanager",
                  "libnvidia-nscq", "libnvsdm"):
            assert got[p] == f"{RENAMED_DRIVER}-1ubuntu1", (h, p, got.get(p))
        assert [p for p in got if p.startswith("nvidia-driver-pinning-")] == [f"nvidia-driver-pinning-{RENAMED_DRIVER}"]
        assert f"{h}: healthy (8 × NVIDIA B300 SXM6 AC, driver {RENAMED_DRIVER}; fabric Completed on 8 GPUs" in \
            on_host(h, "/usr/local/libexec/glm-infra/health-gate.sh check")


# --- two routers behind one address (issue 40) -----------------------------------------------------------

VIP = "10.88.0.10"
PROMETHEUS = "http://10.88.0.13:9090"  # monitoring.host: the router's host (sim-3)
STANDBY = "sim-1"  # runs instances too; sim-3 runs the router alone, so its death takes no worker with it


def holds(host: str) -> bool:
    return bool(on_host(host, f"ip -o -4 addr show to {VIP}/32").strip())


def vip_holders() -> list[str]:
    return [h for h in ("sim-1", "sim-2", "sim-3") if holds(h)]


def vip_chat(text: str, timeout: int = 60) -> dict:
    return router_chat(f"https://{VIP}:8000", CLIENT["key"], ssl.create_default_context(cadata=CLIENT["ca"]), text,
                       timeout)


def router_started_at(host: str) -> float:
    return float(on_host(host, "date -d \"$(systemctl show -p ActiveEnterTimestamp --value glm-vllm-router)\" +%s"))


def test_a_second_router_joins_the_running_stack_and_a_router_change_loses_no_request(stack, router_host_mirror):
    """The running single-router stack gains a standby router (sim-1) and the virtual address: nothing that serves
    is replaced or restarted, clients of the old address are served throughout; then a change of the router's
    flags restarts both routers, one at a time, each drained to the other's front first: no request fails."""
    if not CLIENT:
        pytest.skip("needs the stack of test_rolling_driver_upgrade_under_load")
    stack.config_set("glm-infra:router.standbyHosts[0]", STANDBY)
    stack.config_set("glm-infra:router.virtualAddress", VIP)
    preview = stack.preview_json()
    ops = {s["urn"].split("::")[-1]: s.get("op") for s in preview.get("steps", [])}
    assert not {n for n, op in ops.items() if op in ("replace", "delete", "create-replacement", "delete-replaced")}, ops
    assert not {n for n, op in ops.items() if op != "same" and n.endswith(("-rollout", "-unit"))
                and not n.startswith(f"glm-router-{STANDBY}-")}, "no instance restarts"
    running = router_started_at("sim-3")
    with steady_load(chat) as load:  # the old address (sim-3's own): its front keeps serving it
        up = stack.up()
    assert not load.failures, load.failures
    assert router_started_at("sim-3") == running, "the running router was not restarted"
    assert "sim-1: router TLS: took router.host's CA" in up.stdout
    out = stack.outputs()
    assert out["routerUrl"] == f"https://{VIP}:8000" and out["routerCaCertificate"] == CLIENT["ca"], "one CA for both"
    assert len(vip_holders()) == 1
    vip_chat("through the virtual address")

    started = {h: router_started_at(h) for h in ("sim-3", STANDBY)}
    stack.config_set("glm-infra:router.healthCheckInterval", "3")
    t_up = time.time()
    with steady_load(vip_chat, per_second=4) as load:
        up = stack.up()
        time.sleep(2)
    print(f"\nrouter change through {VIP}: {load.sent} requests, {len(load.failures)} failed", file=sys.stderr)
    for line in up.stdout.splitlines():
        if "front passes" in line or "drained after" in line:
            print(f"  {line.strip()[-160:]}", file=sys.stderr)
    for h in ("sim-3", STANDBY):
        assert started[h] < router_started_at(h), f"{h}'s router restarted"
        assert re.search(rf"{h}: the front passes new requests to https://\S+; waiting", up.stdout), f"{h} drained first"
        assert f"{h}: the front passes requests to its own router again" in up.stdout
    first, second = (up.stdout.index(f"{h}: the front passes new requests") for h in ("sim-3", STANDBY))
    assert first < second and up.stdout.index("sim-3: the front passes requests to its own router again") < second, \
        "one router at a time"
    assert load.sent >= 20 and not load.failures, load.failures
    assert t_up < router_started_at("sim-3") < router_started_at(STANDBY)


def test_the_router_host_holding_the_address_dies_and_the_address_moves(stack):
    """sim-3 (the router alone) loses power under load while it holds the address: the standby takes the address
    within seconds; only a request in flight there may fail (the client sends one at a time)."""
    if vip_holders() != ["sim-3"]:  # the address stays where it is (nopreempt): put it on sim-3 for the test
        on_host(STANDBY, "systemctl stop keepalived")
        deadline = time.monotonic() + 20
        while vip_holders() != ["sim-3"]:
            assert time.monotonic() < deadline, "sim-3 takes the address when the standby's keepalived stops"
            time.sleep(0.5)
        on_host(STANDBY, "systemctl start keepalived")
    vip_chat("before the power cut")
    with steady_load(vip_chat, per_second=4) as load:
        time.sleep(3)
        cut = time.time()
        power_cut("sim-3")
        deadline = time.monotonic() + 30
        while not holds(STANDBY):  # (sim-3 answers no SSH now)
            assert time.monotonic() < deadline, f"{STANDBY} holds {VIP} within 30 s of sim-3's power cut"
            time.sleep(0.2)
        moved = time.time() - cut
        while True:  # until a request sent after the move is answered
            try:
                vip_chat("after the power cut", timeout=30)
                break
            except (urllib.error.URLError, OSError):
                assert time.monotonic() < deadline + 30, "the address answers again"
        answered = time.time() - cut
        time.sleep(5)
    print(f"\nsim-3 powered off: {STANDBY} held {VIP} after {moved:.1f} s, answered after {answered:.1f} s; "
          f"{load.sent} requests, {len(load.failures)} failed: {load.failures}", file=sys.stderr)
    assert len(load.failures) <= 1, load.failures
    assert answered < 20
    # What the node exporter serves there: the standby holds the address and serves.
    metrics = on_host(STANDBY, "cat /var/lib/prometheus/node-exporter/glm-router-vrrp.prom")
    assert f'glm_router_address_held{{address="{VIP}"}} 1' in metrics and f'glm_router_serves{{address="{VIP}"}} 1' in metrics
    # sim-3 back (as after a power cut): its units start at boot, the address stays on the standby.
    power_back("sim-3")
    stack.up()
    assert vip_holders() == [STANDBY]
    vip_chat("with both routers again")
    # Prometheus (on sim-3, back) saw the address move: a ticket, no page.
    deadline = time.monotonic() + 120
    while True:
        with urllib.request.urlopen(f"{PROMETHEUS}/api/v1/alerts", timeout=10) as r:
            alerts = {a["labels"]["alertname"]: a["state"] for a in json.load(r)["data"]["alerts"]}
        if alerts.get("GlmRouterAddressMoved") == "firing":
            break
        assert time.monotonic() < deadline, f"GlmRouterAddressMoved fires once Prometheus is back: {alerts}"
        time.sleep(3)
    # (Pending for a moment is no page: Prometheus back from the cut has yet to scrape a fresh claim.)
    assert "firing" not in (alerts.get("GlmRouterAddressUnheld"), alerts.get("GlmRouterAddressHeldTwice")), alerts


# --- hosts join and leave through the stack's own file (issue 40) ----------------------------------------

JOINING = {"sim-4": "10.88.0.14", "sim-5": "10.88.0.15"}  # a prefill host and a decode host
EXTRA: dict = {}  # the file naming the joining hosts, for `scripts/sim --stack FILE down`


@pytest.fixture(scope="module", autouse=True)
def joining_hosts_stopped(tmp_path_factory):
    """The joining hosts stop after the module's stack is destroyed (this fixture is set up before `stack`, so it is
    torn down after it): the lane's `scripts/sim down` reads the sim stack's file, which names only its own three."""
    EXTRA["file"] = tmp_path_factory.mktemp("joining") / "Pulumi.joining.yaml"
    EXTRA["file"].write_text(json.dumps({"config": {"glm-infra:hosts": [
        {"name": n, "address": a} for n, a in JOINING.items()]}}))
    yield
    subprocess.run([str(ROOT / "scripts/sim"), "--stack", str(EXTRA["file"]), "down"], timeout=600)


def on_joining(host: str, cmd: str) -> str:
    """``cmd`` on a joining host, also once the sim stack's file names it no more."""
    return on_host(host, cmd, stack=EXTRA["file"])


def stack_instances(hosts: tuple[str, ...]) -> dict[str, dict]:
    return {n: i for n, i in json.loads(sh("pulumi stack output -s sim instances --json").stdout).items()
            if i["host"] in hosts}


def requests_served(instance: dict) -> float:
    """What one instance has answered (vllm:request_success_total, every finish reason), read on its host."""
    text = on_joining(instance["host"], f"curl -fsS {instance['url']}/metrics || true")
    return sum(float(v) for v in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.M))


def unit_stopped_at(host: str, unit: str) -> float:
    out = on_joining(host, f"journalctl -u {unit} -o short-unix --no-pager | grep -E 'Stopp(ed|ing)' | head -1")
    return float(out.split()[0])


def test_two_hosts_join_under_load_and_take_traffic_then_one_leaves_drained(stack):
    """sim-4 joins prefill and sim-5 decode by being listed in the stack's file, under load through the virtual
    address: the firewall of every host lets them in, their instances start warm (the warm caches relayed), both
    routers roll, no request fails, and the new instances take traffic. Then sim-4 leaves the file: the routers roll
    without it first (Pulumi deletes last), its instance stops after that, and again no request fails."""
    if not CLIENT or not vip_holders():
        pytest.skip("needs the two-router stack of the tests above")
    n = 3
    for name, address in JOINING.items():
        stack.config_set(f"glm-infra:hosts[{n}].name", name)
        stack.config_set(f"glm-infra:hosts[{n}].address", address)
        for i in range(8):
            stack.config_set(f"glm-infra:hosts[{n}].computeNics[{i}]", f"mlx5_{i}")
        n += 1
    set_host_keys()
    subprocess.run([str(ROOT / "scripts/sim"), "up"], check=True, timeout=600)  # boots the two the file now names
    stack.config_set("glm-infra:prefill.hosts[2]", "sim-4")
    stack.config_set("glm-infra:decode.hosts[2]", "sim-5")
    routers = {h: router_started_at(h) for h in ("sim-3", STANDBY)}

    firsts: dict[str, float] = {}
    t_up = time.time()
    with steady_load(vip_chat, per_second=4) as load:
        done = threading.Event()

        def watch() -> None:  # when each new instance answers its first request (printed, not asserted)
            while not done.wait(2):
                try:
                    instances = stack_instances(("sim-4", "sim-5"))
                except AssertionError:  # the state read while the up rewrites it ("failed to load checkpoint: EOF")
                    continue
                for name, inst in instances.items():
                    if name not in firsts and requests_served(inst) > 0:
                        firsts[name] = time.time() - t_up
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        stack.up()
        took = time.time() - t_up
        time.sleep(6)
        done.set()
        watcher.join(timeout=60)
    print(f"\nsim-4 (prefill) and sim-5 (decode) joined under load: up {took:.0f} s, {load.sent} requests, "
          f"{len(load.failures)} failed; first request answered by a new instance at "
          + ", ".join(f"{k} {v:.0f} s" for k, v in sorted(firsts.items())), file=sys.stderr)
    assert load.sent >= 40 and not load.failures, load.failures
    joined = stack_instances(("sim-4", "sim-5"))
    assert {i["host"] for i in joined.values()} == {"sim-4", "sim-5"}, joined
    for h in ("sim-1", "sim-2", "sim-3"):
        table = on_host(h, "nft list table inet glm_infra")
        assert all(a in table for a in JOINING.values()), f"{h}'s firewall lets the new hosts in"
    for h in ("sim-3", STANDBY):
        assert routers[h] < router_started_at(h), f"{h}'s router rolled with the new workers"
    for name, inst in joined.items():
        unit = f"glm-vllm-{name}"
        journal = on_joining(inst["host"], f"journalctl -u {unit} --no-pager -o cat")
        assert "Using FlashInfer autotune cache file" in journal and COLD not in journal, (name, journal[-2000:])
    for i in range(30):  # three prefill instances, three decode ones: each new one answers some of 30
        vip_chat(f"after the join {i}")
    assert all(requests_served(inst) > 0 for inst in joined.values()), "the new instances take traffic"

    # sim-4 leaves: out of the pool and out of the stack's hosts.
    (prefill_4,) = [name for name, inst in joined.items() if inst["host"] == "sim-4"]
    routers = {h: router_started_at(h) for h in ("sim-3", STANDBY)}
    sh("pulumi config rm -s sim --path 'glm-infra:prefill.hosts[2]'")
    sh("pulumi config rm -s sim --path 'glm-infra:hosts[3]'")
    t_up = time.time()
    with steady_load(vip_chat, per_second=4) as load:
        stack.up()
        took = time.time() - t_up
        time.sleep(2)
    stopped = unit_stopped_at("sim-4", f"glm-vllm-{prefill_4}")
    print(f"sim-4 left under load: up {took:.0f} s, {load.sent} requests, {len(load.failures)} failed; its instance "
          f"stopped {stopped - max(router_started_at(h) for h in routers):.1f} s after the last router rolled",
          file=sys.stderr)
    assert load.sent >= 20 and not load.failures, load.failures
    for h in routers:
        assert routers[h] < router_started_at(h) < stopped, f"{h}'s router rolled without sim-4 before it stopped"
    assert set(stack.outputs()["hosts"]) == {"sim-1", "sim-2", "sim-3", "sim-5"}
    assert "10.88.0.14" not in on_host("sim-1", "nft list table inet glm_infra"), "sim-4 is let in no more"
    assert on_joining("sim-4", "systemctl list-units 'glm-*' --all --no-legend").strip() == "", \
        "sim-4 as destroy leaves it"
