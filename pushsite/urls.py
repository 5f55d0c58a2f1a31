from django.contrib import admin
from django.urls import path

from relay import unifiedpush_views, views
from relay.api.views import api as api_v1

urlpatterns = [
    path("admin/", admin.site.urls),
    path("healthz", views.healthz, name="healthz"),
    path("readyz", views.readyz, name="readyz"),
    path("metrics", views.metrics_view, name="metrics"),
    # /api/v1/openapi.json is the schema, /api/v1/docs the interactive docs.
    path("api/v1/", api_v1.urls),
    # UnifiedPush: endpoints, message resources and the Matrix push gateway (README).
    path("push/message/<str:reference>", unifiedpush_views.message_resource, name="up-message"),
    path("push/<str:token>", unifiedpush_views.push_resource, name="up-endpoint"),
    path("_matrix/push/v1/notify", unifiedpush_views.matrix_notify, name="up-matrix"),
]
