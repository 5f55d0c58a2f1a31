# ruff: noqa: F811 -- the fixtures fcm and fcm_app are test_direct_sends.py's
"""The gateway's delivery journal (relay/services/delivery_journal.py): a delivered push's
Delivery row is on local disk before its publish is answered and in the database a moment
later; a journal whose gateway died (SIGKILL, in a real child process) is written by the next
one; a live gateway's journal is never taken; rows the database refuses are set aside, not
retried forever.

Against the real database, broker and fake FCM behind the real client; the gateway killed
mid-stream with its journal in tests/test_faults_workers.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.conf import settings

from relay.models import Delivery, Registration
from relay.providers.base import Outcome
from relay.services import delivery_journal, direct_sends
from relay.services.delivery import Bookkeeping, DatabaseUnavailable
from relay.services.delivery_journal import REFUSED_SUFFIX, SUFFIX, Journal, folder
from relay.services.publishing import Verdict, plan_publishes
from tests.test_batching import publish_for
from tests.test_direct_sends import (
    claim_all,
    fcm,  # noqa: F401 -- fixture
    fcm_app,  # noqa: F401 -- fixture
    make_registration,
)

pytestmark = [pytest.mark.defaults, pytest.mark.django_db]


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[Journal]:
    # The writer's own rounds never come within a test: each test flushes or sweeps itself.
    kept = Journal(tmp_path / "journal", interval=3600)
    kept.start()
    yield kept
    kept.stop()


def journal_files(path: Path, suffix: str = SUFFIX) -> list[Path]:
    return sorted(path.glob(f"*{suffix}"))


def lines(path: Path) -> list[dict]:
    return [
        json.loads(line) for path in journal_files(path) for line in path.read_text().splitlines()
    ]


def send_one(component, journal: Journal, n: int) -> tuple[Registration, str]:
    """A publish sent by the direct path with the journal; the registration and push id."""
    registration = make_registration(component, n)
    plan = plan_publishes([publish_for(registration)], claim=claim_all)
    [send] = plan.direct
    assert direct_sends.send_planned(plan, send, journal) == [Verdict.ACCEPTED]
    return registration, send.jobs[0].push_id


def test_a_delivered_push_is_journaled_before_its_answer_and_written_at_the_flush(
    component, fcm_app, fcm, journal
):
    registration, push_id = send_one(component, journal, 1)
    assert len(fcm.requests_for(registration.token)) == 1
    # Answered: the row is on disk, not yet in the database.
    [line] = lines(journal.folder)
    assert [row["push_id"] for row in line["deliveries"]] == [push_id]
    assert line["delivered"] == [registration.pk]
    assert not Delivery.objects.exists()
    assert journal.waiting() == 1

    journal.flush()
    [record] = Delivery.objects.all()
    assert (str(record.push_id), record.outcome) == (push_id, Outcome.DELIVERED)
    assert record.registration_id == registration.pk
    registration.refresh_from_db()
    assert registration.last_push is not None
    assert journal.waiting() == 0
    # The live file keeps its written line until it is full (written again after a crash,
    # which changes nothing).
    [left] = journal_files(journal.folder)
    assert len(left.read_text().splitlines()) == 1


def test_a_push_that_is_not_delivered_is_written_before_its_answer(
    component, fcm_app, fcm, journal
):
    registration = make_registration(component, 2)
    fcm.respond(registration.token, status=404, error_code="UNREGISTERED")
    plan = plan_publishes([publish_for(registration)], claim=claim_all)
    [send] = plan.direct
    assert direct_sends.send_planned(plan, send, journal) == [Verdict.ACCEPTED]
    assert Delivery.objects.get().outcome == Outcome.DEAD_TOKEN
    registration.refresh_from_db()
    assert registration.dead_since is not None
    assert lines(journal.folder) == []


@pytest.mark.django_db(transaction=True)  # the journal's own thread writes at its stop
def test_a_stopped_journal_writes_what_it_kept_and_keeps_no_more(component, fcm_app, fcm, journal):
    _, push_id = send_one(component, journal, 3)
    journal.stop()
    assert [str(pk) for pk in Delivery.objects.values_list("push_id", flat=True)] == [push_id]
    assert journal_files(journal.folder) == []
    # After its stop, a batch's rows are written by the batch itself.
    _, later = send_one(component, journal, 4)
    assert str(Delivery.objects.get(push_id=later).push_id) == later


def test_a_live_gateways_journal_is_never_taken_by_another(
    component, fcm_app, fcm, journal, tmp_path
):
    _, push_id = send_one(component, journal, 5)
    other = Journal(journal.folder, interval=3600)
    assert other.sweep() == 0
    assert not Delivery.objects.exists()
    assert len(lines(journal.folder)) == 1
    journal.flush()
    assert Delivery.objects.filter(push_id=push_id).exists()


CHILD = """
import json, os, signal, sys
from pathlib import Path
import django
django.setup()
from relay.services.delivery import Bookkeeping, DatabaseUnavailable
from relay.services.delivery_journal import Journal
journal = Journal(Path(sys.argv[1]), interval=3600)
journal.start()
for message in json.load(sys.stdin):
    assert journal.keep(Bookkeeping.from_message(message))
