"""The deployment files: Dockerfile, .dockerignore, docker-compose.yml and deploy/.

No Docker engine runs here, so the files are checked for what the project relies on: the compose
file against a JSON schema of those parts, and by ``config`` of each compose tool it supports
(Compose v2 when installed; Debian's docker-compose 1.29, which ``make test`` installs), its
settings against the server's real ones, and both health checks by running them against a small
local HTTP server. The nginx config is run for real: Debian's nginx (``make
test`` installs it) in front of two ``ordinal serve`` processes on loopback ports; without nginx
that test skips, except under CI (``CI`` set), where it fails.
"""

from __future__ import annotations

import http.server
import itertools
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import yaml

import model.cpu as cpu
import model.kernels as kernels
from tests.server.conftest import free_socket, sse_events

REPO = Path(__file__).resolve().parents[1]
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
SERVE_COMMAND = ["ordinal", "serve", "--host", "0.0.0.0"]
CHECKPOINTS_MOUNT = "./checkpoints:/app/checkpoints:ro"
DURATION = {"type": "string", "pattern": r"^\d+(ms|s|m|h)$"}

HEALTHCHECK_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["test", "interval", "timeout", "retries", "start_period"],
    "properties": {
        "test": {
            "type": "array",
            "items": {"type": "string"},
            "prefixItems": [{"enum": ["CMD", "CMD-SHELL"]}],
            "contains": {"pattern": "/health"},
        },
        "interval": DURATION,
        "timeout": DURATION,
        "start_period": DURATION,
        "retries": {"type": "integer", "minimum": 1},
    },
}
SERVICE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["build", "ports", "volumes", "environment", "healthcheck", "restart"],
    "properties": {
        "build": {
            "type": "object",
            "required": ["context"],
            "properties": {"context": {"const": "."}, "dockerfile": {"const": "Dockerfile"}},
        },
        "ports": {"type": "array", "minItems": 1, "items": {"pattern": r"^\d+:\d+$"}},
        # Every mount read-only, the checkpoints among them.
        "volumes": {
            "type": "array",
            "items": {"type": "string", "pattern": ":ro$"},
            "contains": {"const": CHECKPOINTS_MOUNT},
        },
        "environment": {
            "type": "object",
            "propertyNames": {"pattern": "^ORDINAL_[A-Z0-9_]+$"},
            "additionalProperties": {"type": ["string", "null"]},
        },
        "healthcheck": HEALTHCHECK_SCHEMA,
        "restart": {"const": "unless-stopped"},
    },
}


def at(path: str, schema: dict[str, Any]) -> dict[str, Any]:
    """A schema requiring ``schema`` at the dotted ``path`` of nested objects."""
    for key in reversed(path.split(".")):
        schema = {"type": "object", "required": [key], "properties": {key: schema}}
    return schema


NVIDIA_GPU = {
    "required": ["driver", "count", "capabilities"],
    "properties": {
        "driver": {"const": "nvidia"},
        "count": {"const": 1},
        "capabilities": {"contains": {"const": "gpu"}},
    },
}
GPU_SCHEMA: dict[str, Any] = {
    "allOf": [
        at("profiles", {"const": ["gpu"]}),
        at("environment.ORDINAL_DEVICE", {"const": "cuda"}),
        at("environment.ORDINAL_DTYPE", {"const": "bfloat16"}),
        at("deploy.resources.reservations.devices", {"type": "array", "contains": NVIDIA_GPU}),
    ]
}
COMPOSE_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["services"],
    "properties": {
        "services": {
            "type": "object",
            "required": ["ordinal", "ordinal-gpu"],
            "properties": {
                "ordinal": {
                    "allOf": [SERVICE_SCHEMA],
                    "properties": {"ports": {"contains": {"const": "8000:8000"}}},
                    "not": {"required": ["profiles"]},  # `docker compose up` must start it
                },
                "ordinal-gpu": {"allOf": [SERVICE_SCHEMA, GPU_SCHEMA]},
            },
        }
    },
}


