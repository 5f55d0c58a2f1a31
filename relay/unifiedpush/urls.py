"""UnifiedPush's HTTP surface: endpoints, message resources and the Matrix push gateway."""

from django.urls import path

from relay.unifiedpush import views

urlpatterns = [
    path("push/message/<str:reference>", views.message_resource, name="up-message"),
    path("push/<str:token>", views.push_resource, name="up-endpoint"),
    path("_matrix/push/v1/notify", views.matrix_notify, name="up-matrix"),
]
