"""The XMPP components' pages: a component's secret (write-only), its link and its pushes."""

from __future__ import annotations

from typing import Any, cast

from django import forms
from django.contrib import admin, messages
from django.db.models import QuerySet
from django.forms.models import BaseInlineFormSet
from django.http import (
    HttpRequest,
    HttpResponse,
    HttpResponseRedirect,
)
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils.safestring import SafeString

from relay import features
from relay.admin.base import (
    TenantScopedAdmin,
    change_message,
    component_link_state,
    confirm,
    count_subquery,
    is_operator_request,
    link_badge,
    pushes_since,
)
from relay.models import (
    Component,
)
from relay.services import link_leases, onboarding


# --------------------------------------------------------------------------- components
class ComponentForm(forms.ModelForm):
    """The component secret is write-only: empty keeps it, and a new component gets a strong
    generated one; only the operator's staff read it back, in the configuration snippet."""

    new_secret = forms.CharField(
        label="Secret",
        required=False,
        strip=True,
        widget=forms.PasswordInput(
            render_value=False, attrs={"autocomplete": "new-password", "spellcheck": "false"}
        ),
        help_text="Leave empty to keep the current secret (a new component gets a strong "
        "generated one), or enter the one already set on the XMPP server: "
        + onboarding.SECRET_HELP
        + ".",
    )

    class Meta:
        model = Component
        fields = (
            "tenant",
            "app",
            "jid",
            "host",
            "port",
            "enabled",
        )

    def clean_new_secret(self) -> str:
        secret = self.cleaned_data.get("new_secret") or ""
        if secret and not onboarding.valid_secret(secret):
            raise forms.ValidationError(onboarding.SECRET_HELP)
        return secret

    def clean(self) -> dict[str, Any]:
        cleaned = cast(dict[str, Any], super().clean())  # a ModelForm's is never None
        # The tenant is read-only (not in the form) for a tenant's own staff.
        tenant = cleaned.get("tenant")
        tenant_id = tenant.pk if tenant is not None else self.instance.tenant_id
        app = cleaned.get("app")
        if app is not None and tenant_id is not None and app.tenant_id != tenant_id:
            self.add_error("app", "This app belongs to another tenant.")
        # Read-only fields (operator-only) are not in the form: fall back to the instance.
        has_app = app is not None if "app" in self.fields else self.instance.app_id is not None
        # With feature apps installed, their inlines check the rule (ComponentPartFormSet).
        if not has_app and not features.component_parts():
            raise forms.ValidationError("Choose an app: the component serves the p2 commands.")
        return cleaned

    def save(self, commit: bool = True) -> Component:
        component = super().save(commit=False)
        secret = self.cleaned_data.get("new_secret") or ""
        if secret:
            component.secret = secret
        elif not component.secret:
            component.secret = onboarding.new_component_secret()
        if commit:
            component.save()
        return component


