"""The Windows API's round trips: the app kept per process and checked by the actions' own
first statement, and a dead kept database connection replaced without Django's `SELECT 1`."""

from __future__ import annotations

import threading
import time
import uuid

import psycopg
import pytest
from django.db import OperationalError, close_old_connections, connection

from relay.models import App, Registration, Tenant
from relay.windows import services as uwpx
from relay.windows.models import WnsDevice
from relay.windows.services import AccountRef, ErrorKind, UwpxError, batch, identifiers, sql
from tests.support.provider_fakes import change_credentials

DEVICE_ID = "5486bd868050a620141f4e81c9f1d2c67ab0de27e5e26d218ca41c9394ee806b"
CHANNEL = "https://db5p.notify.windows.com/?token=AwYAAAD8sXKQxmVlUmNhQ%2bjNMKn6"
ACCOUNTS = [AccountRef(bare_jid="romeo@example.org"), AccountRef(bare_jid="juliet@example.net")]


@pytest.fixture(autouse=True)
def own_rate_limit_counters(settings):
    settings.CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.locmem.LocMemCache",
            "LOCATION": f"uwpx-rt-{uuid.uuid4()}",
        }
    }


@pytest.fixture
def app(component) -> App:
    return component.app


@pytest.fixture
def statements(monkeypatch) -> list[str]:
    """Every statement the actions send through the package's `sql.fetchall`."""
    sent: list[str] = []
    real = sql.fetchall

    def counting(sql, params):
        sent.append(sql)
        return real(sql, params)

    monkeypatch.setattr(sql, "fetchall", counting)
    return sent


@pytest.mark.defaults
@pytest.mark.django_db
def test_a_known_app_costs_no_statement_and_a_new_device_is_one(app, statements):
    uwpx.app_for_key(public_key=app.public_key)  # the first request reads it
    statements.clear()
    kept = uwpx.app_for_key(public_key=app.public_key)
    uwpx.set_channel_uri(app=kept, device_id=DEVICE_ID, channel_uri=CHANNEL)
    assert len(statements) == 1 and statements[0].startswith("INSERT")
    assert WnsDevice.objects.filter(app=app).count() == 1


@pytest.mark.defaults
@pytest.mark.django_db
def test_a_suspension_counts_from_the_next_request_on(app):
    kept = uwpx.app_for_key(public_key=app.public_key)
    uwpx.set_channel_uri(app=kept, device_id=DEVICE_ID, channel_uri=CHANNEL)
    Tenant.objects.filter(pk=app.tenant_id).update(suspended=True)
    kept = uwpx.app_for_key(public_key=app.public_key)
    for call in (
        lambda: uwpx.set_channel_uri(app=kept, device_id=DEVICE_ID, channel_uri=CHANNEL),
        lambda: uwpx.set_channel_uri(app=kept, device_id="ab" * 32, channel_uri=CHANNEL),
        lambda: uwpx.set_accounts(app=kept, device_id=DEVICE_ID, accounts=ACCOUNTS),
        lambda: uwpx.request_test_push(app=kept, device_id=DEVICE_ID),
    ):
        with pytest.raises(UwpxError) as refused:
            call()
        assert refused.value.kind is ErrorKind.UNAVAILABLE
        assert "suspended" in refused.value.message
    assert not Registration.objects.exists()
    assert WnsDevice.objects.count() == 1


@pytest.mark.defaults
@pytest.mark.django_db
def test_a_removed_app_is_unknown_at_once(app):
    kept = uwpx.app_for_key(public_key=app.public_key)
    app.components.all().delete()
    App.objects.filter(pk=app.pk).delete()
    with pytest.raises(UwpxError) as refused:
        uwpx.set_channel_uri(app=kept, device_id=DEVICE_ID, channel_uri=CHANNEL)
    assert refused.value.kind is ErrorKind.UNKNOWN_APP
    with pytest.raises(UwpxError) as refused:
        uwpx.app_for_key(public_key=app.public_key)
    assert refused.value.kind is ErrorKind.UNKNOWN_APP


