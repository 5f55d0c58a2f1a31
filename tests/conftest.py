"""Shared fixtures: a tenant with an app and a component, and a clean send queue."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def _static_root() -> None:
    """STATIC_ROOT exists, as after `collectstatic` (WhiteNoise warns about a missing one in
    every handler it is built into; `collected_static` fills it when a test needs files)."""
    from pathlib import Path

    from django.conf import settings

    Path(settings.STATIC_ROOT).mkdir(parents=True, exist_ok=True)


@pytest.fixture(scope="module", autouse=True)
def _collected_after_each_module():
    """What a module's tests left to the garbage collector (an unclosed socket, file or
    transport) is collected as its last test ends: the ResourceWarning, an error
    (pyproject.toml), then names that module, not whichever the collector happened to run in.
    Once per module: after every test it cost minutes of the suite."""
    import gc

    yield
    gc.collect()


@pytest.fixture
def component(db):
    from relay.models import App, Component, Tenant

    tenant = Tenant.objects.create(name="example")
    app = App.objects.create(tenant=tenant, name="conversations")
    return Component.objects.create(
        tenant=tenant, app=app, jid="push.localhost", secret="s3cr3t", host="127.0.0.1", port=5347
    )


@pytest.fixture
def send_queue():
    """The real broker's send queue, empty before and after the test."""
    from tests.support import broker

    broker.purge()
    yield broker
    broker.purge()


@pytest.fixture(scope="session")
def collected_static() -> str:
    """The static files collected where the web process serves them from (WhiteNoise reads
    them at its start); the path of a large one (jQuery, 280 KiB)."""
    from pathlib import Path

    from django.conf import settings
    from django.core.management import call_command

    if not (Path(settings.STATIC_ROOT) / "staticfiles.json").exists():
        call_command("collectstatic", interactive=False, verbosity=0)
    return "/static/admin/js/vendor/jquery/jquery.js"


@pytest.fixture
def push_client():
    """The UnifiedPush resource as the web server calls it (tests/support/push_client.py)."""
    from tests.support.push_client import PushClient

    return PushClient()


@pytest.fixture(autouse=True)
def _tallies_written_per_batch(settings):
    """Tests that publish in-process read the tallies at once; the gateway's default writes
    them once a second (tests/test_lifecycle.py tests that, with its own interval)."""
    settings.RELAY = {**settings.RELAY, "TALLY_FLUSH_SECONDS": 0}


pytest_plugins = [
    "tests.support.fixtures",
    "tests.support.shards",
    "tests.support.traces",
    "tests.support.fault_lab",
]
