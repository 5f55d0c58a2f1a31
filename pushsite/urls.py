from django.contrib import admin
from django.urls import path

from relay import features, views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("healthz", views.healthz, name="healthz"),
    path("readyz", views.readyz, name="readyz"),
    path("metrics", views.metrics_view, name="metrics"),
    # The feature apps' URLs (the Windows API's /api/v1/).
    *features.urlpatterns(),
    # The feature apps' web resources (relay.features) are not Django's: the web server sends
    # their paths to them (pushsite/server.py).
]
