import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "pushsite.settings")
django_application = get_wsgi_application()

from relay.metrics import CountRequests  # noqa: E402
from relay.unifiedpush.http import FastPushPath  # noqa: E402  (needs Django set up)
from relay.windows.api.fast import FastUwpxPath  # noqa: E402  (needs Django set up)

# POSTs to UnifiedPush endpoints and valid Windows API messages skip Django's request cycle;
# everything else is Django's. Every request, both ways, is counted for /metrics.
application = CountRequests(FastPushPath(FastUwpxPath(django_application)))
