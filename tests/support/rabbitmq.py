"""Private RabbitMQ nodes on free ports, started, restarted and killed by the tests.

Each node (or three-node cluster) gets its own folder (data, logs, config, enabled plugins),
its own epmd port (ERL_EPMD_PORT), AMQP port and distribution port, and an Erlang cookie in
its own HOME, so it never meets the machine's own RabbitMQ (Debian's package starts one) or
another test run's. Readiness is a real AMQP connection, never a fixed sleep.

A cluster (`PrivateRabbitCluster`) has three nodes on one epmd; the fault tests kill one with
SIGKILL, delete its data directory and bring it back the way an operator replaces a lost host
(`replace_node`: forget it on a survivor, start it empty, join it, grow the quorum queues).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import amqp

from tests.support.ports import LOOPBACK, free_port, port_accepts

RABBITMQ_BIN = Path("/usr/lib/rabbitmq/bin")
HOST = "localhost"  # node names are name@localhost: no DNS, no host name of this machine


class RabbitError(RuntimeError):
    """A private RabbitMQ node would not start, stop or join."""


def _binary(name: str) -> str:
    path = RABBITMQ_BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if found is None:
        raise RabbitError(f"{name} not found: install rabbitmq-server (`make test` does)")
    return found


def amqp_ready(port: int, timeout: float = 2.0) -> bool:
    """A real AMQP handshake (guest may log in from loopback), not just an open port."""
    connection = amqp.Connection(
        f"{LOOPBACK}:{port}", userid="guest", password="guest", connect_timeout=timeout
    )
    try:
        connection.connect()
    except Exception:
        return False
    with contextlib.suppress(Exception):
        connection.close()
    return True


class PrivateRabbit:
    """One RabbitMQ node of our own. `start`, `stop` (rabbitmqctl stop: what an operator's
    restart does), `kill` (SIGKILL to the VM), `restart`, `wipe` (the data directory)."""

    def __init__(
        self,
        name: str = "relay",
        *,
        workdir: Path | None = None,
        epmd_port: int | None = None,
        home: Path | None = None,
    ) -> None:
        self.name = name
        self.node = f"{name}@{HOST}"
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix=f"relay-rabbit-{name}-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.home = home or self.workdir / "home"
        self.port = free_port()
        self.dist_port = free_port()
        self.epmd_port = epmd_port or free_port()
        self.owns_epmd = epmd_port is None
        self.mnesia = self.workdir / "mnesia"
        self.logs = self.workdir / "log"
        self.process: subprocess.Popen[bytes] | None = None
        self._write_files()

    def join_at_boot(self, peers: list[PrivateRabbit]) -> None:
        """Next start, a blank node joins the cluster of `peers` (classic_config peer
        discovery) before it opens its AMQP listener: no client meets it alone."""
        self._write_files(peers)

    def _write_files(self, peers: list[PrivateRabbit] | None = None) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        cookie = self.home / ".erlang.cookie"
        if not cookie.exists():
            cookie.write_text(secrets.token_hex(16))
            cookie.chmod(0o400)
        self.logs.mkdir(parents=True, exist_ok=True)
        (self.workdir / "enabled_plugins").write_text("[].\n")
        (self.workdir / "rabbitmq-env.conf").write_text("")  # not /etc/rabbitmq's
        (self.workdir / "rabbitmq.conf").write_text(
            "\n".join(
                [
                    f"listeners.tcp.1 = {LOOPBACK}:{self.port}",
                    "loopback_users.guest = true",
                    # A test machine's disk may be nearly full: do not block publishers for it.
                    "disk_free_limit.absolute = 1MB",
                    "log.file.level = warning",
                    "log.console = false",
                    *(
                        ["cluster_formation.peer_discovery_backend = classic_config"]
                        if peers
                        else []
                    ),
                    *(
                        f"cluster_formation.classic_config.nodes.{n} = {peer.node}"
                        for n, peer in enumerate(peers or [], start=1)
                    ),
                    "",
                ]
            )
        )

    def env(self) -> dict[str, str]:
        env = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("RABBITMQ_", "ERL_")) and key != "CONF_ENV_FILE"
        }
        env.update(
            HOME=str(self.home),
            RABBITMQ_NODENAME=self.node,
            RABBITMQ_NODE_IP_ADDRESS=LOOPBACK,
            RABBITMQ_NODE_PORT=str(self.port),
            RABBITMQ_DIST_PORT=str(self.dist_port),
            ERL_EPMD_PORT=str(self.epmd_port),
            ERL_EPMD_ADDRESS=LOOPBACK,
            RABBITMQ_CONF_ENV_FILE=str(self.workdir / "rabbitmq-env.conf"),
            RABBITMQ_CONFIG_FILE=str(self.workdir / "rabbitmq.conf"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(self.workdir / "enabled_plugins"),
            RABBITMQ_MNESIA_BASE=str(self.mnesia),
            RABBITMQ_LOG_BASE=str(self.logs),
            RABBITMQ_PID_FILE=str(self.workdir / "rabbit.pid"),
            # Listen for the distribution on loopback only.
            RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}",
            RABBITMQ_CTL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}",
        )
        return env

    # --- life cycle

    def start(self, timeout: float = 90.0) -> PrivateRabbit:
        if self.running():
            return self
        with (self.logs / "console.log").open("ab") as log:  # the node keeps its own copy
            self.process = subprocess.Popen(
                [_binary("rabbitmq-server")],
                env=self.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # our signals are ours, not the node's
            )
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while not amqp_ready(self.port):
            if self.process is not None and self.process.poll() is not None:
                raise RabbitError(f"{self.node} exited: {self.console_tail()}")
            if time.monotonic() > deadline:
                raise RabbitError(f"{self.node} not ready within {timeout}s: {self.console_tail()}")
            time.sleep(0.2)

    def console_tail(self) -> str:
        with contextlib.suppress(OSError):
            return (self.logs / "console.log").read_text(errors="replace")[-2000:]
        return ""

    def ctl(self, *args: str, tool: str = "rabbitmqctl", timeout: float = 120.0) -> str:
        """rabbitmqctl (or rabbitmq-queues, rabbitmq-diagnostics) against this node."""
        result = subprocess.run(
            [_binary(tool), "-n", self.node, *args],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if result.returncode != 0:
            output = (result.stderr or result.stdout)[-2000:]
            raise RabbitError(f"{tool} {' '.join(args)}: {output}")
        return result.stdout

    def stop(self, timeout: float = 60.0) -> None:
        """A clean shutdown (SIGTERM to the VM, as systemd does), waited for."""
        if self.process is None:
            return
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self.process = None

    def kill(self) -> None:
        """SIGKILL to the whole node (the VM and its helpers): the host died."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)
        self.process = None

    def restart(self, down_seconds: float = 0.0) -> None:
        self.stop()
        if down_seconds:
            time.sleep(down_seconds)
        self.start()

    def wipe(self) -> None:
        """Delete the data directory (the node's disk is gone); the node must be down."""
        if self.running():
            raise RabbitError("wipe a stopped node only")
        shutil.rmtree(self.mnesia, ignore_errors=True)

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def url(self, vhost: str = "") -> str:
        return f"amqp://guest:guest@{LOOPBACK}:{self.port}/{vhost}"

    def stop_epmd(self, timeout: float = 10.0) -> None:
        """`epmd -kill`: epmd refuses while a (just killed) node is still registered."""
        deadline = time.monotonic() + timeout
        while port_accepts(self.epmd_port) and time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                subprocess.run(
                    ["epmd", "-kill"], env=self.env(), capture_output=True, timeout=10, check=False
                )
            time.sleep(0.1)

    def close(self) -> None:
        self.kill()
        if self.owns_epmd:
            self.stop_epmd()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> PrivateRabbit:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.close()


