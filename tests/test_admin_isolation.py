"""Tenant isolation in the admin: a tenant's own staff reach their tenant's objects only.

Two tenants, "alpha" and "bravo", each with one of everything; every name of bravo's contains
"bravo". A staff user of alpha, even holding every permission there is, must never see
"bravo" on any admin page (lists, forms, choice lists, filters, searches, charts, exports,
autocomplete), must get "not found" for every bravo object's change, delete and history page,
and no action may touch a bravo object. The pages come from `admin.site._registry`, so a newly
registered model is covered (or the test says what it is missing).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib import admin
from django.contrib.admin.models import LogEntry
from django.contrib.admin.utils import quote
from django.contrib.auth.models import Group, Permission, User
from django.contrib.contenttypes.models import ContentType
from django.db import models
from django.test import Client, RequestFactory
from django.urls import NoReverseMatch, reverse

from relay.admin.base import OperatorOnlyAdmin, TenantScopedAdmin
from relay.services import tenancy
from tests.support.admin import (
    TenantWorld,
    admin_settings,  # noqa: F401 -- fixture
    build_tenant,
    changeform_data,
    login_verified,
    make_operator,
    make_tenant_staff,
)

pytestmark = [
    pytest.mark.defaults,
    pytest.mark.django_db,
    pytest.mark.usefixtures("admin_settings"),
]

MARKER = "bravo"


@pytest.fixture
def worlds(db) -> tuple[TenantWorld, TenantWorld]:
    return build_tenant("alpha"), build_tenant(MARKER)


@pytest.fixture
def alpha_client(worlds) -> Client:
    alpha, _ = worlds
    client = Client()
    login_verified(client, make_tenant_staff(alpha, "alpha-staff", every_permission=True))
    return client


@pytest.fixture
def operator_client(worlds) -> Client:
    client = Client()
    login_verified(client, make_operator())
    return client


def url(model: type[models.Model], view: str, *args: Any) -> str:
    opts = model._meta
    return reverse(f"admin:{opts.app_label}_{opts.model_name}_{view}", args=args)


def text_of(response: Any) -> str:
    if getattr(response, "streaming", False):
        return b"".join(response.streaming_content).decode()
    return response.content.decode()


def alpha_secrets(alpha: TenantWorld) -> list[str]:
    """Credentials alpha's own staff must never read back either."""
    return [
        alpha.component.secret,
        alpha.registration.token,
        alpha.registration.secret,
        "alpha-private-key-material",
        "alpha-wns-client-secret",
    ]


def assert_clean(response: Any, alpha: TenantWorld, where: str) -> str:
    text = text_of(response)
    assert MARKER not in text.lower(), f"{where} shows a bravo object"
    for secret in alpha_secrets(alpha):
        assert secret not in text, f"{where} shows a credential in clear"
    return text


def assert_not_found(response: Any, where: str) -> None:
    """404, 403, or the admin's "does not exist" redirect to its index."""
    if response.status_code == 302:
        assert response.url == reverse("admin:index"), f"{where} redirected to {response.url}"
    else:
        assert response.status_code in (403, 404), f"{where} answered {response.status_code}"


def registered() -> Iterator[tuple[type[models.Model], admin.ModelAdmin]]:
    yield from admin.site._registry.items()


def bravo_snapshot(bravo: TenantWorld) -> dict[str, Any]:
    """Everything of bravo's as stored, and the history entries about it."""
    snapshot: dict[str, Any] = {}
    for model, objects in bravo.objects.items():
        pks = [obj.pk for obj in objects]
        rows = list(model.objects.filter(pk__in=pks).order_by("pk").values())
        snapshot[model._meta.label] = json.loads(json.dumps(rows, default=str))
    snapshot["group"] = [
        bravo.group.name,
        sorted(bravo.group.permissions.values_list("pk", flat=True)),
    ]
    snapshot["log"] = sorted(
        LogEntry.objects.filter(
            content_type__in=[ContentType.objects.get_for_model(m) for m in bravo.objects],
        ).values_list("pk", flat=True)
    )
    return snapshot


