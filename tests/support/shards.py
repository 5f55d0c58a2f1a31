"""`--shard K/N`: run the K-th of N slices of the suite, whole test modules at a time.

Why: the suite is mostly waiting (real Prosody, ejabberd, Spark, restarts of private servers),
so two slices running side by side, each under its own private PostgreSQL and Redis
(`python -m tests.support.services`), finish in about half the time on two cores and never
share a database, a broker queue or a port. A module stays whole so its module- and
session-scoped servers (an XMPP server, a Spark session) start once per slice, not per test.

Modules are dealt longest first to the slice with the least time so far, by the seconds each
took in a recorded run (tests/durations.json: each `make test` job writes its modules' times
to var/test-logs/, and `make test-durations` merges them in); a module
not recorded yet counts as the median. Every module lands in exactly one slice, so the slices
together run the whole suite.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest

DURATIONS = Path(__file__).resolve().parent.parent / "durations.json"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--shard",
        default=None,
        metavar="K/N",
        help="run only the K-th of N slices of the test modules (1 <= K <= N)",
    )


def parse_shard(value: str) -> tuple[int, int]:
    try:
        index, count = (int(part) for part in value.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard expects K/N, got {value!r}") from None
    if not 1 <= index <= count:
        raise pytest.UsageError(f"--shard {value}: K must be between 1 and N")
    return index, count


def recorded_durations(path: Path = DURATIONS) -> dict[str, float]:
    if not path.exists():
        return {}
    return {str(module): float(seconds) for module, seconds in json.loads(path.read_text()).items()}


def deal(modules: list[str], count: int, durations: dict[str, float]) -> list[list[str]]:
    """Modules into `count` slices of about equal recorded time (longest first)."""
    default = statistics.median(durations.values()) if durations else 1.0
    slices: list[list[str]] = [[] for _ in range(count)]
    loads = [0.0] * count
    for module in sorted(modules, key=lambda name: (-durations.get(name, default), name)):
        lightest = loads.index(min(loads))
        slices[lightest].append(module)
        loads[lightest] += durations.get(module, default)
    return slices


@pytest.hookimpl(trylast=True)  # after `-m` has deselected: deal only the modules that run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    value = config.getoption("--shard")
    if value is None:
        return
    index, count = parse_shard(value)
    modules = sorted({item.nodeid.split("::", 1)[0] for item in items})
    mine = set(deal(modules, count, recorded_durations())[index - 1])
    kept = [item for item in items if item.nodeid.split("::", 1)[0] in mine]
    deselected = [item for item in items if item.nodeid.split("::", 1)[0] not in mine]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
    items[:] = kept


_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    module = report.nodeid.split("::", 1)[0]
    _seconds[module] = _seconds.get(module, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    """With TEST_DURATIONS_OUT set (`make test` sets it per job), write how long each module
    took, for `make test-durations` to merge into tests/durations.json."""
    out = os.environ.get("TEST_DURATIONS_OUT")
    if out and _seconds:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        rounded = {module: round(seconds, 1) for module, seconds in sorted(_seconds.items())}
        Path(out).write_text(json.dumps(rounded, indent=1) + "\n")


def merge(paths: list[Path], into: Path = DURATIONS) -> dict[str, float]:
    """The modules' times from the slices of one run, as tests/durations.json."""
    merged: dict[str, float] = {}
    for path in paths:
        merged.update(recorded_durations(path))
    if not merged:
        raise SystemExit("no recorded durations given: run `make test` first")
    into.write_text(json.dumps(dict(sorted(merged.items())), indent=1) + "\n")
    return merged


if __name__ == "__main__":
    import sys

    if len(sys.argv) < 3 or sys.argv[1] != "merge":
        raise SystemExit("usage: python -m tests.support.shards merge DURATIONS.json...")
    print(f"recorded {len(merge([Path(p) for p in sys.argv[2:]]))} modules in {DURATIONS}")
