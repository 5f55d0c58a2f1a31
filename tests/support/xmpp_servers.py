"""Real XMPP servers (Prosody 0.12, ejabberd 23.01 from Debian) as plain child processes.

Each instance lives in its own working folder (config, data, logs), listens on 127.0.0.1 only,
on free ports, and knows a list of XEP-0114 components ``[(jid, secret), ...]``. Both classes
have the same shape::

    server = ProsodyServer([("push.localhost", "s3cr3t")])
    server.start()              # waits until c2s and component ports accept connections
    server.c2s_port, server.component_port, server.domain   # "localhost"
    server.restart()            # same ports, same data (accounts survive)
    server.stop()               # SIGTERM, then SIGKILL after a few seconds
    server.close()              # stop and remove the working folder if we made it

Nothing here needs Django.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import os
import shutil
import signal
import subprocess
import tempfile
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, ClassVar, Self

import yaml

from tests.support.ports import LOOPBACK, free_port, port_accepts
from tests.support.waiting import wait_until

Component = tuple[str, str]
"""An XEP-0114 component: (jid, secret)."""

DEFAULT_COMPONENTS: tuple[Component, ...] = (("push.localhost", "s3cr3t"),)
PEERS_DIR = Path(__file__).resolve().parent.parent / "peers"
EJABBERD_ERL_LIBS = "/usr/lib/x86_64-linux-gnu"

_running: weakref.WeakSet[XmppServer] = weakref.WeakSet()


class ServerStartError(RuntimeError):
    """The server did not come up; the message ends with the tail of its logs."""


class _PortInUse(ServerStartError):
    """The server could not bind one of its ports (another process took it)."""


class XmppServer(ABC):
    """Common machinery: working folder, ports, process start/stop, readiness, logs."""

    kind: ClassVar[str]
    domain: ClassVar[str] = "localhost"
    host: ClassVar[str] = LOOPBACK
    executable: ClassVar[str]
    _bind_failure_markers: ClassVar[tuple[str, ...]]

    def __init__(
        self,
        components: Sequence[Component] = DEFAULT_COMPONENTS,
        *,
        workdir: str | Path | None = None,
        c2s_port: int | None = None,
        component_port: int | None = None,
        startup_timeout: float = 60.0,
        stop_timeout: float = 30.0,
    ) -> None:
        self._components: tuple[Component, ...] = tuple((str(j), str(s)) for j, s in components)
        if not self._components:
            raise ValueError("at least one component (jid, secret) is required")
        jids = [jid for jid, _ in self._components]
        if len(set(jids)) != len(jids):
            raise ValueError(f"duplicate component JIDs: {jids}")
        self._owns_workdir = workdir is None
        self._workdir = Path(
            tempfile.mkdtemp(prefix=f"{self.kind}-") if workdir is None else workdir
        ).resolve()
        self._workdir.mkdir(parents=True, exist_ok=True)
        # Ports given by the caller, or used by a successful start, never change again
        # (clients and components must find the server again after a restart).
        self._ports_pinned = c2s_port is not None or component_port is not None
        self._c2s_port = c2s_port if c2s_port is not None else free_port()
        self._component_port = component_port if component_port is not None else free_port()
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._console: IO[bytes] | None = None
        self.last_startup_seconds: float | None = None

    # ----------------------------------------------------------------- properties
    @property
    def c2s_port(self) -> int:
        return self._c2s_port

    @property
    def component_port(self) -> int:
        return self._component_port

    @property
    def components(self) -> tuple[Component, ...]:
        return self._components

    @property
    def workdir(self) -> Path:
        return self._workdir

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def console_path(self) -> Path:
        return self._workdir / "console.log"

    @property
    @abstractmethod
    def log_path(self) -> Path:
        """The server's own (debug level) log file."""

    @classmethod
    def available(cls) -> bool:
        """True when the server's executable is installed."""
        return shutil.which(cls.executable) is not None

    # ----------------------------------------------------------------- to implement
    @abstractmethod
    def _write_config(self) -> None:
        """Write the config file(s) for the current ports into the working folder."""

    @abstractmethod
    def _command(self) -> list[str]: ...

    @abstractmethod
    def _environment(self) -> dict[str, str]:
        """Extra environment variables for the server process."""

    @abstractmethod
    def _cwd(self) -> Path: ...

    @abstractmethod
    def _ready_markers(self) -> list[str]:
        """Log lines (substrings) that show both listeners are up."""

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the server and wait until its c2s and component ports accept connections.

        Retries with fresh ports when a port is taken (unless ports are pinned); raises
        ServerStartError with the tail of the logs otherwise.
        """
        if self.is_running:
            return
        attempts = 1 if self._ports_pinned else 3
        for attempt in range(1, attempts + 1):
            try:
                self._start_once()
            except _PortInUse:
                if attempt == attempts:
                    raise
                self._c2s_port, self._component_port = free_port(), free_port()
            else:
                self._ports_pinned = True
                return

    def stop(self, *, graceful: bool = True) -> None:
        """Stop the server: SIGTERM, then SIGKILL after ``stop_timeout`` seconds.

        ``graceful=False`` sends SIGKILL at once (the data may then miss recent writes).
        """
        proc, self._proc = self._proc, None
        if proc is not None:
            _running.discard(self)
            if proc.poll() is None and not graceful:
                self._kill_group(proc)
                proc.wait(30)
            elif proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(self.stop_timeout)
                except subprocess.TimeoutExpired:
                    self._kill_group(proc)
                    proc.wait(30)
            # Helpers the server spawned in its own session (e.g. Erlang port programs).
            self._kill_group(proc)
        if self._console is not None:
            self._console.close()
            self._console = None

    def restart(self) -> None:
        """Stop and start again on the same ports with the same data."""
        self.stop()
        self.start()

    def close(self) -> None:
        """Kill the server (its data is done with), and remove the working folder if this
        instance created it (a folder given to the constructor is kept, logs included)."""
        self.stop(graceful=False)
        if self._owns_workdir:
            shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = f"pid={self.pid}" if self.is_running else "stopped"
        return (
            f"<{type(self).__name__} {state} c2s={self._c2s_port} "
            f"component={self._component_port} components={[j for j, _ in self._components]}>"
        )

    # ----------------------------------------------------------------- logs
    def log_text(self) -> str:
        """The whole server log (all starts of this instance)."""
        return _read_text(self.log_path)

    def console_text(self) -> str:
        """What the process wrote to stdout/stderr (all starts of this instance)."""
        return _read_text(self.console_path)

    def wait_for_log(self, text: str, timeout: float = 30.0, *, since: int = 0) -> None:
        """Wait until the server log contains ``text`` (after byte offset ``since``).

        ``since=server.log_size()`` taken before an action only looks at what followed it.
        Raises TimeoutError with the log tail.
        """
        wait_until(
            lambda: text in _read_text(self.log_path, since),
            timeout,
            lambda: f"{text!r} in the {self.kind} log\n{self.log_tail()}",
        )

    def log_size(self) -> int:
        """The current size of the server log in bytes (an offset for ``wait_for_log``)."""
        return _file_size(self.log_path)

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the console output and of the server log, for error messages."""
        parts = []
        for title, text in (("console", self.console_text()), ("log", self.log_text())):
            tail = "\n".join(text.splitlines()[-lines:])
            parts.append(f"--- {title} ({self._workdir}) ---\n{tail}")
        return "\n".join(parts)

    # ----------------------------------------------------------------- internals
    def _start_once(self) -> None:
        self._write_config()
        log_offset = _file_size(self.log_path)
        console_offset = _file_size(self.console_path)
        self._console = open(self.console_path, "ab")  # noqa: SIM115 - closed in stop()
        started = time.monotonic()
        self._proc = subprocess.Popen(
            self._command(),
            cwd=self._cwd(),
            env={**os.environ, **self._environment()},
            stdin=subprocess.DEVNULL,
            stdout=self._console,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: stop() can clean up helpers
        )
        _running.add(self)
        deadline = started + self.startup_timeout
        markers = self._ready_markers()
        while True:
            new_log = _read_text(self.log_path, log_offset) + _read_text(
                self.console_path, console_offset
            )
            if any(marker in new_log for marker in self._bind_failure_markers):
                self.stop(graceful=False)
                raise _PortInUse(f"{self!r}: a port is already in use\n{self.log_tail()}")
            returncode = self._proc.poll()
            if returncode is not None:
                self.stop(graceful=False)
                raise ServerStartError(
                    f"{self!r} exited with status {returncode} while starting\n{self.log_tail()}"
                )
            if all(marker in new_log for marker in markers) and all(
                port_accepts(port) for port in (self._c2s_port, self._component_port)
            ):
                self.last_startup_seconds = time.monotonic() - started
                return
            if time.monotonic() > deadline:
                self.stop(graceful=False)
                raise ServerStartError(
                    f"{self!r} not ready after {self.startup_timeout} s\n{self.log_tail()}"
                )
            time.sleep(0.05)

    @staticmethod
    def _kill_group(proc: subprocess.Popen[bytes]) -> None:
        # The group id is the pid of the process we started in a new session; the group only
        # holds processes that this server spawned.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


