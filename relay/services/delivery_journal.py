"""The gateway's everyday bookkeeping: appended to a journal on local disk before the publish
is answered, written to the database a moment later, many pushes in one statement.

At an everyday rate every push is a batch of one, and writing what its send taught (its
Delivery row, its registration's `last_push`) before the answer would be a database round
trip per push (what it costs: docs/benchmarks.md, The delivery journal). So the gateway
appends it to its journal, one JSON line in one write(2) (no fsync, no round trip), and one
thread writes what the journal gathered every RELAY_DELIVERY_JOURNAL_SECONDS (sooner once
MAX_WAITING pushes wait) through `delivery.record_kept`, as a worker writes a batch.

Why no Delivery row is lost: the line is in the kernel's page cache before the publish is
answered, so it outlives the gateway however the gateway ends (SIGKILL, the OOM killer, a
crash). Each journal file is held under an exclusive flock(2) by the gateway writing it; a
file nobody holds belongs to a gateway that is gone, and the next gateway to run on the host
(at start, then every ORPHAN_SWEEP_SECONDS) writes its rows and removes it. Writing a row
twice changes nothing (one Delivery row per push id; `last_push` only moves forward). A host
that loses power loses what its page cache had not written, as PostgreSQL loses the commits
that did not wait for the WAL flush (the bookkeeping never did). A database that does not
answer keeps the rows in the journal until it does.

Only a batch whose pushes were all delivered comes here. A dead token, a deferred retry or a
dead letter is written before the answer, as before: the first changes the next publish's
answer, the others are the only copy of their push.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from django.db import connection

from relay import metrics
from relay.services.delivery import Bookkeeping, DatabaseUnavailable, record_kept

log = logging.getLogger(__name__)

# Pushes waiting that wake the writer before its interval is up.
MAX_WAITING = 1000
# A file takes no more lines past this size (about 2,400 pushes).
FILE_BYTES = 1 << 20
# The most Delivery rows written in one statement when a journal is read back.
ROWS_PER_WRITE = 1000
ORPHAN_SWEEP_SECONDS = 10.0
SUFFIX = ".journal"
# A journal whose rows the database refused (not: did not answer) is renamed so and kept for
# an operator; the next ones go on.
REFUSED_SUFFIX = ".refused"


def folder(var_dir: Path) -> Path:
    """Where the gateways of this host keep their journals for this database: a journal is
    only ever written to the database it was kept for (another VAR_DIR user, e.g. a second
    installation or a test, may name another)."""
    database = connection.settings_dict
    name = "|".join(str(database[key]) for key in ("ENGINE", "HOST", "PORT", "NAME"))
    return var_dir / "delivery-journal" / hashlib.sha256(name.encode()).hexdigest()[:16]


class _File:
    """One journal file, held under an exclusive flock(2) by its gateway while it lives."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd
        self.size = 0
        self.broken = False  # a write failed part-way: no more lines go after it

    @classmethod
    def create(cls, folder: Path) -> _File:
        path = folder / f"{os.getpid()}-{uuid.uuid4().hex}{SUFFIX}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return cls(path, fd)

    def append(self, book: Bookkeeping) -> bool:
        line = json.dumps(_message(book), separators=(",", ":")).encode() + b"\n"
        try:
            written = os.write(self.fd, line)
        except OSError as error:
            log.warning("journal.write_failed", extra={"error_type": type(error).__name__})
            written = -1
        if written != len(line):
            self.broken = True
            return False
        self.size += written
        return True

    def remove(self) -> None:
        """Its rows are written: gone, then unlocked (never the other way round, or a sweep
        could take it in between and write them again)."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self.fd)


def _message(book: Bookkeeping) -> dict[str, Any]:
    """What a journal line holds; not `Bookkeeping.to_message`, whose `asdict` copies every
    row, on the send's own thread (a journaled book has only these fields)."""
    return {"at": book.at, "delivered": book.delivered, "deliveries": book.deliveries}


def merged(books: Iterable[Bookkeeping]) -> Iterator[Bookkeeping]:
    """Everyday books as few as can be written in one statement each: their registrations'
    `last_push` moved to the latest time, one Delivery row per push id (the last one)."""
    rows: dict[str, dict[str, Any]] = {}
    delivered: set[int] = set()
    at = ""
    for book in books:
        if book.dead or book.dead_letters or book.deferred:
            raise ValueError("only delivered pushes are journaled")
        at = max(at, book.at)
        delivered.update(book.delivered)
        for row in book.deliveries:
            rows[str(row["push_id"])] = row
            if len(rows) >= ROWS_PER_WRITE:
                yield Bookkeeping(
                    at=at, delivered=sorted(delivered), deliveries=list(rows.values())
                )
                rows, delivered = {}, set()
    if rows or delivered:
        yield Bookkeeping(at=at, delivered=sorted(delivered), deliveries=list(rows.values()))


def read(fd: int) -> list[Bookkeeping]:
    """A journal's books; a line cut short (its writer died mid-write) is skipped, logged."""
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    books = []
    for line in b"".join(chunks).splitlines():
        try:
            books.append(Bookkeeping.from_message(json.loads(line)))
        except (ValueError, TypeError):
            log.warning("journal.line_unreadable", extra={"size": len(line)})
    return books


