"""Group commit: the requests that a web process's threads store at the same moment share ONE
statement (or transaction) and one commit: the UnifiedPush POSTs (unifiedpush.store) and the
Windows API's registrations (uwpx).

No extra thread and no waiting window: the first thread to arrive writes (the leader); the
threads that arrive while it writes queue up, and when it is done the first of them writes
everything queued meanwhile in one batch, and so on. Alone, a POST is written at once; under
load the batches grow by themselves, and each POST still gets its own answer (or error).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


class _Slot(Generic[Item, Result]):
    __slots__ = ("done", "error", "item", "lead", "result")

    def __init__(self, item: Item) -> None:
        self.item = item
        # A lock held from the start and released once by whoever answers: cheaper than an
        # Event (no Condition, no extra waiter lock), and a slot is only ever released once.
        self.done = threading.Lock()
        self.done.acquire()
        self.lead = False
        self.result: Result | None = None
        self.error: BaseException | None = None


class GroupCommit(Generic[Item, Result]):
    def __init__(
        self,
        write: Callable[[Sequence[Item]], Sequence[Result]],
        *,
        max_batch: int = 100,
        gather_seconds: float = 0.0,
    ) -> None:
        self._write = write
        self._max_batch = max_batch
        self._gather = gather_seconds
        self._last_batch = 0
        self._lock = threading.Lock()
        self._queue: list[_Slot[Item, Result]] = []
        self._writing = False
        self.batches = 0  # written so far (tests and benchmarks read them)
        self.items = 0

    def submit(self, item: Item) -> Result:
        slot: _Slot[Item, Result] = _Slot(item)
        with self._lock:
            self._queue.append(slot)
            lead = not self._writing
            self._writing = True
        if not lead:
            slot.done.acquire()
            if not slot.lead:
                return self._outcome(slot)
        self._lead()
        return self._outcome(slot)

    def _lead(self) -> None:
        if self._gather and self._last_batch > 1:
            # Others were writing with us last time: give the ones on their way a moment.
            time.sleep(self._gather)
        with self._lock:
            batch, self._queue = self._queue[: self._max_batch], self._queue[self._max_batch :]
        try:
            results = self._write([slot.item for slot in batch])
            if len(results) != len(batch):
                raise RuntimeError("a batch write answered for the wrong number of items")
        except BaseException as error:  # every waiter gets the failure, none waits forever
            for slot in batch:
                slot.error = error
        else:
            for slot, result in zip(batch, results, strict=True):
                slot.result = result
        self.batches += 1
        self.items += len(batch)
        self._last_batch = len(batch)
        with self._lock:
            successor = self._queue[0] if self._queue else None
            if successor is None:
                self._writing = False
            else:
                successor.lead = True
        # batch[0] is the writing thread's own slot (a leader always heads the queue), awake.
        for slot in batch[1:]:
            slot.done.release()
        if successor is not None:
            successor.done.release()

    @staticmethod
    def _outcome(slot: _Slot[Item, Result]) -> Result:
        if slot.error is not None:
            raise slot.error
        return slot.result  # type: ignore[return-value]