def load_compose() -> dict[str, Any]:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def interpolate(value: str | None) -> str | None:
    """The value compose gives ``${NAME:-default}`` when NAME is unset (tests run unset)."""
    if value is None:
        return None
    return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", value)


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, with continuation lines joined and comments dropped."""
    text = (REPO / "Dockerfile").read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    pairs = [line.strip().split(maxsplit=1) for line in joined.splitlines() if line.strip()]
    return [(pair[0].upper(), pair[1] if len(pair) > 1 else "") for pair in pairs]


def expand_build_args(instructions: list[tuple[str, str]], text: str) -> str:
    """``text`` with ``${ARG}`` replaced by the ARG defaults declared in the Dockerfile."""
    defaults = dict(arg.split("=", 1) for name, arg in instructions if name == "ARG" and "=" in arg)
    return re.sub(r"\$\{(\w+)\}", lambda match: defaults.get(match[1], match[0]), text)


def test_compose_file_has_the_parts_we_rely_on() -> None:
    jsonschema.validate(load_compose(), COMPOSE_SCHEMA)


MISTAKES = {
    "writable checkpoints": ("ordinal", "volumes", ["./checkpoints:/app/checkpoints"]),
    "healthcheck off /health": ("ordinal", "healthcheck", {"test": ["CMD", "true"]}),
    "unprefixed setting": ("ordinal", "environment", {"PORT": "8000"}),
    "gpu always on": ("ordinal-gpu", "profiles", []),
    "gpu without device": ("ordinal-gpu", "deploy", {"resources": {}}),
}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_compose_schema_rejects_mistakes(mistake: str) -> None:
    service, key, value = MISTAKES[mistake]
    compose = load_compose()
    compose["services"][service][key] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(compose, COMPOSE_SCHEMA)


@pytest.mark.parametrize("service", ["ordinal", "ordinal-gpu"])
def test_compose_environment_is_valid_settings(
    service: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from server.api.settings import Settings

    environment = load_compose()["services"][service]["environment"]
    # pydantic-settings ignores unknown ORDINAL_* variables, so names are checked by hand.
    prefix = Settings.model_config["env_prefix"]
    known = {prefix + name.upper() for name in Settings.model_fields}
    assert set(environment) <= known, f"not settings: {sorted(set(environment) - known)}"
    for name in known:
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        if value is not None:  # no value: passed through from the host shell
            monkeypatch.setenv(name, interpolate(value))
    settings = Settings()  # raises, naming the field, on a value the server would refuse
    assert str(settings.checkpoints) == CHECKPOINTS_MOUNT.split(":")[1]


def test_containers_listen_where_ports_and_healthcheck_point() -> None:
    exposed = {arg for name, arg in dockerfile_instructions() if name == "EXPOSE"}
    for name in ("ordinal", "ordinal-gpu"):
        service = load_compose()["services"][name]
        container_ports = {mapping.split(":")[-1] for mapping in service["ports"]}
        assert container_ports == {interpolate(service["environment"]["ORDINAL_PORT"])}
        assert container_ports <= exposed


def test_scale_profile_puts_replicas_behind_nginx() -> None:
    services = load_compose()["services"]
    replica, nginx = services["ordinal-replica"], services["nginx"]
    assert replica["profiles"] == nginx["profiles"] == ["scale"]
    jsonschema.validate({**replica, "ports": ["1:1"]}, SERVICE_SCHEMA)  # a server like the others
    assert "ports" not in replica  # reached through nginx only, so replicas > 1 cannot clash
    assert int(interpolate(str(replica["deploy"]["replicas"]))) == 2
    assert nginx["depends_on"]["ordinal-replica"]["condition"] == "service_healthy"
    assert "./deploy/nginx.conf.template:/etc/ordinal/nginx.conf.template:ro" in nginx["volumes"]
    environment = nginx["environment"]
    host, port = environment["UPSTREAM"].split(":")
    assert host == "ordinal-replica" and port == replica["environment"]["ORDINAL_PORT"]
    assert nginx["ports"] == [f"{environment['NGINX_LISTEN']}:{environment['NGINX_LISTEN']}"]


@pytest.mark.skipif(shutil.which("envsubst") is None, reason="envsubst (gettext-base) missing")
def test_compose_renders_the_nginx_config_like_the_test_does(tmp_path: Path) -> None:
    """The nginx service's envsubst leaves nginx's own variables alone and yields the config the
    nginx test runs, with the replica service as the one upstream name."""
    nginx = load_compose()["services"]["nginx"]
    script = nginx["command"][2].replace("$$", "$")  # compose's escape for a literal $
    envsubst = re.search(r"envsubst '[^']*'", script)[0]
    rendered = subprocess.run(
        f"{envsubst} < {NGINX_TEMPLATE}",
        shell=True,
        env={**nginx["environment"], "PATH": os.environ["PATH"], "host": "WRONG"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    environment = nginx["environment"]
    expected = render_nginx_config(
        environment["NGINX_LISTEN"], [environment["UPSTREAM"]], environment["NGINX_ACCESS_LOG"]
    )
    assert rendered == expected
    assert "proxy_set_header Host $host;" in rendered


# The compose tools the file is for: Compose v2 (the docker plugin) and Debian's docker-compose
# 1.29 (the v1 tool, which `make test` installs). Each one installed must accept the file.
COMPOSE_TOOLS = {"docker compose": ["docker", "compose"], "docker-compose": ["docker-compose"]}


def compose_installed(command: list[str]) -> bool:
    if not shutil.which(command[0]):
        return False
    return subprocess.run([*command, "version"], capture_output=True).returncode == 0


def compose_tools() -> list[list[str]]:
    """The command of each supported compose tool that is installed."""
    return [command for command in COMPOSE_TOOLS.values() if compose_installed(command)]


@pytest.mark.parametrize("tool", list(COMPOSE_TOOLS))
def test_compose_tool_accepts_the_file(tool: str) -> None:
    command = COMPOSE_TOOLS[tool]
    if not compose_installed(command):
        if tool == "docker-compose" and os.environ.get("CI"):
            pytest.fail("docker-compose is not installed (CI is set: `make test` installs it)")
        pytest.skip(f"{tool} is not installed; the schema test covers the file")
    for profile in ("gpu", "scale", "monitoring"):
        result = subprocess.run(
            [*command, "--profile", profile, "config", "-q"],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, f"{tool} --profile {profile}: {result.stderr}"


def test_every_build_names_a_dockerfile_that_exists() -> None:
    """compose's ``config`` does not open the Dockerfiles: this does. A service built from no
    Dockerfile runs a published image at a pinned version."""
    for name, service in load_compose()["services"].items():
        if "build" not in service:
            assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", service["image"]), name
            continue
        build = service["build"]
        assert "dockerfile_inline" not in build, f"{name}: a key only Compose v2 reads"
        assert (REPO / build["context"] / build["dockerfile"]).is_file(), name


# ----------------------------------------------------------------------------------------------
# The monitoring profile: Prometheus and Grafana with ordinal's dashboard (deploy/grafana/); the
# dashboard's queries are run against a real /metrics in tests/server/test_vllm_dashboard.py.

DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "ordinal.json"


def mounts(service: dict[str, Any]) -> dict[str, Path]:
    """A service's read-only bind mounts: container path → the repository path mounted there."""
    found = {}
    for volume in service["volumes"]:
        source, target, mode = volume.split(":")
        assert mode == "ro" and source.startswith("./"), volume
        assert (REPO / source).exists(), volume
        found[target] = REPO / source
    return found


