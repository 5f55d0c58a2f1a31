"""The Celery app: workers run the send tasks that the gateway queues."""

import os

from celery import Celery

from relay import broker

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "pushsite.settings")

# Before the app reads its broker URL: `sqlrelay+sqlite:///...`, the embedded broker that
# leases messages, so a killed worker's sends come back (relay/broker.py). RabbitMQ (amqp://)
# is kombu's own py-amqp transport, configured in pushsite/settings.py.
broker.register()

app = Celery("pushsite")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
