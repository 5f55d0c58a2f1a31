"""Starting the Spark reports (analytics/jobs.py) from the relay: the management command and
the Celery beat task.

The job runs in a process of its own: it holds a JVM and half a gigabyte or more, which must
not live on in a web or worker process, and it needs no Django (the same module runs under
`spark-submit` on a cluster). It reads ANALYTICS_DATABASE_URL (the read replica; DATABASE_URL
when unset) and loads the daily aggregates into DATABASE_URL.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Callable
from datetime import date

from django.conf import settings

from relay import conf

log = logging.getLogger(__name__)


class ReportsFailed(RuntimeError):
    """The job exited with an error; its last lines say why."""


class ReportsRefused(ReportsFailed):
    """The job refused to run: a setting it cannot use, or a database it cannot reach. The
    message is the job's one line saying which (never a password)."""


# The job's exit status, and the start of its one line on stderr, when it refuses to run.
REFUSED_STATUS = 2
REFUSED_PREFIX = "analytics.jobs: "


def job_argv(
    *,
    since: date | None = None,
    until: date | None = None,
    master: str | None = None,
    force: bool = False,
) -> list[str]:
    argv = [sys.executable, "-m", "analytics.jobs"]
    if since:
        argv += ["--since", since.isoformat()]
    if until:
        argv += ["--until", until.isoformat()]
    if master:
        argv += ["--master", master]
    if force:
        argv.append("--force")
    return argv


def run_reports(
    *,
    since: date | None = None,
    until: date | None = None,
    master: str | None = None,
    force: bool = False,
    output: Callable[[str], None] | None = None,
) -> int:
    """Run the job (default: yesterday and today, local[*]) and pass its progress lines to
    `output`. Returns the number of lines; raises ReportsFailed when the job fails."""
    env = {**os.environ, "VAR_DIR": str(conf.current().var_dir)}
    lines: list[str] = []
    with subprocess.Popen(
        job_argv(since=since, until=until, master=master, force=force),
        cwd=settings.BASE_DIR,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as process:
        assert process.stdout is not None
        for line in process.stdout:
            line = line.rstrip("\n")
            lines.append(line)
            if output is not None:
                output(line)
    if process.returncode != 0:
        log.error("reports.failed", extra={"returncode": process.returncode})
        if process.returncode == REFUSED_STATUS:
            for line in reversed(lines):
                if line.startswith(REFUSED_PREFIX):
                    raise ReportsRefused(line.removeprefix(REFUSED_PREFIX))
        raise ReportsFailed("\n".join(lines[-20:]) or f"exit status {process.returncode}")
    log.info("reports.done", extra={"lines": len(lines)})
    return len(lines)