print("kept", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_journal_of_a_gateway_killed_outright_is_written_by_the_next(
    component, fcm_app, fcm, tmp_path
):
    """The books are kept by a real process that then dies by SIGKILL, as the OOM killer
    ends a gateway: nothing of it runs after the kill, only the kernel kept its writes."""
    first = Journal(tmp_path / "first", interval=3600)
    first.start()
    pushes = [send_one(component, first, n) for n in (6, 7)]
    books = lines(first.folder)
    first.flush()  # written: now wiped, to see the dead process's journal alone do it
    first.stop()
    Delivery.objects.all().delete()
    Registration.objects.update(last_push=None)

    killed = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "journal")],
        input=json.dumps(books),
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "pushsite.settings"},
        check=False,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert killed.stdout == "kept\n"
    [orphan] = journal_files(tmp_path / "journal")
    assert len(orphan.read_text().splitlines()) == 2

    nxt = Journal(tmp_path / "journal", interval=3600)
    assert nxt.sweep() == 1
    assert {str(pk) for pk in Delivery.objects.values_list("push_id", flat=True)} == {
        push_id for _, push_id in pushes
    }
    assert all(r.last_push is not None for r in Registration.objects.all())
    assert journal_files(tmp_path / "journal") == []
    # Written twice changes nothing: one row per push id.
    orphan.write_text("".join(json.dumps(book) + "\n" for book in books))
    assert nxt.sweep() == 1
    assert Delivery.objects.count() == 2


