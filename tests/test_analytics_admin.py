"""The admin's reports page and aggregate tables: operators see every tenant and the totals,
a tenant's own staff only their tenant's figures; nothing is editable."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from relay.report_models import (
    ReportAnomaly,
    ReportDomain,
    ReportErrorCode,
    ReportRegistrations,
    ReportUsage,
)
from relay.unifiedpush.models import ReportUnifiedPush
from tests.support.admin import (
    admin_settings,  # noqa: F401 -- fixture
    build_tenant,
    login_verified,
    make_operator,
    make_tenant_staff,
)

pytestmark = [
    pytest.mark.defaults,
    pytest.mark.django_db,
    pytest.mark.usefixtures("admin_settings"),
]


@pytest.fixture
def worlds(db):
    alpha, bravo = build_tenant("alpha"), build_tenant("bravo")
    today = timezone.now().date()
    for world, sent in ((alpha, 40), (bravo, 7000)):
        tenant, app = world.tenant, world.app
        common = {
            "day": today - timedelta(days=1),
            "tenant_id": tenant.pk,
            "tenant_name": tenant.name,
        }
        ReportUsage.objects.create(
            **common,
            level="tenant",
            pushes_sent=sent,
            delivered=sent - 3,
            failed=3,
            latency_p50_ms=sent / 10,
        )
        ReportUsage.objects.create(
            **common, level="app", app_id=app.pk, app_name=app.name, pushes_sent=sent
        )
        ReportUsage.objects.create(
            **common,
            level="provider",
            provider="up",
            publishes_received=sent // 4,
            pushes_sent=sent // 4,
            delivered=sent // 4 - 1,
            bytes_relayed=sent * 1111,
        )
        ReportUnifiedPush.objects.create(
            **common,
            component_name=f"up.{tenant.name}.example",
            received=sent // 4,
            delivered=sent // 4 - 1,
            expired=1,
            bytes_relayed=sent * 1111,
        )
        ReportRegistrations.objects.create(
            **common, app_id=app.pk, app_name=app.name, provider="fcm", active=sent + 1, new=2
        )
        ReportDomain.objects.create(
            **common,
            publishing_domain=f"{tenant.name}.example",
            publishes_received=sent,
            rank_by_volume=1,
        )
        ReportErrorCode.objects.create(
            **common,
            app_id=app.pk,
            app_name=app.name,
            provider="fcm",
            outcome="failed",
            error_code=f"{tenant.name.upper()}_CODE",
            count=3,
        )
        ReportAnomaly.objects.create(
            **common,
            scope="tenant",
            metric="volume",
            value=sent,
            baseline=1,
            threshold=1,
            detail=f"volume moved for {tenant.name}",
        )
    ReportUsage.objects.create(
        day=today - timedelta(days=1), level="all", pushes_sent=7040, latency_p50_ms=123.0
    )
    return alpha, bravo


def page(user) -> str:
    client = Client()
    login_verified(client, user)
    response = client.get(reverse("admin:reports"))
    assert response.status_code == 200
    return response.content.decode()


def test_operator_sees_every_tenant_and_the_totals(worlds):
    text = page(make_operator())
    for expected in (
        "alpha.example",
        "bravo.example",
        "ALPHA_CODE",
        "BRAVO_CODE",
        "volume moved for bravo",
        "7001",
        "<svg",
        "123.0",
        # UnifiedPush: its own provider value, its bytes, and a chart of its own (the
        # feature's, relay.features `report_charts`).
        str(7000 * 1111),
        "UnifiedPush messages per reported day",
        'id="report-unifiedpush-chart"><svg',
        "1760 received, 1758 delivered",
    ):
        assert expected in text


def test_tenant_staff_see_only_their_tenant(worlds):
    alpha, _ = worlds
    text = page(make_tenant_staff(alpha, "alpha-staff", every_permission=True))
    for expected in ("alpha.example", "ALPHA_CODE", "volume moved for alpha", "41", "<svg", "4.0"):
        assert expected in text
    assert str(40 * 1111) in text and "10 received, 9 delivered" in text  # alpha's UnifiedPush
    assert "bravo" not in text.lower()
    assert "7040" not in text and "123.0" not in text  # the all-tenant totals are not theirs
    # The chart holds alpha's pushes only.
    assert "40 pushes" in text and "7040 pushes" not in text


def test_aggregate_tables_are_read_only_and_the_operators(worlds):
    alpha, _ = worlds
    operator, staff = Client(), Client()
    login_verified(operator, make_operator())
    login_verified(staff, make_tenant_staff(alpha, "alpha-staff", every_permission=True))
    for model in (
        ReportUsage,
        ReportRegistrations,
        ReportDomain,
        ReportErrorCode,
        ReportUnifiedPush,
        ReportAnomaly,
    ):
        name = f"{model._meta.app_label}_{model._meta.model_name}"
        changelist = reverse(f"admin:{name}_changelist")
        response = operator.get(changelist)
        assert response.status_code == 200, name
        assert len(response.context["cl"].result_list) >= 2
        assert operator.get(reverse(f"admin:{name}_add")).status_code == 403
        row = model.objects.first()
        change = operator.get(reverse(f"admin:{name}_change", args=[row.pk]))
        assert change.status_code == 200 and b'name="_save"' not in change.content
        assert staff.get(changelist).status_code == 403


def test_the_unifiedpush_report_belongs_to_its_app_and_keeps_its_table(worlds):
    """The feature app owns the model; the Spark reports still write its table by name
    (analytics.writer), and the operator finds it in UnifiedPush's section of the index."""
    assert ReportUnifiedPush._meta.app_label == "unifiedpush"
    assert ReportUnifiedPush._meta.db_table == "relay_reportunifiedpush"
    operator = Client()
    login_verified(operator, make_operator())
    changelist = reverse("admin:unifiedpush_reportunifiedpush_changelist")
    listed = operator.get(changelist).content.decode()
    assert "up.alpha.example" in listed and "up.bravo.example" in listed
    section = operator.get(reverse("admin:app_list", args=["unifiedpush"])).content.decode()
    assert changelist in section and "UnifiedPush reports" in section