def test_every_registered_model_is_scoped_or_operator_only(worlds):
    """A model admin must choose: tenant-scoped (with test data here) or operator-only."""
    _, bravo = worlds
    for model, model_admin in registered():
        if isinstance(model_admin, TenantScopedAdmin):
            assert tenancy.tenant_path(model), f"{model.__name__} has no tenant path"
            assert bravo.objects.get(model), (
                f"{model.__name__} is tenant-scoped: give tests/support/admin.py build_tenant() "
                "an object of it"
            )
        else:
            assert isinstance(model_admin, OperatorOnlyAdmin), (
                f"{model.__name__}'s admin is neither TenantScopedAdmin nor OperatorOnlyAdmin"
            )


def test_operator_sees_both_tenants(worlds, operator_client):
    """The other half of isolation: the same pages do show bravo to the operator."""
    for model, objects in worlds[1].objects.items():
        if model not in admin.site._registry:
            continue
        response = operator_client.get(url(model, "changelist"))
        assert response.status_code == 200
        shown = {obj.pk for obj in response.context["cl"].result_list}
        assert {obj.pk for obj in objects} <= shown, model.__name__
        for obj in objects:
            assert operator_client.get(url(model, "change", quote(obj.pk))).status_code == 200


def test_lists_searches_and_filters_show_no_other_tenant(worlds, alpha_client):
    alpha, bravo = worlds
    index = alpha_client.get(reverse("admin:index"))
    assert index.status_code == 200
    assert_clean(index, alpha, "the index")
    for model, model_admin in registered():
        where = f"{model.__name__} list"
        response = alpha_client.get(url(model, "changelist"))
        if isinstance(model_admin, OperatorOnlyAdmin):
            assert response.status_code == 403, where
            assert url(model, "changelist") not in index.content.decode(), where
            continue
        assert response.status_code == 200, where
        assert_clean(response, alpha, where)
        shown = list(response.context["cl"].result_list)
        assert shown, f"{where} is empty: the test data is missing"
        assert all(tenancy.owning_tenant_id(obj) == alpha.tenant.pk for obj in shown), where
        # Searching or filtering for bravo's objects finds nothing.
        probes: list[dict[str, Any]] = [
            {"q": MARKER[1:]},  # matches bravo's names; "bravo" itself would be echoed
            {"q": bravo.registration.node},
            {"q": str(bravo.delivery.push_id)},
            {"tenant__id__exact": bravo.tenant.pk},
            {"app__id__exact": bravo.app.pk},
            {"app__tenant__id__exact": bravo.tenant.pk},
            {"component__id__exact": bravo.component.pk},
            {"registration__id__exact": bravo.registration.pk},
            {"_facets": "1"},
        ]
        for params in probes:
            response = alpha_client.get(url(model, "changelist"), params)
            if response.status_code == 400:  # a lookup this list does not allow
                continue
            if response.status_code == 302:  # a lookup on a field the model lacks
                assert "?e=1" in response.url, where
                continue
            assert response.status_code == 200, f"{where} {params}"
            assert_clean(response, alpha, f"{where} {params}")
            assert not any(
                tenancy.owning_tenant_id(obj) != alpha.tenant.pk
                for obj in response.context["cl"].result_list
            ), f"{where} {params}"


def test_object_pages_of_another_tenant_are_not_found(worlds, alpha_client):
    alpha, bravo = worlds
    before = bravo_snapshot(bravo)
    targets: list[tuple[type[models.Model], Any]] = [
        (model, obj.pk) for model, objects in bravo.objects.items() for obj in objects
    ]
    # Operator-only models: their objects are bravo's group (and anything else) too.
    targets += [(Group, bravo.group.pk)]
    targets += [(LogEntry, entry.pk) for entry in LogEntry.objects.all()[:3]]
    for model, pk in targets:
        if model not in admin.site._registry:
            continue
        for view in ("change", "delete", "history"):
            where = f"{model.__name__} {view} {pk}"
            response = alpha_client.get(url(model, view, quote(pk)))
            assert_not_found(response, where)
            assert_clean(response, alpha, where)
        # Writing is no better than reading.
        response = alpha_client.post(url(model, "delete", quote(pk)), {"post": "yes"})
        assert_not_found(response, f"{model.__name__} delete POST")
        response = alpha_client.post(url(model, "change", quote(pk)), {"name": "hijacked"})
        assert_not_found(response, f"{model.__name__} change POST")
    response = alpha_client.post(
        reverse("admin:relay_registration_test_push", args=[bravo.registration.pk])
    )
    assert response.status_code == 404
    assert bravo_snapshot(bravo) == before


