"""A worker told to stop stops when its running sends end, not when its event loop's poll
times out: Celery's SIGTERM handler runs on the loop's own thread, inside its poll, so
relay/tasks.py wakes the loop from another thread (kombu's public Hub.call_soon). Checked on
a real kombu Hub made as Celery's worker makes it, polling on the main thread, with a real
signal: the wake-up must come before the loop's own next timer, which the poll waits for."""

from __future__ import annotations

import signal
import socket
import threading

from kombu.asynchronous import Hub, set_event_loop
from kombu.asynchronous.timer import Timer

from relay import tasks

# The loop's next timer: the poll sleeps until then unless woken. Celery's own is at most 10 s
# away; this one is further, so that a wake-up slowed by a saturated machine (make test runs
# its suites side by side) still comes first, while a missing one fails the test.
POLL_SECONDS = 60.0


def test_the_shutdown_signal_wakes_the_event_loop_before_its_poll_times_out(monkeypatch):
    hub = Hub(Timer(max_interval=2 * POLL_SECONDS))
    set_event_loop(hub)
    quiet, other_end = socket.socketpair()
    looping, woken, timer_fired = threading.Event(), threading.Event(), threading.Event()
    hub.add_reader(quiet, lambda *_: None)  # something to poll for, as the broker connection

    def on_woken() -> None:
        woken.set()
        hub.remove(quiet)  # nothing left to poll for: the loop comes round at once

    monkeypatch.setattr(tasks, "_nothing", on_woken)
    hub.call_later(POLL_SECONDS, timer_fired.set)  # the poll now sleeps until then
    hub.call_soon(looping.set)

    def on_signal(signum: int, frame: object) -> None:
        tasks._wake_the_event_loop(sig="TERM", how="Warm", exitcode=0)

    previous = signal.signal(signal.SIGUSR1, on_signal)
    main = threading.main_thread().ident
    assert main == threading.get_ident()
    sender = threading.Thread(
        target=lambda: looping.wait(30) and signal.pthread_kill(main, signal.SIGUSR1)
    )
    sender.start()
    try:
        for _ in hub.create_loop():
            if woken.is_set() or timer_fired.is_set():
                break
        assert woken.is_set() and not timer_fired.is_set(), "the loop slept out its poll"
    finally:
        sender.join(30)
        signal.signal(signal.SIGUSR1, previous)
        hub.close()
        set_event_loop(None)
        quiet.close()
        other_end.close()
