"""HTTP/1.1 over raw sockets, for tests that must control every byte and every read: a
request written in pieces or pipelined, answers read (or not) as a hostile client would."""

from __future__ import annotations

import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Answer:
    status: int
    head: bytes
    body: bytes

    def header(self, name: str) -> str | None:
        match = re.search(rb"(?im)^" + re.escape(name.encode()) + rb": *([^\r\n]*)", self.head)
        return match.group(1).decode("latin-1") if match else None


def request(method: str, path: str, *headers: str, body: bytes = b"") -> bytes:
    """One request's bytes: Host added unless given, Content-Length for a body or a POST."""
    lines = [f"{method} {path} HTTP/1.1"]
    if not any(line.lower().startswith("host:") for line in headers):
        lines.append("Host: localhost")
    lines.extend(headers)
    framed = any(
        line.lower().startswith(("content-length:", "transfer-encoding:")) for line in headers
    )
    if not framed and (body or method in ("POST", "PUT")):
        lines.append(f"Content-Length: {len(body)}")
    return "\r\n".join(lines).encode() + b"\r\n\r\n" + body


def post(token: str, body: bytes, *headers: str) -> bytes:
    return request("POST", f"/push/{token}", *headers, body=body)


class Reader:
    """Answers read off one connection, in order, each whole (Content-Length framed)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def answers(self, count: int, timeout: float = 20.0) -> list[Answer]:
        out: list[Answer] = []
        deadline = time.monotonic() + timeout
        while len(out) < count:
            end = self.buffer.find(b"\r\n\r\n")
            if end >= 0:
                head = self.buffer[:end]
                # HTTP/1.0 requests are answered in HTTP/1.0 (RFC 9110 6.2 allows either).
                assert re.match(rb"HTTP/1\.[01] \d{3} ", head), self.buffer[:300]
                match = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
                length = int(match.group(1)) if match else 0
                if len(self.buffer) >= end + 4 + length:
                    out.append(
                        Answer(int(head[9:12]), head, self.buffer[end + 4 : end + 4 + length])
                    )
                    self.buffer = self.buffer[end + 4 + length :]
                    continue
            left = deadline - time.monotonic()
            assert left > 0, (
                f"{len(out)} of {count} answers within {timeout}s: {self.buffer[:300]!r}"
            )
            self.sock.settimeout(left)
            chunk = self.sock.recv(65536)
            if not chunk:
                break
            self.buffer += chunk
        return out


def exchange(sock: socket.socket, data: bytes, count: int = 1) -> list[Answer]:
    """Send `data`, read `count` answers."""
    sock.sendall(data)
    return Reader(sock).answers(count)


def closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """Whether the other end closes (EOF or reset) within `timeout`, whatever it sent first."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if not sock.recv(65536):
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False
    return False


def established(port: int) -> int:
    """Connections the server on `port` (this machine) holds open, from /proc/net/tcp."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port and fields[3] == "01":  # ESTABLISHED
                count += 1
    return count
