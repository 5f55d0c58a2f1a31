"""A worker takes what it loaded out of the garbage collector's passes once it is ready
(and a prefork child once it starts): Django, Celery and the providers' clients live as long
as the process, and walking them again at every full collection was a share of each push's
CPU (docs/benchmarks.md); and its collector's passes are spaced for a batch's allocations."""

from __future__ import annotations

import gc

import pytest
from celery.signals import worker_process_init, worker_ready

from relay import tasks


@pytest.fixture
def unfrozen():
    thresholds = gc.get_threshold()
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


pytestmark = pytest.mark.defaults


@pytest.mark.parametrize("signal", [worker_ready, worker_process_init], ids=lambda s: s.name)
def test_a_ready_worker_freezes_the_heap_it_loaded(signal, unfrozen):
    assert gc.get_freeze_count() == 0
    [receiver] = [
        receiver for _, receiver in signal.receivers if receiver is tasks._freeze_the_loaded_heap
    ]
    receiver(sender=None, signal=signal)
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == tasks.COLLECTOR_THRESHOLDS != (700, 10, 10)
