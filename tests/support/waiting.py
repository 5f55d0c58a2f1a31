"""Waiting for a condition, never for a fixed time.

Why: the suite runs on two cores that its own jobs side by side (and other work) keep busy, at
loads of 8-20. There a process may take tens of seconds to start and a callback a second to
run, so a fixed sleep is either too short (a flaky test) or too long (a slow one). A wait here
returns as soon as its condition holds; its deadline is generous, since it only costs time when
the test fails anyway, and then its message says what was awaited (and, given a callable, what
was seen instead: a log's tail, the state reached).

`holds_for` is the other half: a condition that must stay true for a while ("nothing more
arrives", "still locked out"). It fails as soon as the condition breaks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# Long enough for a Django process to start on two saturated cores; a ready condition returns
# at once, so only a failing test waits this long.
DEFAULT_TIMEOUT = 60.0
INTERVAL = 0.05

Detail = str | Callable[[], str]


def _describe(what: Detail) -> str:
    return what() if callable(what) else what


def wait_until(
    check: Callable[[], T],
    timeout: float = DEFAULT_TIMEOUT,
    what: Detail = "the condition",
    *,
    interval: float = INTERVAL,
) -> T:
    """The first truthy value of `check()`, polled until `timeout` seconds have passed.

    An exception from `check` (e.g. "the process died", with its log) ends the wait at once.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{_describe(what)}: not within {timeout} s")
        time.sleep(interval)


async def async_wait_until(
    check: Callable[[], T],
    timeout: float = DEFAULT_TIMEOUT,
    what: Detail = "the condition",
    *,
    interval: float = 0.01,
) -> T:
    """`wait_until` inside an event loop: the loop keeps running between the checks."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{_describe(what)}: not within {timeout} s")
        await asyncio.sleep(interval)


def holds_for(
    check: Callable[[], object],
    seconds: float,
    what: Detail = "the condition",
    *,
    interval: float = INTERVAL,
) -> None:
    """Fail as soon as `check()` turns false within the next `seconds` (checked at the end too).

    For what must *not* happen: under load it can only see less of the window's events late,
    never fail a correct product.
    """
    deadline = time.monotonic() + seconds
    while True:
        if not check():
            raise AssertionError(f"{_describe(what)}: no longer true")
        if time.monotonic() >= deadline:
            return
        time.sleep(interval)
