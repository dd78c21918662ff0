"""The weights relay: the tree (pure planning) and real ``weights.py stage`` processes on loopback, one
per simulated host (its own path and port), copying down the tree from a throttled mirror: the copy
completes and verifies everywhere, a parent killed mid-copy or serving corrupt bytes is left for an
ancestor, resume keeps what is there."""

from __future__ import annotations

import json
import math
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, bundled, free_port, wait_port

from glm_infra import hostplan
from glm_infra.plan import ports, topology
from glm_infra.plan.topology import RELAY_DEGREE, relay_tree, weights_relay
from glm_infra.roles import weights
from glm_infra.stack import load_file
from testbed import STANDINS

WEIGHTS = bundled("weights")  # the one file a host gets (agent/bundle.py)
MAKE = STANDINS / "make-checkpoint"
SLOW = ROOT / "testbed" / "slow_source.py"
SHARDS = [f"model-0000{i}-of-00006.safetensors" for i in range(1, 7)]


# --- the tree --------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 16, 96])
def test_the_tree_reaches_every_host_once_within_log2_depth(n):
    order = [f"h{i}" for i in range(n)]
    tree = relay_tree(order)
    assert list(tree) == order and tree["h0"].parent is None and tree["h0"].ancestors == ()
    fed = [c for r in tree.values() for c in r.children]
    assert sorted(fed) == sorted(order[1:]), "every host but the seed has exactly one parent"
    for r in tree.values():
        assert len(r.children) <= RELAY_DEGREE
        if r.parent is not None:
            assert r.ancestors[0] == r.parent and r.ancestors[-1] == "h0", "parent first, the seed last"
            assert r.host in tree[r.parent].children
    assert max(len(r.ancestors) for r in tree.values()) == math.floor(math.log2(n))


def test_a_host_added_at_the_end_changes_nobody_else():
    before = relay_tree([f"h{i}" for i in range(10)])
    after = relay_tree([f"h{i}" for i in range(11)])
    changed = [h for h in before if before[h] != after[h]]
    assert changed == [after["h10"].parent], "only the new host's parent gains a child"
    assert after["h10"].parent == "h4" and before["h4"].children == ("h9",)


def test_weights_relay_roots_the_seed_and_follows_the_stack_order():
    cfg = load_file(ROOT / "stacks" / "Pulumi.prod-b300.yaml").config
    tree = weights_relay(cfg)
    serving = [h.name for h in cfg.hosts if h.name in {i.host for i in topology.allocate(cfg)}]
    assert list(tree) == serving and tree[serving[0]].parent is None
    moved = cfg.model_copy(update={"model": cfg.model.model_copy(update={"seed_host": serving[-1]})})
    assert list(weights_relay(moved))[0] == serving[-1]
    local = cfg.model_copy(update={"model": cfg.model.model_copy(update={"source": "local"})})
    assert weights_relay(local) == {}


def test_only_hosts_with_children_listen_and_each_peer_names_its_ancestors():
    cfg = load_file(ROOT / "stacks" / "Pulumi.prod-b300.yaml").config
    tree = weights_relay(cfg)
    relay = {li.host for li in ports.listeners(cfg) if li.owner == "weights relay"}
    assert relay == {h for h, r in tree.items() if r.children} and relay
    p = topology.plan(cfg)
    address = {h.name: h.address for h in cfg.hosts}
    for h in p.hosts:
        if not h.provisioned:
            continue
        (stage,) = [s for s in weights.weights_steps(cfg, p, h) if s.name == "weights-stage"]
        r = tree[h.name]
        peers = [a.split()[0] for a in stage.create.split("--peer ")[1:]]
        assert peers == [f"http://{address[a]}:{cfg.model.fanout_port}" for a in r.ancestors]
        assert ("--serve" in stage.create) == bool(r.children)
        assert f"--name {h.name}" in stage.create
    assert not any(s.name.startswith("weights-fanout") for hs in hostplan.plan_all(cfg, p, stack_name="t").values()
                   for s in hs.steps.values()), "no fan-out server outside the staging"


