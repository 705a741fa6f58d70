"""``distune status`` against the real service app, served by waitress in this process and driven
by scripted reports; and against no service at all."""

import io
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from waitress.server import create_server

from distune.cli.main import main
from distune.cli.service_client import ServiceConnection, ServiceError
from distune.cli.status import format_table, watch
from distune.tuning_service.app import create_app
from distune.tuning_service.config import TuningConfig
from distune.tuning_service.messages import Registration, Report
from distune.tuning_service.service import TuningService
from distune.tuning_service.session import StaleGroupError
from tests.support.models import SINGLE_NODE_REGISTRATION as FACTS
from tests.support.service_process import TOKEN


def drive(service, name, windows, rate):
    """Report ``windows`` windows of 0.5 s for ``name``, following the service's groups."""
    reply = service.register(name, Registration.from_json(FACTS))
    train_iter = 0
    for _ in range(windows):
        iterations = max(1, round(rate(reply.group.hyperparameters.bucket_size_2p) * 0.5))
        train_iter += iterations
        try:
            reply = service.report(name, Report(reply.group.id, train_iter, iterations, 0.5))
        except StaleGroupError as error:
            reply = error.reply
        if reply.completed:
            break


class Server:
    """The service's app on a free port, in a thread."""

    def __init__(self, service, token=TOKEN):
        self.server = create_server(create_app(service, token=token), host="127.0.0.1", port=0)
        self.url = f"http://127.0.0.1:{self.server.effective_port}"
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()

    def close(self):
        self.server.close()
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def service():
    """A real tuning service with three models: completed, sampling, and in warmup."""
    config = TuningConfig(
        max_samples=5, sampling_confidence_time=1.0, min_windows=2, warmup_time=1.0, seed=0
    )
    service = TuningService(config)
    drive(service, "bert", 200, lambda p: 60 + 4 * (24 - abs(p - 20)))
    drive(service, "alpha", 12, lambda p: 30.0 + p)
    service.register("warm", Registration.from_json(FACTS))
    return service


