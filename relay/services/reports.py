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
from pathlib import Path

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


def job_log(var_dir: Path) -> Path:
    """Where a run's stderr goes (Spark's and the JVM's messages, errors): one file, replaced
    by each run; the command's output holds the progress lines alone."""
    return var_dir / "reports-job.log"


def run_reports(
    *,
    since: date | None = None,
    until: date | None = None,
    master: str | None = None,
    force: bool = False,
    output: Callable[[str], None] | None = None,
) -> int:
    """Run the job (default: yesterday and today, local[*]) and pass its progress lines to
    `output`. Returns the number of lines; raises ReportsFailed when the job fails (with the
    last lines of its stderr, which is kept in `job_log`)."""
    var_dir = conf.current().var_dir
    var_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "VAR_DIR": str(var_dir)}
    lines: list[str] = []
    log_path = job_log(var_dir)
    with (
        log_path.open("w", encoding="utf-8") as stderr,
        subprocess.Popen(
            job_argv(since=since, until=until, master=master, force=force),
            cwd=settings.BASE_DIR,
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        ) as process,
    ):
        assert process.stdout is not None
        for line in process.stdout:
            line = line.rstrip("\n")
            lines.append(line)
            if output is not None:
                output(line)
    if process.returncode != 0:
        errors = log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        log.error("reports.failed", extra={"returncode": process.returncode})
        if process.returncode == REFUSED_STATUS:
            for line in reversed(errors):
                if line.startswith(REFUSED_PREFIX):
                    raise ReportsRefused(line.removeprefix(REFUSED_PREFIX))
        tail = (lines + errors)[-40:]
        raise ReportsFailed("\n".join(tail) or f"exit status {process.returncode}")
    log.info("reports.done", extra={"lines": len(lines)})
    return len(lines)
