"""Every benchmark under bench/ still starts: its module-level imports hold and its options
parse (`--help`). A model that moved between apps broke one before anyone ran it; the
benchmarks themselves run with `make bench`, not here."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.processes import ROOT

pytestmark = pytest.mark.defaults

# bench/analytics.py refuses to start outside `tests.support.services` (it needs PostgreSQL).
SCRIPTS = sorted(
    path
    for path in (ROOT / "bench").glob("*.py")
    if path.name not in {"__init__.py", "common.py", "component_server.py", "analytics.py"}
)


def test_there_are_benchmarks_to_check() -> None:
    assert {path.name for path in SCRIPTS} >= {
        "relay.py",
        "providers.py",
        "unifiedpush.py",
        "links.py",
    }


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_a_benchmark_starts_and_parses_its_options(script) -> None:
    done = subprocess.run(
        [sys.executable, str(script), "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "HOME": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage:" in done.stdout