class ProsodyServer(XmppServer):
    """Prosody 0.12 run as ``prosody -F --config <workdir>/prosody.cfg.lua``.

    The config (tests/peers/prosody.cfg.lua) reads ports, components and options from the
    environment; it is copied into the working folder so each run is self-contained.
    """

    kind = "prosody"
    executable = "prosody"
    _bind_failure_markers = ("Failed to open server port",)

    def __init__(
        self,
        components: Sequence[Component] = DEFAULT_COMPONENTS,
        *,
        push_max_errors: int = 16,
        push_with_body: bool = False,
        push_with_sender: bool = False,
        hibernation_time: int = 60,
        max_ack_delay: int = 5,
        workdir: str | Path | None = None,
        c2s_port: int | None = None,
        component_port: int | None = None,
        startup_timeout: float = 60.0,
        stop_timeout: float = 30.0,
    ) -> None:
        super().__init__(
            components,
            workdir=workdir,
            c2s_port=c2s_port,
            component_port=component_port,
            startup_timeout=startup_timeout,
            stop_timeout=stop_timeout,
        )
        self.push_max_errors = push_max_errors
        self.push_with_body = push_with_body
        self.push_with_sender = push_with_sender
        self.hibernation_time = hibernation_time
        self.max_ack_delay = max_ack_delay

    @property
    def config_path(self) -> Path:
        return self._workdir / "prosody.cfg.lua"

    @property
    def log_path(self) -> Path:
        return self._workdir / "prosody.log"

    def _write_config(self) -> None:
        for folder in ("data", "certs"):
            (self._workdir / folder).mkdir(exist_ok=True)
        shutil.copyfile(PEERS_DIR / "prosody.cfg.lua", self.config_path)

    def _command(self) -> list[str]:
        return [self.executable, "-F", "--config", str(self.config_path)]

    def _environment(self) -> dict[str, str]:
        env = {
            "PROSODY_LAB": str(self._workdir),
            "C2S_PORT": str(self._c2s_port),
            "COMPONENT_PORT": str(self._component_port),
            "COMPONENT_COUNT": str(len(self._components)),
            "PUSH_MAX_ERRORS": str(self.push_max_errors),
            "PUSH_WITH_BODY": "1" if self.push_with_body else "0",
            "PUSH_WITH_SENDER": "1" if self.push_with_sender else "0",
            "SMACKS_HIBERNATION": str(self.hibernation_time),
            "SMACKS_MAX_ACK_DELAY": str(self.max_ack_delay),
        }
        for index, (jid, secret) in enumerate(self._components, start=1):
            env[f"COMPONENT_{index}_JID"] = jid
            env[f"COMPONENT_{index}_SECRET"] = secret
        return env

    def _cwd(self) -> Path:
        return self._workdir

    def _ready_markers(self) -> list[str]:
        return [
            f"Activated service 'c2s' on [{LOOPBACK}]:{self._c2s_port}",
            f"Activated service 'component' on [{LOOPBACK}]:{self._component_port}",
        ]


