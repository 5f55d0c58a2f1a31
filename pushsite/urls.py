from django.contrib import admin
from django.urls import path

from relay import features, views

urlpatterns = [
    # The feature apps' URLs (relay.features), first: the second step's pages under admin/
    # (relay.operators) come before the admin's own, then the Windows API's /api/v1/ and the
    # UnifiedPush resource as runserver serves it (the web process answers those paths itself,
    # pushsite/server.py).
    *features.urlpatterns(),
    path("admin/", admin.site.urls),
    path("healthz", views.healthz, name="healthz"),
    path("readyz", views.readyz, name="readyz"),
    path("metrics", views.metrics_view, name="metrics"),
]
