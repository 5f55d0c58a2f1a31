"""The two documented ways to deploy: compose.yaml with the Dockerfile, and the systemd units.

No Docker engine runs here, so the compose file is checked by the real Compose CLI
(`docker-compose config`, which parses, validates and interpolates it) and by reading it, and
the Dockerfile by hadolint and by reading it. The systemd units are checked by
`systemd-analyze verify` and `security`, and each unit's ExecStart is RUN as a real process
with the unit's environment and an EnvironmentFile made from .env.example, against a private
PostgreSQL and Redis: every process starts, does its job, and stops cleanly on SIGTERM.
"""

from __future__ import annotations

import http.client
import io
import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from cryptography.fernet import Fernet

from relay.environment import Environment
from relay.services.credentials import records
from tests.support.ports import LOOPBACK, free_port
from tests.support.processes import ROOT, ServiceProcess
from tests.support.rabbitmq import PrivateRabbit
from tests.support.services import PrivatePostgres, PrivateRedis
from tests.support.waiting import wait_until

UNITS_DIR = ROOT / "deploy" / "systemd"
INSTALL_DIR = "/opt/push-relay"  # where the units (and the image) expect the checkout
STATE_DIR = "/var/lib/push-relay"
ENV_FILE = "/etc/push-relay/push-relay.env"
PROCESSES = ("web", "gateway", "worker", "beat", "uwpx")
APP_SERVICES = ("migrate", *PROCESSES)
HOST = "push.example.org"
BIN = Path(sys.executable).parent


# --- reading the files ---------------------------------------------------------------------------


