"""Management commands: every argument is explained, and `replay_dead_letters` queues exactly the
dead letters its filters name, through the same replay the admin action uses."""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import uuid
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command, get_commands, load_command_class
from django.utils import timezone

from relay.models import DeadLetter, Service
from relay.services.queue import SendJob
from tests.support.admin import TenantWorld, build_tenant
from tests.support.ports import free_port
from tests.support.processes import ROOT, service_env, test_database_url

pytestmark = pytest.mark.defaults

# Every app of ours: the core, the feature apps inside relay/, the gateway.
OUR_APPS = {"relay", "relay.unifiedpush", "relay.windows", "xmppgateway"}


def test_every_argument_of_every_command_of_ours_has_help():
    commands = {name: app for name, app in get_commands().items() if app in OUR_APPS}
    assert {
        "load_tenants",
        "replay_dead_letters",
        "rotate_credentials",
        "run_gateway",
        "run_uwpx_listener",
    } <= set(commands)
    for name, app in sorted(commands.items()):
        command = load_command_class(app, name)
        assert command.help.strip(), name
        parser = command.create_parser("manage.py", name)
        unexplained = [
            action.option_strings[0] if action.option_strings else action.dest
            for action in parser._actions  # argparse keeps no public list of them
            if not action.help or action.help == argparse.SUPPRESS
        ]
        assert unexplained == [], f"{name}: {unexplained}"


# --- replay_dead_letters ------------------------------------------------------------------------


def add_letter(
    world: TenantWorld,
    *,
    provider: str = Service.FCM,
    reason: str = "exhausted: UNAVAILABLE",
    age: timedelta = timedelta(minutes=10),
    replayed: bool = False,
) -> DeadLetter:
    push_id = uuid.uuid4()
    letter = DeadLetter.objects.create(
        push_id=push_id,
        tenant=world.tenant,
        app=world.app,
        registration=world.registration,
        provider=provider,
        reason=reason,
        attempts=8,
        job=SendJob(
            push_id=str(push_id),
            registration_id=world.registration.pk,
            publishing_domain=f"{world.marker}.example",
            important=False,
            received=(timezone.now() - age).isoformat(),
        ).to_message(),
        replayed=timezone.now() if replayed else None,
    )
    # `created` is set on insert (auto_now_add): age it afterwards.
    DeadLetter.objects.filter(pk=letter.pk).update(created=timezone.now() - age)
    return letter


def replay(*args: str) -> str:
    out = io.StringIO()
    call_command("replay_dead_letters", *args, stdout=out)
    return out.getvalue()


def queued_push_ids(send_queue) -> list[str]:
    return [job["push_id"] for job in send_queue.queued_jobs()]


@pytest.fixture
def worlds(db):
    """Two tenants, each with the dead letter build_tenant makes (FCM, "<marker>-exhausted"),
    recorded an hour ago."""
    alpha, beta = build_tenant("alpha"), build_tenant("beta")
    DeadLetter.objects.update(created=timezone.now() - timedelta(hours=1))
    return alpha, beta


def test_filters_pick_exactly_the_matching_letters(worlds, send_queue):
    alpha, beta = worlds
    throttled = {"provider": Service.APNS, "reason": "too old: THROTTLED"}
    apns = add_letter(alpha, **throttled)
    old = add_letter(alpha, **throttled, age=timedelta(days=3))
    add_letter(alpha, **throttled, replayed=True)
    add_letter(beta, **throttled)

    output = replay("--tenant", "alpha", "--provider", "apns", "--reason", "THROTTLED",
                    "--since", "1d")  # fmt: skip
    assert output.strip().endswith("replayed 1 dead letter(s)")
    assert queued_push_ids(send_queue) == [str(apns.push_id)]
    assert set(DeadLetter.objects.filter(replayed__isnull=True).values_list("pk", flat=True)) == {
        alpha.dead_letter.pk,
        beta.dead_letter.pk,
        old.pk,
        DeadLetter.objects.get(tenant=beta.tenant, provider=Service.APNS).pk,
    }

    replay("--app", "beta-app")
    assert sorted(queued_push_ids(send_queue)) == sorted(
        str(letter.push_id) for letter in DeadLetter.objects.filter(tenant=beta.tenant)
    )
    # An absolute time works too; the letter from three days ago is the last one left.
    since = (timezone.now() - timedelta(days=4)).strftime("%Y-%m-%dT%H:%M")
    output = replay("--since", since, "--tenant", "alpha")
    assert output.strip().endswith("replayed 2 dead letter(s)")
    assert set(queued_push_ids(send_queue)) == {str(alpha.dead_letter.push_id), str(old.push_id)}
    assert not DeadLetter.objects.filter(replayed__isnull=True).exists()


