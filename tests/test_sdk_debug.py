"""glm_infra/sdk_debug.py: the SDK runtime's own debug lines stay in the program (no synchronous Log RPC to the
engine each), everything else still reaches the engine: the program's own debug lines, and every warning,
info and error, the SDK's included. Against the SDK's real modules and a recording engine."""

from __future__ import annotations

import pulumi
import pulumi.runtime.resource as sdk_resource
import pulumi.runtime.rpc_manager as sdk_rpc_manager
import pytest
from pulumi.runtime import settings

from conftest import ROOT

from glm_infra import sdk_debug


class Engine:
    def __init__(self):
        self.lines: list[tuple[int, str]] = []

    def Log(self, req):  # noqa: N802 - the engine service's method name
        self.lines.append((req.severity, req.message))


@pytest.fixture
def engine(monkeypatch):
    e = Engine()
    monkeypatch.setattr(settings.SETTINGS, "engine", e)
    sdk_debug.restore()
    yield e
    sdk_debug.restore()


def said(engine) -> list[str]:
    return [m for _, m in engine.lines]


def test_the_sdks_debug_lines_stay_in_the_program_and_the_rest_reach_the_engine(engine):
    sdk_resource.log.debug("before")
    assert said(engine) == ["before"]  # the SDK as it comes: a Log RPC each
    quieted = sdk_debug.quiet()
    assert {"pulumi.runtime.resource", "pulumi.runtime.rpc_manager"} <= set(quieted)
    sdk_resource.log.debug("registering resource: ty=x")
    sdk_rpc_manager.log.debug("beginning rpc x")
    sdk_resource.log.warn("a warning of the SDK's")
    sdk_resource.log.error("an error of the SDK's")
    pulumi.log.debug("the program's own")
    assert said(engine) == ["before", "a warning of the SDK's", "an error of the SDK's", "the program's own"]
    assert sdk_debug.quiet() == quieted  # idempotent
    sdk_debug.restore()
    sdk_resource.log.debug("after")
    assert said(engine)[-1] == "after" and sdk_resource.log is pulumi.log


def test_glm_infra_sdk_debug_keeps_the_chatter(engine, monkeypatch):
    monkeypatch.setenv("GLM_INFRA_SDK_DEBUG", "1")
    assert sdk_debug.quiet() == []
    sdk_resource.log.debug("kept")
    assert said(engine) == ["kept"]


def test_the_program_quiets_the_sdk_first_thing():
    main = (ROOT / "__main__.py").read_text()
    assert main.index("sdk_debug.quiet()") < main.index('Cluster("glm"')