@pytest.mark.parametrize("stack", ["sim", "prod-b300", "b300-2node", "b300-prefill-dp2", "b300-1node-colocated"])
def test_every_relay_step_signs_with_the_stacks_key_and_its_host_holds_it(stack):
    """Issue 38: nothing crosses hosts unsigned. Every step that serves (--serve, relay) or copies (--role peer)
    through a relay passes the stack's relay key file, and its host gets that file (root-only, a secret); a host
    that relays nothing gets no key."""
    import shlex

    from glm_infra.spec import paths

    cfg = load_file(ROOT / "stacks" / f"Pulumi.{stack}.yaml").config
    p = topology.plan(cfg)
    steps = hostplan.plan_all(cfg, p, stack_name="t")
    relaying = set()
    for host, hs in steps.items():
        for step in hs.steps.values():
            # Each weights.py command line of the step, up to the shell's next separator.
            for m in re.finditer(re.escape(paths.WEIGHTS) + r" [^;&|]*", step.create):
                argv = shlex.split(m.group())
                if len(argv) < 2:
                    continue  # (where it is installed)
                crosses = argv[1] == "relay" or "--serve" in argv or ("--role" in argv and
                                                                      argv[argv.index("--role") + 1] == "peer")
                if crosses:
                    relaying.add(host)
                    assert argv[argv.index("--relay-key-file") + 1] == paths.RELAY_KEY, (host, step.name, argv)
    for host, hs in steps.items():
        key = hs.steps.get("relay-key")
        assert (key is not None) == (host in relaying), host
        if key is not None:
            (f,) = key.files
            assert (f.path, f.mode, f.secret, key.secret) == (paths.RELAY_KEY, 0o600, True, True)
            assert key.secret_render({"relay_key": "k" * 64}).splitlines()[-1] == "GLM_RELAY_KEY=" + "k" * 64
    assert bool(relaying) == (len(p.serving_hosts) > 1)


def test_the_relay_stall_is_passed_only_when_the_stack_sets_it():
    """model.relayStallSeconds reaches every staging host as --stall; unset, the command is as before
    (weights.py's own 120 s), so a deployed stack's steps do not change."""
    cfg = load_file(ROOT / "stacks" / "Pulumi.prod-b300.yaml").config
    p = topology.plan(cfg)

    def creates(c) -> list[str]:
        return [s.create for h in p.hosts if h.provisioned for s in weights.weights_steps(c, p, h)
                if s.name == "weights-stage"]

    assert creates(cfg) and not any("--stall" in c for c in creates(cfg))
    short = cfg.model_copy(update={"model": cfg.model.model_copy(update={"relay_stall_seconds": 30})})
    assert all(c.endswith("--stall 30") or "--stall 30 " in c for c in creates(short))
    for bad in (0, 4, 3601, "x"):
        with pytest.raises(ValueError, match="relay_stall_seconds|relayStallSeconds"):
            type(cfg.model).model_validate({**cfg.model.model_dump(), "relay_stall_seconds": bad})


# --- real processes on loopback --------------------------------------------------------------------


