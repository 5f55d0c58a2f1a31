"""The typed settings object and the system checks of rules that span several settings."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pydantic
import pytest
from django.conf import settings
from django.core.checks import run_checks
from django.test import override_settings

from relay import conf
from relay.checks import broker_check, retry_window_check, state_store_check, web_check
from relay.environment import Environment
from tests.support.processes import ROOT

pytestmark = pytest.mark.defaults


def relay_settings(**changes: object) -> override_settings:
    return override_settings(RELAY={**settings.RELAY, **changes})


def closed_port() -> int:
    """A local TCP port nothing listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# --- the typed object --------------------------------------------------------------------------


def test_the_object_types_what_settings_py_built():
    current = conf.current()
    assert current.send_retry_max_seconds == float(settings.RELAY["SEND_RETRY_MAX_SECONDS"])
    assert current.state_url == settings.RELAY["STATE_URL"]
    assert current.credential_keys == tuple(settings.RELAY["CREDENTIAL_KEYS"])
    assert current.uwpx_rate_limit_address == tuple(settings.RELAY["UWPX_RATE_LIMIT_ADDRESS"])
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        current.send_max_attempts = 1  # type: ignore[misc]


def test_a_changed_setting_is_seen_and_its_end_too():
    before = conf.current().coalesce_seconds
    with relay_settings(COALESCE_SECONDS=before + 7):
        assert conf.current().coalesce_seconds == before + 7
    assert conf.current().coalesce_seconds == before


def test_a_setting_missing_from_relay_takes_its_one_declared_default():
    relay = {key: value for key, value in settings.RELAY.items() if key != "BREAKER_STALLS"}
    declared = Environment.model_fields["breaker_stalls"].default
    with override_settings(RELAY={**relay}):
        assert conf.current().breaker_stalls == declared == 3


def test_a_malformed_value_is_refused_with_its_name():
    with relay_settings(BREAKER_STALLS="three"), pytest.raises(pydantic.ValidationError) as refused:
        conf.current()
    assert "breaker_stalls" in str(refused.value)


# --- the broker's visibility timeout against the longest retry delay --------------------------


def visibility(seconds: float | None, **changes: object) -> set[str]:
    broker = "amqp://nowhere//" if seconds is None else "sqlrelay+sqlite:///nowhere.sqlite3"
    with relay_settings(
        CELERY_BROKER_URL=broker, CELERY_VISIBILITY_TIMEOUT=seconds or 1, **changes
    ):
        return {message.id for message in retry_window_check()}


def test_the_defaults_leave_room_for_the_longest_retry():
    assert {message.id for message in retry_window_check()} == set()
    assert visibility(3600, SEND_RETRY_MAX_SECONDS=300.0) == set()


def test_a_visibility_timeout_within_the_longest_retry_is_an_error():
    assert visibility(300, SEND_RETRY_MAX_SECONDS=300.0) == {"relay.E104"}
    assert visibility(60, SEND_RETRY_MAX_SECONDS=30.0, COALESCE_SECONDS=120.0) == {"relay.E104"}


def test_a_broker_without_a_visibility_timeout_is_not_checked():
    assert visibility(None, SEND_RETRY_MAX_SECONDS=100_000.0) == set()


def test_the_settings_file_has_the_check_run_on_the_real_environment(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "CELERY_BROKER_URL"}}
    env.update(
        VAR_DIR=str(tmp_path),
        CELERY_BROKER_URL=f"sqlrelay+sqlite:///{tmp_path}/broker.sqlite3",
        CELERY_VISIBILITY_TIMEOUT="120",
        RELAY_SEND_RETRY_MAX_SECONDS="300",
    )
    result = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "relay.E104" in result.stderr


# --- the state store answers at start ---------------------------------------------------------


def store_ids(url: str) -> set[str]:
    with relay_settings(STATE_URL=url):
        return {message.id for message in state_store_check(databases=["default"])}


def test_the_configured_store_answers():
    assert store_ids(settings.RELAY["STATE_URL"]) == set()


def test_a_sqlite_store_in_a_writable_folder_answers(tmp_path):
    assert store_ids(f"sqlite:///{tmp_path / 'state.sqlite3'}") == set()


def test_a_store_that_does_not_answer_is_an_error(tmp_path):
    assert store_ids(f"redis://127.0.0.1:{closed_port()}/0") == {"relay.E106"}
    assert store_ids(f"sqlite:///{tmp_path / 'missing' / 'state.sqlite3'}") == {"relay.E106"}


def test_a_store_url_no_store_understands_is_an_error():
    assert store_ids("memcached://127.0.0.1:11211") == {"relay.E105"}


@pytest.mark.django_db
def test_the_store_is_asked_only_when_databases_are_checked():
    with relay_settings(STATE_URL=f"redis://127.0.0.1:{closed_port()}/0"):
        assert {m.id for m in run_checks(tags=["relay"])} & {"relay.E106"} == set()
        with_database = {m.id for m in run_checks(tags=["relay"], databases=["default"])}
    assert "relay.E106" in with_database


def test_the_defaults_pass_the_web_process_check():
    assert web_check() == []


@pytest.mark.parametrize(
    ("changes", "code"),
    [
        ({"WEB_BIND": "port-8000"}, "relay.E130"),
        ({"WEB_BIND": "127.0.0.1:99999"}, "relay.E130"),
        ({"WEB_WORKERS": 0}, "relay.E131"),
        ({"WEB_MAX_CONNECTIONS": 0}, "relay.E131"),
        ({"WEB_MAX_HEADERS": 5}, "relay.E132"),
        ({"WEB_MAX_REQUEST_LINE": 20000}, "relay.E132"),  # beyond the head's bytes
        ({"WEB_MAX_BODY_BYTES": 4096}, "relay.E132"),
        ({"WEB_FLUSH_SECONDS": 0}, "relay.E133"),
    ],
)
def test_a_web_setting_that_cannot_work_is_an_error(changes, code):
    with relay_settings(**changes):
        assert [message.id for message in web_check()] == [code]


def test_a_redis_broker_is_refused_with_the_way_out():
    with relay_settings(CELERY_BROKER_URL="redis://127.0.0.1:6379/0"):
        [message] = broker_check()
    assert message.id == "relay.E140" and "drain_redis_broker" in (message.hint or "")
    with relay_settings(CELERY_BROKER_URL="amqp://guest:guest@127.0.0.1:5672//"):
        assert broker_check() == []


def test_no_declared_setting_is_read_from_the_raw_environment():
    """Declared settings are read through relay.conf.current(): a module that reads one from
    os.environ misses its type, its default and a test's override_settings. Only
    relay/environment.py (the declarations) and pushsite/settings.py (which builds them) read
    the environment."""
    import re

    from relay.environment import declared

    names = {env for _, env, _ in declared()}
    raw = re.compile(
        r"(?:os\.environ\.get|os\.getenv|os\.environ\.setdefault)\(\s*[\"']([A-Z][A-Z0-9_]*)[\"']"
        r"|os\.environ\[\s*[\"']([A-Z][A-Z0-9_]*)[\"']\s*\]"
        r"|[\"']([A-Z][A-Z0-9_]*)[\"']\s+in\s+os\.environ"
    )
    allowed = {ROOT / "relay" / "environment.py", ROOT / "pushsite" / "settings.py"}
    found = []
    for package in ("pushsite", "relay", "xmppgateway"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path in allowed:
                continue
            for match in raw.finditer(path.read_text()):
                name = next(group for group in match.groups() if group)
                if name in names:
                    found.append(f"{path.relative_to(ROOT)}: {name}")
    assert found == []
