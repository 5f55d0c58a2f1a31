"""The containers' HEALTHCHECK: GET a probe URL, exit 0 on HTTP 200.

The web process's (the image's HEALTHCHECK), and the gateway's and worker's probe listeners
(compose.yaml: http://127.0.0.1:9101/healthz and :9102; docs/production.md, "Watching it").

Standard library only (the slim image has no curl) and no Django start-up, so a probe every
few seconds costs nearly nothing. It sends the first usable ALLOWED_HOSTS entry as the Host
header: in production Django answers 400 to any other host, and a probe that only works with
`ALLOWED_HOSTS=*` would push operators to weaken it.

    python deploy/healthcheck.py [URL]      (default http://127.0.0.1:8000/healthz)
"""

from __future__ import annotations

import http.client
import os
import sys
from urllib.parse import urlsplit

DEFAULT_URL = "http://127.0.0.1:8000/healthz"
TIMEOUT_SECONDS = 5.0


def host_header(allowed_hosts: str, fallback: str) -> str:
    """The first ALLOWED_HOSTS entry a request may carry ("*" and ".domain" need a name)."""
    for entry in (item.strip() for item in allowed_hosts.split(",")):
        if entry and entry != "*":
            return entry.removeprefix(".")  # ".example.org" allows example.org itself too
    return fallback


def probe(url: str) -> int:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        print(f"healthcheck: expected an http:// URL, got {url!r}", file=sys.stderr)
        return 2
    host = host_header(os.environ.get("ALLOWED_HOSTS", ""), parts.netloc)
    connection = http.client.HTTPConnection(
        parts.hostname, parts.port or 80, timeout=TIMEOUT_SECONDS
    )
    try:
        connection.request("GET", parts.path or "/", headers={"Host": host})
        status = connection.getresponse().status
    except OSError as error:
        print(f"healthcheck: {url}: {error}", file=sys.stderr)
        return 1
    finally:
        connection.close()
    if status != 200:
        print(f"healthcheck: {url}: HTTP {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(probe(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_URL))
