"""Our services stopped while they still load (seconds on a busy machine) end cleanly.

A supervisor, or a test's teardown, may stop a service at any moment; before the service has
set up its own handling, Python's default used to kill it with the signal (status -15) or, for
Ctrl-C, print a KeyboardInterrupt traceback. manage.py handles both from its first lines.
"""

from __future__ import annotations

import signal
import sys

import pytest

from tests.support.processes import ServiceProcess, service_env
from tests.support.waiting import wait_until

pytestmark = pytest.mark.defaults

# The line each service logs once it runs (after its own signal handling is in place).
STARTED = {
    "run_gateway": '"gateway.started"',
    "run_uwpx_listener": '"uwpx_listener.disabled"',
}


def loading(process: ServiceProcess) -> bool:
    """Whether it handles SIGTERM yet; one that died while starting fails the test at once."""
    if not process.alive():
        raise AssertionError(f"it died while starting\n{process.log_tail()}")
    return process.handles(signal.SIGTERM)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("command", sorted(STARTED))
def test_a_service_stopped_while_it_loads_exits_cleanly(command, signum):
    argv = [sys.executable, "manage.py", command]
    if command == "run_uwpx_listener":
        argv.append("--idle-if-unconfigured")
    process = ServiceProcess(command, argv, service_env())
    try:
        # manage.py handles both long before Django is loaded: stop it right then. (SIGINT is
        # caught from the interpreter's start, by the KeyboardInterrupt it would raise.)
        wait_until(lambda: loading(process), what=process.log_tail)
        process.process.send_signal(signum)
        code = process.process.wait(60)
    finally:
        process.stop()
    log = process.log_text()
    assert code == 0, process.log_tail()
    assert "Traceback" not in log, log
    assert STARTED[command] not in log  # it was stopped while loading, as meant


def test_a_service_that_runs_still_stops_through_its_own_handling(transactional_db):
    """The early handler gives way to the service's own: a stop once it runs is graceful."""
    process = ServiceProcess("gateway", [sys.executable, "manage.py", "run_gateway"], service_env())
    try:
        wait_until(lambda: STARTED["run_gateway"] in process.log_text(), what=process.log_tail)
    finally:
        code = process.stop()
    assert code == 0, process.log_tail()
    assert '"gateway.stopped"' in process.log_text()
    assert "Traceback" not in process.log_text()


def test_the_running_web_process_says_it_handles_sigterm():
    """Its supervisor takes SIGTERM with sigtimedwait; it must also show the signal as handled
    (/proc's SigCgt), which is what a stop that waits for it to be ready reads: otherwise every
    stop of a running web process waited out its whole deadline."""
    from tests.support.processes import start_web

    web, _ = start_web()
    try:
        assert web.handles(signal.SIGTERM), web.log_tail()
    finally:
        assert web.stop() == 0, web.log_tail()