class Fleet:
    """A mirror and one staging process per host; everything it started ends with the test."""

    def __init__(self, tmp: Path, rate: int) -> None:
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}
        self.src = tmp / "mirror"
        subprocess.run([sys.executable, str(MAKE), str(self.src), "--revision", "rev1", "--shards", "6",
                        "--shard-mb", "1"], check=True, capture_output=True)
        port = free_port()
        self.mirror_log = tmp / "mirror.log"
        self.mirror = subprocess.Popen([sys.executable, str(SLOW), "--dir", str(self.src), "--bind",
                                        f"127.0.0.1:{port}", "--rate", str(rate)],
                                       stdout=subprocess.DEVNULL, stderr=open(self.mirror_log, "w"))
        self.url = f"http://127.0.0.1:{port}"
        wait_port(port)
        self.keyfile = tmp / "relay.env"  # the stack's relay key, on every host
        self.keyfile.write_text("GLM_RELAY_KEY=" + "f" * 64 + "\n")

    def path(self, host: str) -> Path:
        return self.tmp / host / "model"

    def root(self, host: str) -> Path:
        return self.tmp / host / "model.revisions" / "rev1"

    def port(self, host: str) -> int:
        return self.ports.setdefault(host, free_port())

    def start(self, host: str, tree: dict[str, topology.Relay], stall: float = 5, children=None) -> None:
        r = tree[host]
        argv = [sys.executable, str(WEIGHTS), "stage", "--revision", "rev1", "--path", str(self.path(host)),
                "--margin-gb", "0", "--name", host, "--stall", str(stall), "--timeout", "90"]
        if r.parent is None:
            argv += ["--role", "seed", "--source", "mirror", "--url", self.url]
        else:
            argv += ["--role", "peer"]
            for up in r.ancestors:
                argv += ["--peer", f"http://127.0.0.1:{self.port(up)}"]
        kids = list(r.children) if children is None else children
        if kids:
            argv += ["--serve", f"127.0.0.1:{self.port(host)}", "--children", ",".join(kids)]
        if kids or r.parent is not None:
            argv += ["--relay-key-file", str(self.keyfile)]
        self.procs[host] = subprocess.Popen(argv, stdout=open(self.tmp / f"{host}.log", "w"),
                                            stderr=subprocess.STDOUT)

    def log(self, host: str) -> str:
        return (self.tmp / f"{host}.log").read_text()

    def wait(self, *hosts: str, timeout: float = 90) -> None:
        for h in hosts:
            assert self.procs[h].wait(timeout=timeout) == 0, f"{h}:\n{self.log(h)}"

    def same_as_source(self, host: str) -> bool:
        files = json.loads((self.src / "rev1" / "manifest.json").read_text())["files"]
        return all((self.path(host) / e["path"]).read_bytes() == (self.src / "rev1" / e["path"]).read_bytes()
                   for e in files) and (self.path(host) / ".glm-complete").exists()

    def source_gets(self) -> list[str]:
        return [l.split('"GET ')[1].split()[0] for l in self.mirror_log.read_text().splitlines() if '"GET ' in l]

    def close(self) -> None:
        for p in [*self.procs.values(), self.mirror]:
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.fixture
def fleet(tmp_path):
    made: list[Fleet] = []

    def make(rate: int) -> Fleet:
        made.append(Fleet(tmp_path, rate))
        return made[-1]

    yield make
    for f in made:
        f.close()


def test_the_tree_copies_everything_once_from_the_source_and_every_host_verifies(fleet):
    f = fleet(rate=4 << 20)
    hosts = ["s", "a", "b", "c", "d"]
    tree = relay_tree(hosts)  # s → a, b; a → c, d
    for h in hosts:
        f.start(h, tree)
    f.wait(*hosts)
    for h in hosts:
        assert f.same_as_source(h), h
    gets = [g for g in f.source_gets() if "manifest" not in g]
    assert len(gets) == 9 and len(set(gets)) == 9, "each file left the source once"
    assert "seed: 9 files from the mirror source" in f.log("s")
    for child, parent in (("a", "s"), ("b", "s"), ("c", "a"), ("d", "a")):
        assert f"peer: 9 files copied (9 from http://127.0.0.1:{f.ports[parent]})" in f.log(child), f.log(child)
    for h in ("s", "a"):  # hosts with children served them from inside their staging, then stopped
        assert "stopped: every host copying from here is done or left" in f.log(h)
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", f.ports[h])) != 0, f"{h}: nothing listens after the step"
    progress = json.loads((f.root("c") / ".glm-progress.json").read_text())
    assert progress["complete"] and sorted(progress["published"]) == sorted(e["path"] for e in progress["files"])


