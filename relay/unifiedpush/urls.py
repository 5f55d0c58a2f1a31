"""UnifiedPush's routes in Django's URLs (pushsite/urls.py includes them): what Django's own
server answers for `/push/…` and the Matrix gateway; the web process answers them itself."""

from django.urls import re_path

from relay.unifiedpush import views

urlpatterns = [
    # Every path of relay.unifiedpush.http.PATHS (the view checks the whole path).
    re_path(r"^(?:push/|_matrix/push/v1/notify$)", views.resource, name="unifiedpush"),
]
