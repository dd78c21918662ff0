"""glm_infra/sdk_wait.py: the SDK's wait for outstanding outputs, one wait per round, still failing at
the first error — also an output's created while the round runs. Runs the SDK's own ``wait_for_rpcs``
over real asyncio tasks and Outputs."""

from __future__ import annotations

import asyncio
import time

import pulumi
import pytest
from pulumi.runtime import settings
from pulumi.runtime.stack import wait_for_rpcs

from glm_infra import sdk_wait


@pytest.fixture
def sdk(request):
    """The SDK as it comes (param False) or with the round wait installed (True); restored after."""
    was = sdk_wait.installed()
    sdk_wait.uninstall()
    if request.param:
        assert sdk_wait.install()
    yield request.param
    sdk_wait.uninstall()
    if was:
        sdk_wait.install()


def _run(make_outputs) -> tuple[int, BaseException | None, int]:
    """Run wait_for_rpcs over the outputs ``make_outputs()`` creates (tracked the way Output tracks
    them); returns how many times asyncio.wait was called, what wait_for_rpcs raised, and how many
    futures those waits watched in all (each one a callback added and removed: the cost)."""
    calls = watched = 0
    real_wait = asyncio.wait

    async def counting_wait(fs, *a, **kw):
        nonlocal calls, watched
        fs = list(fs)
        calls += 1
        watched += len(fs)
        return await real_wait(fs, *a, **kw)

    async def main() -> BaseException | None:
        made = list(make_outputs())
        settings.SETTINGS.outputs.update(made)
        try:
            await asyncio.wait_for(wait_for_rpcs(), timeout=10)
        except BaseException as e:  # noqa: BLE001 - what the SDK raised is the result
            return e
        finally:
            left = [*made, *settings.SETTINGS.outputs]
            settings.SETTINGS.outputs.clear()
            for t in left:
                t.cancel()
            await asyncio.gather(*left, return_exceptions=True)  # nothing left pending when the loop closes
        return None

    asyncio.wait = counting_wait  # the view in pulumi.runtime.stack reads asyncio.wait at call time
    try:
        loop = asyncio.new_event_loop()  # not asyncio.run: it would unset the thread's loop other tests use
        try:
            error = loop.run_until_complete(main())
        finally:
            loop.close()
        return calls, error, watched
    finally:
        asyncio.wait = real_wait


def _staggered(n: int):
    async def done_after(k: int) -> None:
        for _ in range(k):
            await asyncio.sleep(0)

    return lambda: [asyncio.ensure_future(done_after(k)) for k in range(n)]


@pytest.mark.parametrize("sdk", [True], indirect=True)
def test_outputs_that_finish_one_by_one(sdk):
    n = 300
    _, error, watched = _run(_staggered(n))
    assert error is None
    # One round: each output watched once (and the round itself by the watcher, once per WATCH_S).
    assert watched < 2 * n, watched


@pytest.mark.parametrize("sdk", [False], indirect=True)
def test_the_sdk_still_waits_once_per_output(sdk):
    """Why the module exists: the SDK as it comes waits again after each completion. When this fails
    the SDK waits linearly on its own, and the shim is a risk without a benefit."""
    n = 300
    calls, error, _ = _run(_staggered(n))
    assert error is None
    assert calls >= n // 2, f"the SDK now waits linearly: remove glm_infra/sdk_wait.py ({calls} waits for {n} outputs)"


@pytest.mark.parametrize("sdk", [False, True], indirect=True)
def test_a_failed_output_surfaces_while_others_still_wait(sdk):
    def outputs():
        async def fails() -> None:
            await asyncio.sleep(0.01)
            raise RuntimeError("registration failed")

        async def never() -> None:
            await asyncio.Event().wait()

        return [asyncio.ensure_future(fails()), asyncio.ensure_future(never())]

    _, error, _ = _run(outputs)
    # Not the timeout: waiting for every output of the round would hang on the one that never ends.
    assert isinstance(error, RuntimeError) and "registration failed" in str(error)


