"""glm_infra/sdk_wait.py: the SDK's wait for outstanding outputs, one wait per round, still failing at
the first error. Runs the SDK's own ``wait_for_rpcs`` over real asyncio tasks."""

from __future__ import annotations

import asyncio

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


def _run(make_outputs) -> tuple[int, BaseException | None]:
    """Run wait_for_rpcs over the outputs ``make_outputs()`` creates (tracked the way Output tracks
    them); returns how many times asyncio.wait was called and what wait_for_rpcs raised."""
    calls = 0
    real_wait = asyncio.wait

    async def counting_wait(*a, **kw):
        nonlocal calls
        calls += 1
        return await real_wait(*a, **kw)

    async def main() -> BaseException | None:
        for t in make_outputs():
            settings.SETTINGS.outputs.add(t)
        try:
            await asyncio.wait_for(wait_for_rpcs(), timeout=10)
        except BaseException as e:  # noqa: BLE001 - what the SDK raised is the result
            return e
        finally:
            for t in list(settings.SETTINGS.outputs):
                t.cancel()
            settings.SETTINGS.outputs.clear()
        return None

    asyncio.wait = counting_wait  # the view in pulumi.runtime.stack reads asyncio.wait at call time
    try:
        loop = asyncio.new_event_loop()  # not asyncio.run: it would unset the thread's loop other tests use
        try:
            error = loop.run_until_complete(main())
        finally:
            loop.close()
        return calls, error
    finally:
        asyncio.wait = real_wait


def _staggered(n: int):
    async def done_after(k: int) -> None:
        for _ in range(k):
            await asyncio.sleep(0)

    return lambda: [asyncio.ensure_future(done_after(k)) for k in range(n)]


@pytest.mark.parametrize("sdk", [False, True], indirect=True)
def test_outputs_that_finish_one_by_one(sdk):
    calls, error = _run(_staggered(300))
    assert error is None
    if sdk:
        assert calls <= 2  # one round (and one more to see the set empty at most)
    else:
        assert calls >= 100  # the SDK's own loop: a wait per completion (the quadratic cost)


@pytest.mark.parametrize("sdk", [False, True], indirect=True)
def test_a_failed_output_surfaces_while_others_still_wait(sdk):
    def outputs():
        async def fails() -> None:
            await asyncio.sleep(0.01)
            raise RuntimeError("registration failed")

        async def never() -> None:
            await asyncio.Event().wait()

        return [asyncio.ensure_future(fails()), asyncio.ensure_future(never())]

    _, error = _run(outputs)
    # Not the timeout: waiting for every output of the round would hang on the one that never ends.
    assert isinstance(error, RuntimeError) and "registration failed" in str(error)


def test_opt_out_and_idempotence(monkeypatch):
    was = sdk_wait.installed()
    sdk_wait.uninstall()
    try:
        monkeypatch.setenv("GLM_INFRA_SDK_WAIT", "sdk")
        assert not sdk_wait.install() and not sdk_wait.installed()
        monkeypatch.delenv("GLM_INFRA_SDK_WAIT")
        assert sdk_wait.install() and sdk_wait.install() and sdk_wait.installed()
        import pulumi.runtime.stack as stack
        assert stack.asyncio.sleep is asyncio.sleep  # everything but wait is asyncio's own
    finally:
        sdk_wait.uninstall()
        if was:
            sdk_wait.install()
