"""Where firebase-admin sends an app's FCM messages: the one module that touches private names of
firebase-admin (7.7.0) and google-auth (2.62.2), both pinned in pyproject.toml.

Everything else in `relay.providers.fcm` goes through the public API (`messaging.send`, the
public exception classes, `Certificate.get_credential`). These three have no public way:

- The FCM endpoint. firebase-admin has no option for it: `_MessagingService.__init__` formats
  Google's URL into the instance's `_fcm_url`, and `messaging.send` posts there. An app whose
  endpoint is not Google's (a fake in tests, a proxy in front of Google) gets `_fcm_url` of its
  own service replaced; the class attribute stays Google's, so apps with different endpoints
  coexist in one process.
- Retries. The service's session (`_client.session`) retries 500/503 four times with backoff
  (about 8 s) and read errors once. The relay's queue retries with its own backoff and a worker
  thread must not sleep meanwhile, so the endpoint gets a transport adapter without retries.
  The same session would re-read proxy, CA bundle and .netrc settings from the environment on
  every request; they are read once here.
- The regional access boundary. google-auth looks it up at iamcredentials.googleapis.com in a
  background thread, with the app's access token. Against an endpoint that is not Google's
  that is a needless request to Google, so the credential's
  `_is_regional_access_boundary_lookup_required` answers False there.

tests/test_fcm_endpoint.py checks, against the installed libraries, that each name exists and
is what they use: an upgrade that renames one fails there instead of sending to Google.
"""

from __future__ import annotations

import os
from typing import Any

import firebase_admin
import requests
import requests.adapters
from firebase_admin import messaging

GOOGLE_FCM_ENDPOINT = "https://fcm.googleapis.com"


def send_url(endpoint: str, project_id: str) -> str:
    return f"{endpoint.rstrip('/')}/v1/projects/{project_id}/messages:send"


def _session(app: firebase_admin.App) -> requests.Session:
    """The requests session `messaging.send` goes through for `app`."""
    session: requests.Session = messaging._get_messaging_service(app)._client.session
    return session


def point_at(app: firebase_admin.App, credential: Any, endpoint: str) -> str:
    """Make `messaging.send(..., app=app)` post to `endpoint`, once, without retries; returns
    the send URL. `credential` is the app's google-auth credential."""
    service = messaging._get_messaging_service(app)
    if not hasattr(service, "_fcm_url") or not hasattr(service, "_client"):
        raise RuntimeError("firebase-admin changed: re-check relay/providers/fcm_endpoint.py")
    url = send_url(endpoint, app.project_id)
    service._fcm_url = url
    session = _session(app)
    # requests picks the longest matching prefix, so this beats the library's own mounts.
    adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=100, max_retries=0)
    session.mount(endpoint.rstrip("/") + "/", adapter)
    session.proxies.update(requests.utils.get_environ_proxies(url))
    bundle = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE")
    if bundle and session.verify is True:
        session.verify = bundle
    session.trust_env = False
    if endpoint.rstrip("/") != GOOGLE_FCM_ENDPOINT:
        credential._is_regional_access_boundary_lookup_required = lambda: False
    return url


def close_connections(app: firebase_admin.App) -> None:
    """Close the pooled connections of `app`'s sends (`delete_app` leaves them open).

    Not the client's own `close()`: it sets the session to None under a racing send.
    """
    _session(app).close()