@pytest.mark.parametrize("sdk", [False, True], indirect=True)
def test_a_failure_in_an_output_created_mid_round_surfaces_at_once(sdk):
    """An output of the round takes its time; another, created by a third after the round began (as
    an apply creates Outputs), fails. The failure ends the wait then, not when the slow one is done."""
    slow_s = 3.0

    def outputs():
        async def slow() -> None:
            await asyncio.sleep(slow_s)

        async def fails() -> None:
            await asyncio.sleep(0.01)
            raise RuntimeError("registration failed mid-round")

        async def creates_one() -> None:
            await asyncio.sleep(0.02)
            # A real Output: tracked in SETTINGS.outputs the way the SDK tracks every Output.
            pulumi.Output.from_input(asyncio.ensure_future(fails()))

        return [asyncio.ensure_future(slow()), asyncio.ensure_future(creates_one())]

    start = time.monotonic()
    _, error, _ = _run(outputs)
    took = time.monotonic() - start
    assert isinstance(error, RuntimeError) and "mid-round" in str(error), error
    assert took < slow_s / 6, f"the failure surfaced after {took:.2f} s, with the slow output ({slow_s} s)"


@pytest.fixture
def bare(monkeypatch):
    """The SDK as it comes, whatever ran before; afterwards the test's patches undone, then as it was."""
    was = sdk_wait.installed()
    sdk_wait.uninstall()
    yield
    monkeypatch.undo()
    sdk_wait.uninstall()
    if was:
        sdk_wait.install()


def test_an_untested_sdk_version_is_left_alone_with_a_warning(bare, monkeypatch):
    # Outside a Pulumi run (a mocks test before this one leaves the SDK's engine set).
    monkeypatch.setattr(sdk_wait._settings, "get_engine", lambda: None)
    import pulumi.runtime.stack as stack

    monkeypatch.setattr(sdk_wait, "TESTED", frozenset({"3.0.0"}))
    with pytest.warns(RuntimeWarning, match=r"pulumi \S+ is not a version it was tested with \(3\.0\.0\)"):
        assert sdk_wait.install() is False
    assert not sdk_wait.installed() and stack.asyncio is asyncio


def test_an_sdk_without_the_name_to_replace_is_left_alone_with_a_warning(bare, monkeypatch):
    # Outside a Pulumi run (a mocks test before this one leaves the SDK's engine set).
    monkeypatch.setattr(sdk_wait._settings, "get_engine", lambda: None)
    import pulumi.runtime.stack as stack

    monkeypatch.delattr(stack, "asyncio")
    with pytest.warns(RuntimeWarning, match="pulumi.runtime.stack has no asyncio of its own to replace"):
        assert sdk_wait.install() is False
    assert not hasattr(stack, "asyncio")


def test_opt_out_and_idempotence(bare, monkeypatch):
    import pulumi.runtime.stack as stack

    monkeypatch.setenv("GLM_INFRA_SDK_WAIT", "sdk")
    assert not sdk_wait.install() and not sdk_wait.installed()
    monkeypatch.delenv("GLM_INFRA_SDK_WAIT")
    assert sdk_wait.install() and sdk_wait.install() and sdk_wait.installed()
    assert stack.asyncio.sleep is asyncio.sleep  # everything but wait is asyncio's own


def test_in_a_pulumi_run_the_warning_goes_to_the_cli(bare, monkeypatch):
    from pulumi_harness import run_callable

    monkeypatch.setattr(sdk_wait, "TESTED", frozenset({"3.0.0"}))
    run, installed = run_callable(lambda: pulumi.Output.from_input(sdk_wait.install()))
    assert installed is False
    assert any("the Pulumi SDK's wait left as it is: pulumi" in m and "not a version it was tested with" in m
               for m in run.logs), run.logs
