"""Run several test commands side by side and fail at the end if any failed.

    python -m tests.support.parallel --job NAME 'COMMAND' [--job NAME 'COMMAND' ...]

Why: `make test` runs slices of the PostgreSQL suite and the embedded-defaults suite at the
same time (see tests/support/shards.py), and one failure must never hide another. Each line a
job prints is shown as it comes, prefixed with the job's name; the job's whole output is also
kept in var/test-logs/NAME.log; at the end a summary gives every job's exit status, its wall
time and its last line (pytest's tally), then the end of every failed test's traceback
(tests/support/traces.py), then every test a job reported as failed or in error (pytest's short
summary lines), so a failure shows even where only the end of the
output is kept; the exit status is non-zero if any job failed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

LOGS = Path("var/test-logs")
# pytest's short test summary: "FAILED tests/x.py::test - why", "ERROR tests/x.py::test - why".
FAILURE = re.compile(r"^(FAILED|ERROR) \S+")
# The end of each such test's traceback (tests/support/traces.py).
TRACE = re.compile(r"^TRACE \S+ \| ")
TRACES_PER_JOB = 90


@dataclass
class Job:
    name: str
    command: str
    started: float = field(default_factory=time.monotonic)
    last_line: str = ""
    failures: list[str] = field(default_factory=list)
    traces: list[str] = field(default_factory=list)
    status: int | None = None
    seconds: float = 0.0


def follow(job: Job, process: subprocess.Popen[bytes], lock: threading.Lock) -> None:
    """Copy the job's output to our stdout (prefixed) and to its log file."""
    assert process.stdout is not None
    with (LOGS / f"{job.name}.log").open("wb") as log:
        for raw in process.stdout:
            log.write(raw)
            line = raw.decode(errors="replace").rstrip("\n")
            if line.strip():
                job.last_line = line.strip()
            if FAILURE.match(line):
                job.failures.append(line.strip())
            elif TRACE.match(line):
                job.traces.append(line.rstrip())
            with lock:
                sys.stdout.write(f"[{job.name}] {line}\n")
                sys.stdout.flush()
    job.status = process.wait()
    job.seconds = time.monotonic() - job.started


def run(jobs: list[Job]) -> int:
    LOGS.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()
    threads = []
    for job in jobs:
        process = subprocess.Popen(
            ["bash", "-c", job.command],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        thread = threading.Thread(target=follow, args=(job, process, lock), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    print("\n== summary ==")
    for job in jobs:
        for trace in job.traces[:TRACES_PER_JOB]:
            print(f"{job.name}: {trace[:400]}")
        if len(job.traces) > TRACES_PER_JOB:
            print(f"{job.name}: ... {len(job.traces) - TRACES_PER_JOB} more TRACE lines in its log")
    for job in jobs:
        verdict = "ok" if job.status == 0 else f"FAILED (exit {job.status})"
        print(f"{job.name}: {verdict} in {job.seconds:.0f} s -- {job.last_line}")
    for job in jobs:
        for failure in job.failures:
            print(f"{job.name}: {failure[:400]}")
    failed = [job.name for job in jobs if job.status != 0]
    if failed:
        print(f"failed: {', '.join(failed)} (whole output in {LOGS}/)")
        return 1
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--job", nargs=2, action="append", metavar=("NAME", "COMMAND"), required=True,
        help="a job's name (its log file's name) and the shell command it runs",
    )  # fmt: skip
    arguments = parser.parse_args(argv)
    return run([Job(name, command) for name, command in arguments.job])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
