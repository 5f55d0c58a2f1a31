"""What the relay records for the reports: the registration lifecycle log, the per-minute
publish tallies, and their pruning after the retention period."""

from __future__ import annotations

import dataclasses
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import OperationalError, connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from relay.models import Delivery, Registration, Service, Tenant
from relay.report_models import PublishTally, RegistrationEvent, RetentionCut
from relay.services import delivery, lifecycle, queue, retention, tallies, throttling
from relay.services import provider_registry as registry
from relay.services.publishing import Publish, Verdict, accept_publishes
from relay.services.registrations import register_device, unregister_device
from relay.unifiedpush.models import UnifiedPushDelivery
from relay.windows import services as uwpx
from tests.fakes.fcm import FakeFcm
from tests.fakes.wns import FakeWns
from tests.support.provider_fakes import change_credentials, configure_fcm, configure_wns

pytestmark = [pytest.mark.defaults, pytest.mark.django_db]

CHANNEL = "https://db5p.notify.windows.com/?token=chan-{}"


def relay_settings(**changes: object) -> override_settings:
    return override_settings(RELAY={**settings.RELAY, **changes})


def events() -> list[tuple[str, int, int]]:
    return [
        (e.kind, e.registration_id, e.live_change) for e in RegistrationEvent.objects.order_by("id")
    ]


def register(component, token: str, device: str = "dev-1"):
    return register_device(
        component=component,
        service=Service.FCM,
        bare_jid="alice@localhost",
        device_id=device,
        token=token,
    )


@pytest.fixture(scope="module")
def fcm():
    with FakeFcm() as fake:
        yield fake


def test_lifecycle_of_a_registration(component, fcm, send_queue):
    configure_fcm(component.app, fcm)
    component.app.save()
    register(component, "tok-1")
    registration = Registration.objects.get()
    reg_id = registration.pk
    register(component, "tok-1")  # the same live token again: nothing happened
    register(component, "tok-2")
    assert events() == [("created", reg_id, 1), ("renewed", reg_id, 0)]

    # The provider says the token is gone: the real delivery path marks it dead.
    fcm.respond("tok-2", 404)
    now = timezone.now()
    job = queue.SendJob(
        push_id=str(uuid.uuid4()),
        registration_id=reg_id,
        publishing_domain="localhost",
        important=True,
        received=now.isoformat(),
        queued=now.isoformat(),
    )
    assert delivery.deliver(job).value == "dead_token"
    # A second dead answer for an already dead registration is not a second death.
    delivery.deliver(dataclasses.replace(job, push_id=str(uuid.uuid4())))
    registry.close_all()
    assert events()[2:] == [("died", reg_id, -1)]

    register(component, "tok-3")  # revived by a new token
    unregister_device(
        component=component, service=Service.FCM, bare_jid="alice@localhost", device_id="dev-1"
    )
    assert events()[3:] == [("renewed", reg_id, 1), ("removed", reg_id, -1)]
    # The live count is the sum of the changes: 0 now, as the table says.
    assert sum(change for _, _, change in events()) == Registration.objects.count() == 0

    event = RegistrationEvent.objects.first()
    assert (event.tenant_id, event.app_id, event.provider) == (
        component.tenant_id,
        component.app_id,
        "fcm",
    )


def test_removing_a_dead_registration_changes_no_live_count(component):
    register(component, "tok-1")
    Registration.objects.update(dead_since=timezone.now())
    unregister_device(
        component=component, service=Service.FCM, bare_jid="alice@localhost", device_id="dev-1"
    )
    assert [(kind, change) for kind, _, change in events()] == [("created", 1), ("removed", 0)]


def test_windows_devices_log_created_renewed_and_removed(component):
    with FakeWns() as wns:
        configure_wns(component.app, wns)
    change_credentials(component.app, "wns", channel_hosts="*.notify.windows.com")
    app = component.app
    device = "d" * 64
    uwpx.set_channel_uri(app=app, device_id=device, channel_uri=CHANNEL.format(1))
    accounts = [uwpx.AccountRef(bare_jid=f"user{n}@localhost") for n in range(3)]
    uwpx.set_accounts(app=app, device_id=device, accounts=accounts)
    ids = sorted(Registration.objects.values_list("id", flat=True))
    assert sorted(events()) == sorted(("created", i, 1) for i in ids)

    # WNS said the first account's channel is gone (as the delivery path records it).
    dead_at = timezone.now()
    Registration.objects.filter(pk=ids[0]).update(dead_since=dead_at)
    lifecycle.died([ids[0]], at=dead_at)
    uwpx.set_channel_uri(app=app, device_id=device, channel_uri=CHANNEL.format(2))
    renewed = [(reg, change) for kind, reg, change in events() if kind == "renewed"]
    # A new channel renews every account; the dead one comes back to life.
    assert sorted(renewed) == [(ids[0], 1), (ids[1], 0), (ids[2], 0)]

    uwpx.set_accounts(app=app, device_id=device, accounts=accounts[:1])
    removed = sorted((reg, change) for kind, reg, change in events() if kind == "removed")
    assert removed == [(ids[1], -1), (ids[2], -1)]
    # The same channel again renews nothing.
    before = len(events())
    uwpx.set_channel_uri(app=app, device_id=device, channel_uri=CHANNEL.format(2))
    assert len(events()) == before

    removed_devices = uwpx.remove_stale_devices(
        older_than_days=1, now=timezone.now() + timedelta(days=2)
    )
    assert removed_devices == 1
    assert events()[-1] == ("removed", ids[0], -1)
    assert sum(change for _, _, change in events()) == Registration.objects.count() == 0


