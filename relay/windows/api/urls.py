"""The Windows API's URLs, which the site includes (relay.features: `urlpatterns`)."""

from django.urls import path

from relay.windows.api.views import api

# /api/v1/openapi.json is the schema, /api/v1/docs the interactive docs.
urlpatterns = [path("api/v1/", api.urls)]
