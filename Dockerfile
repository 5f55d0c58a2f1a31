# One image for every process of the relay; the command picks the process (compose.yaml):
#   web       python -m pushsite.server                         (the default CMD)
#   gateway   python manage.py run_gateway
#   worker    celery -A pushsite worker --pool threads ...
#   beat      celery -A pushsite beat                           (exactly one per deployment)
#   uwpx      python manage.py run_uwpx_listener --idle-if-unconfigured
#   migrate   python manage.py migrate --noinput                (before the others, on upgrade)
# The same command lines as the systemd units in deploy/systemd/ (tests/test_deployment.py).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/push-relay/.venv/bin:$PATH \
    VAR_DIR=/var/lib/push-relay \
    STATIC_ROOT=/opt/push-relay/static \
    WEB_BIND=0.0.0.0:8000

# A dedicated user that owns nothing but VAR_DIR (the beat schedule; a volume in compose.yaml).
RUN groupadd --system --gid 10001 push-relay \
    && useradd --system --uid 10001 --gid push-relay --home-dir /var/lib/push-relay \
        --no-create-home --shell /usr/sbin/nologin push-relay \
    && install -d -o push-relay -g push-relay -m 0750 /var/lib/push-relay

WORKDIR /opt/push-relay
# Installed as `make run` does (an editable install of the checkout into .venv, the versions
# pinned in pyproject.toml): templates and manage.py are read from the checkout.
COPY pyproject.toml manage.py ./
COPY pushsite pushsite
COPY relay relay
COPY xmppgateway xmppgateway
COPY analytics analytics
COPY templates templates
COPY deploy deploy
RUN python -m venv .venv \
    && .venv/bin/pip install --no-cache-dir -e . \
    && python -m compileall -q pushsite relay xmppgateway analytics
# Static files are collected at build time. Settings need a SECRET_KEY to load: a throwaway
# VAR_DIR gets a generated one, which is deleted with it (never part of the image).
RUN VAR_DIR=/tmp/build-var python manage.py collectstatic --noinput -v0 \
    && rm -rf /tmp/build-var

USER 10001:10001
EXPOSE 8000 1997
# For the web process; compose.yaml turns it off for the others (they serve no HTTP yet).
HEALTHCHECK --interval=15s --timeout=6s --start-period=20s --retries=3 \
    CMD ["python", "/opt/push-relay/deploy/healthcheck.py", "http://127.0.0.1:8000/healthz"]
CMD ["python", "-m", "pushsite.server"]
