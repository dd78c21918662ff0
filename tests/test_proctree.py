"""The suite's process bookkeeping (tests/proctree.py): whole trees are killed, and a process the
suite started is found at the end however it was detached."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import proctree


def wait_gone(pids: list[int], timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(p in proctree.processes() for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_kill_tree_reaches_grandchildren_that_outlive_their_parent():
    # Like pulumi and its plugins: the parent starts children in sessions of their own.
    parent = subprocess.Popen(["bash", "-c", "setsid sleep 300 & setsid sleep 301 & wait"])
    deadline = time.monotonic() + 10
    while len(proctree.descendants(parent.pid)) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    children = proctree.descendants(parent.pid)
    killed = proctree.kill_tree(parent.pid)
    parent.wait()
    assert set(children) <= set(killed)
    assert wait_gone(children), "no child survives its killed parent"


def test_leftovers_finds_detached_processes_of_the_session_and_watched_programs(tmp_path):
    session, since = proctree.new_session_id(), time.time() - 1
    # Detached twice over (parent 1), carrying the session's id.
    subprocess.run(["bash", "-c", "setsid sleep 302 >/dev/null 2>&1 < /dev/null &"], check=True,
                   env=dict(os.environ, **{proctree.SESSION_VAR: session}))
    # A watched program without the id (a host's server started by its own systemd, say).
    fake = tmp_path / "llm-d-inference-sim"
    shutil.copy("/bin/sleep", fake)
    sim = subprocess.Popen([str(fake), "303"], env={k: v for k, v in os.environ.items() if k != proctree.SESSION_VAR},
                           start_new_session=True)
    keep = proctree.ancestors(os.getpid())
    try:
        deadline = time.monotonic() + 10
        while True:
            left = proctree.leftovers(session, since, keep)
            argvs = [" ".join(p.argv) for p in left]
            if "sleep 302" in argvs and any(a.endswith("llm-d-inference-sim 303") for a in argvs):
                break
            assert time.monotonic() < deadline, argvs
            time.sleep(0.1)
        assert os.getpid() not in {p.pid for p in left}, "pytest itself is not a leftover"
    finally:
        for p in proctree.leftovers(session, since, keep):
            if p.argv[-1] in ("302", "303"):
                proctree.kill_tree(p.pid)
        sim.wait()
    # SIGKILL is delivered asynchronously: on a loaded machine the orphan may still be listed for a moment.
    deadline = time.monotonic() + 10
    while [p for p in proctree.leftovers(session, since, keep) if p.argv[-1:] in (("302",), ("303",))] \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in proctree.leftovers(session, since, keep) if p.argv[-1] in ("302", "303")]


def test_another_sessions_processes_are_left_alone():
    session, since = proctree.new_session_id(), time.time() - 1
    other = subprocess.Popen(["bash", "-c", "exec -a vllm-router sleep 304"], start_new_session=True,
                             env=dict(os.environ, **{proctree.SESSION_VAR: "another-suite"}))
    try:
        deadline = time.monotonic() + 10
        while other.pid not in proctree.processes() or "vllm-router" not in proctree.processes()[other.pid].argv[0]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        left = proctree.leftovers(session, since, proctree.ancestors(os.getpid()))
        assert other.pid not in {p.pid for p in left}, "a watched program of another test session is not ours"
    finally:
        other.kill()
        other.wait()


def test_a_tree_older_than_the_session_is_left_alone(tmp_path):
    """Simulated hosts booted by hand before the suite: their servers start (and restart) during the
    session, with no session id, below a launcher older than the session; not the suite's."""
    fake = tmp_path / "llm-d-inference-sim"
    shutil.copy("/bin/sleep", fake)
    older = subprocess.Popen(["bash", "-c", f"sleep 1; {fake} 305 & wait"], start_new_session=True,
                             env={k: v for k, v in os.environ.items() if k != proctree.SESSION_VAR})
    time.sleep(0.3)
    session, since = proctree.new_session_id(), time.time()
    try:
        deadline = time.monotonic() + 10
        while not any(p.program == fake.name and p.argv[-1] == "305" for p in proctree.processes().values()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        left = proctree.leftovers(session, since, proctree.ancestors(os.getpid()))
        assert not [p for p in left if p.program == fake.name], "a server of a tree older than the session"
    finally:
        proctree.kill_tree(older.pid)
        older.wait()


def test_a_tree_started_beside_the_suite_is_left_alone(tmp_path):
    """A benchmark started from the same shell as a running suite: its watched programs (simulated
    hosts, pulumi) are below the suite's ancestors, not below the suite."""
    session, since = proctree.new_session_id(), time.time() - 1
    fake = tmp_path / "pulumi-resource-command"
    shutil.copy("/bin/sleep", fake)
    bare = {k: v for k, v in os.environ.items() if k != proctree.SESSION_VAR}
    shell = subprocess.Popen(["bash", "-c", f"{fake} 305 & wait"], env=bare, start_new_session=True)
    try:
        deadline = time.monotonic() + 10

        def started() -> list[int]:  # the fake program itself: a child seen between fork and exec is still bash
            table = proctree.processes()
            return [pid for pid in proctree.descendants(shell.pid, table) if table[pid].program == fake.name]

        while not started():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        child = started()[0]
        ours = {p.pid for p in proctree.leftovers(session, since, proctree.ancestors(os.getpid()))}
        assert child in ours, "below the suite: a leftover"
        # The same tree as if its shell were one of the suite's ancestors (the suite's own parent shell).
        beside = {p.pid for p in proctree.leftovers(session, since, proctree.ancestors(os.getpid()) | {shell.pid})}
        assert child not in beside, "beside the suite: somebody else's"
    finally:
        proctree.kill_tree(shell.pid)
        shell.wait()
