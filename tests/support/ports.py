"""Free TCP ports on the loopback interface for the real-peer test servers.

Ports are picked at random *below* the kernel's ephemeral range, so that an outgoing
connection of some other process cannot grab a port between the moment we pick it and the
moment the server binds it. A port is only handed out once per process, and it must be
bindable right now. Parallel test runs pick random ports, so they collide only rarely; the
server classes retry with fresh ports when a bind fails anyway.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

LOOPBACK = "127.0.0.1"

_LOWEST_PORT = 20000
_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()
_lock = threading.Lock()


def _port_range() -> tuple[int, int]:
    """Return the inclusive range to pick from: [20000, start of the ephemeral range)."""
    try:
        ephemeral_start = int(_EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_start = 32768
    if ephemeral_start - 1 <= _LOWEST_PORT + 1000:
        # Unusual kernel setting: fall back to a range above the ephemeral ports' default end.
        return 61000, 65535
    return _LOWEST_PORT, ephemeral_start - 1


def is_port_free(port: int, host: str = LOOPBACK) -> bool:
    """Return True when nothing listens on (or is bound to) ``host:port`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = LOOPBACK) -> int:
    """Return a TCP port on ``host`` that is free now and was not handed out before."""
    low, high = _port_range()
    with _lock:
        for _ in range(1000):
            port = random.randint(low, high)
            if port in _handed_out or not is_port_free(port, host):
                continue
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free TCP port found on {host} in {low}..{high}")


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """Return ``count`` distinct free TCP ports on ``host``."""
    return [free_port(host) for _ in range(count)]


def port_accepts(port: int, host: str = LOOPBACK, timeout: float = 0.5) -> bool:
    """Return True when a TCP connection to ``host:port`` succeeds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False
