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


def test_a_perf_report_is_read_into_shares_of_the_cpu() -> None:
    from bench.common import shares_of_perf_report

    report = """# Samples: 3K of event 'cpu-clock:pppH'
#
# Overhead  Shared Object         Symbol
# ........  ....................  ...........................
#
    19.45%  [kernel.kallsyms]     [k] finish_task_switch.isra.0
    17.30%  libpython3.11.so.1.0  [.] _PyEval_EvalFrameDefault
     6.15%  libc.so.6             [.] __GI___lll_lock_wait
     3.58%  libpython3.11.so.1.0  [.] gc_collect_main
     0.92%  libpython3.11.so.1.0  [.] visit_reachable
     2.00%  [kernel.kallsyms]     [k] tcp_sendmsg_locked
     0.60%  _psycopg.cpython-311-x86_64-linux-gnu.so  [.] pq_exec
"""
    assert shares_of_perf_report(report) == {
        "thread switches": 0.256,
        "garbage collector": 0.045,
        "interpreter": 0.173,
        "kernel, other": 0.02,
        "other": 0.006,
    }
    assert shares_of_perf_report("# no samples\n") == {}