@pytest.fixture(scope="module")
def server(service):
    server = Server(service)
    yield server
    server.close()


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in ("DISTUNE_SERVICE_URL", "DISTUNE_SERVICE_TOKEN", "DISTUNE_SERVICE_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)


def closed_port_url():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


def test_the_table_has_a_row_per_model_with_state_samples_groups_score_and_gain(
    service, server, capsys
):
    assert main(["status", "--service", server.url, "--token", TOKEN]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["MODEL", "STATE", "SAMPLES", "CURRENT", "BEST", "SCORE", "GAIN"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert list(rows) == ["alpha", "bert", "warm"]
    status = service.status()["models"]
    bert = status["bert"]
    assert bert["state"] == "completed" and bert["best"] is not None
    best_bucket = bert["best"]["group"]["hyperparameters"]["bucket_size_2p"]
    assert rows["bert"].split()[1:3] == ["completed", f"{bert['samples']}/5"]
    # The chosen group appears twice: it runs now, and it is the best.
    assert rows["bert"].count(f"bucket 2^{best_bucket} B") == 2
    assert f"{bert['best']['score']:.4g} it/s" in rows["bert"]
    assert rows["bert"].rstrip().endswith(f"{bert['best']['gain_vs_default']:+.1%}")
    assert rows["alpha"].split()[1:3] == ["sampling", f"{status['alpha']['samples']}/5"]
    # In warmup nothing is measured: the default group runs, and there is no best yet.
    assert rows["warm"].split()[1:3] == ["warmup", "0/5"]
    assert "bucket 2^24 B (16 MiB), flat" in rows["warm"]
    assert rows["warm"].split()[-3:] == ["-", "-", "-"]
    # Columns line up: every row's CURRENT starts where the header's does.
    column = lines[0].index("CURRENT")
    assert all(line[column : column + 7] == "bucket " for line in lines[1:])


def test_json_prints_the_raw_status_from_the_environment(server, monkeypatch, capsys):
    monkeypatch.setenv("DISTUNE_SERVICE_URL", server.url + "/")
    monkeypatch.setenv("DISTUNE_SERVICE_TOKEN", TOKEN)
    assert main(["status", "--json"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out) == ServiceConnection(server.url, TOKEN).status()
    assert out.count("\n") == 1


def test_the_token_can_come_from_a_private_file(server, monkeypatch, tmp_path, capsys):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    monkeypatch.setenv("DISTUNE_SERVICE_TOKEN_FILE", str(path))
    assert main(["status", "--service", server.url]) == 0
    assert "bert" in capsys.readouterr().out
    path.chmod(0o640)
    assert main(["status", "--service", server.url]) == 1
    err = capsys.readouterr().err
    assert "readable by other users (mode 0640)" in err and "chmod 600" in err
    assert TOKEN not in err


@pytest.mark.parametrize(
    ("argv", "environment", "message"),
    [
        ([], {}, "which service? give --service URL or set DISTUNE_SERVICE_URL"),
        (["--service", "127.0.0.1:80"], {}, "must look like http://HOST:PORT"),
        (
            ["--service", "http://127.0.0.1:9", "--token-file", "/nonexistent/token"],
            {},
            "cannot read the token file /nonexistent/token",
        ),
        (
            [],
            {
                "DISTUNE_SERVICE_URL": "http://127.0.0.1:9",
                "DISTUNE_SERVICE_TOKEN_FILE": "/nonexistent/t",
            },
            "cannot read the token file /nonexistent/t",
        ),
    ],
)
def test_missing_or_bad_settings_are_one_line_errors(
    argv, environment, message, monkeypatch, capsys
):
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert main(["status", *argv]) == 1
    err = capsys.readouterr().err
    assert message in err and err.startswith("distune status: ") and err.count("\n") == 1


def test_a_missing_or_wrong_token_is_named_not_shown(server, capsys):
    assert main(["status", "--service", server.url]) == 1
    assert "needs its token" in capsys.readouterr().err
    assert main(["status", "--service", server.url, "--token", "guess"]) == 1
    err = capsys.readouterr().err
    assert "refused the token" in err and "guess" not in err


def test_an_unreachable_service_is_one_line_and_exit_1_without_traceback():
    url = closed_port_url()
    run = subprocess.run(
        [sys.executable, "-m", "distune.cli", "status", "--service", url],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "DISTUNE_SERVICE_TOKEN": TOKEN},
    )
    assert run.returncode == 1 and run.stdout == ""
    assert (
        run.stderr
        == f"distune status: cannot reach the tuning service at {url}: connection refused\n"
    )


def test_something_that_is_not_the_service_is_said_so(server, capsys):
    assert main(["status", "--service", server.url + "/elsewhere", "--token", TOKEN]) == 1
    assert "answered /api/v1/status with HTTP 404" in capsys.readouterr().err


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_watch_redraws_in_place_until_the_service_goes(service):
    server = Server(service)
    out = Terminal()
    failure = []

    def watching():
        try:
            watch(ServiceConnection(server.url, TOKEN), 0.1, False, out)
        except ServiceError as error:
            failure.append(str(error))

    thread = threading.Thread(target=watching)
    thread.start()
    deadline = time.monotonic() + 20
    while out.getvalue().count("\x1b[H\x1b[J") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    server.close()
    thread.join(timeout=20)
    frames = out.getvalue().split("\x1b[H\x1b[J")
    assert frames[0] == "" and len(frames) >= 3
    for frame in frames[1:]:
        heading, blank, table = frame.split("\n", 2)
        assert heading.startswith(f"{server.url} at ") and "(Ctrl-C to stop)" in heading
        assert blank == "" and table.strip() == format_table(service.status())
    assert failure and "cannot reach the tuning service" in failure[0]


def test_an_empty_service_says_no_model_yet():
    assert format_table({"models": {}}) == "no model has registered with the tuning service yet"


def test_distune_alone_lists_the_commands(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for command in ("status", "plot", "log"):
        assert f"\n    {command} " in out


def test_the_commands_load_neither_torch_nor_pandas_nor_matplotlib_until_needed():
    code = (
        "import sys, distune.cli.main; "
        "print(sorted(m for m in ('torch', 'pandas', 'matplotlib', 'skopt', "
        "'distune.worker_runtime', 'distune.tuning_service.service') if m in sys.modules))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.stdout.strip() == "[]", run.stderr
