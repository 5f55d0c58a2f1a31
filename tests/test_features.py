"""What the feature apps add reaches the core, the admin, the site and beat through their
AppConfigs only (relay/features.py): installed, each part is there; left out of
INSTALLED_APPS, nothing of it is."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.test import override_settings
from django.urls import resolve

from relay import features

pytestmark = pytest.mark.defaults

FEATURE_APPS = ("relay.unifiedpush", "relay.windows", "relay.operators")


def test_the_installed_features_parts_are_found():
    assert [part.key for part in features.component_parts()] == ["unifiedpush"]
    assert features.component_related_names() == ("unifiedpush_settings",)
    assert [inline.__name__ for inline in features.component_inlines()] == [
        "ComponentSettingsInline"
    ]
    [resource] = features.web_resources()
    assert resource.paths.fullmatch("/push/v4.local.x")
    assert resource.paths.fullmatch("/_matrix/push/v1/notify")
    assert not resource.paths.fullmatch("/api/v1/register")
    assert resolve("/api/v1/openapi.json").route.startswith("api/v1/")
    assert resolve("/admin/second-factor/").url_name == "second_step"  # relay.operators
    assert list(features.beat_schedule()) == ["remove-stale-uwpx-devices"]
    assert features.state_gauge_names() == {
        "relay_unifiedpush_stored_messages",
        "relay_windows_devices",
    }
    assert len(features.kept_registrations()) == 1
    assert [chart.element_id for chart in features.report_charts()] == ["report-unifiedpush-chart"]


def test_without_the_feature_apps_the_core_finds_nothing_of_them():
    core_only = [name for name in settings.INSTALLED_APPS if name not in FEATURE_APPS]
    assert len(core_only) == len(settings.INSTALLED_APPS) - len(FEATURE_APPS)
    with override_settings(INSTALLED_APPS=core_only):
        assert features.component_parts() == ()
        assert features.component_inlines() == []
        assert features.web_resources() == []
        assert features.urlpatterns() == []
        assert features.beat_schedule() == {}
        assert features.state_metrics() == []
        assert features.kept_registrations() == []
        assert features.report_charts() == []
    assert [part.key for part in features.component_parts()] == ["unifiedpush"]