class EjabberdServer(XmppServer):
    """ejabberd 23.01 with the Erlang VM run directly (``ejabberdctl`` would switch user).

    The VM runs without distribution (node ``nonode@nohost``): ejabberd does not need a node
    name when nothing connects to it with ``ejabberdctl``, and an undistributed node never
    registers with epmd, so parallel instances cannot clash on a name.
    """

    kind = "ejabberd"
    executable = "erl"
    _bind_failure_markers = ("eaddrinuse", "address already in use")

    def __init__(
        self,
        components: Sequence[Component] = DEFAULT_COMPONENTS,
        *,
        resume_timeout: int = 60,
        push_include_body: bool | str = "New message",
        loglevel: str = "debug",
        workdir: str | Path | None = None,
        c2s_port: int | None = None,
        component_port: int | None = None,
        startup_timeout: float = 120.0,
        stop_timeout: float = 30.0,
    ) -> None:
        super().__init__(
            components,
            workdir=workdir,
            c2s_port=c2s_port,
            component_port=component_port,
            startup_timeout=startup_timeout,
            stop_timeout=stop_timeout,
        )
        self.resume_timeout = resume_timeout
        self.push_include_body = push_include_body
        self.loglevel = loglevel

    @classmethod
    def available(cls) -> bool:
        return super().available() and Path(EJABBERD_ERL_LIBS).joinpath("ejabberd-23.01").is_dir()

    @property
    def config_path(self) -> Path:
        return self._workdir / "ejabberd.yml"

    @property
    def spool_dir(self) -> Path:
        return self._workdir / "spool"

    @property
    def log_path(self) -> Path:
        return self._workdir / "log" / "ejabberd.log"

    def render_config(self) -> dict[str, Any]:
        """The template tests/peers/ejabberd.yml with this instance's ports and options."""
        template = yaml.safe_load((PEERS_DIR / "ejabberd.yml").read_text())
        config: dict[str, Any] = copy.deepcopy(template)
        config["loglevel"] = self.loglevel
        for listener in config["listen"]:
            if listener["module"] == "ejabberd_c2s":
                listener["port"] = self._c2s_port
            elif listener["module"] == "ejabberd_service":
                listener["port"] = self._component_port
                listener["hosts"] = {jid: {"password": secret} for jid, secret in self._components}
        modules = config["modules"]
        modules["mod_stream_mgmt"]["resume_timeout"] = self.resume_timeout
        modules["mod_push"]["include_body"] = self.push_include_body
        return config

    def _write_config(self) -> None:
        self.spool_dir.mkdir(exist_ok=True)
        self.log_path.parent.mkdir(exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self.render_config(), sort_keys=False))

    def _command(self) -> list[str]:
        return [
            self.executable,
            "-noinput",
            "-noshell",
            "+K",
            "true",
            "-mnesia",
            "dir",
            f'"{self.spool_dir}"',
            "-s",
            "ejabberd",
        ]

    def _environment(self) -> dict[str, str]:
        return {
            "ERL_LIBS": EJABBERD_ERL_LIBS,
            "EJABBERD_CONFIG_PATH": str(self.config_path),
            "EJABBERD_LOG_PATH": str(self.log_path),
            "ERL_CRASH_DUMP": str(self._workdir / "erl_crash.dump"),
            "HOME": str(self._workdir),  # keep Erlang's files (cookie, history) out of ~
        }

    def _cwd(self) -> Path:
        return self.spool_dir

    def _ready_markers(self) -> list[str]:
        return [
            f"Start accepting TCP connections at {LOOPBACK}:{self._c2s_port} for ejabberd_c2s",
            f"Start accepting TCP connections at {LOOPBACK}:{self._component_port} "
            "for ejabberd_service",
        ]


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _read_text(path: Path, offset: int = 0) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            return handle.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""


@atexit.register
def _stop_leftover_servers() -> None:
    """Safety net: never leave a server running after the test process ends."""
    for server in list(_running):
        server.stop(graceful=False)