@pytest.mark.defaults
@pytest.mark.django_db
def test_narrowed_channel_hosts_refuse_a_channel_the_kept_app_allowed(app):
    kept = uwpx.app_for_key(public_key=app.public_key)
    uwpx.set_channel_uri(app=kept, device_id=DEVICE_ID, channel_uri=CHANNEL)
    change_credentials(app, "wns", channel_hosts="*.example.org")
    with pytest.raises(UwpxError) as refused:
        uwpx.set_channel_uri(app=kept, device_id="ab" * 32, channel_uri=CHANNEL)
    assert refused.value.kind is ErrorKind.INVALID
    with pytest.raises(UwpxError) as refused:
        uwpx.set_accounts(app=kept, device_id=DEVICE_ID, accounts=ACCOUNTS)
    assert refused.value.kind is ErrorKind.CONFLICT
    assert WnsDevice.objects.count() == 1
    assert not Registration.objects.exists()


# --- a dead kept connection ---------------------------------------------------------------------


def _kill_backend() -> int:
    """Terminate this thread's database session from another one, as a server restart or a
    dropped proxy connection would; its pid."""
    connection.ensure_connection()
    pid = connection.connection.info.backend_pid
    params = connection.settings_dict
    with psycopg.connect(
        dbname=params["NAME"],
        user=params["USER"],
        password=params["PASSWORD"],
        host=params["HOST"],
        port=params["PORT"],
        autocommit=True,
    ) as other:
        other.execute("SELECT pg_terminate_backend(%s)", [pid])
    return pid


def _next_request() -> None:
    """What Django does between requests: the kept connection is due for its health check."""
    close_old_connections()
    assert connection.connection is not None and not connection.health_check_done


@pytest.fixture
def no_health_check(monkeypatch):
    def refused():
        raise AssertionError("a SELECT 1 health check was sent")

    monkeypatch.setattr(connection, "is_usable", refused)


@pytest.mark.django_db(transaction=True)
def test_a_request_sends_no_health_check_of_its_own(app, no_health_check):
    if connection.vendor != "postgresql":
        pytest.skip("health checks are PostgreSQL's")
    kept = uwpx.app_for_key(public_key=app.public_key)
    uwpx.set_channel_uri(app=kept, device_id=DEVICE_ID, channel_uri=CHANNEL)
    _next_request()
    uwpx.set_accounts(app=kept, device_id=DEVICE_ID, accounts=ACCOUNTS)
    _next_request()
    uwpx.set_channel_uri(app=kept, device_id=DEVICE_ID, channel_uri=CHANNEL + "x")
    assert Registration.objects.filter(token=CHANNEL + "x").count() == 2


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("action", ["set_channel_uri", "set_accounts", "new_device"])
def test_a_dead_kept_connection_is_replaced_and_not_surfaced(app, action, no_health_check):
    if connection.vendor != "postgresql":
        pytest.skip("a PostgreSQL session to terminate")
    kept = uwpx.app_for_key(public_key=app.public_key)
    uwpx.set_channel_uri(app=kept, device_id=DEVICE_ID, channel_uri=CHANNEL)
    _next_request()
    dead = _kill_backend()
    if action == "set_channel_uri":
        uwpx.set_channel_uri(app=kept, device_id=DEVICE_ID, channel_uri=CHANNEL + "x")
        assert WnsDevice.objects.get().channel_uri == CHANNEL + "x"
    elif action == "new_device":
        uwpx.set_channel_uri(app=kept, device_id="ab" * 32, channel_uri=CHANNEL)
        assert WnsDevice.objects.count() == 2
    else:
        answer = uwpx.set_accounts(app=kept, device_id=DEVICE_ID, accounts=ACCOUNTS)
        assert len(answer.accounts) == 2
        assert Registration.objects.count() == 2
    assert connection.connection.info.backend_pid != dead


@pytest.mark.django_db(transaction=True)
def test_a_connection_dying_again_is_surfaced_after_one_retry(app, monkeypatch):
    """One retry, only for the kept connection's first use: a database that keeps failing
    is the client's 'try again later', not a loop."""
    if connection.vendor != "postgresql":
        pytest.skip("a PostgreSQL session to terminate")
    kept = uwpx.app_for_key(public_key=app.public_key)
    uwpx.set_channel_uri(app=kept, device_id=DEVICE_ID, channel_uri=CHANNEL)
    _next_request()
    runs = []
    real = sql.fetchall

    def dying(sql, params):
        runs.append(sql)
        _kill_backend()
        return real(sql, params)

    monkeypatch.setattr(sql, "fetchall", dying)
    with pytest.raises(OperationalError):
        uwpx.set_channel_uri(app=kept, device_id="ab" * 32, channel_uri=CHANNEL)
    assert len(runs) == 2
    connection.close()
    runs.clear()
    with pytest.raises(OperationalError):  # a fresh connection: no retry at all
        uwpx.set_channel_uri(app=kept, device_id="ab" * 32, channel_uri=CHANNEL)
    assert len(runs) == 1
    connection.close()  # the test's teardown needs a live one


