"""The suite's one way to wait (tests/support/waiting.py): for a condition, never a fixed time."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.support.waiting import async_wait_until, holds_for, wait_until

pytestmark = pytest.mark.defaults


def test_wait_until_returns_the_first_truthy_value_as_soon_as_it_comes():
    values = iter([None, 0, "", "ready", "later"])
    started = time.monotonic()
    assert wait_until(lambda: next(values), timeout=30, interval=0.01) == "ready"
    assert time.monotonic() - started < 10  # not the deadline


def test_wait_until_says_what_it_waited_for_and_what_it_saw():
    seen = {"state": "starting"}
    with pytest.raises(TimeoutError, match=r"the link is up \(starting\): not within 0.1 s"):
        wait_until(lambda: False, 0.1, lambda: f"the link is up ({seen['state']})")


def test_an_error_in_the_condition_ends_the_wait_at_once():
    def died() -> bool:
        raise RuntimeError("the gateway died: its log")

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="its log"):
        wait_until(died, timeout=60)
    assert time.monotonic() - started < 10


def test_async_wait_until_lets_the_loop_run_meanwhile():
    async def scenario() -> str:
        done: list[str] = []
        asyncio.get_running_loop().call_later(0.05, done.append, "set by the loop")
        return (await async_wait_until(lambda: done, timeout=30))[0]

    assert asyncio.run(scenario()) == "set by the loop"


def test_holds_for_passes_a_condition_that_stays_true_the_whole_window():
    started = time.monotonic()
    holds_for(lambda: True, 0.2)
    assert time.monotonic() - started >= 0.2


def test_holds_for_fails_as_soon_as_the_condition_breaks():
    broken_at = time.monotonic() + 0.1
    started = time.monotonic()
    with pytest.raises(AssertionError, match="nothing more arrives: no longer true"):
        holds_for(lambda: time.monotonic() < broken_at, 30, "nothing more arrives")
    assert time.monotonic() - started < 10  # not the window's end