def test_forms_and_choice_lists_offer_no_other_tenant(worlds, alpha_client):
    alpha, _ = worlds
    for model, model_admin in registered():
        if isinstance(model_admin, OperatorOnlyAdmin):
            assert alpha_client.get(url(model, "add")).status_code == 403
            continue
        add = alpha_client.get(url(model, "add"))
        assert add.status_code in (200, 403), model.__name__
        assert_clean(add, alpha, f"{model.__name__} add form")
        for obj in alpha.objects.get(model, []):
            for view in ("change", "history"):
                response = alpha_client.get(url(model, view, quote(obj.pk)))
                assert response.status_code == 200, f"{model.__name__} {view}"
                assert_clean(response, alpha, f"{model.__name__} {view}")


def test_foreign_key_choices_refuse_another_tenants_objects(worlds, alpha_client):
    """Posting bravo's ids into alpha's forms is refused as an invalid choice."""
    alpha, bravo = worlds
    app_model = type(alpha.app)
    page = alpha_client.get(url(app_model, "add"))
    response = alpha_client.post(
        url(app_model, "add"), changeform_data(page, tenant=bravo.tenant.pk, name="sneaky")
    )
    assert response.status_code == 200
    assert "tenant" in response.context["adminform"].form.errors
    assert not app_model.objects.filter(name="sneaky").exists()

    change = url(type(alpha.component), "change", alpha.component.pk)
    response = alpha_client.post(
        change, changeform_data(alpha_client.get(change), app=bravo.app.pk)
    )
    assert response.status_code == 200
    assert "app" in response.context["adminform"].form.errors
    alpha.component.refresh_from_db()
    assert alpha.component.app == alpha.app


def test_autocomplete_returns_no_other_tenant(worlds, alpha_client):
    alpha, bravo = worlds
    bravo_pks = {
        model: {str(obj.pk) for obj in objects} for model, objects in bravo.objects.items()
    }
    checked = 0
    for model, _ in registered():
        for field in model._meta.get_fields():
            if not (
                field.is_relation and field.concrete and (field.many_to_one or field.one_to_one)
            ):
                continue
            response = alpha_client.get(
                reverse("admin:autocomplete"),
                {
                    "app_label": model._meta.app_label,
                    "model_name": model._meta.model_name,
                    "field_name": field.name,
                    "term": "",
                },
            )
            where = f"autocomplete {model.__name__}.{field.name}"
            assert response.status_code in (200, 403, 404), where
            if response.status_code != 200:
                continue
            checked += 1
            assert_clean(response, alpha, where)
            ids = {result["id"] for result in response.json()["results"]}
            assert not ids & bravo_pks.get(field.related_model, set()), where
    assert checked, "no autocomplete answered: the test proves nothing"


def test_actions_never_touch_another_tenant(worlds, alpha_client, operator_client, send_queue):
    """Every action of every admin (the operator's set, the largest), posted by alpha's staff
    with bravo's ids, both as a first click and as a confirmation."""
    alpha, bravo = worlds
    before = bravo_snapshot(bravo)
    operator_request = RequestFactory().get("/")
    operator_request.user = User.objects.get(username="operator")
    posted = 0
    for model, model_admin in registered():
        actions = model_admin.get_actions(operator_request)
        targets = [str(obj.pk) for obj in bravo.objects.get(model, [])]
        if model is Group:
            targets = [str(bravo.group.pk)]
        for name in actions:
            for extra in ({"index": "0"}, {"post": "yes"}):
                response = alpha_client.post(
                    url(model, "changelist"),
                    {"action": name, "_selected_action": targets, **extra},
                )
                where = f"{model.__name__} action {name} {extra}"
                assert response.status_code in (200, 302, 403), where
                assert_clean(response, alpha, where)
                posted += 1
    assert posted
    assert bravo_snapshot(bravo) == before
    assert send_queue.queued_jobs() == []


