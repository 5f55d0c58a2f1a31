"""The Celery app: workers run the send tasks that the gateway queues."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "pushsite.settings")

app = Celery("pushsite")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