def test_a_parent_killed_mid_copy_leaves_its_child_to_an_ancestor(fleet):
    f = fleet(rate=1 << 20)  # ~6 s for the checkpoint: time to kill the parent mid-copy
    tree = {"s": topology.Relay("s", None, (), ("p",)), "p": topology.Relay("p", "s", ("s",), ("c",)),
            "c": topology.Relay("c", "p", ("p", "s"), ())}  # a chain: s → p → c
    for h in ("s", "p", "c"):
        f.start(h, tree)
    deadline = time.monotonic() + 30
    while not any((f.root("c") / s).exists() for s in SHARDS):
        assert time.monotonic() < deadline, f.log("c")
        time.sleep(0.05)
    f.procs["p"].send_signal(signal.SIGKILL)
    f.wait("c")
    assert f.same_as_source("c")
    assert f"copying from http://127.0.0.1:{f.ports['s']} (the seed) now" in f.log("c"), f.log("c")
    # The seed served c to the end, then fails its own step for p: the next up stages p (and it) again.
    assert f.procs["s"].wait(timeout=60) == 1
    assert "p made no request for 5s: not waiting for it any longer" in f.log("s"), f.log("s")
    assert "but p stopped copying from this host before they had every file" in f.log("s")
    assert (f.path("s") / ".glm-complete").exists()
    gets = [g for g in f.source_gets() if "manifest" not in g]
    assert len(gets) == len(set(gets)), "the seed still read each file from the source once"


def test_a_parent_serving_corrupt_bytes_is_rejected_and_the_file_fetched_elsewhere(fleet):
    f = fleet(rate=16 << 20)
    tree = {"s": topology.Relay("s", None, (), ("p", "late")), "p": topology.Relay("p", "s", ("s",), ("c",)),
            "c": topology.Relay("c", "p", ("p", "s"), ())}
    # "late" never comes: the seed keeps serving for --stall seconds after it is done.
    f.start("s", tree, stall=15)
    f.start("p", tree, stall=15)
    deadline = time.monotonic() + 60
    while "verified at" not in f.log("p"):
        assert time.monotonic() < deadline and f.procs["p"].poll() is None, f.log("p")
        time.sleep(0.05)
    shard = f.root("p") / SHARDS[2]  # p verified it, then its disk went bad: same size, other bytes
    blob = bytearray(shard.read_bytes())
    blob[5000] ^= 0xFF
    shard.write_bytes(bytes(blob))
    f.start("c", tree, stall=15)
    f.wait("c", "p", "s")
    assert f.same_as_source("c")
    log = f.log("c")
    assert f"{SHARDS[2]}: sha256 mismatch (bytes rejected); copying from http://127.0.0.1:{f.ports['s']}" in log, log
    assert "late never came for 15s" in f.log("s")


def test_resume_keeps_verified_files_and_completes_partial_ones(fleet):
    f = fleet(rate=16 << 20)
    tree = relay_tree(["s", "r"])
    f.start("s", tree, children=[])  # the seed has the checkpoint …
    f.wait("s")
    src = f.src / "rev1"
    root = f.root("r")
    root.mkdir(parents=True)
    for name in SHARDS[:3]:  # verified files of an earlier, interrupted staging
        (root / name).write_bytes((src / name).read_bytes())
    data = (src / SHARDS[3]).read_bytes()
    (root / (SHARDS[3] + ".partial")).write_bytes(data[: len(data) // 3])  # a cut transfer
    (root / (SHARDS[4] + ".partial")).write_bytes((src / SHARDS[4]).read_bytes())  # cut before its rename: 416
    f.start("s", tree)  # … and serves it again to r
    f.start("r", tree)
    f.wait("r", "s")
    assert f.same_as_source("r")
    assert "peer: 6 files copied" in f.log("r") and "3 already here and verified" in f.log("r"), f.log("r")
    assert not list(root.glob("*.partial"))
    assert "seed: 0 files from the mirror source, 9 already here and verified" in f.log("s")


def test_a_host_with_a_complete_copy_stages_again_without_any_parent(fleet):
    """A peer staged again alone (its parent's staging is over: nothing serves) keeps what it verified."""
    f = fleet(rate=16 << 20)
    tree = relay_tree(["s", "r"])
    f.start("s", tree)
    f.start("r", tree)
    f.wait("r", "s")
    f.start("r", tree, stall=2)
    f.wait("r")
    log = f.log("r")
    assert "every file already here and verified; none of" in log and "answered within 2s, none needed" in log, log
    assert "peer: 0 files copied (none), 9 already here and verified" in log, log
    assert f.same_as_source("r")
