"""The end of every failed test's traceback, as `TRACE <test> | <line>` lines.

Why: CI keeps only the end of `make test`'s output, where pytest's own tracebacks of three jobs
side by side are long gone. tests/support/parallel.py puts these lines into its summary, the
last thing printed, so the first failure can be read.
"""

from __future__ import annotations

import pytest

TRACE_LINES = 15
_config: pytest.Config | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _config
    _config = config


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.outcome != "failed" or not report.longrepr or _config is None:
        return
    reporter = _config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    lines = [line for line in str(report.longrepr).splitlines() if line.strip()]
    for line in lines[-TRACE_LINES:]:
        reporter.write_line(f"TRACE {report.nodeid} | {line[:300]}")