def test_a_line_cut_short_is_skipped_and_the_rest_written(component, fcm_app, fcm, journal):
    _, push_id = send_one(component, journal, 8)
    [line] = lines(journal.folder)
    journal.flush()
    Delivery.objects.all().delete()
    orphan = journal.folder / f"dead-{uuid.uuid4().hex}{SUFFIX}"
    whole = json.dumps(line)
    orphan.write_text(whole + "\n" + whole[: len(whole) // 2])
    assert Journal(journal.folder, interval=3600).sweep() == 1
    assert [str(pk) for pk in Delivery.objects.values_list("push_id", flat=True)] == [push_id]


@pytest.mark.django_db(transaction=True)  # the constraints are checked at the commit
def test_rows_whose_registration_or_app_went_meanwhile_are_written_as_a_deletion_leaves_them(
    component, fcm_app, fcm, journal
):
    gone, gone_push = send_one(component, journal, 9)
    _, kept_push = send_one(component, journal, 10)
    gone.delete()  # unregistered between the send and the flush
    journal.flush()
    rows = dict(Delivery.objects.values_list("push_id", "registration_id"))
    assert {str(pk) for pk in rows} == {gone_push, kept_push}
    assert rows[uuid.UUID(gone_push)] is None


def test_rows_the_database_refuses_are_set_aside_and_the_next_journal_is_written(
    component, fcm_app, fcm, journal
):
    _, push_id = send_one(component, journal, 11)
    [line] = lines(journal.folder)
    journal.flush()
    Delivery.objects.all().delete()
    bad = json.loads(json.dumps(line))
    bad["deliveries"][0]["push_id"] = "not a push id"
    first = journal.folder / f"a-{uuid.uuid4().hex}{SUFFIX}"
    second = journal.folder / f"b-{uuid.uuid4().hex}{SUFFIX}"
    first.write_text(json.dumps(bad) + "\n")
    second.write_text(json.dumps(line) + "\n")

    assert Journal(journal.folder, interval=3600).sweep() == 2
    assert [str(pk) for pk in Delivery.objects.values_list("push_id", flat=True)] == [push_id]
    [refused] = journal_files(journal.folder, REFUSED_SUFFIX)
    assert json.loads(refused.read_text()) == bad
    assert not first.exists() and not second.exists()


def test_only_delivered_books_are_kept(journal):
    assert journal.keep(Bookkeeping(at="2026-01-01T00:00:00+00:00", dead=[1])) is False
    assert journal.keep(Bookkeeping(at="2026-01-01T00:00:00+00:00", deferred=[{}])) is False
    assert journal.keep(Bookkeeping(at="2026-01-01T00:00:00+00:00")) is True
    assert lines(journal.folder) == []


def test_each_database_has_a_journal_folder_of_its_own(tmp_path):
    mine = folder(tmp_path)
    database = settings.DATABASES["default"]
    other = {**database, "NAME": f"{database['NAME']}-other"}
    from django.db import connection

    saved = connection.settings_dict
    connection.settings_dict = other
    try:
        assert folder(tmp_path) != mine
    finally:
        connection.settings_dict = saved
    assert mine.parent == tmp_path / "delivery-journal"


def test_a_journal_stopped_while_the_database_is_away_leaves_its_rows_for_the_next(tmp_path):
    """At the stop, one retry window (RELAY_DATABASE_RETRY_SECONDS), not two: the rows stay
    on disk, unlocked, for the next gateway. The writer stands in for a database that does
    not answer (the real one taken away: tests/test_e2e_relay.py, tests/test_faults.py)."""
    tries: list[Bookkeeping] = []

    def away(book: Bookkeeping) -> None:
        tries.append(book)
        raise DatabaseUnavailable("OperationalError")

    journal = Journal(tmp_path, interval=3600, write=away)
    journal.start()
    row = {"push_id": str(uuid.uuid4()), "app_id": 1, "registration_id": 1}
    assert journal.keep(Bookkeeping(at="2026-01-01T00:00:00+00:00", deliveries=[row]))
    journal.stop()
    assert len(tries) == 1
    [left] = [path for path in journal_files(tmp_path) if path.stat().st_size]
    assert json.loads(left.read_text())["deliveries"] == [row]
    # Unlocked: the next gateway takes it.
    nxt = Journal(tmp_path, interval=3600, write=tries.append)
    assert nxt.sweep() >= 1
    assert [book.deliveries for book in tries[1:]] == [[row]]


def test_a_full_file_takes_no_more_lines_and_is_removed_once_written(
    component, fcm_app, fcm, journal, monkeypatch
):
    monkeypatch.setattr(delivery_journal, "FILE_BYTES", 1)  # full after one line
    _, push_id = send_one(component, journal, 12)
    [full] = journal_files(journal.folder)
    journal.flush()
    assert [str(pk) for pk in Delivery.objects.values_list("push_id", flat=True)] == [push_id]
    assert not full.exists()
    [fresh] = journal_files(journal.folder)
    assert fresh.stat().st_size == 0
    _, later = send_one(component, journal, 13)
    assert [row["push_id"] for row in json.loads(fresh.read_text())["deliveries"]] == [later]
    journal.flush()  # here, not in the writer's thread at the fixture's stop