class ComponentPartFormSet(BaseInlineFormSet):
    """The formset of a feature app's inline on the component's page (its settings of the
    component, relay.features). A component serves something: its app's p2 commands or a
    feature; the last of these formsets to be cleaned checks that, over all of them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Every inline of one page gets the same (unsaved) component: they meet on it.
        self.siblings: list[ComponentPartFormSet] = self.instance.__dict__.setdefault(
            "_part_formsets", []
        )
        self.siblings.append(self)

    def serves(self) -> bool:
        """A row is kept or added (and not deleted) by this formset."""
        return any(
            not getattr(form, "cleaned_data", {}).get("DELETE")
            and (not form.instance._state.adding or form.has_changed())
            for form in self.forms
        )

    def clean(self) -> None:
        super().clean()
        if self is not self.siblings[-1] or self.instance.app_id is not None:
            return
        if not any(formset.serves() for formset in self.siblings):
            names = " or ".join(str(s.model._meta.verbose_name) for s in self.siblings if s.model)
            raise forms.ValidationError(
                f"Choose an app (the p2 commands), set up {names}, or both."
            )


@admin.register(Component)
class ComponentAdmin(TenantScopedAdmin):
    form = ComponentForm
    list_display = (
        "jid",
        "tenant",
        "app",
        "enabled",
        "link_state",
        "link_since",
        "link_error",
        "pushes_last_hour",
    )
    list_filter = ("enabled", "link__state", "tenant", "app")
    search_fields = ("jid", "host")
    list_select_related = ("tenant", "app", "link", "lease")
    readonly_fields = ("link_status", "configuration")
    actions = ("enable", "disable", "regenerate_secret")
    # Where the gateway connects, and under which JID, is the operator's to decide: a tenant
    # could otherwise point the gateway at any host and port, or claim another server's JID.
    operator_only_fields = ("tenant", "jid", "host", "port")
    operator_only_actions = ("regenerate_secret", "delete_selected")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return is_operator_request(request) and super().has_add_permission(request)

    def has_delete_permission(self, request: HttpRequest, obj: Component | None = None) -> bool:
        return is_operator_request(request) and super().has_delete_permission(request, obj)

    def get_list_display(self, request: HttpRequest) -> Any:
        # Which gateway (host) holds a link is the operator's business, not a tenant's.
        shown = super().get_list_display(request)
        if is_operator_request(request):
            shown = (*shown[:5], "link_gateway", *shown[5:])
        return shown

    def get_fieldsets(self, request: HttpRequest, obj: Component | None = None) -> list[Any]:
        fieldsets: list[Any] = [
            (None, {"fields": ("tenant", "app", "jid", "enabled")}),
            (
                "Connection",
                {
                    "fields": (("host", "port"), "new_secret"),
                    "description": "The relay's gateway connects to host:port of the "
                    "tenant's XMPP server as this component (XEP-0114). Changes are picked "
                    "up within seconds, without a restart.",
                },
            ),
        ]
        if obj is not None:
            fieldsets += [
                ("Link", {"fields": ("link_status",)}),
                ("Configuration for the XMPP server", {"fields": ("configuration",)}),
            ]
        return fieldsets

    def get_inlines(self, request: HttpRequest, obj: Component | None) -> list[Any]:
        """What the feature apps add to a component (relay.features: component_inlines)."""
        return [*super().get_inlines(request, obj), *features.component_inlines()]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Component]:
        return (
            super()
            .get_queryset(request)
            .select_related(*features.component_related_names())
            .annotate(
                pushes=count_subquery(
                    pushes_since(1).filter(registration__isnull=False),
                    "registration__component",
                )
            )
        )

    @admin.display(description="link", ordering="link__state")
    def link_state(self, obj: Component) -> SafeString:
        return link_badge(component_link_state(obj))

    @admin.display(description="since", ordering="link__since")
    def link_since(self, obj: Component) -> Any:
        link = getattr(obj, "link", None)
        return link.since if link is not None else None

    @admin.display(description="gateway", ordering="lease__holder")
    def link_gateway(self, obj: Component) -> str:
        return link_leases.holder_of(getattr(obj, "lease", None)) or "-"

    @admin.display(description="last error")
    def link_error(self, obj: Component) -> str:
        link = getattr(obj, "link", None)
        return link.last_error if link is not None else ""

    @admin.display(description="pushes in the last hour", ordering="pushes")
    def pushes_last_hour(self, obj: Component) -> int:
        return getattr(obj, "pushes", 0)

    @admin.display(description="link")
    def link_status(self, obj: Component) -> SafeString:
        return render_to_string(
            "admin/relay/link_status.html",
            {
                "state": component_link_state(obj),
                "badge": link_badge(component_link_state(obj)),
                "link": getattr(obj, "link", None),
                "pushes_last_hour": getattr(obj, "pushes", 0),
                "show_gateway": getattr(obj, "_show_secret", False),  # the operator's
                "gateway": link_leases.current_holder(obj.pk),
            },
        )

    @admin.display(description="paste into the server")
    def configuration(self, obj: Component) -> SafeString:
        # The request is not passed to display functions; the view stores who is looking.
        show_secret = getattr(obj, "_show_secret", False)
        snippets = onboarding.config_snippets(component=obj, show_secret=show_secret)
        return render_to_string(
            "admin/relay/configuration.html",
            {"snippets": snippets, "show_secret": show_secret, "component": obj},
        )

    def get_object(
        self, request: HttpRequest, object_id: str, from_field: str | None = None
    ) -> Component | None:
        obj = super().get_object(request, object_id, from_field)
        if obj is not None:
            obj._show_secret = is_operator_request(request)
        return obj

    def response_add(
        self, request: HttpRequest, obj: Component, post_url_continue: str | None = None
    ) -> HttpResponse:
        # Straight to the component's page: its configuration snippet is the next step.
        if not {"_addanother", "_popup"} & set(request.POST):
            messages.success(
                request,
                "Paste the configuration below into the tenant's XMPP server; the link comes "
                "up within seconds once the server knows the component.",
            )
            return HttpResponseRedirect(reverse("admin:relay_component_change", args=[obj.pk]))
        return super().response_add(request, obj, post_url_continue)

    @admin.action(description="Enable the selected components", permissions=["change"])
    def enable(self, request: HttpRequest, queryset: QuerySet[Component]) -> None:
        changed = 0
        for component in queryset.filter(enabled=False):
            component.enabled = True
            component.save(update_fields=["enabled", "updated"])
            self.log_change(request, component, change_message(Component, "enabled"))
            changed += 1
        self.message_user(request, f"Enabled {changed} component(s).", messages.SUCCESS)

    @admin.action(description="Disable the selected components", permissions=["change"])
    def disable(self, request: HttpRequest, queryset: QuerySet[Component]) -> HttpResponse | None:
        page = confirm(
            self,
            request,
            queryset,
            action="disable",
            title="Disable these components?",
            consequence="The gateway closes their links within seconds. Prosody answers "
            "publishes with a temporary error meanwhile; ejabberd may drop its users' "
            "registrations.",
        )
        if page is not None:
            return page
        changed = 0
        for component in queryset.filter(enabled=True):
            component.enabled = False
            component.save(update_fields=["enabled", "updated"])
            self.log_change(request, component, change_message(Component, "enabled"))
            changed += 1
        self.message_user(request, f"Disabled {changed} component(s).", messages.SUCCESS)
        return None

    @admin.action(description="Generate new secrets", permissions=["operator"])
    def regenerate_secret(
        self, request: HttpRequest, queryset: QuerySet[Component]
    ) -> HttpResponse | None:
        page = confirm(
            self,
            request,
            queryset,
            action="regenerate_secret",
            title="Generate new secrets for these components?",
            consequence="Their links fail until each XMPP server is given its new secret "
            "(shown in the component's configuration snippet).",
        )
        if page is not None:
            return page
        for component in queryset:
            component.secret = onboarding.new_component_secret()
            component.save(update_fields=["secret", "updated"])
            self.log_change(request, component, change_message(Component, "secret"))
        self.message_user(request, f"Generated {queryset.count()} new secret(s).", messages.SUCCESS)
        return None