@dataclass
class Unit:
    """A systemd unit file: every assignment of every section, in order (keys may repeat)."""

    name: str
    sections: dict[str, list[tuple[str, str]]] = field(default_factory=dict)

    @classmethod
    def read(cls, path: Path) -> Unit:
        unit = cls(path.name)
        section: list[tuple[str, str]] | None = None
        for number, raw in enumerate(path.read_text().splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith(("#", ";")):
                continue
            assert not line.endswith("\\"), f"{path.name}:{number}: no continuation lines"
            if line.startswith("["):
                section = unit.sections.setdefault(line.strip("[]"), [])
                continue
            assert section is not None and "=" in line, f"{path.name}:{number}: {line}"
            key, value = line.split("=", 1)
            section.append((key.strip(), value.strip()))
        return unit

    def all(self, section: str, key: str) -> list[str]:
        return [value for k, value in self.sections.get(section, []) if k == key]

    def one(self, section: str, key: str) -> str:
        [value] = self.all(section, key)
        return value

    def environment(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for value in self.all("Service", "Environment"):
            for assignment in shlex.split(value):
                name, _, setting = assignment.partition("=")
                env[name] = setting
        return env

    def exec_starts(self) -> list[str]:
        return self.all("Service", "ExecStart")


def units() -> dict[str, Unit]:
    """push-relay-NAME.service by NAME."""
    found = {
        path.name.removeprefix("push-relay-").removesuffix(".service"): Unit.read(path)
        for path in sorted(UNITS_DIR.glob("push-relay-*.service"))
    }
    assert found, "no units"
    return found


def read_env_file(text: str) -> dict[str, str]:
    """KEY=value lines as systemd's EnvironmentFile= and Compose's .env read them (the simple
    form both agree on: no quotes, no comment after a value)."""
    values: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        name, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Z][A-Z0-9_]*", name), f"line {number}: {raw!r}"
        assert " #" not in value and not value.startswith(("'", '"')), f"line {number}: {raw!r}"
        values[name] = value
    return values


def expand(command: str, env: dict[str, str]) -> list[str]:
    """An ExecStart line as systemd runs it: words, then ${NAME} replaced inside each word."""
    assert not re.search(r"\$(?!\{)", command), f"use ${{NAME}} only: {command}"
    assert command[0] not in "-@:+!", f"no ExecStart prefixes: {command}"

    def value(match: re.Match[str]) -> str:
        assert match.group(1) in env, f"{match.group(1)} is not set for: {command}"
        return env[match.group(1)]

    return [re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", value, word) for word in shlex.split(command)]


def shell_defaults(command: str) -> list[str]:
    """A Procfile line with its ${NAME:-default} expanded to the defaults."""
    return shlex.split(re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", command))


def procfile() -> dict[str, list[str]]:
    lines = (ROOT / "Procfile").read_text().splitlines()
    return {
        name: shell_defaults(command)
        for name, _, command in (line.partition(":") for line in lines if line.strip())
    }


@dataclass
class Instruction:
    keyword: str
    arguments: str


def dockerfile() -> list[Instruction]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    return [
        Instruction(*[*line.strip().split(None, 1), ""][:2])
        for line in text.splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]


def normalized(argv: list[str]) -> list[str]:
    """What must match between the routes: the program (not where it is installed) and every
    argument except a bind address, which differs on purpose (a container listens on all its
    interfaces, a host on loopback behind the proxy)."""
    words = [Path(argv[0]).name, *argv[1:]]
    if "--bind" in words:
        words[words.index("--bind") + 1] = "<bind>"
    return words


def variables_the_code_reads() -> set[str]:
    """What relay/environment.py declares for the Python code, and the few names read
    straight from os.environ (tools that run before or without Django's settings)."""
    from relay.environment import declared

    found = {
        env for _, env, info in declared() if not (info.json_schema_extra or {}).get("read_by")
    }
    pattern = re.compile(
        r"(?:os\.environ\.get|os\.getenv|\benv\.get)\(\s*\"([A-Z][A-Z0-9_]*)\""
        r"|os\.environ\[\s*\"([A-Z][A-Z0-9_]*)\"\s*\]"
    )
    for package in ("pushsite", "relay", "xmppgateway", "analytics"):
        for path in (ROOT / package).rglob("*.py"):
            for match in pattern.finditer(path.read_text()):
                found.add(match.group(1) or match.group(2))
    assert {"SECRET_KEY", "DATABASE_URL", "RELAY_SEND_MAX_ATTEMPTS", "REQUESTS_CA_BUNDLE"} <= found
    return found


def compose_interpolations() -> set[str]:
    return set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)", (ROOT / "compose.yaml").read_text()))


def unit_variables() -> set[str]:
    return {
        name
        for unit in units().values()
        for command in unit.exec_starts()
        for name in re.findall(r"\$\{([A-Z][A-Z0-9_]*)\}", command)
    }


def env_example() -> dict[str, str]:
    """Every name in .env.example, set or shown commented out with its default."""
    text = (ROOT / ".env.example").read_text()
    names = dict(read_env_file(text))
    for line in text.splitlines():
        match = re.fullmatch(r"# ([A-Z][A-Z0-9_]*)=(\S*)", line.strip())
        if match:
            names.setdefault(match.group(1), match.group(2))
    return names


def compose_config(env_text: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`docker-compose config` (the real Compose CLI, no engine needed) with this .env."""
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    (project / ".env").write_text(env_text)
    return subprocess.run(
        [str(BIN / "docker-compose"), "--project-directory", str(project),
         "-f", str(ROOT / "compose.yaml"), "config", "--format", "json"],
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def filled_env(**values: str) -> str:
    """.env.example with the required values filled in (and more, as given)."""
    text = (ROOT / ".env.example").read_text()
    for name, value in values.items():
        line = f"{name}={value}"
        text, count = re.subn(rf"(?m)^(# )?{name}=.*$", line, text, count=1)
        if not count:
            text += f"\n{line}\n"
    return text


def required_values() -> dict[str, str]:
    return {
        "SECRET_KEY": "k" * 40 + "-deployment-test-" + "z" * 20,
        "CREDENTIAL_KEYS": Fernet.generate_key().decode(),
        "UNIFIEDPUSH_KEYS": Fernet.generate_key().decode(),  # base64url of 32 bytes, too
        "ALLOWED_HOSTS": HOST,
        "CSRF_TRUSTED_ORIGINS": f"https://{HOST}",
        "POSTGRES_PASSWORD": "compose-test-password",
        "RABBITMQ_PASSWORD": "rabbit-test-password",
        "RABBITMQ_ERLANG_COOKIE": "c" * 32,
    }


# --- the files agree with each other and with the code -------------------------------------------


def test_every_route_runs_the_same_five_processes_and_a_migration(tmp_path):
    found = units()
    assert set(found) == set(APP_SERVICES)
    unit_argv = {
        name: [normalized(expand(command, unit.environment())) for command in unit.exec_starts()]
        for name, unit in found.items()
    }
    result = compose_config(filled_env(**required_values()), tmp_path)
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    assert set(services) == {*APP_SERVICES, "postgres", "redis", "rabbit1", "rabbit2", "rabbit3"}
    for name in APP_SERVICES:
        assert normalized(services[name]["command"]) == unit_argv[name][0], name
    # The unit's migration also collects the static files, which the image does at build.
    assert unit_argv["migrate"][1] == ["python", "manage.py", "collectstatic", "--noinput", "-v0"]
    assert len(unit_argv["migrate"]) == 2
    assert all(len(unit_argv[name]) == 1 for name in PROCESSES)

    # The Procfile of `make run` names the same processes with the same defaults.
    assert {name: normalized(argv) for name, argv in procfile().items()} == {
        name: unit_argv[name][0] for name in PROCESSES
    }
    # The image's default command is the web process; every command exists in the image.
    [cmd] = [i for i in dockerfile() if i.keyword == "CMD"]
    assert json.loads(cmd.arguments) == services["web"]["command"]
    for name in APP_SERVICES:
        program = services[name]["command"][0]
        assert (BIN / program).exists(), f"{program} is not installed by `pip install -e .`"


def test_the_units_install_and_harden_every_process():
    for name, unit in units().items():
        assert unit.one("Unit", "PartOf") == "push-relay.target", name
        assert unit.one("Install", "WantedBy") == "push-relay.target", name
        assert unit.one("Service", "User") == "push-relay", name
        assert unit.one("Service", "WorkingDirectory") == INSTALL_DIR, name
        assert unit.one("Service", "EnvironmentFile") == ENV_FILE, name
        assert unit.environment()["VAR_DIR"] == STATE_DIR, name
        service = dict(unit.sections["Service"])
        assert service["NoNewPrivileges"] == "yes", name
        assert service["ProtectSystem"] == "strict", name
        assert service["PrivateTmp"] == "yes", name
        assert unit.all("Service", "ReadWritePaths") == [STATE_DIR], name
        assert unit.one("Service", "StateDirectory") == "push-relay", name
        for command in unit.exec_starts():
            assert command.startswith(f"{INSTALL_DIR}/.venv/bin/"), command
        if name == "migrate":
            assert service["Type"] == "oneshot" and service["RemainAfterExit"] == "yes"
            assert "Restart" not in service
        else:
            assert service["Restart"] == "on-failure", name
            assert service["KillMode"] == "mixed", name  # SIGTERM to the main process only
            assert "push-relay-migrate.service" in unit.one("Unit", "After").split(), name
    # The web process's connections stay below its open-file limit (docs/web.md).
    cap = Environment.model_fields["web_max_connections"].default
    assert int(units()["web"].one("Service", "LimitNOFILE")) >= cap + 128
    target = Unit.read(UNITS_DIR / "push-relay.target")
    assert target.one("Install", "WantedBy") == "multi-user.target"


def test_systemd_accepts_the_units_and_rates_them_well_hardened(tmp_path):
    """`systemd-analyze verify` (syntax, every key known, the programs exist) and `security`
    (the exposure score of the hardening), on copies whose paths point at this checkout."""
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is missing: install systemd (`make test` does, as root)"
    (tmp_path / "push-relay.env").write_text(filled_env(**required_values()))
    for path in [*UNITS_DIR.glob("*.service"), UNITS_DIR / "push-relay.target"]:
        text = path.read_text().replace(ENV_FILE, str(tmp_path / "push-relay.env"))
        (tmp_path / path.name).write_text(text.replace(INSTALL_DIR, str(ROOT)))
    names = sorted(p.name for p in tmp_path.glob("push-relay*.*") if p.suffix != ".env")
    verify = subprocess.run(
        [analyze, "verify", "--man=no", *names], cwd=tmp_path, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert verify.returncode == 0 and verify.stdout + verify.stderr == "", verify.stderr
    for name in names:
        if not name.endswith(".service"):
            continue
        security = subprocess.run(
            [analyze, "security", "--offline=true", name], cwd=tmp_path, capture_output=True,
            text=True, timeout=60, check=False,
        )  # fmt: skip
        score = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", security.stdout)
        assert score, security.stdout + security.stderr
        # 0 is a sandbox, 10 no protection at all; systemd calls up to 2.0 "OK".
        assert float(score.group(1)) <= 2.0, f"{name}: {score.group(0)}"


def test_env_example_and_the_configuration_table_are_generated_from_the_declarations():
    from relay.management.commands.environment import generated

    for path, text in generated(ROOT).items():
        assert path.read_text() == text, f"{path.name}: run `manage.py environment --write`"


def test_env_example_lists_every_variable_the_code_and_the_command_lines_read():
    listed = env_example()
    code = variables_the_code_reads()
    assert code - set(listed) == set(), "read by the code but not in .env.example"
    # Nothing else: each name is read by the code, a unit's or the Procfile's command line, or
    # compose.yaml.
    procfile_variables = set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)", (ROOT / "Procfile").read_text()))
    others = unit_variables() | procfile_variables | compose_interpolations()
    assert set(listed) - code - others == set(), "in .env.example but read by nothing"
    assert unit_variables() <= set(listed) and compose_interpolations() <= set(listed)
    # Each name comes with a comment: the line before it is a comment or another commented
    # default of the same group.
    lines = (ROOT / ".env.example").read_text().splitlines()
    for index, line in enumerate(lines):
        if re.match(r"(# )?[A-Z][A-Z0-9_]*=", line):
            assert index and lines[index - 1].startswith("#"), f"no comment for {line!r}"
    # The required ones are set (empty) rather than commented out, so they cannot be missed.
    required = {
        "DEPLOYMENT",
        "SECRET_KEY",
        "CREDENTIAL_KEYS",
        "UNIFIEDPUSH_KEYS",
        "ALLOWED_HOSTS",
        "POSTGRES_PASSWORD",
    }
    assert required <= set(read_env_file("\n".join(lines)))


def test_the_compose_file_wires_databases_healthchecks_and_beat_once(tmp_path):
    raw = yaml.safe_load((ROOT / "compose.yaml").read_text())
    result = compose_config(filled_env(**required_values()), tmp_path)
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    code = variables_the_code_reads()
    images = {services[name]["image"] for name in APP_SERVICES}
    assert images == {"push-relay:latest"}, "one image for every process"
    for name in APP_SERVICES:
        service = services[name]
        assert service["build"]["context"] == str(tmp_path / "project")
        # Settings come from .env; compose.yaml itself sets only names the settings read.
        written = raw["services"][name]  # PyYAML applies the `<<` merge keys
        assert written["env_file"] == [{"path": ".env", "required": True}], name
        assert set(written["environment"]) <= code, f"{name}: {set(written['environment']) - code}"
        needs = {dep: spec["condition"] for dep, spec in service["depends_on"].items()}
        if name == "migrate":
            assert needs == {"postgres": "service_healthy"}
            assert service["restart"] == "no"
        else:
            assert needs == {
                "postgres": "service_healthy",
                "redis": "service_healthy",
                "rabbit1": "service_healthy",
                "rabbit2": "service_healthy",
                "rabbit3": "service_healthy",
                "migrate": "service_completed_successfully",
            }, name
    environment = services["web"]["environment"]
    assert environment["DATABASE_URL"] == (
        "postgres://relay:compose-test-password@postgres:5432/relay"
    )
    # The broker: every node of the three-node RabbitMQ cluster, for failover.
    nodes = environment["CELERY_BROKER_URL"].split(";")
    assert nodes == [f"amqp://relay:rabbit-test-password@rabbit{n}:5672//" for n in (1, 2, 3)]
    cookies = {services[f"rabbit{n}"]["environment"]["RABBITMQ_ERLANG_COOKIE"] for n in (1, 2, 3)}
    assert cookies == {"c" * 32}, "one cookie: one cluster"
    assert environment["RELAY_STATE_URL"].startswith("redis://redis:6379/")
    assert environment["CACHE_URL"].startswith("redis://redis:6379/")
    assert environment["CACHE_URL"] != environment["RELAY_STATE_URL"]
    assert services["uwpx"]["environment"]["UWPX_LISTEN_ADDRESS"] == "0.0.0.0"
    assert environment["WEB_BIND"] == "0.0.0.0:8000"  # inside the container: all interfaces
    assert services["web"]["ulimits"]["nofile"] == {"soft": 65536, "hard": 65536}

    # The web process has the image's healthcheck, the gateway and the worker probe their own
    # listener (reachable by Prometheus on the network); beat is one, forever.
    [healthcheck] = [i for i in dockerfile() if i.keyword == "HEALTHCHECK"]
    web_test = services["web"]["healthcheck"]["test"]
    assert json.dumps(web_test[1:]) in healthcheck.arguments and web_test[0] == "CMD"
    for name, variable, port in (
        ("gateway", "GATEWAY_PROBE_LISTEN", 9101),
        ("worker", "WORKER_PROBE_LISTEN", 9102),
    ):
        assert services[name]["environment"][variable] == f"0.0.0.0:{port}"
        test = services[name]["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "/opt/push-relay/deploy/healthcheck.py"], name
        assert test[3] == f"http://127.0.0.1:{port}/healthz", name
        assert services[name]["environment"]["DATABASE_URL"] == environment["DATABASE_URL"]
    for name in ("beat", "uwpx", "migrate"):
        assert services[name]["healthcheck"] == {"disable": True}, name
    assert services["beat"]["deploy"]["replicas"] == 1
    assert all("deploy" not in services[name] for name in APP_SERVICES if name != "beat")
    assert any(v["target"] == STATE_DIR for v in services["beat"]["volumes"])

    # PostgreSQL and Redis: named volumes, healthchecks, Redis durable and never evicting.
    for name, data in (("postgres", "/var/lib/postgresql/data"), ("redis", "/data")):
        [volume] = services[name]["volumes"]
        assert volume["type"] == "volume" and volume["target"] == data, name
        assert services[name]["healthcheck"]["test"][0] == "CMD", name
        assert raw["volumes"][volume["source"]] is None  # declared, named
    redis_command = services["redis"]["command"]
    assert redis_command[redis_command.index("--maxmemory-policy") + 1] == "noeviction"
    assert redis_command[redis_command.index("--appendonly") + 1] == "yes"
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD"] == "compose-test-password"


def test_compose_refuses_to_start_without_the_database_password(tmp_path):
    values = required_values()
    del values["POSTGRES_PASSWORD"]
    result = compose_config(filled_env(**values), tmp_path)
    assert result.returncode != 0
    assert "set POSTGRES_PASSWORD in .env" in result.stderr


def test_the_dockerfile_builds_a_slim_non_root_image_with_the_app_installed():
    lint = subprocess.run(
        [str(BIN / "hadolint"), "--no-color", str(ROOT / "Dockerfile")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert lint.returncode == 0, lint.stdout + lint.stderr
    instructions = dockerfile()
    keywords = [i.keyword for i in instructions]
    assert instructions[0].keyword == "FROM" and instructions[0].arguments == "python:3.11-slim"
    [user] = [i.arguments for i in instructions if i.keyword == "USER"]
    assert user.split(":")[0] not in ("0", "root")
    # The user is made in the image, and it switches to it after everything is installed.
    assert "useradd --system --uid " + user.split(":")[0] in " ".join(
        i.arguments for i in instructions if i.keyword == "RUN"
    )
    assert keywords.index("USER") > max(k for k, word in enumerate(keywords) if word == "RUN")
    runs = " ".join(i.arguments for i in instructions if i.keyword == "RUN")
    assert "pip install --no-cache-dir -e ." in runs  # the versions pinned in pyproject.toml
    assert "manage.py collectstatic --noinput" in runs
    env = " ".join(i.arguments for i in instructions if i.keyword == "ENV")
    assert f"VAR_DIR={STATE_DIR}" in env and f"PATH={INSTALL_DIR}/.venv/bin" in env
    [workdir] = [i.arguments for i in instructions if i.keyword == "WORKDIR"]
    assert workdir == INSTALL_DIR  # the units' WorkingDirectory: same paths in both routes
    # What the image copies exists, and .dockerignore keeps secrets and local state out.
    copied = [i.arguments.split()[:-1] for i in instructions if i.keyword == "COPY"]
    for sources in copied:
        for source in sources:
            assert (ROOT / source).exists(), source
    ignored = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert {".env", ".venv", "var", ".git"} <= set(ignored)
    assert not {source for sources in copied for source in sources} & set(ignored)
    [healthcheck] = [i.arguments for i in instructions if i.keyword == "HEALTHCHECK"]
    assert "/opt/push-relay/deploy/healthcheck.py" in healthcheck and "/healthz" in healthcheck


@pytest.mark.django_db
def test_tenants_example_is_a_complete_document_load_tenants_accepts(tmp_path):
    from django.core.management import call_command

    from relay.models import App, Component, Tenant
    from tests.fakes.apns import make_p8_key
    from tests.fakes.fcm import make_service_account

    example = tmp_path / "tenants.yaml"
    shutil.copy(ROOT / "tenants.example.yaml", example)
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    account = make_service_account("https://oauth2.googleapis.com/token", "example-project")
    (credentials / "conversations-firebase.json").write_text(json.dumps(account))
    (credentials / "AuthKey_ABC123DEFG.p8").write_text(make_p8_key()[0])
    (credentials / "uwpx-wns-secret.txt").write_text("the-wns-client-secret\n")

    out = io.StringIO()
    call_command("load_tenants", str(example), "--dry-run", stdout=out)
    assert out.getvalue().splitlines()[:6] == [
        "tenant example: created",
        "app example/conversations: created",
        "app example/uwpx: created",
        "component push.example.org: created",
        "UnifiedPush push.example.org: created",
        "component push.uwpx.example.org: created",
    ]
    assert not Tenant.objects.exists()
    call_command("load_tenants", str(example), stdout=out)
    app = App.objects.get(name="conversations")
    assert records.values_of(app, "fcm")["service_account"]
    assert records.values_of(app, "apns")["key"]
    assert records.values_of(app, "apns")["topic"] == "eu.siacs.conversations"
    uwpx = App.objects.get(name="uwpx")
    assert records.values_of(uwpx, "wns")["secret"] == "the-wns-client-secret"
    component = Component.objects.get(jid="push.example.org")
    assert component.host == "xmpp.example.org"
    assert component.unifiedpush_settings.endpoint_url == "https://push.example.org"


# --- the units' command lines, run -----------------------------------------------------------


@dataclass
class Deployment:
    """What a host running the units has: a database, a broker, VAR_DIR, the env file."""

    env_file: Path
    var_dir: Path
    web_port: int
    postgres: PrivatePostgres
    gateway_probe_port: int = 0
    worker_probe_port: int = 0


def unit_env(unit: Unit, deployment: Deployment) -> dict[str, str]:
    """The environment systemd gives the unit's process: its own basics, Environment=, then
    the EnvironmentFile (which wins), with the install and state paths of this test."""
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "LANG": "C.UTF-8", "HOME": str(deployment.var_dir)}  # fmt: skip
    env.update(unit.environment())
    env.update(read_env_file(deployment.env_file.read_text()))
    return {name: relocate(value, deployment) for name, value in env.items()}


def relocate(text: str, deployment: Deployment) -> str:
    return text.replace(INSTALL_DIR, str(ROOT)).replace(STATE_DIR, str(deployment.var_dir))


def unit_argv(unit: Unit, command: str, deployment: Deployment) -> list[str]:
    env = unit_env(unit, deployment)
    return [relocate(word, deployment) for word in expand(command, env)]


def start_unit(name: str, deployment: Deployment) -> ServiceProcess:
    unit = units()[name]
    assert relocate(unit.one("Service", "WorkingDirectory"), deployment) == str(ROOT)
    [command] = unit.exec_starts()
    return ServiceProcess(name, unit_argv(unit, command, deployment), unit_env(unit, deployment))


@pytest.fixture(scope="module")
def deployment(tmp_path_factory) -> Iterator[Deployment]:
    folder = tmp_path_factory.mktemp("deployment")
    var_dir = folder / "var"
    var_dir.mkdir()
    web_port, gateway_probe_port, worker_probe_port = free_port(), free_port(), free_port()
    with PrivatePostgres() as postgres, PrivateRedis() as redis, PrivateRabbit() as rabbit:
        database = postgres.create_database("relay")
        env_file = folder / "push-relay.env"
        env_file.write_text(
            filled_env(
                **required_values(),
                DATABASE_URL=database,
                CELERY_BROKER_URL=rabbit.url(),
                RELAY_STATE_URL=redis.url(0),
                CACHE_URL=redis.url(1),
                WEB_BIND=f"{LOOPBACK}:{web_port}",
                GATEWAY_PROBE_LISTEN=f"{LOOPBACK}:{gateway_probe_port}",
                WORKER_PROBE_LISTEN=f"{LOOPBACK}:{worker_probe_port}",
                # Beat sends its housekeeping task every second, so the worker runs it here.
                RELAY_UWPX_STALE_CHECK_SECONDS="1",
            )
        )
        yield Deployment(
            env_file, var_dir, web_port, postgres, gateway_probe_port, worker_probe_port
        )


def get(port: int, path: str, **headers: str) -> tuple[int, dict[str, str], str]:
    connection = http.client.HTTPConnection(LOOPBACK, port, timeout=10)
    try:
        connection.request("GET", path, headers={"Host": HOST, **headers})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read().decode()
    finally:
        connection.close()


def events(process: ServiceProcess) -> list[str]:
    """The `event` of every JSON log line of the process."""
    found = []
    for line in process.log_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and "event" in entry:
            found.append(entry["event"])
    return found


def healthcheck(port: int, deployment: Deployment) -> subprocess.CompletedProcess[str]:
    """The image's HEALTHCHECK command, aimed at this test's web port."""
    [instruction] = [i for i in dockerfile() if i.keyword == "HEALTHCHECK"]
    argv = json.loads(instruction.arguments.split("CMD", 1)[1])
    argv = [relocate(word, deployment).replace(":8000/", f":{port}/") for word in argv]
    argv[0] = sys.executable
    env = {"PATH": "/usr/bin:/bin", "ALLOWED_HOSTS": HOST}
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30, check=False)


def test_each_unit_runs_does_its_job_and_stops_cleanly_on_sigterm(deployment):
    # 1. The one-shot: migrations and static files, each ExecStart in turn, as systemd does.
    migrate = units()["migrate"]
    for command in migrate.exec_starts():
        result = subprocess.run(
            unit_argv(migrate, command, deployment), cwd=ROOT,
            env=unit_env(migrate, deployment), capture_output=True, text=True, timeout=300,
            check=False,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
    applied = deployment.postgres.psql("SELECT count(*) FROM django_migrations", dbname="relay")
    assert int(applied) > 10
    assert (deployment.var_dir / "static" / "staticfiles.json").exists()

    # 2. The five processes, at once, as `systemctl start push-relay.target` starts them.
    processes = {name: start_unit(name, deployment) for name in PROCESSES}
    try:
        port = deployment.web_port

        def web_answers() -> bool:
            try:
                return get(port, "/healthz")[0] == 200
            except OSError:
                return False

        wait_until(web_answers, timeout=60)
        status, _, body = get(port, "/readyz")
        assert status == 200 and json.loads(body)["checks"] == {
            "database": True,
            "broker": True,
            "throttling": True,
            "cache": True,
        }
        # Behind the TLS proxy (X-Forwarded-Proto: https) the admin answers; without it,
        # production redirects to https.
        status, _, page = get(port, "/admin/login/", **{"X-Forwarded-Proto": "https"})
        assert status == 200 and "csrfmiddlewaretoken" in page
        stylesheet = re.search(r'href="(/static/[^"]+\.css)"', page)
        assert stylesheet, "no stylesheet on the login page"
        assert get(port, stylesheet.group(1), **{"X-Forwarded-Proto": "https"})[0] == 200
        status, headers, _ = get(port, "/admin/login/")
        assert status == 301 and headers["Location"] == f"https://{HOST}/admin/login/"
        check = healthcheck(port, deployment)
        assert check.returncode == 0, check.stderr

        wait_until(lambda: "gateway.started" in events(processes["gateway"]), timeout=60)

        # The gateway's and the worker's probe listeners (no component: nothing to wait for).
        def ready(probe_port: int) -> bool:
            try:
                return get(probe_port, "/readyz")[0] == 200
            except OSError:
                return False

        for probe_port in (deployment.gateway_probe_port, deployment.worker_probe_port):
            wait_until(lambda p=probe_port: ready(p), timeout=60)
            assert get(probe_port, "/healthz")[0] == 200
            assert "relay_" in get(probe_port, "/metrics")[2]
        # Beat sends the housekeeping task every second; the worker runs it on the database.
        wait_until(lambda: "uwpx.stale_devices_removed" in processes["worker"].log_text(), 90)
        assert "Sending due task remove-stale-uwpx-devices" in processes["beat"].log_text()
        wait_until(lambda: "uwpx_listener.disabled" in events(processes["uwpx"]), timeout=60)
        for name, process in processes.items():
            assert process.alive(), f"{name} died:\n{process.log_text()[-3000:]}"
    finally:
        # 3. SIGTERM to each main process (KillMode=mixed), as `systemctl stop` sends it.
        for process in processes.values():
            if process.alive():
                process.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        codes: dict[str, int | None] = {}
        for name, process in processes.items():
            try:
                codes[name] = process.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[name] = None  # still running: killed now
            process.stop(timeout=1)
    logs = {name: process.log_text() for name, process in processes.items()}
    assert codes == dict.fromkeys(PROCESSES, 0), {n: logs[n][-2000:] for n in codes if codes[n]}
    for name, text in logs.items():
        assert "Traceback" not in text, f"{name}:\n{text[-3000:]}"
    assert "gateway.stopped" in events(processes["gateway"])
    assert "uwpx_listener.disabled" in events(processes["uwpx"])
    # The web process is gone: the image's healthcheck says so.
    assert healthcheck(deployment.web_port, deployment).returncode == 1