class Journal:
    """One gateway's journal under `folder`; thread-safe. `keep` a book, `start` the writer,
    `stop` it (writing everything first).

    A file takes lines until it holds FILE_BYTES, and is removed once every row in it is
    written: a file per round cost more than the round's database write (docs/benchmarks.md,
    The delivery journal). So a live file also holds rows already written; after a crash
    they are written again, which changes nothing."""

    def __init__(
        self,
        folder: Path,
        *,
        interval: float,
        write: Callable[[Bookkeeping], None] = record_kept,
    ) -> None:
        self.folder = folder
        self.interval = interval
        self._write = write
        self._lock = threading.Lock()
        self._file: _File | None = None
        self._full: list[_File] = []  # files that take no more lines, removed once written
        self._kept: list[Bookkeeping] = []  # kept since the last round took them
        self._unwritten: list[Bookkeeping] = []  # taken by a round the database did not take
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._swept: float | None = None
        self.cpu_seconds = 0.0  # the writer thread's CPU so far (benchmarks read it)
        self._database_away = False  # the last write met DatabaseUnavailable

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._file = self._open()
        self._thread = threading.Thread(target=self._run, name="delivery-journal", daemon=True)
        self._thread.start()

    def keep(self, book: Bookkeeping) -> bool:
        """Journal an everyday book; False when it was not (the caller writes it itself)."""
        if book.dead or book.dead_letters or book.deferred:
            return False
        if not book.deliveries and not book.delivered:
            return True  # nothing to write
        with self._lock:
            current = self._file
            if current is None or current.broken or not current.append(book):
                return False
            self._kept.append(book)
            waiting = len(self._kept)
        if waiting >= MAX_WAITING:
            self._wake.set()
        return True

    def stop(self) -> None:
        """Write everything kept (what the database does not take stays on disk, for the
        next gateway), then stop."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()

    def waiting(self) -> int:
        """Pushes kept whose rows are not written yet."""
        with self._lock:
            return len(self._kept) + len(self._unwritten)

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._wake.wait(self.interval)
                self._wake.clear()
                self.flush(final=self._stopping.is_set())
                if self._swept is None or time.monotonic() - self._swept >= ORPHAN_SWEEP_SECONDS:
                    self._swept = time.monotonic()
                    self.sweep()
                self.cpu_seconds = time.thread_time()
            if self._database_away:  # not another retry window at the stop: it stays on disk
                log.warning("journal.left_for_the_next_gateway", extra={"pushes": self.waiting()})
            else:
                self.flush(final=True)
        except Exception:  # what is kept stays on disk; the sends write their own from now on
            log.exception("journal.stopped_by_error")
        finally:
            with self._lock:
                left = [*self._full, *([self._file] if self._file else [])]
                self._file, self._full = None, []
            for file in left:  # unlocked and left for the next gateway on this host
                os.close(file.fd)
            connection.close()

    def flush(self, *, final: bool = False) -> None:
        """Write the rows kept so far (one caller at a time: the writer's thread, or a test
        that never started it)."""
        with self._lock:
            books, self._kept = [*self._unwritten, *self._kept], []
            self._unwritten = []
            current = self._file
            if current is not None and (final or current.broken or current.size >= FILE_BYTES):
                self._full.append(current)
                current = None
            self._file = current if final or current else self._open()
        if books and not self._written(books):
            with self._lock:  # the database is away: taken again by the next round
                self._unwritten = books
        else:
            with self._lock:
                full, self._full = self._full, []
            for file in full:
                file.remove()
        metrics.JOURNAL_WAITING.set(self.waiting())

    def _open(self) -> _File | None:
        """A new file; None when the disk refuses one (the pushes are then written before
        their answer, as without a journal, until a later round opens one)."""
        try:
            return _File.create(self.folder)
        except OSError as error:
            log.warning("journal.open_failed", extra={"error_type": type(error).__name__})
            return None

    def _written(self, books: list[Bookkeeping], path: Path | None = None) -> bool:
        """Whether the books are done with: written, or refused and set aside (their file,
        `path`, renamed; or a file of their own)."""
        try:
            for book in merged(books):
                self._write(book)
        except DatabaseUnavailable:
            log.warning("journal.database_unavailable", extra={"pushes": len(books)})
            self._database_away = True
            return False
        except Exception as error:  # never retried forever: kept for an operator
            log.exception(
                "journal.refused",
                extra={
                    "file": path.name if path else "",
                    "pushes": len(books),
                    "error_type": type(error).__name__,
                },
            )
            metrics.JOURNAL_REFUSED.inc()
            if path is not None:
                path.rename(path.with_suffix(REFUSED_SUFFIX))
            else:  # a live file's other lines are written: these as a file of their own
                refused = self.folder / f"{os.getpid()}-{uuid.uuid4().hex}{REFUSED_SUFFIX}"
                lines = (json.dumps(_message(book), separators=(",", ":")) for book in books)
                refused.write_text("\n".join(lines) + "\n")
        self._database_away = False
        return True

    def sweep(self) -> int:
        """Write and remove the journals of gateways that are gone; how many."""
        swept = 0
        for path in sorted(self.folder.glob(f"*{SUFFIX}")):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue  # written and removed meanwhile
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)  # a live gateway's
                continue
            orphan = _File(path, fd)
            if os.fstat(fd).st_nlink == 0:
                os.close(fd)  # its writer removed it while this sweep opened it
                continue
            books = read(fd)
            if books and not self._written(books, path):
                os.close(fd)
                return swept
            log.info("journal.recovered", extra={"pushes": len(books)})
            metrics.JOURNAL_RECOVERED.inc()
            orphan.remove()
            swept += 1
        return swept
