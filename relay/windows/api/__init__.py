"""The public HTTP API (django-ninja), mounted at /api/v1/ by pushsite.urls."""
