"""The Celery app: workers run the send tasks that the gateway queues."""

import os

from celery import Celery

from relay import broker, redis_broker

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "pushsite.settings")

# Before the app reads its broker URL: `sqlrelay+sqlite:///...`, the embedded broker that
# leases messages, so a killed worker's sends come back (relay/broker.py).
broker.register()
# `redis://...`: kombu's Redis transport with leases (relay/redis_broker.py), so a killed worker
# or a broker restart loses no send and a broker reconnect never kills a worker.
redis_broker.register()

app = Celery("pushsite")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
