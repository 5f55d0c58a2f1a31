"""The SQLite store (one host): the same decisions as the Lua scripts, each in one
`BEGIN IMMEDIATE` transaction.
"""

from __future__ import annotations

import logging
import os
import random
import sqlite3
import threading
import time

from relay.services.throttling.decisions import (
    GRACE_SECONDS,
    Admission,
    Ask,
    Bucket,
    Decision,
    Fold,
    Limit,
    Refusal,
    StateUnavailable,
    Taken,
)

log = logging.getLogger(__name__)

# --- SQLite (one host) -------------------------------------------------------------------------

_SCHEMA = """
CREATE TABLE IF NOT EXISTS buckets (
    key TEXT PRIMARY KEY, tokens REAL NOT NULL, ts REAL NOT NULL, expires REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS windows (
    key TEXT PRIMARY KEY, last REAL, pending TEXT, due REAL, important INTEGER,
    mc INTEGER, psc INTEGER, folded INTEGER, expires REAL NOT NULL
);
"""


_FRESH_WINDOW = "INSERT OR REPLACE INTO windows VALUES (?, ?, NULL, NULL, NULL, NULL, NULL, 0, ?)"


class SqliteStore:
    """The same decisions as the Lua scripts, each in one `BEGIN IMMEDIATE` transaction."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._local = threading.local()
        try:
            self._connection().executescript(_SCHEMA)
        except sqlite3.Error as error:
            raise StateUnavailable(type(error).__name__) from error

    def _connection(self) -> sqlite3.Connection:
        pid, conn = getattr(self._local, "conn", (None, None))
        if conn is None or pid != os.getpid():
            conn = sqlite3.connect(self.path, timeout=10.0, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            self._local.conn = (os.getpid(), conn)
        return conn

    def _transaction(self) -> _Transaction:
        try:
            return _Transaction(self._connection())
        except sqlite3.Error as error:
            raise StateUnavailable(type(error).__name__) from error

    def admit(
        self, bucket: str, limit: Limit, window_key: str, window: float, push_id: str, fold: Fold
    ) -> Admission:
        with self._transaction() as conn:
            now = time.time()
            if random.random() < 0.001:
                conn.execute("DELETE FROM buckets WHERE expires < ?", (now,))
                conn.execute("DELETE FROM windows WHERE expires < ?", (now,))
            if not limit.unlimited:
                row = conn.execute(
                    "SELECT tokens, ts FROM buckets WHERE key = ? AND expires >= ?", (bucket, now)
                ).fetchone()
                tokens, ts = (float(limit.burst), now) if row is None else row
                tokens = min(limit.burst, tokens + max(0.0, now - ts) * limit.rate)
                allowed = tokens >= 1
                expires = now + limit.burst / limit.rate + 60
                conn.execute(
                    "INSERT OR REPLACE INTO buckets VALUES (?, ?, ?, ?)",
                    (bucket, tokens - 1 if allowed else tokens, now, expires),
                )
                if not allowed:
                    return Admission(Decision.LIMITED, delay=(1 - tokens) / limit.rate)
            if window <= 0:
                return Admission(Decision.SEND)
            row = conn.execute(
                "SELECT last, pending, due FROM windows WHERE key = ? AND expires >= ?",
                (window_key, now),
            ).fetchone()
            last, pending, due = row if row is not None else (None, None, None)
            if pending and due is not None and now < due + GRACE_SECONDS:
                conn.execute(
                    "UPDATE windows SET important = MAX(important, ?), mc = COALESCE(?, mc),"
                    " psc = COALESCE(?, psc), folded = folded + 1 WHERE key = ?",
                    (
                        int(fold.important),
                        fold.message_count,
                        fold.pending_subscription_count,
                        window_key,
                    ),
                )
                return Admission(Decision.FOLDED, push_id=pending)
            if last is not None and now - last < window:
                due = last + window
                conn.execute(
                    "INSERT OR REPLACE INTO windows VALUES (?, ?, ?, ?, ?, ?, ?, 0, ?)",
                    (
                        window_key,
                        last,
                        push_id,
                        due,
                        int(fold.important),
                        fold.message_count,
                        fold.pending_subscription_count,
                        due + GRACE_SECONDS,
                    ),
                )
                return Admission(Decision.SCHEDULE, delay=due - now)
            conn.execute(_FRESH_WINDOW, (window_key, now, now + window + GRACE_SECONDS))
            return Admission(Decision.SEND)

    def admit_many(self, asks: list[Ask]) -> list[Admission]:
        """One host: a transaction per decision is cheap, and keeps each one atomic."""
        return [
            self.admit(a.bucket, a.limit, a.window_key, a.window, a.push_id, a.fold) for a in asks
        ]

    def take(self, window_key: str, push_id: str, window: float) -> Taken | None:
        with self._transaction() as conn:
            now = time.time()
            row = conn.execute(
                "SELECT last, pending, important, mc, psc, folded, expires FROM windows"
                " WHERE key = ? AND expires >= ?",
                (window_key, now),
            ).fetchone()
            if row is None:
                conn.execute(_FRESH_WINDOW, (window_key, now, now + window + GRACE_SECONDS))
                return None
            last, pending, important, mc, psc, folded, expires = row
            last = now if last is None or last < now else last
            if pending != push_id:
                conn.execute("UPDATE windows SET last = ? WHERE key = ?", (last, window_key))
                return None
            conn.execute(
                "UPDATE windows SET last = ?, pending = NULL, due = NULL, important = NULL,"
                " mc = NULL, psc = NULL, folded = 0, expires = ? WHERE key = ?",
                (last, max(expires, now + window + GRACE_SECONDS), window_key),
            )
            return Taken(bool(important), mc, psc, int(folded or 0))

    def abandon(self, window_key: str, push_id: str) -> None:
        with self._transaction() as conn:
            conn.execute(
                "UPDATE windows SET pending = NULL, due = NULL, important = NULL, mc = NULL,"
                " psc = NULL, folded = 0 WHERE key = ? AND pending = ?",
                (window_key, push_id),
            )

    def take_tokens(self, buckets: list[Bucket]) -> Refusal | None:
        with self._transaction() as conn:
            now = time.time()
            if random.random() < 0.001:
                conn.execute("DELETE FROM buckets WHERE expires < ?", (now,))
            tokens: list[float] = []
            refusal: Refusal | None = None
            for index, bucket in enumerate(buckets):
                limit = bucket.limit
                row = conn.execute(
                    "SELECT tokens, ts FROM buckets WHERE key = ? AND expires >= ?",
                    (bucket.key, now),
                ).fetchone()
                have, ts = (float(limit.burst), now) if row is None else row
                have = min(limit.burst, have + max(0.0, now - ts) * limit.rate)
                tokens.append(have)
                if have < 1 and refusal is None:
                    refusal = Refusal(index, (1 - have) / limit.rate)
            for bucket, have in zip(buckets, tokens, strict=True):
                conn.execute(
                    "INSERT OR REPLACE INTO buckets VALUES (?, ?, ?, ?)",
                    (
                        bucket.key,
                        have if refusal else have - 1,
                        now,
                        now + bucket.limit.burst / bucket.limit.rate + 60,
                    ),
                )
            return refusal

    def ping(self) -> None:
        with self._transaction() as conn:
            conn.execute("SELECT 1 FROM buckets LIMIT 1")

    def reset(self) -> None:
        with self._transaction() as conn:
            conn.execute("DELETE FROM buckets")
            conn.execute("DELETE FROM windows")


class _Transaction:
    """`BEGIN IMMEDIATE` takes SQLite's write lock first, so read-then-write is atomic."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> sqlite3.Connection:
        try:
            self.conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as error:
            raise StateUnavailable(type(error).__name__) from error
        return self.conn

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        try:
            self.conn.execute("ROLLBACK" if exc_type else "COMMIT")
        except sqlite3.Error as error:
            if exc_type is None:
                raise StateUnavailable(type(error).__name__) from error
