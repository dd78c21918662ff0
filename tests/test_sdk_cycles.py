"""glm_infra/sdk_cycles.py: the SDK's dependency-cycle check without the walks that cannot find a cycle gives the
SDK's own answers and records the SDK's own graph, on random graphs and on the cycles it must refuse, and the
program installs it before any resource."""

from __future__ import annotations

import random

import pulumi.runtime.resource_cycle_breaker as breaker
import pulumi.runtime.rpc as rpc
import pytest
from conftest import ROOT

from glm_infra import sdk_cycles


class Node:
    """A stand-in resource: the cycle breaker keeps its edges on the object (identity equality)."""

    def __init__(self, i: int):
        self.i = i


def replay(declare, calls: list[tuple[int, int]], n: int) -> tuple[list[bool], list[set[int]]]:
    nodes = [Node(i) for i in range(n)]
    answers = [declare(nodes[a], nodes[b]) for a, b in calls]
    return answers, [{d.i for d in breaker._deps(x)} for x in nodes]


@pytest.mark.parametrize("seed", range(60))
def test_the_same_answers_and_graph_as_the_sdks_own_check(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 30) if seed < 40 else rng.randint(50, 90)  # the last ones: long paths both ways
    calls = [(rng.randrange(n), rng.randrange(n)) for _ in range(rng.randint(1, 120) if seed < 40 else 500)]
    sdk = replay(breaker.declare_dependency, calls, n)
    ours = replay(sdk_cycles.declare_dependency, calls, n)
    assert ours == sdk


def test_a_cycle_is_refused_as_the_sdk_refuses_it():
    a, b, c = Node(0), Node(1), Node(2)
    assert sdk_cycles.declare_dependency(a, b) and sdk_cycles.declare_dependency(b, c)
    assert not sdk_cycles.declare_dependency(c, a)  # c → a → b → c
    assert not sdk_cycles.declare_dependency(a, a)
    assert sdk_cycles.declare_dependency(a, c)  # no cycle: a already reaches c
    assert {d.i for d in breaker._deps(c)} == set()


def test_random_graphs_do_refuse_edges():
    """The comparison above meets refusals, not only the fast path: over the 40 graphs, both kinds occur."""
    refused = walked = 0
    for seed in range(40):
        rng = random.Random(seed)
        n = rng.randint(2, 30)
        calls = [(rng.randrange(n), rng.randrange(n)) for _ in range(rng.randint(1, 120))]
        answers, _ = replay(sdk_cycles.declare_dependency, calls, n)
        refused += answers.count(False)
        walked += len(answers)
    assert refused > 10 and walked - refused > 100


def test_install_replaces_the_sdks_check_and_uninstall_puts_it_back(monkeypatch):
    was = sdk_cycles.installed()
    sdk_cycles.uninstall()
    try:
        assert rpc.declare_dependency is breaker.declare_dependency
        assert sdk_cycles.install() and rpc.declare_dependency is sdk_cycles.declare_dependency
        assert sdk_cycles.install()  # idempotent
        sdk_cycles.uninstall()
        monkeypatch.setenv("GLM_INFRA_SDK_CYCLES", "sdk")
        assert not sdk_cycles.install() and rpc.declare_dependency is breaker.declare_dependency
    finally:
        sdk_cycles.uninstall()
        if was:
            monkeypatch.delenv("GLM_INFRA_SDK_CYCLES", raising=False)
            sdk_cycles.install()


def test_the_program_installs_it_before_any_resource():
    main = (ROOT / "__main__.py").read_text()
    assert main.index("sdk_cycles.install()") < main.index('Cluster("glm"')
