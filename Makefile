# Two commands do everything on a fresh Debian machine:
#   make run   start web, gateway and worker on embedded defaults (SQLite, a file-backed broker)
#   make test  install what the tests need (system packages too, as root) and run them all
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The suite runs on PostgreSQL, RabbitMQ and Redis (as CI must), then the embedded defaults
# again. Unless TEST_DATABASE_URL / TEST_BROKER_URL / TEST_STATE_URL (and TEST_CACHE_URL) name
# servers to use, the session starts a private PostgreSQL, RabbitMQ and Redis on free ports
# (tests/support/services.py), so nothing needs to run beforehand and two runs on one machine
# never share a database or a broker.
export TEST_DATABASE_URL TEST_BROKER_URL TEST_STATE_URL TEST_CACHE_URL
WITH_SERVICES := $(BIN)/python -m tests.support.services --
SYSTEM_PACKAGES := python3-venv postgresql redis-server rabbitmq-server prosody prosody-modules lua-unbound ejabberd nginx \
	chromium chromium-driver libpostgresql-jdbc-java systemd openjdk-17-jre-headless prometheus

.PHONY: run test test-postgres test-defaults test-durations lint bench system-deps venv migrate clean

$(STAMP): pyproject.toml
	@if ! $(PYTHON) -m venv --help >/dev/null 2>&1 || ! $(PYTHON) -c "import ensurepip" 2>/dev/null; then \
		if [ "$$(id -u)" = "0" ]; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null; \
		else echo "please install python3-venv"; exit 1; fi; \
	fi
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	@touch $(STAMP)

venv: $(STAMP)

system-deps:
	@if [ "$$(id -u)" = "0" ]; then \
		missing=$$(for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
		if [ -n "$$missing" ]; then \
			echo "installing: $$missing"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
		fi; \
	else \
		echo "not root: expecting $(SYSTEM_PACKAGES) to be installed"; \
	fi

migrate: $(STAMP)
	$(BIN)/python manage.py migrate --noinput

run: $(STAMP) migrate
	$(BIN)/python manage.py collectstatic --noinput -v0
	$(BIN)/honcho start -f Procfile

# The product packages whose imports deptry checks against pyproject.toml.
PRODUCT := relay xmppgateway pushsite analytics

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/deptry $(PRODUCT)
	$(BIN)/lint-imports --no-cache
	$(BIN)/mypy

# Both suites always run, side by side: the PostgreSQL suite in two slices of whole modules
# (tests/support/shards.py), each under its own private PostgreSQL and Redis and its own VAR_DIR,
# and the embedded-defaults suite beside them. The target fails at the end if any failed, so one
# failure never hides another (tests/support/parallel.py prints a summary; logs in var/test-logs).
# No reruns: the tests wait for conditions with deadlines that hold on saturated cores
# (tests/support/waiting.py), so a test that fails once is a defect.
SUITE_POSTGRES = VAR_DIR=$$(mktemp -d) $(WITH_SERVICES) $(BIN)/python -m pytest -m "not embedded" $(PYTEST_ARGS)
SUITE_DEFAULTS = env -u DATABASE_URL -u CELERY_BROKER_URL -u CACHE_URL -u RELAY_STATE_URL \
	VAR_DIR=$$(mktemp -d) $(BIN)/python -m pytest -m defaults $(PYTEST_ARGS)
# Servers named in TEST_DATABASE_URL / TEST_BROKER_URL / TEST_STATE_URL would be shared by
# the slices (one test database, one broker queue): then the PostgreSQL suite runs as one job.
SLICES := 3
ifeq ($(TEST_DATABASE_URL)$(TEST_BROKER_URL)$(TEST_STATE_URL),)
POSTGRES_JOBS = $(foreach k,$(shell seq $(SLICES)),--job postgres-$(k) \
	'TEST_DURATIONS_OUT=var/test-logs/durations-postgres-$(k).json $(SUITE_POSTGRES) --shard $(k)/$(SLICES)')
else
POSTGRES_JOBS = --job postgres 'TEST_DURATIONS_OUT=var/test-logs/durations-postgres.json $(SUITE_POSTGRES)'
endif
# Lint runs beside the suites: one more job, not minutes before them.
test: system-deps $(STAMP)
	$(BIN)/python -m tests.support.parallel --job lint '$(MAKE) --no-print-directory lint' \
		$(POSTGRES_JOBS) --job defaults '$(SUITE_DEFAULTS)'

test-postgres: $(STAMP)
	$(SUITE_POSTGRES)

# The embedded defaults (SQLite, the file-backed broker) must keep working on a laptop.
test-defaults: $(STAMP)
	$(SUITE_DEFAULTS)

# Take the modules' times of the last `make test` into tests/durations.json (the slices balance on it).
test-durations: $(STAMP)
	$(BIN)/python -m tests.support.shards merge var/test-logs/durations-postgres*.json

# Benchmarks print their figures and write them to bench/results/*.json.
bench: $(STAMP)
	$(WITH_SERVICES) $(BIN)/python bench/relay.py
	$(WITH_SERVICES) $(BIN)/python bench/everyday_path.py
	$(WITH_SERVICES) $(BIN)/python bench/providers.py
	$(WITH_SERVICES) $(BIN)/python bench/api.py
	$(WITH_SERVICES) $(BIN)/python bench/hostile.py
	$(WITH_SERVICES) $(BIN)/python bench/links.py
	$(WITH_SERVICES) $(BIN)/python bench/analytics.py
	$(WITH_SERVICES) $(BIN)/python bench/unifiedpush.py

clean:
	rm -rf $(VENV) var