# --- group commit -------------------------------------------------------------------------------


def _device_id(index: int) -> str:
    return f"{index:064x}"


def _accounts(index: int) -> list[AccountRef]:
    return [AccountRef(bare_jid=f"user{index}-{n}@example.org") for n in range(2)]


def _in_threads(count: int, work) -> list:
    """`work(index)` in `count` threads at once, each on its own database connection."""
    start = threading.Barrier(count)
    results: list = [None] * count

    def run(index: int) -> None:
        try:
            start.wait()
            results[index] = work(index)
        except BaseException as error:  # the test reports it
            results[index] = error
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(n,)) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return results


def _visible_elsewhere(sql: str, params: list) -> int:
    """A count read on a connection of its own: only what is committed."""
    settings = connection.settings_dict
    with psycopg.connect(
        dbname=settings["NAME"],
        user=settings["USER"],
        password=settings["PASSWORD"],
        host=settings["HOST"],
        port=settings["PORT"],
    ) as other:
        return int(other.execute(sql, params).fetchone()[0])


@pytest.fixture
def slow_first_batch(monkeypatch):
    """The first batch of each group takes a while, so the other threads queue behind it and
    the next batch holds them all; records each batch's size."""
    batches: dict[str, list[int]] = {}
    for name in ("channel_group", "accounts_group"):
        group = getattr(batch, name)
        real = group._write
        log = batches.setdefault(name, [])

        def write(items, real=real, log=log):
            if not log:
                time.sleep(0.5)
            result = real(items)
            log.append(len(items))
            return result

        monkeypatch.setattr(group, "_write", write)
    return batches


@pytest.mark.django_db(transaction=True)
def test_concurrent_registrations_share_a_commit_and_each_is_answered_after_it(
    app, slow_first_batch
):
    if connection.vendor != "postgresql":
        pytest.skip("batches are PostgreSQL's")
    kept = uwpx.app_for_key(public_key=app.public_key)
    count = 8

    def register(index: int) -> tuple[int, int, uwpx.AccountsAnswer]:
        device_id = _device_id(index)
        uwpx.set_channel_uri(app=kept, device_id=device_id, channel_uri=f"{CHANNEL}{index}")
        devices = _visible_elsewhere(
            "SELECT count(*) FROM relay_wnsdevice WHERE device_id_hash = %s",
            [uwpx.device_id_hash(device_id)],
        )
        answer = uwpx.set_accounts(app=kept, device_id=device_id, accounts=_accounts(index))
        registrations = _visible_elsewhere(
            "SELECT count(*) FROM relay_registration r JOIN windows_wnsaccount a"
            " ON a.registration_id = r.id JOIN relay_wnsdevice d ON d.id = a.device_id"
            " WHERE d.device_id_hash = %s",
            [uwpx.device_id_hash(device_id)],
        )
        return (devices, registrations, answer)

    results = _in_threads(count, register)
    for result in results:
        assert not isinstance(result, BaseException), result
    channel_batches = slow_first_batch["channel_group"]
    accounts_batches = slow_first_batch["accounts_group"]
    # All but the first thread waited behind the first batch, and went in one more.
    assert sum(channel_batches) == count
    assert sum(accounts_batches) == count
    assert max(channel_batches) > 1
    assert max(accounts_batches) > 1
    assert len(accounts_batches) < count
    for devices, registrations, answer in results:
        # Answered only once committed: another connection saw the rows as soon as answered.
        assert devices == 1 and registrations == 2
        assert len(answer.accounts) == 2 and all(a.node and a.secret for a in answer.accounts)
    assert Registration.objects.count() == 2 * count
    assert len({r.node for r in Registration.objects.all()}) == 2 * count
    # The lifecycle log has every creation, as the single path writes it.
    assert _visible_elsewhere("SELECT count(*) FROM relay_registrationevent", []) == 2 * count

    # Again, unchanged: renewed in batches, the same nodes and secrets answered.
    slow_first_batch["accounts_group"].clear()
    again = _in_threads(
        count,
        lambda index: uwpx.set_accounts(
            app=kept, device_id=_device_id(index), accounts=_accounts(index)
        ),
    )
    for index, answer in enumerate(again):
        assert not isinstance(answer, BaseException), answer
        first = results[index][2]
        assert [(a.node, a.secret) for a in answer.accounts] == [
            (a.node, a.secret) for a in first.accounts
        ]
    assert max(slow_first_batch["accounts_group"]) > 1
    assert Registration.objects.count() == 2 * count
    assert _visible_elsewhere("SELECT count(*) FROM relay_registrationevent", []) == 2 * count


