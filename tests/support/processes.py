"""Running the real gateway and worker as processes of their own against the test database."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import quote

from django.db import connection

from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]


def test_database_url(host: str | None = None, port: int | None = None) -> str:
    """The URL of the database pytest-django made, optionally through another host/port."""
    db = connection.settings_dict
    if db["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{db['NAME']}"
    user = quote(db.get("USER") or "")
    password = f":{quote(db['PASSWORD'])}" if db.get("PASSWORD") else ""
    host = host or db.get("HOST") or "127.0.0.1"
    port = port or int(db.get("PORT") or 5432)
    return f"postgres://{user}{password}@{host}:{port}/{db['NAME']}"


class ServiceProcess:
    """One of our own processes (gateway or worker), logging to a file the test can read."""

    def __init__(
        self, name: str, argv: list[str], env: dict[str, str], *, handles_sigterm: bool = True
    ) -> None:
        self.name = name
        # Our services stop cleanly on SIGTERM once they handle it; `stop()` waits for that.
        self.handles_sigterm = handles_sigterm
        descriptor, path = tempfile.mkstemp(prefix=f"{name}-", suffix=".log")
        self.log_path = Path(path)
        # The child writes through its own copy of the descriptor: ours closes at once.
        with open(descriptor, "wb") as log:
            self.process = subprocess.Popen(
                argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_events(self) -> list[str]:
        """The `event` of each of its JSON log lines."""
        import json

        events = []
        for line in self.log_text().splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    events.append(str(json.loads(line).get("event", "")))
        return events

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        """The end of its log, for a failure's message."""
        state = "running" if self.alive() else f"exited with {self.process.returncode}"
        return f"--- {self.name} ({state}), {self.log_path} ---\n{self.log_text()[-chars:]}"

    def handles(self, signum: int) -> bool:
        """Whether the process has its own handling of `signum` yet (caught, or blocked to be
        waited for), read from /proc: before that the signal would kill it outright."""
        try:
            status = Path(f"/proc/{self.process.pid}/status").read_text()
        except OSError:
            return True
        bit = 1 << (signum - 1)
        masks = [
            int(line.split(":", 1)[1], 16)
            for line in status.splitlines()
            if line.startswith(("SigCgt:", "SigBlk:"))
        ]
        return any(mask & bit for mask in masks)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, once the process handles it (a process still loading on a busy machine
        would otherwise die of it, status -15); its exit status. Killed after `timeout`."""
        if self.process.poll() is None:
            if self.handles_sigterm:
                with contextlib.suppress(TimeoutError):
                    wait_until(
                        lambda: not self.alive() or self.handles(signal.SIGTERM),
                        timeout=timeout,
                        what=f"{self.name} handles SIGTERM",
                    )
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


def child_pids(parent: int) -> list[int]:
    """The processes whose parent is `parent` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                found.append(int(entry.name))
    return found


def service_env(**overrides: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "DATABASE_URL": test_database_url(),
            "RELAY_COMPONENT_POLL_SECONDS": "0.3",
            "RELAY_RECONNECT_MIN_SECONDS": "0.2",
            "RELAY_RECONNECT_MAX_SECONDS": "2",
            "RELAY_SEND_RETRY_BASE_SECONDS": "0.2",
            "RELAY_SEND_RETRY_MAX_SECONDS": "1",
            "DATABASE_CONN_MAX_AGE": "600",
            "PYTHONUNBUFFERED": "1",
            # Any free port: several gateways and workers may run at once.
            "GATEWAY_PROBE_LISTEN": "127.0.0.1:0",
            "WORKER_PROBE_LISTEN": "127.0.0.1:0",
        }
    )
    env.update(overrides)
    return env


def start_gateway(**env: str) -> ServiceProcess:
    return ServiceProcess(
        "gateway", [sys.executable, "manage.py", "run_gateway"], service_env(**env)
    )


def worker_argv(
    *, concurrency: int = 4, loglevel: str = "INFO", pool: str = "threads"
) -> list[str]:
    """The command line of one of our Celery workers (tests and benchmarks use the same). Each
    has a node name of its own: RabbitMQ lets one worker per name hold its control queue."""
    import uuid

    return [
        sys.executable, "-m", "celery", "-A", "pushsite", "worker",
        "--hostname", f"worker-{uuid.uuid4().hex[:8]}@%h",
        "--pool", pool, "--concurrency", str(concurrency), "--loglevel", loglevel,
        "--without-heartbeat", "--without-gossip", "--without-mingle",
    ]  # fmt: skip


def beat_argv(schedule: str, *, loglevel: str = "INFO") -> list[str]:
    """The command line of beat (the Procfile's), its schedule in the file `schedule`:
    housekeeping only (the workers sweep the deferred sends themselves)."""
    return [
        sys.executable, "-m", "celery", "-A", "pushsite", "beat",
        "--loglevel", loglevel, "--schedule", schedule,
    ]  # fmt: skip


def probe_url(process: ServiceProcess, timeout: float = 60.0) -> str:
    """The base URL of a gateway's or worker's probe listener (port 0: read from its log)."""
    import json

    def listening() -> str:
        if not process.alive():
            raise RuntimeError(f"{process.name} died:\n{process.log_tail()}")
        for line in process.log_text().splitlines():
            if '"probes.listening"' in line:
                entry = json.loads(line)
                return f"http://{entry['host']}:{entry['port']}"
        return ""

    return str(wait_until(listening, timeout, lambda: f"no probe listener\n{process.log_tail()}"))


def start_worker(**env: str) -> ServiceProcess:
    return ServiceProcess("worker", worker_argv(), service_env(**env))


test_database_url.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test


def start_web(
    *, workers: int = 1, threads: int = 4, prefix: Sequence[str] = (), **env: str
) -> tuple[ServiceProcess, str]:
    """The web process as the Procfile runs it (`python -m pushsite.server`), on a free port;
    and its base URL. `prefix`: a command that runs it (`prlimit --nofile=…`)."""
    from tests.support.ports import free_port

    port = free_port()
    settings = {
        "WEB_BIND": f"127.0.0.1:{port}",
        "WEB_WORKERS": str(workers),
        "WEB_THREADS": str(threads),
    }
    web = ServiceProcess(
        "web",
        [*prefix, sys.executable, "-m", "pushsite.server"],
        service_env(**{**settings, **env}),
    )
    return web, _ready(web, port)


def start_dev_server(**env: str) -> tuple[ServiceProcess, str]:
    """Django's development server (`manage.py runserver`) on a free port; and its base URL."""
    from tests.support.ports import free_port

    port = free_port()
    web = ServiceProcess(
        "runserver",
        [sys.executable, "manage.py", "runserver", f"127.0.0.1:{port}", "--noreload"],
        service_env(**env),
        handles_sigterm=False,  # Django's development server just dies of it
    )
    return web, _ready(web, port)


def _ready(web: ServiceProcess, port: int) -> str:
    """The base URL, once /healthz answers."""
    import urllib.request

    base_url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if not web.alive():
            raise RuntimeError(f"the web process died:\n{web.log_tail()}")
        try:
            return urllib.request.urlopen(base_url + "/healthz", timeout=5).status == 200
        except OSError:
            return False

    wait_until(ready, 60, lambda: f"{base_url}/healthz does not answer\n{web.log_tail()}")
    return base_url