class PrivateRabbitCluster:
    """Three nodes (a, b, c) on one epmd and one cookie, joined into one cluster."""

    def __init__(self, names: tuple[str, ...] = ("a", "b", "c")) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="relay-rabbit-cluster-"))
        self.epmd_port = free_port()
        home = self.workdir / "home"
        self.nodes = [
            PrivateRabbit(name, workdir=self.workdir / name, epmd_port=self.epmd_port, home=home)
            for name in names
        ]

    def start(self) -> PrivateRabbitCluster:
        first = self.nodes[0].start()
        for node in self.nodes[1:]:
            node.start()
            self.join(node, first)
        return self

    def join(self, node: PrivateRabbit, to: PrivateRabbit) -> None:
        node.ctl("stop_app")
        node.ctl("join_cluster", to.node)
        node.ctl("start_app")
        node.wait_ready()

    def members(self, via: PrivateRabbit | None = None) -> str:
        return (via or self.nodes[0]).ctl("cluster_status")

    def replace_node(self, node: PrivateRabbit) -> None:
        """Bring back a node whose disk is gone: forget it on a survivor, start it empty so
        that it joins the others as it boots, and give every quorum queue a replica on it
        again (docs/broker.md). Started alone and joined by hand, it would take connections
        meanwhile and confirm publishes into a queue of its own that `join_cluster` resets
        away."""
        survivors = [other for other in self.nodes if other is not node and other.running()]
        survivors[0].ctl("forget_cluster_node", node.node)
        node.join_at_boot(survivors)
        node.start()
        status = node.ctl("cluster_status")
        if survivors[0].node not in status:
            raise RabbitError(f"{node.node} did not join at boot: {status}")
        node.ctl("grow", node.node, "all", tool="rabbitmq-queues")

    def urls(self) -> list[str]:
        return [node.url() for node in self.nodes]

    def url(self) -> str:
        """A kombu failover URL: every node, `;`-separated."""
        return ";".join(self.urls())

    def close(self) -> None:
        for node in self.nodes:
            node.kill()
        self.nodes[0].stop_epmd()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> PrivateRabbitCluster:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.close()