def test_a_replayed_job_is_a_first_attempt_with_the_same_push_id(worlds, send_queue):
    alpha, _ = worlds
    replay("--tenant", "alpha")
    [job] = send_queue.queued_jobs()
    assert job["push_id"] == str(alpha.dead_letter.push_id)
    assert job["attempt"] == 1 and job["replayed"]
    assert replay("--tenant", "alpha").strip().endswith("replayed 0 dead letter(s)")
    assert send_queue.queued_jobs() == []


def test_limit_takes_the_oldest_and_progress_is_shown_per_batch(worlds, send_queue):
    alpha, _ = worlds
    letters = [add_letter(alpha, age=timedelta(minutes=minutes)) for minutes in (5, 4, 3, 2, 1)]
    output = replay("--tenant", "alpha", "--limit", "5", "--batch-size", "2")
    assert output.splitlines() == [
        "replayed 2 of 5",
        "replayed 4 of 5",
        "replayed 5 of 5",
        "replayed 5 dead letter(s)",
    ]
    expected = [alpha.dead_letter, *letters[:4]]
    assert queued_push_ids(send_queue) == [str(letter.push_id) for letter in expected]
    assert DeadLetter.objects.get(pk=letters[4].pk).replayed is None


def test_dry_run_counts_by_tenant_app_provider_and_reason_and_queues_nothing(worlds, send_queue):
    alpha, _ = worlds
    add_letter(alpha, provider=Service.APNS, reason="too old: THROTTLED")
    add_letter(alpha, provider=Service.APNS, reason="too old: THROTTLED")
    output = replay("--dry-run")
    assert output.splitlines() == [
        "       2  alpha/alpha-app apns too old: THROTTLED",
        "       1  alpha/alpha-app fcm alpha-exhausted",
        "       1  beta/beta-app fcm beta-exhausted",
        "dry run: 4 dead letter(s) would be replayed; none was",
    ]
    assert replay("--dry-run", "--limit", "1").splitlines()[-1].startswith("dry run: 1 dead")
    assert replay("--dry-run", "--tenant", "nobody").strip() == (
        "dry run: no dead letter matches; none would be replayed"
    )
    assert send_queue.queued_jobs() == []
    assert not DeadLetter.objects.filter(replayed__isnull=False).exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--since", "last tuesday"], "expected an ISO date or time"),
        (["--provider", "sms"], "invalid choice: 'sms'"),
        (["--limit", "0"], "expected a whole number of at least 1"),
    ],
)
def test_bad_arguments_are_refused_clearly(db, args, message):
    with pytest.raises(CommandError) as caught:
        replay(*args)
    assert message in str(caught.value)


@pytest.mark.django_db(transaction=True)
def test_an_unreachable_broker_fails_the_command_and_keeps_the_letter_pending():
    """Run as its own process (the real command line) with a broker nobody listens on."""
    world = build_tenant("down")
    closed = free_port()
    broker = (
        f"amqp://guest:guest@127.0.0.1:{closed}//"
        if "amqp" in service_env().get("CELERY_BROKER_URL", "")
        else f"sqlrelay+sqlite:///{ROOT}/var/missing-folder-{closed}/broker.sqlite3"
    )
    result = subprocess.run(
        [sys.executable, "manage.py", "replay_dead_letters"],
        cwd=ROOT,
        env=service_env(DATABASE_URL=test_database_url(), CELERY_BROKER_URL=broker),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "the queue is unavailable: 0 of 1 dead letter(s) were replayed" in result.stderr
    world.dead_letter.refresh_from_db()
    assert world.dead_letter.replayed is None  # the claim was rolled back: replayable again