def test_no_token_or_hash_in_the_log(component):
    register(component, "tok-secret-1")
    row = RegistrationEvent.objects.values().get()
    text = repr(row)
    registration = Registration.objects.get()
    for private in (
        "tok-secret-1",
        "alice",
        registration.node,
        registration.secret,
        registration.device_hash,
    ):
        assert private not in text


# --- publish tallies ----------------------------------------------------------------------------


def _publish(component, registration, **changes) -> Publish:
    values = {
        "component_id": component.pk,
        "publishing_domain": "localhost",
        "node": registration.node if registration else "nope",
        "secret": registration.secret if registration else "x",
        "important": False,
        "message_count": 1,
    }
    values.update(changes)
    return Publish(**values)


def tally() -> dict[tuple[str, str, str], int]:
    return {
        (row.provider, row.publishing_domain, row.verdict): row.count
        for row in PublishTally.objects.all()
    }


def test_every_verdict_of_a_batch_is_tallied_in_one_statement(component, send_queue):
    throttling.reset()
    tenant = component.tenant
    tenant.rate_limit_per_second, tenant.rate_limit_burst = 0.001, 4
    tenant.save()
    regs = []
    for n in range(3):
        register(component, f"tok-{n}", device=f"dev-{n}")
        regs.append(Registration.objects.get(token=f"tok-{n}"))
    batch = [
        # one registration three times: sent now, one delayed send, one folded into it
        _publish(component, regs[0]),
        _publish(component, regs[0]),
        _publish(component, regs[0]),
        _publish(component, regs[1]),
        _publish(component, regs[2]),  # over the burst of 4: rate-limited
        _publish(component, None),  # unknown node
        _publish(component, regs[1], secret="wrong"),  # forbidden
        _publish(component, regs[1], publishing_domain="Other.example"),  # not its domain
    ]
    with relay_settings(COALESCE_SECONDS=3600), CaptureQueriesContext(connection) as queries:
        verdicts = accept_publishes(batch)
    throttling.reset()
    assert verdicts == [Verdict.ACCEPTED] * 4 + [
        Verdict.RATE_LIMITED,
        Verdict.UNKNOWN_NODE,
        Verdict.FORBIDDEN,
        Verdict.UNKNOWN_NODE,
    ]
    assert tally() == {
        ("fcm", "localhost", "accepted"): 3,
        ("fcm", "localhost", "coalesced"): 1,
        ("fcm", "localhost", "rate-limited"): 1,
        ("", "localhost", "unknown-node"): 1,
        ("fcm", "localhost", "forbidden"): 1,
        ("fcm", "other.example", "unknown-node"): 1,
    }
    upserts = [q for q in queries.captured_queries if "relay_publishtally" in q["sql"]]
    assert len(upserts) == 1
    row = PublishTally.objects.first()
    assert (row.tenant_id, row.app_id) == (component.tenant_id, component.app_id)
    assert row.minute.second == 0 and row.minute.microsecond == 0

    # A second batch in the same minute adds to the same rows.
    with relay_settings(COALESCE_SECONDS=0):
        accept_publishes([_publish(component, None), _publish(component, None)])
    assert tally()[("", "localhost", "unknown-node")] == 3


def test_tallies_are_summed_in_memory_and_written_once_per_interval(component, send_queue):
    """At an everyday rate every gateway batch is one publish: its tally waits for the
    interval, and one statement writes what the batches summed meanwhile."""
    register(component, "tok-1")
    registration = Registration.objects.get()
    tallies.flush()
    with relay_settings(TALLY_FLUSH_SECONDS=3600, COALESCE_SECONDS=0):
        with CaptureQueriesContext(connection) as queries:
            for _ in range(3):
                accept_publishes([_publish(component, registration)])
            accept_publishes([_publish(component, None)])
        assert not [q for q in queries.captured_queries if "relay_publishtally" in q["sql"]]
        assert tally() == {}
        assert tallies.pending() == 4
        with CaptureQueriesContext(connection) as queries:
            tallies.flush()
    assert len([q for q in queries.captured_queries if "relay_publishtally" in q["sql"]]) == 1
    assert tally() == {("fcm", "localhost", "accepted"): 3, ("", "localhost", "unknown-node"): 1}
    assert tallies.pending() == 0


