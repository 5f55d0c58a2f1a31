"""gunicorn's configuration (`--config python:pushsite.gunicorn_conf`): metrics across workers.

gunicorn runs WEB_WORKERS processes, and a scrape of /metrics reaches one of them. In
prometheus_client's multiprocess mode each process keeps its values in files under
PROMETHEUS_MULTIPROC_DIR, and /metrics adds up the files of all of them (relay/metrics.py).
The directory must be set before the workers import prometheus_client and emptied at every
start (old files would be counted again), so this runs in gunicorn's master:

- WEB_METRICS_DIR set (a tmpfs is best): its old files are removed;
- unset: a fresh directory under the system's temporary directory, removed on exit.

Only the web process uses it: the gateway and the worker are one process each.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

logger_class = "pushsite.gunicorn_logging.Logger"

# prometheus_client's own variable: written here for the workers, never read from the
# operator's environment (.env.example: WEB_METRICS_DIR).
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

_made: list[str] = []


def on_starting(server: Any) -> None:
    directory = os.environ.get("WEB_METRICS_DIR", "")
    if directory:
        Path(directory).mkdir(parents=True, exist_ok=True)
        for stale in Path(directory).glob("*.db"):
            stale.unlink()
    else:
        directory = tempfile.mkdtemp(prefix="relay-web-metrics-")
        _made.append(directory)
    # Only here, never in the shared environment: the gateway and the worker must not write
    # their values into the web's files (nor have them removed at the web's next start).
    os.environ[MULTIPROC_ENV] = directory  # the workers inherit it


def child_exit(server: Any, worker: Any) -> None:
    """A dead worker's live gauges (in-flight sends) stop counting; its counters stay."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)


def on_exit(server: Any) -> None:
    for directory in _made:
        shutil.rmtree(directory, ignore_errors=True)