def test_export_holds_own_tenant_only(worlds, alpha_client):
    alpha, bravo = worlds
    delivery_model = type(alpha.delivery)
    response = alpha_client.post(
        url(delivery_model, "changelist"),
        {
            "action": "export_csv",
            "index": "0",
            "select_across": "1",
            "_selected_action": [str(alpha.delivery.pk), str(bravo.delivery.pk)],
        },
    )
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/csv")
    text = assert_clean(response, alpha, "the CSV export")
    assert str(alpha.delivery.push_id) in text


def test_health_usage_and_charts_show_own_tenant_only(worlds, alpha_client, operator_client):
    alpha, _ = worlds
    for name in ("admin:health", "admin:usage"):
        response = alpha_client.get(reverse(name))
        assert response.status_code == 200
        text = assert_clean(response, alpha, name)
        assert "alpha" in text
        # The shared queue's depth is the operator's business.
        assert 'id="queue-depth"' not in text
        assert MARKER in operator_client.get(reverse(name)).content.decode()
    tenant_page = alpha_client.get(url(type(alpha.tenant), "change", alpha.tenant.pk))
    text = assert_clean(tenant_page, alpha, "alpha's tenant page")
    assert "<svg" in text and "alpha-app" in text


def test_tenant_staff_cannot_change_operator_policy(worlds, alpha_client):
    """Suspension and rate limits are the operator's: read-only for the tenant's staff."""
    alpha, _ = worlds
    tenant_url = url(type(alpha.tenant), "change", alpha.tenant.pk)
    page = alpha_client.get(tenant_url)
    form = page.context["adminform"].form
    assert {"name", "suspended", "rate_limit_per_second", "rate_limit_burst"}.isdisjoint(
        form.fields
    )
    data = changeform_data(
        page,
        display_name="Alpha Hosting Ltd",
        allowed_domains="alpha.example",
        suspended="on",
        rate_limit_per_second="99999",
        name="renamed",
    )
    response = alpha_client.post(tenant_url, data)
    assert response.status_code == 302, response.context["adminform"].form.errors
    alpha.tenant.refresh_from_db()
    assert alpha.tenant.display_name == "Alpha Hosting Ltd"
    assert alpha.tenant.allowed_domains == "alpha.example"
    assert (alpha.tenant.name, alpha.tenant.suspended) == ("alpha", False)
    assert alpha.tenant.rate_limit_per_second is None
    # Making and removing tenants and components is the operator's too, whatever the
    # group's permissions; so are where a component connects and under which JID.
    assert alpha_client.get(url(type(alpha.tenant), "add")).status_code == 403
    assert alpha_client.get(url(type(alpha.component), "add")).status_code == 403
    component_url = url(type(alpha.component), "change", alpha.component.pk)
    page = alpha_client.get(component_url)
    assert {"tenant", "jid", "host", "port"}.isdisjoint(page.context["adminform"].form.fields)
    response = alpha_client.post(
        component_url,
        changeform_data(page, host="10.0.0.1", port="6379", jid="push.bravo.example", enabled=None),
    )
    assert response.status_code == 302
    alpha.component.refresh_from_db()
    assert (alpha.component.host, alpha.component.port) == ("xmpp.alpha.example", 5347)
    assert not alpha.component.enabled  # what they may change, they can
    delete = alpha_client.post(url(type(alpha.tenant), "delete", alpha.tenant.pk), {"post": "yes"})
    assert (
        delete.status_code == 403 and type(alpha.tenant).objects.filter(pk=alpha.tenant.pk).exists()
    )