def test_tallies_the_database_refused_are_written_with_the_next_flush(component, monkeypatch):
    register(component, "tok-1")
    registration = Registration.objects.get()
    real_write = tallies._write
    tallies.flush()

    def database_down(counts: object) -> None:
        raise OperationalError("the database is restarting")

    with relay_settings(TALLY_FLUSH_SECONDS=3600):
        accept_publishes([_publish(component, registration)])
        monkeypatch.setattr(tallies, "_write", database_down)
        tallies.flush()
        assert tallies.pending() == 1
        monkeypatch.setattr(tallies, "_write", real_write)
        accept_publishes([_publish(component, None)])
        tallies.flush()
    assert tally() == {("fcm", "localhost", "accepted"): 1, ("", "localhost", "unknown-node"): 1}


def test_tallies_go_to_the_publish_minute(component):
    when = datetime(2030, 5, 1, 10, 59, 59, 999000, tzinfo=UTC)
    register(component, "tok-1")
    registration = Registration.objects.get()
    publishes = [
        _publish(component, registration, received=when),
        _publish(component, registration, received=when + timedelta(milliseconds=2)),
    ]
    tallies.record_verdicts(
        publishes, {(component.pk, registration.node): registration}, [Verdict.ACCEPTED] * 2
    )
    minutes = dict(PublishTally.objects.values_list("minute", "count"))
    assert minutes == {
        datetime(2030, 5, 1, 10, 59, tzinfo=UTC): 1,
        datetime(2030, 5, 1, 11, 0, tzinfo=UTC): 1,
    }


# --- retention ----------------------------------------------------------------------------------


def _delivery(component, received: datetime) -> Delivery:
    return Delivery(
        tenant=component.tenant,
        app=component.app,
        provider="fcm",
        publishing_domain="localhost",
        priority="high",
        received=received,
        queued=received,
        outcome="delivered",
    )


def _unifiedpush_delivery(component, received: datetime) -> UnifiedPushDelivery:
    return UnifiedPushDelivery(
        tenant=component.tenant,
        component=component,
        outcome="delivered",
        urgency=2,
        received=received,
        finished=received,
        size=10,
        ttl=60,
    )


def test_prune_deletes_only_what_is_older_than_the_retention(component, capsys):
    now = timezone.now()
    old, recent = now - timedelta(days=40), now - timedelta(days=10)
    Delivery.objects.bulk_create(
        [_delivery(component, old if n % 2 else recent) for n in range(25)]
    )
    UnifiedPushDelivery.objects.bulk_create(
        [_unifiedpush_delivery(component, old if n % 3 else recent) for n in range(9)]
    )
    common = {"tenant": component.tenant, "app": component.app, "provider": "fcm"}
    RegistrationEvent.objects.bulk_create(
        [
            RegistrationEvent(at=at, registration_id=1, kind="created", live_change=1, **common)
            for at in (old, recent)
        ]
    )
    PublishTally.objects.bulk_create(
        [
            PublishTally(minute=at, publishing_domain="x", verdict="accepted", count=1, **common)
            for at in (old, recent)
        ]
    )
    steps: list[retention.Progress] = []
    pruned = retention.prune(days=30, batch_size=4, progress=steps.append)
    assert pruned == {
        "relay_delivery": 12,
        "relay_registrationevent": 1,
        "relay_publishtally": 1,
        "relay_unifiedpushdelivery": 6,
        "operators_auditentry": 0,  # the audit trail is pruned too; nothing of it is old here
    }
    assert not Delivery.objects.filter(received__lt=now - timedelta(days=30)).exists()
    assert Delivery.objects.count() == 13
    assert list(UnifiedPushDelivery.objects.values_list("received", flat=True)) == [recent] * 3
    assert RegistrationEvent.objects.get().at == recent
    assert PublishTally.objects.get().minute == recent
    # Small batches, each reported: 23 ids in ranges of 4.
    delivery_steps = [s for s in steps if s.table == "relay_delivery"]
    assert len(delivery_steps) == 6 and delivery_steps[-1].done_ids == delivery_steps[-1].total_ids

    with relay_settings(RETENTION_DAYS=5):
        call_command("prune_records", batch_size=100)
    out = capsys.readouterr().out
    assert "relay_delivery: 13 row(s) pruned" in out
    assert "relay_unifiedpushdelivery: 3 row(s) pruned" in out
    assert Delivery.objects.count() == 0 and not UnifiedPushDelivery.objects.exists()