@pytest.mark.django_db(transaction=True)
def test_a_batch_leaves_what_it_cannot_write_plainly_to_each_request_alone(app):
    """A removal, an unknown device, a taken account, an account claimed twice in the batch:
    None (the request's own transaction answers it, errors included); the rest is written."""
    if connection.vendor != "postgresql":
        pytest.skip("batches are PostgreSQL's")
    kept = uwpx.app_for_key(public_key=app.public_key)
    for index in range(4):
        uwpx.set_channel_uri(app=kept, device_id=_device_id(index), channel_uri=CHANNEL)
    uwpx.set_accounts(app=kept, device_id=_device_id(1), accounts=_accounts(1))

    def item(index: int, accounts: list[AccountRef]) -> batch.AccountsItem:
        device_id = _device_id(index)
        wanted = identifiers.resolve_accounts(device_id=device_id, accounts=accounts)
        return batch.AccountsItem(kept, uwpx.device_id_hash(device_id), wanted)

    claimed = uwpx.account_id(device_id=_device_id(1), bare_jid="user1-0@example.org")
    shared = uwpx.account_id(device_id=_device_id(9), bare_jid="shared@example.org")
    answers = batch.write_accounts(
        [
            item(0, _accounts(0)),  # plain: written
            item(1, _accounts(1)[:1]),  # removes an account
            item(5, _accounts(5)),  # unknown device
            item(2, [AccountRef(account_id=claimed)]),  # another device's account
            item(3, [AccountRef(account_id=shared)]),  # plain: written
            item(2, [AccountRef(account_id=shared)]),  # claimed earlier in the batch
        ]
    )
    assert [answer is not None for answer in answers] == [True, False, False, False, True, False]
    assert (
        Registration.objects.filter(
            wns_account__device__device_id_hash=uwpx.device_id_hash(_device_id(1))
        ).count()
        == 2
    )  # untouched by the batch
    # Each left-out request, on its own path, answers as the single path always did.
    with pytest.raises(UwpxError) as refused:
        uwpx.set_accounts(
            app=kept, device_id=_device_id(2), accounts=[AccountRef(account_id=shared)]
        )
    assert refused.value.kind is ErrorKind.CONFLICT
    with pytest.raises(UwpxError) as refused:
        uwpx.set_accounts(app=kept, device_id=_device_id(5), accounts=_accounts(5))
    assert refused.value.kind is ErrorKind.UNKNOWN_DEVICE
    assert (
        len(
            uwpx.set_accounts(app=kept, device_id=_device_id(1), accounts=_accounts(1)[:1]).accounts
        )
        == 1
    )
    assert Registration.objects.count() == 2 + 1 + 1


@pytest.mark.defaults
@pytest.mark.django_db
def test_a_database_error_on_a_live_kept_connection_is_raised_not_retried():
    """Only a connection that died is replaced: a locked SQLite file, a statement timeout or
    the like is the caller's error, once."""
    connection.ensure_connection()
    wrapper = connection
    enabled, done = wrapper.health_check_enabled, wrapper.health_check_done
    wrapper.health_check_enabled, wrapper.health_check_done = True, False
    runs = []

    def failing():
        runs.append(1)
        raise OperationalError("database is locked")

    try:
        with pytest.raises(OperationalError, match="locked"):
            sql.on_live_connection(failing)
    finally:
        wrapper.health_check_enabled, wrapper.health_check_done = enabled, done
    assert runs == [1]
