"""Django as a WSGI application: served by the web process (pushsite/server.py) for every
path the UnifiedPush resource does not take."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "pushsite.settings")
application = get_wsgi_application()