def test_who_is_the_operator(worlds):
    """Superusers and holders of the operator permission see all; bound staff their tenants
    (even holding the operator permission); unbound staff and anyone else nothing."""
    alpha, bravo = worlds
    assert tenancy.tenant_ids_for(User.objects.create_superuser("root", password="x" * 20)) is None
    assert tenancy.tenant_ids_for(User.objects.create_user("ops", is_staff=True)) == frozenset()
    operator = User.objects.create_user("staff-operator", is_staff=True)
    operator.groups.add(Group.objects.get(name=tenancy.OPERATORS_GROUP))
    assert tenancy.tenant_ids_for(User.objects.get(pk=operator.pk)) is None
    # The permission without staff status opens nothing (the admin refuses them anyway).
    outsider = User.objects.create_user("not-staff")
    outsider.groups.add(Group.objects.get(name=tenancy.OPERATORS_GROUP))
    assert tenancy.tenant_ids_for(User.objects.get(pk=outsider.pk)) == frozenset()
    both = make_tenant_staff(alpha, "both", every_permission=False)
    both.groups.add(bravo.group)
    assert tenancy.tenant_ids_for(both) == {alpha.tenant.pk, bravo.tenant.pk}
    # A tenant group holding every permission, the operator's included, stays confined.
    confined = make_tenant_staff(alpha, "confined", every_permission=True)
    assert confined.has_perm(tenancy.OPERATOR_PERMISSION)
    assert tenancy.tenant_ids_for(confined) == {alpha.tenant.pk}
    assert tenancy.tenant_ids_for(User.objects.create_user("customer")) == frozenset()


def test_staff_of_an_unbound_group_see_nothing(worlds, alpha_client):
    """The operator removes alpha's binding: its group keeps its permissions (every one there
    is but the operator's), and its members must reach no tenant at all, not every tenant."""
    alpha, bravo = worlds
    alpha.group.permissions.remove(
        Permission.objects.get(codename="operate_all_tenants", content_type__app_label="relay")
    )
    alpha.binding.delete()
    before = bravo_snapshot(bravo)
    for model, model_admin in registered():
        response = alpha_client.get(url(model, "changelist"))
        if isinstance(model_admin, OperatorOnlyAdmin):
            assert response.status_code == 403, model.__name__
            continue
        assert response.status_code == 200, model.__name__
        assert list(response.context["cl"].result_list) == [], model.__name__
        assert MARKER not in text_of(response).lower()
        for world in (alpha, bravo):
            for obj in world.objects.get(model, []):
                assert_not_found(
                    alpha_client.get(url(model, "change", quote(obj.pk))), model.__name__
                )
    component_page = alpha_client.get(url(type(bravo.component), "change", bravo.component.pk))
    assert bravo.component.secret not in text_of(component_page)
    for name in ("admin:health", "admin:usage"):
        assert MARKER not in alpha_client.get(reverse(name)).content.decode().lower()
    # Suspending another tenant is refused too.
    response = alpha_client.post(
        url(type(bravo.tenant), "changelist"),
        {"action": "suspend", "_selected_action": [str(bravo.tenant.pk)], "post": "yes"},
    )
    assert response.status_code in (200, 302, 403)
    assert bravo_snapshot(bravo) == before


def test_a_staff_operator_in_the_operators_group_sees_every_tenant(worlds):
    _, bravo = worlds
    user = User.objects.create_user("ops", password="x" * 20, is_staff=True)
    user.groups.add(Group.objects.get(name=tenancy.OPERATORS_GROUP))
    client = Client()
    login_verified(client, user)
    response = client.get(url(type(bravo.component), "change", bravo.component.pk))
    assert response.status_code == 200
    assert bravo.component.secret in text_of(response)  # the operator's snippet shows it
    assert client.get(url(type(bravo.tenant), "add")).status_code == 200


def test_anonymous_and_non_staff_get_nothing(worlds):
    alpha, _ = worlds  # noqa: RUF059
    for model, _ in registered():
        response = Client().get(url(model, "changelist"))
        assert response.status_code == 302 and "/login/" in response.url
    for name in ("admin:health", "admin:usage"):
        assert "/login/" in Client().get(reverse(name)).url
    outsider = Client()
    login_verified(outsider, User.objects.create_user("outsider", password="x" * 20))
    assert "/login/" in outsider.get(reverse("admin:index")).url


def test_urls_of_registered_models_resolve():
    """Guards the URL names this module builds (a renamed view would make tests vacuous)."""
    for model, _ in registered():
        for view in ("changelist", "add"):
            try:
                url(model, view)
            except NoReverseMatch:  # pragma: no cover - the assertion explains
                pytest.fail(f"no {view} URL for {model.__name__}")


