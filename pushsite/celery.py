"""The Celery app: workers run the send tasks that the gateway queues."""

import os
from typing import Any

from celery import Celery, signals

from relay import broker

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "pushsite.settings")

# Before the app reads its broker URL: `sqlrelay+sqlite:///...`, the embedded broker that
# leases messages, so a killed worker's sends come back (relay/broker.py). RabbitMQ (amqp://)
# is kombu's own py-amqp transport, configured in pushsite/settings.py.
broker.register()

app = Celery("pushsite")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@signals.import_modules.connect
def _feature_beat_entries(sender: Any = None, **kwargs: Any) -> None:
    """The feature apps' periodic tasks (relay.features: `beat_schedule`) join the core's
    (CELERY_BEAT_SCHEDULE). Celery's Django fixup, connected before, has set Django up by
    then; beat reads the schedule after this, when its scheduler starts."""
    from relay import features

    app.conf.beat_schedule = {**features.beat_schedule(), **app.conf.beat_schedule}
