from django.contrib import admin
from django.urls import include, path

from relay import views
from relay.windows.api.views import api as api_v1

urlpatterns = [
    # The second step, enrolment and each staff member's security page (relay/operators).
    path("admin/", include("relay.operators.urls")),
    path("admin/", admin.site.urls),
    path("healthz", views.healthz, name="healthz"),
    path("readyz", views.readyz, name="readyz"),
    path("metrics", views.metrics_view, name="metrics"),
    # /api/v1/openapi.json is the schema, /api/v1/docs the interactive docs.
    path("api/v1/", api_v1.urls),
    # UnifiedPush's endpoints, message resources and Matrix push gateway: the web process
    # answers them before Django (pushsite/server.py); these serve them under runserver.
    path("", include("relay.unifiedpush.urls")),
]