def test_checks_name_staff_who_see_nothing_and_confined_operator_groups(worlds):
    from relay.checks import tenant_scope_check

    alpha, _ = worlds
    assert tenant_scope_check() == []
    User.objects.create_user("forgotten", is_staff=True)
    make_tenant_staff(alpha, "confined", every_permission=True)  # the group gets every perm
    ids = sorted(message.id for message in tenant_scope_check())
    assert ids == ["relay.W010", "relay.W011"]
    assert "1 active staff user(s)" in tenant_scope_check()[0].msg


def _filter_paths(model_admin: admin.ModelAdmin, request: Any) -> set[str]:
    paths = {model_admin.date_hierarchy} if model_admin.date_hierarchy else set()
    for entry in model_admin.get_list_filter(request):
        if isinstance(entry, str):
            paths.add(entry)
        elif isinstance(entry, tuple):
            paths.add(entry[0])
    return paths | set(getattr(model_admin, "extra_lookup_fields", ()))


def test_url_lookups_cannot_probe_hidden_values(worlds, alpha_client, operator_client):
    """`?secret__startswith=a` answered "rows" or "none": a prefix loop read a component secret
    back. Every lookup but the list's own filters is refused (400), for every user."""
    alpha, bravo = worlds
    component_list = url(type(alpha.component), "changelist")
    registration_list = url(type(alpha.registration), "changelist")
    probes = [
        (component_list, "secret__startswith", alpha.component.secret[:3]),
        (component_list, "secret__regex", "^alp"),
        (component_list, "secret__gt", "a"),
        (component_list, "secret", alpha.component.secret),
        (registration_list, "secret__startswith", alpha.registration.secret[:2]),
        (registration_list, "token__startswith", alpha.registration.token[:2]),
        (registration_list, "token__regex", "^alpha"),
        (registration_list, "component__secret__startswith", "alp"),
        (registration_list, "app__wns_secret__isnull", "0"),
        (url(type(alpha.app), "changelist"), "fcm_service_account__contains", "g"),
        (url(type(alpha.app), "changelist"), "wns_secret__gt", ""),
        (url(User, "changelist"), "password__startswith", "md5"),
    ]
    for client in (alpha_client, operator_client):
        for page, lookup, value in probes:
            response = client.get(page, {lookup: value})
            if response.status_code == 403:  # an operator-only list for alpha
                assert client is alpha_client, f"{page}?{lookup}"
                continue
            assert response.status_code == 400, f"{page}?{lookup} answered {response.status_code}"

    # Every field of every list, and every field one relation away, that is no filter.
    request = RequestFactory().get("/")
    request.user = User.objects.get(username="operator")
    refused = 0
    for model, model_admin in registered():
        allowed = _filter_paths(model_admin, request)
        page = url(model, "changelist")
        names = []
        for field in model._meta.concrete_fields:
            names.append(field.name)
            if field.is_relation:
                names += [
                    f"{field.name}__{f.name}" for f in field.related_model._meta.concrete_fields
                ]
        for name in names:
            if name in allowed:
                continue
            response = operator_client.get(page, {f"{name}__startswith": "a"})
            assert response.status_code == 400, f"{model.__name__}?{name}__startswith"
            refused += 1
    assert refused > 50

    # What the lists offer still works: filters, the date bar, and the links we build.
    ok = [
        (component_list, {"tenant__id__exact": alpha.tenant.pk, "enabled__exact": "1"}),
        (component_list, {"link__state__exact": "down"}),
        (registration_list, {"state": "alive", "app__tenant__id__exact": alpha.tenant.pk}),
        (registration_list, {"service__exact": "fcm", "q": alpha.registration.node}),
        (
            url(type(alpha.delivery), "changelist"),
            {"registration__id__exact": alpha.registration.pk, "received__year": "2026"},
        ),
        (url(type(alpha.delivery), "changelist"), {"received__gte": "2020-01-01T00:00:00+00:00"}),
        (url(type(alpha.dead_letter), "changelist"), {"replayed__isempty": "1"}),
    ]
    for page, params in ok:
        response = alpha_client.get(page, params)
        assert response.status_code == 200, f"{page} {params}"
        assert bravo.registration.node not in text_of(response)
