"""Settings from the environment: production refuses defaults and passes the deploy check."""

from __future__ import annotations

import base64
import os
import subprocess
import sys

import pytest
from cryptography.fernet import Fernet

from tests.support.processes import ROOT

pytestmark = pytest.mark.defaults


def manage(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "CELERY_BROKER_URL"}}
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def production_env(tmp_path) -> dict[str, str]:
    return {
        "DEPLOYMENT": "production",
        "SECRET_KEY": "x" * 64 + "-not-a-default-key-" + "y" * 20,
        "ALLOWED_HOSTS": "push.example.org",
        "CREDENTIAL_KEYS": Fernet.generate_key().decode(),
        "UNIFIEDPUSH_KEYS": base64.urlsafe_b64encode(os.urandom(32)).decode(),
        "VAR_DIR": str(tmp_path),
    }


def test_production_settings_pass_the_deploy_check(tmp_path):
    result = manage("check", "--deploy", "--fail-level", "WARNING", env=production_env(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


@pytest.mark.parametrize(
    "missing", ["SECRET_KEY", "CREDENTIAL_KEYS", "ALLOWED_HOSTS", "UNIFIEDPUSH_KEYS"]
)
def test_production_refuses_to_start_without_its_secrets(tmp_path, missing):
    env = production_env(tmp_path)
    del env[missing]
    result = manage("check", env=env)
    assert result.returncode != 0
    assert f"{missing} must be set" in result.stderr
    assert not (tmp_path / "secret_key").exists()


def test_embedded_defaults_need_no_server(tmp_path):
    result = manage(
        "shell",
        "-c",
        "from django.conf import settings; "
        "print(settings.DATABASES['default']['ENGINE']); print(settings.CELERY_BROKER_URL); "
        "print(settings.DEBUG)",
        env={"VAR_DIR": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr
    engine, broker, debug = result.stdout.split()[-3:]
    assert engine == "django.db.backends.sqlite3"
    assert broker == f"sqlrelay+sqlite:///{tmp_path}/relay-broker.sqlite3"
    assert debug == "False"
    assert (tmp_path / "secret_key").stat().st_mode & 0o077 == 0


def test_probes_answer_plain_http_in_production_and_everything_else_redirects(tmp_path):
    """Load balancers probe /healthz and /readyz over plain HTTP: a 301 to https fails them."""
    script = (
        "from django.test import Client; c = Client(HTTP_HOST='push.example.org'); "
        "print(c.get('/healthz').status_code, c.get('/readyz').status_code, "
        "c.get('/metrics').status_code, "
        "c.get('/admin/').status_code, c.get('/healthz', secure=True).status_code)"
    )
    result = manage("shell", "--no-imports", "-c", script, env=production_env(tmp_path))
    assert result.returncode == 0, result.stderr
    healthz, readyz, metrics, admin, secure_healthz = result.stdout.split()[-5:]
    assert healthz == "200"
    assert readyz in ("200", "503")  # the probe's own answer, not a redirect
    assert metrics == "200"  # Prometheus scrapes over plain HTTP too
    assert admin == "301"
    assert secure_healthz == "200"
