"""The Prometheus alert rules (deploy/prometheus/): valid for promtool, each alert shown firing by
a unit test with input series, and every relay metric they read one that relay/metrics.py
defines (a renamed metric would leave an alert that never fires)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from relay import features, metrics

RULES_DIR = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"
RULES = RULES_DIR / "push-relay.rules.yml"
RULE_TESTS = RULES_DIR / "push-relay.rules.test.yml"
RELAY_NAME = re.compile(r"\brelay_[a-z0-9_]+")


def promtool() -> str:
    """promtool (Debian package `prometheus`, in the Makefile's SYSTEM_PACKAGES). Missing, the
    test fails: the rules would go untested."""
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool not found: apt-get install prometheus (make system-deps)")
    return found


def rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_promtool_accepts_the_rules():
    done = subprocess.run(
        [promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules())} rules found" in done.stdout


def test_promtool_unit_tests_pass():
    done = subprocess.run(
        [promtool(), "test", "rules", RULE_TESTS.name],
        cwd=RULES_DIR,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_every_alert_is_shown_firing_and_quiet_by_a_unit_test():
    alerts = {rule["alert"] for rule in rules()}
    fired: set[str] = set()
    quiet: set[str] = set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for check in case["alert_rule_test"]:
            (fired if check.get("exp_alerts") else quiet).add(check["alertname"])
    assert fired == alerts
    # Quiet at some time (healthy series, or not yet for long enough) for all but the alerts
    # that fire at once on what they see.
    assert alerts - quiet <= {"RelayCredentialExpiresSoon", "RelayCredentialExpiring"}


def defined_series() -> set[str]:
    """The series names our processes export: a counter's `_total`, a histogram's `_bucket`,
    `_sum` and `_count`, a gauge's own name, and the gauges read at scrape time."""
    names: set[str] = set(metrics.STATE_GAUGES) | features.state_gauge_names()
    for collector in vars(metrics).values():
        if not isinstance(collector, MetricWrapperBase):
            continue
        name = collector._name  # type: ignore[attr-defined]
        kind = collector._type  # type: ignore[attr-defined]
        if kind == "counter":
            names.add(f"{name}_total")
        elif kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        else:
            names.add(name)
    return names


def test_every_relay_metric_the_rules_and_their_tests_use_is_defined():
    used = {name for rule in rules() for name in RELAY_NAME.findall(rule["expr"])}
    series = {
        name
        for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for item in case["input_series"]
        for name in RELAY_NAME.findall(item["series"].split("{")[0])
    }
    defined = defined_series()
    assert used and used <= defined, f"not defined in relay/metrics.py: {used - defined}"
    assert series <= defined, f"test series not defined in relay/metrics.py: {series - defined}"
    # The deferred backlog, dead letters, links, providers, credentials and the queue: each
    # watched by some rule.
    for needed in (
        "relay_queue_depth",
        "relay_dead_letters_total",
        "relay_gateway_link_up",
        "relay_sends_total",
        "relay_credential_expiry_seconds",
        "relay_deferred_sends",
        "relay_deferred_oldest_due_seconds",
    ):
        assert needed in used
