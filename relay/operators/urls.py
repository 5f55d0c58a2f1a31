"""The second step's pages (open before it: `second-factor/...`) and the security page."""

from django.urls import URLPattern, URLResolver, include, path

from relay.operators import views

app_name = "operators"

urlpatterns: list[URLPattern] = [
    path("second-factor/", views.second_step, name="second_step"),
    path("second-factor/enrol/", views.enrol, name="enrol"),
    path("second-factor/recovery-codes/", views.recovery_codes, name="recovery_codes"),
    path("second-factor/passkey/options/", views.passkey_options, name="passkey_options"),
    path("second-factor/passkey/verify/", views.passkey_verify, name="passkey_verify"),
    path(
        "second-factor/passkey/new/options/",
        views.passkey_registration_options,
        name="passkey_registration_options",
    ),
    path("second-factor/passkey/new/", views.passkey_register, name="passkey_register"),
    path("security/", views.security, name="security"),
]

# What the site includes (relay.features): these pages under admin/, before the admin's own.
site_urlpatterns: list[URLResolver] = [path("admin/", include("relay.operators.urls"))]