def in_container(service: dict[str, Any], path: str) -> Path:
    """The repository file a container of ``service`` sees at ``path``, through its mounts."""
    for target, source in mounts(service).items():
        if path == target or path.startswith(target + "/"):
            return source / path.removeprefix(target).lstrip("/")
    raise AssertionError(f"{path} is not mounted")


def test_monitoring_profile_scrapes_ordinal_and_provisions_the_dashboard() -> None:
    services = load_compose()["services"]
    prometheus, grafana = services["prometheus"], services["grafana"]
    assert prometheus["profiles"] == grafana["profiles"] == ["monitoring"]
    for service in (prometheus, grafana):  # on loopback only: Grafana lets viewers in unasked
        assert all(port.startswith("127.0.0.1:") for port in service["ports"])
    assert prometheus["depends_on"] == ["ordinal"] and grafana["depends_on"] == ["prometheus"]

    # Prometheus scrapes the ordinal service where it listens, at /metrics
    config = yaml.safe_load(in_container(prometheus, "/etc/prometheus/prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    port = services["ordinal"]["environment"]["ORDINAL_PORT"]
    assert job["static_configs"] == [{"targets": [f"ordinal:{port}"]}]

    # Grafana: the datasource reaches that Prometheus, under the uid every panel names
    provisioning = "/etc/grafana/provisioning"
    sources = yaml.safe_load(
        in_container(grafana, f"{provisioning}/datasources/prometheus.yml").read_text()
    )
    (source,) = sources["datasources"]
    published = prometheus["ports"][0].rsplit(":", 1)[1]
    assert (source["type"], source["url"]) == ("prometheus", f"http://prometheus:{published}")
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for node in (panel, *panel["targets"]):
            assert node["datasource"] == {"type": "prometheus", "uid": source["uid"]}
    variable = dashboard["templating"]["list"][0]
    assert variable["datasource"]["uid"] == source["uid"]

    # the dashboard provider reads the folder the dashboard is mounted in; it is the home page
    providers = yaml.safe_load(
        in_container(grafana, f"{provisioning}/dashboards/ordinal.yml").read_text()
    )
    (provider,) = providers["providers"]
    assert in_container(grafana, provider["options"]["path"]) == DASHBOARD.parent
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert in_container(grafana, home) == DASHBOARD


def test_dockerfile_installs_cpu_torch_before_the_project() -> None:
    instructions = dockerfile_instructions()
    assert instructions[0] == ("FROM", "python:3.11-slim AS base")
    runs = [expand_build_args(instructions, arg) for name, arg in instructions if name == "RUN"]
    torch_at = next(i for i, run in enumerate(runs) if "torch==" in run)
    assert "pip install torch==2.13.0" in runs[torch_at]
    assert f"--index-url {CPU_TORCH_INDEX}" in re.sub("[\"']", "", runs[torch_at])
    # Installed later, the project would pull the multi-GB CUDA torch from PyPI first.
    project_at = next(i for i, run in enumerate(runs) if re.search(r"pip install \.(\s|$)", run))
    assert torch_at < project_at


def test_dockerfile_serves_as_a_non_root_user() -> None:
    instructions = dockerfile_instructions()
    users = [arg for name, arg in instructions if name == "USER"]
    assert users and users[-1] not in {"root", "0"}
    assert ("EXPOSE", "8000") in instructions
    cmd = [arg for name, arg in instructions if name == "CMD"]
    assert cmd and json.loads(cmd[-1]) == SERVE_COMMAND  # exec form is a JSON list


def test_image_leaves_out_checkpoints_and_local_state() -> None:
    copied = [
        arg.split()[:-1]
        for name, arg in dockerfile_instructions()
        if name == "COPY" and not arg.startswith("--from=")  # the build stage's kernels
    ]
    sources = {Path(source).parts[0] for sources in copied for source in sources}
    assert not sources & {".", "checkpoints", "runs", ".venv"}
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()}
    assert {".venv", "runs", ".git", "checkpoints", "**/__pycache__"} <= ignored


def test_serve_command_is_accepted_by_the_cli() -> None:
    from ordinal import build_parser

    args = build_parser().parse_args(SERVE_COMMAND[1:])
    assert (args.command, args.host) == ("serve", "0.0.0.0")


def dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    """The Dockerfile's instructions by stage: its ``AS`` name ("final" for the last, unnamed)."""
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for name, arg in dockerfile_instructions():
        if name == "FROM":
            words = arg.split()
            current = stages.setdefault(words[2] if len(words) == 3 else "final", [])
        current.append((name, arg))
    return stages


COMPILERS = ("g++", "gcc", "clang", "build-essential")


def test_the_images_steps_give_a_server_that_decodes_on_the_kernel(
    checkpoints: Path, tmp_path: Path
) -> None:
    """No Docker engine here, so the image's steps are run in a clean folder: the project
    installed as ``pip install .`` installs it (not this checkout), the build stage's kernel
    command, then ``ordinal serve`` as the final stage runs it, with no compiler or ninja on its
    PATH and the kernels' folder from the build stage. Its models decode on the kernel, in the
    variant this CPU's fastest: the libraries the build stage made are found and used as they
    are. (The variants this machine has built already are copied in first: a build is named by
    its code, so they are the image's too; the step compiles the others.) Where the image
    could not build or find them, it would decode with torch, and the test fails."""
    stages = dockerfile_stages()
    assert set(stages) == {"base", "kernels", "final"}
    environment_lines = [arg for name, arg in stages["base"] if name == "ENV"]
    folder = re.search(r"TORCH_EXTENSIONS_DIR=(\S+)", " ".join(environment_lines))
    assert folder, "the base stage names where the kernels are built and found"
    kernels_folder = folder[1]
    build_runs = [arg for name, arg in stages["kernels"] if name == "RUN"]
    assert any(compiler in run for run in build_runs for compiler in COMPILERS)
    build = next(run for run in build_runs if "-m model.kernels" in run)
    final_runs = " ".join(arg for name, arg in stages["final"] if name == "RUN")
    assert not any(compiler in final_runs for compiler in COMPILERS)  # no compiler in the image
    copies = [arg.split() for name, arg in stages["final"] if name == "COPY"]
    assert ["--from=kernels", kernels_folder, kernels_folder] in copies

    app = tmp_path / "app"  # the base stage's COPY lines, then RUN pip install . from there
    app.mkdir()
    for sources in (arg.split() for name, arg in stages["base"] if name == "COPY"):
        for source in sources[:-1]:
            copy = shutil.copytree if (REPO / source).is_dir() else shutil.copy
            copy(REPO / source, app / (source if sources[-1].endswith("/") else sources[-1]))
    site = tmp_path / "site"  # its dependencies are this environment's
    install = ["install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site)]
    subprocess.run([sys.executable, "-m", "pip", *install, str(app)], check=True)
    built = tmp_path / "kernels"
    built.mkdir()
    seeded = set()
    for isa in cpu.runnable():  # builds of the same code are the same: this machine's own
        made = kernels.build_directory(isa)  # (make setup's) stand for the image's, so that
        if (made / f"{kernels.library_name(isa)}.so").exists():  # the step builds the rest
            shutil.copytree(made, built / made.name)
            seeded.add(made.name)
    image = {**os.environ, "PYTHONPATH": str(site), "TORCH_EXTENSIONS_DIR": str(built)}
    command = shlex.split(build)
    assert command[0] == "python"
    result = subprocess.run(  # the build stage, from a folder outside this checkout
        [sys.executable, *command[1:]], cwd=tmp_path, env=image, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert {path.name.split("_")[1] for path in built.iterdir()} == set(
        cpu.ARCHITECTURE_ISAS[platform.machine()]
    )
    for unity in built.glob("*/unity.cpp"):  # built here from the installed copy's sources
        if unity.parent.name not in seeded:
            assert f'#include "{site}/model/kernels/' in unity.read_text()

    port = free_port()
    final = {**image, "PATH": str(tmp_path / "no-tools"), "CXX": "/no/compiler"}
    final.pop("ORDINAL_API_KEY", None)
    serve = ["serve", "--checkpoints", str(checkpoints), "--models", "rope", "--port", str(port)]
    server = subprocess.Popen(
        [sys.executable, "-c", REPLICA, *serve, "--device", "cpu", "--threads", "1"],
        cwd=tmp_path,
        env=final,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", server)
        (entry,) = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"]
    finally:
        server.terminate()
        _, errors = server.communicate(timeout=30)
    assert entry["decode_backend"] == "cpu-kernel", errors[-3000:]
    assert entry["cpu_isa"] == cpu.chosen()
    assert "could not be built" not in errors


class HealthHandler(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass  # keep pytest output clean


@pytest.fixture
def health_server() -> Iterator[http.server.HTTPServer]:
    # A subclass per test, so setting the status never leaks into another test.
    handler = type("Handler", (HealthHandler,), {"status": 200})
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def healthcheck_commands() -> dict[str, list[str]]:
    dockerfile = next(arg for name, arg in dockerfile_instructions() if name == "HEALTHCHECK")
    dockerfile_command = shlex.split(dockerfile.split(" CMD ", 1)[1])
    compose = load_compose()["services"]["ordinal"]["healthcheck"]["test"]
    return {"Dockerfile": dockerfile_command, "docker-compose.yml": compose[1:]}


@pytest.mark.parametrize("source", ["Dockerfile", "docker-compose.yml"])
@pytest.mark.parametrize(("status", "healthy"), [(200, True), (503, False), (None, False)])
def test_healthcheck_passes_only_when_health_answers_ok(
    health_server: http.server.HTTPServer, source: str, status: int | None, healthy: bool
) -> None:
    command = healthcheck_commands()[source]
    assert command[0] == "python"  # the slim image has no curl
    port = health_server.server_address[1]
    if status is None:  # nothing listening: free the port first
        health_server.shutdown()
        health_server.server_close()
    else:
        health_server.RequestHandlerClass.status = status  # type: ignore[attr-defined]
    result = subprocess.run(
        [sys.executable, *command[1:]],
        env={"ORDINAL_PORT": str(port)},  # and no proxy variables that could divert urllib
        capture_output=True,
        timeout=30,
    )
    assert (result.returncode == 0) == healthy, result.stderr


# ----------------------------------------------------------------------------------------------
# nginx in front of two replicas (deploy/nginx.conf.template)

NGINX_TEMPLATE = REPO / "deploy" / "nginx.conf.template"
FORWARD_SECONDS = 0.02  # each forward pass of the replicas' model is slowed to this at least
# A replica: `ordinal serve ARGS` with every forward pass slowed, so a stream's timing shows.
# The forwards run in the replica's engine process, which imports this sitecustomize too.
SLOW_FORWARD = f"""
import time
import model.transformer
forward = model.transformer.Transformer.forward
def slow(self, *args, **kwargs):
    time.sleep({FORWARD_SECONDS})
    return forward(self, *args, **kwargs)
model.transformer.Transformer.forward = slow
"""
REPLICA = "import sys, ordinal; sys.exit(ordinal.main(sys.argv[1:]))"


def render_nginx_config(listen: str, upstreams: list[str], access_log: str) -> str:
    """The template with its variables set: the ``${UPSTREAM}`` line once per replica."""
    lines = []
    for line in NGINX_TEMPLATE.read_text().splitlines():
        if "${UPSTREAM}" in line and not line.lstrip().startswith("#"):
            lines += [line.replace("${UPSTREAM}", upstream) for upstream in upstreams]
        else:  # a comment names them all
            lines.append(line.replace("${UPSTREAM}", " ".join(upstreams)))
    text = "\n".join(lines) + "\n"
    return text.replace("${NGINX_LISTEN}", listen).replace("${NGINX_ACCESS_LOG}", access_log)


def nginx_binary() -> str | None:
    """Debian puts nginx in /usr/sbin, which a non-root PATH may lack."""
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")


@pytest.fixture
def nginx() -> str:
    binary = nginx_binary()
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("nginx is not installed (make test installs it with apt-get)")
        pytest.skip("nginx is not installed: `make nginx` (apt-get install nginx) to run this")
    return binary


def free_port() -> int:
    with free_socket() as sock:
        return sock.getsockname()[1]


def wait_until_healthy(url: str, process: subprocess.Popen[str], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"{process.args} exited: {process.communicate()[1][-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not become healthy in {timeout} s")


def test_nginx_config_renders_one_upstream_line_per_replica() -> None:
    text = render_nginx_config("127.0.0.1:1", ["127.0.0.1:2", "127.0.0.1:3"], "off")
    servers = re.findall(r"^\s*server (\S+) (.*);$", text, flags=re.M)
    assert [(address, rest.split()[:2]) for address, rest in servers] == [
        ("127.0.0.1:2", ["max_fails=2", "fail_timeout=10s"]),
        ("127.0.0.1:3", ["max_fails=2", "fail_timeout=10s"]),
    ]
    assert re.search(r"^\s*proxy_buffering off;$", text, flags=re.M)  # SSE passes unbuffered
    assert "${" not in "".join(line for line in text.splitlines() if "#" not in line)


def test_nginx_spreads_requests_over_two_replicas_and_streams_unbuffered(
    nginx: str, checkpoints: Path, tmp_path: Path
) -> None:
    ports = [free_port(), free_port()]
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(SLOW_FORWARD)
    path = os.pathsep.join([str(slow), str(REPO), os.environ.get("PYTHONPATH", "")])
    environment = {**os.environ, "PYTHONPATH": path.rstrip(os.pathsep), "OMP_NUM_THREADS": "1"}
    environment.pop("ORDINAL_API_KEY", None)
    processes: list[subprocess.Popen[str]] = []
    try:
        for port in ports:
            serve = ["serve", "--checkpoints", str(checkpoints), "--models", "rope"]
            serve += ["--port", str(port), "--device", "cpu", "--threads", "1"]
            serve += ["--stream-interval", "0"]
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-c", REPLICA, *serve],
                    cwd=REPO,
                    env=environment,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        for port, process in zip(ports, processes, strict=True):
            wait_until_healthy(f"http://127.0.0.1:{port}", process)

        listen = free_port()
        prefix = tmp_path / "nginx"
        prefix.mkdir()
        (prefix / "tmp").mkdir()
        access_log = prefix / "access.log"
        upstreams = [f"127.0.0.1:{port}" for port in ports]
        config = prefix / "nginx.conf"
        config.write_text(render_nginx_config(f"127.0.0.1:{listen}", upstreams, str(access_log)))
        checked = subprocess.run(
            [nginx, "-t", "-p", f"{prefix}/", "-c", str(config), "-e", "stderr"],
            capture_output=True,
            text=True,
        )
        assert checked.returncode == 0, checked.stderr
        process = subprocess.Popen(
            [nginx, "-p", f"{prefix}/", "-c", str(config), "-e", "stderr", "-g", "daemon off;"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        processes.append(process)
        front = f"http://127.0.0.1:{listen}"
        wait_until_healthy(front, process, timeout=30)

        with httpx.Client(base_url=front, timeout=60) as client:
            for seed in range(20):
                body = {"model": "rope", "prompt": "ROMEO:", "max_tokens": 1, "seed": seed}
                response = client.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
                assert response.json()["choices"][0]["text"] is not None

            tokens = 20
            body = {"model": "rope", "prompt": "ROMEO:", "max_tokens": tokens, "stream": True}
            body |= {"ignore_eos": True, "temperature": 0}
            arrivals: list[float] = []
            with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                assert response.headers["content-type"].startswith("text/event-stream")
                for event in sse_events(response.iter_lines()):
                    if event == "[DONE]":
                        break
                    if any(choice.get("text") for choice in event.get("choices", [])):
                        arrivals.append(time.perf_counter())

        # nginx logs a request once its upstream response has ended, which for the stream can
        # be just after the client has read [DONE] and left: wait for the last line.
        requests = 21
        deadline = time.monotonic() + 10
        while True:
            served = Counter(
                re.search(r"upstream=(\S+)", line)[1]
                for line in access_log.read_text().splitlines()
                if '"POST /v1/completions' in line
            )
            if sum(served.values()) >= requests or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert set(served) == set(upstreams), served  # both replicas answered
        assert sum(served.values()) == requests
        # Token by token: the first token arrived while the rest were still being generated
        # (each takes at least FORWARD_SECONDS), not all at once when the stream ended.
        # (A token can carry no text yet: part of a character, held back until it completes.)
        assert len(arrivals) > tokens // 2
        assert arrivals[-1] - arrivals[0] > 0.5 * (tokens - 1) * FORWARD_SECONDS
        gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
        assert sum(gap > FORWARD_SECONDS / 2 for gap in gaps) >= tokens // 3
    finally:
        for process in reversed(processes):
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()


def test_image_copies_every_module_the_package_installs() -> None:
    """``pip install .`` in the image needs each top-level module and package pyproject names."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    wanted = {f"{module}.py" for module in project.get("py-modules", [])}
    wanted |= {pattern.rstrip("*") for pattern in project["packages"]["find"]["include"]}
    copied = [arg.split()[:-1] for name, arg in dockerfile_instructions() if name == "COPY"]
    sources = {Path(source).parts[0] for sources in copied for source in sources}
    assert wanted <= sources, wanted - sources