def test_prune_records_how_far_it_went_and_never_moves_the_cut_back(component):
    """The reports keep every day before the cut (tests/test_analytics.py): it is where the
    deletion went, per table, and only a table that lost rows has one."""
    now = timezone.now()

    def cuts() -> dict[str, datetime]:
        return {cut.table_name: cut.pruned_before for cut in RetentionCut.objects.all()}

    Delivery.objects.bulk_create([_delivery(component, now - timedelta(days=40))])
    retention.prune(days=30, now=now)
    assert cuts() == {"relay_delivery": now - timedelta(days=30)}
    # UnifiedPush's delivery records (a feature app's, registered with the retention) too.
    UnifiedPushDelivery.objects.bulk_create(
        [_unifiedpush_delivery(component, now - timedelta(days=40))]
    )
    assert retention.prune(days=30, now=now)["relay_unifiedpushdelivery"] == 1
    assert cuts() == {
        "relay_delivery": now - timedelta(days=30),
        "relay_unifiedpushdelivery": now - timedelta(days=30),
    }
    RetentionCut.objects.filter(table_name="relay_unifiedpushdelivery").delete()
    Delivery.objects.bulk_create([_delivery(component, now - timedelta(days=20))])
    retention.prune(days=10, now=now)
    assert cuts() == {"relay_delivery": now - timedelta(days=10)}
    # A longer retention later deletes what is older still; the cut stays where it was.
    Delivery.objects.bulk_create([_delivery(component, now - timedelta(days=200))])
    assert retention.prune(days=100, now=now)["relay_delivery"] == 1
    assert cuts() == {"relay_delivery": now - timedelta(days=10)}


def test_prune_records_names_every_record_it_prunes():
    """--help and RELAY_RETENTION_DAYS's description name each table `prune` deletes from."""
    from relay.environment import declared
    from relay.management.commands.prune_records import Command

    named = {  # in --help, in the setting's description
        "relay_delivery": ("delivery records", "deliveries"),
        "relay_unifiedpushdelivery": ("UnifiedPush delivery records", "UnifiedPush deliveries"),
        "relay_registrationevent": ("registration events", "registration events"),
        "relay_publishtally": ("publish tallies", "publish tallies"),
        "operators_auditentry": ("audit entries", "audit entries"),
    }
    assert {model._meta.db_table for model, _ in retention.PRUNED} == set(named)
    help_text = " ".join(Command.help.split())
    [setting] = [info for _, env, info in declared() if env == "RELAY_RETENTION_DAYS"]
    for in_help, in_setting in named.values():
        assert in_help in help_text and in_setting in (setting.description or ""), in_help


def test_retention_zero_keeps_everything(component):
    Delivery.objects.bulk_create([_delivery(component, timezone.now() - timedelta(days=999))])
    assert retention.prune(days=0) == {}
    assert Delivery.objects.count() == 1


def test_tenant_deletion_takes_its_records_but_the_lifecycle_log_keeps_the_removals(component):
    register(component, "tok-1")
    PublishTally.objects.create(
        minute=timezone.now().replace(second=0, microsecond=0),
        tenant=component.tenant,
        app=component.app,
        provider="fcm",
        publishing_domain="localhost",
        verdict="accepted",
        count=1,
    )
    component.delete()  # components protect their app; the registration goes with it
    Tenant.objects.all().delete()
    assert not PublishTally.objects.exists() and not Registration.objects.exists()
    # Ids only (no token, JID or name): the past days' live counts stay right.
    assert [(kind, change) for kind, _, change in events()] == [("created", 1), ("removed", -1)]


def test_beat_runs_the_reports_once_a_replica_is_set_and_always_prunes():
    import subprocess
    import sys

    from tests.analytics_data import ROOT

    def schedule(**env: str) -> str:
        code = "from django.conf import settings; print(sorted(settings.CELERY_BEAT_SCHEDULE))"
        environ = {
            k: v
            for k, v in __import__("os").environ.items()
            if k not in ("ANALYTICS_DATABASE_URL", "RELAY_REPORTS_AT")
        }
        return subprocess.run(
            [sys.executable, "-c", f"import django; django.setup(); {code}"],
            cwd=ROOT,
            env={**environ, "DJANGO_SETTINGS_MODULE": "pushsite.settings", **env},
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout

    assert "'prune-records'" in schedule() and "'daily-reports'" not in schedule()
    assert "'daily-reports'" in schedule(ANALYTICS_DATABASE_URL="postgres://r@replica/push")
    assert "'daily-reports'" in schedule(RELAY_REPORTS_AT="04:15")


def test_prune_task_applies_the_retention(component):
    from relay import tasks

    Delivery.objects.bulk_create([_delivery(component, timezone.now() - timedelta(days=999))])
    with relay_settings(RETENTION_DAYS=30):
        assert tasks.prune_records() == 1
    assert Delivery.objects.count() == 0
