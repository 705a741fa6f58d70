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
from distune.tuning_service.messages import Registration
from distune.tuning_service.service import TuningService
from distune.tuning_service.trial_messages import (
    NodeReport,
    TrialKnobs,
    TrialRecord,
    TrialsFinish,
    TrialSpec,
)
from tests.support.models import SINGLE_NODE_REGISTRATION as FACTS
from tests.support.service_process import TOKEN
from tests.support.service_reports import report


def drive(service, name, windows, rate):
    """Report ``windows`` windows of 0.5 s for ``name``, following the service's groups."""
    reply = service.register(name, Registration.from_json(FACTS))
    train_iter = 0
    for _ in range(windows):
        iterations = max(1, round(rate(reply.group.hyperparameters.bucket_size_2p) * 0.5))
        train_iter += iterations
        reply = report(service, name, reply, train_iter, iterations)
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


def test_the_service_is_reached_directly_whatever_proxy_the_environment_names(
    server, monkeypatch, capsys
):
    # http_proxy set for the internet, no no_proxy: the request went to the proxy, which
    # cannot reach the job's service ("cannot reach the tuning service ... connection
    # refused"), and would have seen the token.
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    assert main(["status", "--service", server.url, "--token", TOKEN]) == 0
    assert "bert" in capsys.readouterr().out


def test_https_to_the_plain_http_service_says_it_serves_http(server):
    # The TLS handshake is read as the start of a request that never ends: "no answer in
    # time", as if the service hung.
    https = ServiceConnection(server.url.replace("http:", "https:"), TOKEN, timeout=0.5)
    with pytest.raises(ServiceError) as error:
        https.status()
    assert str(error.value).endswith(
        "; the service itself serves http:// (https only through a TLS proxy in front of it)"
    )


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


def drive_trials(service):
    """A two-node level-2 tuning, scripted: a profile, an oom, a better ok trial, one running."""
    board = service.trials
    knobs = TrialKnobs(micro_batch=2, accumulation=4, stage=0, checkpointing=False)
    configs = [
        {"train_micro_batch_size_per_gpu": m, "gradient_accumulation_steps": a,
         "zero_optimization": {"stage": s}, "activation_checkpointing": c}
        for m, a, s, c in ((2, 4, 0, False), (8, 1, 0, False), (4, 2, 1, True), (1, 8, 3, False))
    ]  # fmt: skip
    outcomes = [("profile", "ok", 75.3, None), ("search", "oom", None, 31 * 2**20),
                ("search", "ok", 81.2, 22 * 2**20)]  # fmt: skip
    for trial, (purpose, outcome, rate, predicted) in enumerate(outcomes):
        board.publish(TrialSpec(trial, 2, purpose, knobs, 29600 + trial, configs[trial]))
        for node_rank in (0, 1):
            board.report(trial, node_rank, NodeReport(outcome, 10.0))
        record = {
            "trial": trial, "purpose": purpose, "config": configs[trial], "outcome": outcome,
            "throughput": rate, "throughput_spread": 0.06 if rate else None,
            "peak_memory_bytes": 21 * 2**20 if rate else None, "predicted_memory_bytes": predicted,
        }  # fmt: skip
        board.record(trial, TrialRecord(record))
    board.publish(TrialSpec(3, 2, "search", knobs, 29603, configs[3]))
    board.report(3, 1, NodeReport("ok", 10.0))


def test_level2_trials_show_with_outcome_throughput_memory_and_the_best(capsys):
    service = TuningService()
    server = Server(service)
    try:
        assert main(["status", "--service", server.url, "--token", TOKEN]) == 0
        assert capsys.readouterr().out == "no model has registered with the tuning service yet\n"
        drive_trials(service)
        assert main(["status", "--service", server.url, "--token", TOKEN]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0] == (
            "level 2: tuning on 2 nodes; 3 trials recorded; trial 3 running (search, 1 x 8), "
            "1 of 2 nodes reported; best so far: trial 2"
        )
        assert lines[1].split()[:4] == ["TRIAL", "PURPOSE", "STRATEGY", "MICRO"]
        rows = [line.split() for line in lines[2:]]
        assert rows[0] == ["0", "profile", "ddp", "2", "x", "4", "ok", "75.3", "samples/s",
                           "6%", "-", "21.0", "MiB"]  # fmt: skip
        assert rows[1] == ["1", "search", "ddp", "8", "x", "1", "oom", "-", "-", "31.0", "MiB",
                           "-"]  # fmt: skip
        assert rows[2][2] == "zero1+ckpt" and rows[2][-1] == "*"  # the best so far
        assert rows[2][-5:-1] == ["22.0", "MiB", "21.0", "MiB"]  # predicted, then measured
        # Once node 0 chooses, the line says so; --json carries the trials document too.
        service.trials.report(3, 0, NodeReport("ok", 10.0))
        service.trials.record(3, TrialRecord({"trial": 3, "config": None, "outcome": "crash"}))
        service.trials.finish(TrialsFinish("run", 2, TrialKnobs()))
        assert main(["status", "--service", server.url, "--token", TOKEN]) == 0
        assert "level 2: finished on 2 nodes; 4 trials recorded; chosen: trial 2" in (
            capsys.readouterr().out
        )
        assert main(["status", "--service", server.url, "--token", TOKEN, "--json"]) == 0
        document = json.loads(capsys.readouterr().out)
        assert document["models"] == {} and document["trials"]["best"] == 2
    finally:
        server.close()


def test_a_model_registered_again_shows_each_registration():
    # Wrapped again after unfreezing: the service tunes the new facts afresh and keeps the
    # head's session under "earlier". Before, the table showed the new session alone, as if
    # the head's choice had never been made.
    service = TuningService(TuningConfig(max_samples=3, sampling_confidence_time=1.0,
                                         min_windows=2, warmup_time=0.0, seed=1))  # fmt: skip
    reply = service.register("m", Registration.from_json({**FACTS, "gradient_bytes": 2**20}))
    for train_iter in range(1, 500):
        reply = report(service, "m", reply, train_iter, 50)
        if reply.completed:
            break
    service.register("m", Registration.from_json({**FACTS, "gradient_bytes": 2**24}))
    status = service.status()
    [earlier] = status["models"]["m"]["earlier"]
    assert earlier["state"] == "completed"
    lines = format_table(status).splitlines()
    assert [line.split("  ")[0] for line in lines[1:]] == [
        "m (registration 1 of 2)",
        "m (registration 2 of 2)",
    ]
    first, second = (line.split() for line in lines[1:])
    assert first[5:7] == ["completed", "3/3"] and "-" in first  # nothing runs it now
    assert second[5:7] == ["sampling", "0/3"] and "2^24" in lines[2]


def test_registrations_are_numbered_as_distune_log_numbers_them(tmp_path, capsys):
    """A registration replaced before its first sample writes no log row: the log numbered the
    later one `registration 2 of 2` where the status table said `3 of 3`."""
    from distune.cli.log_reader import read_log
    from distune.tuning_service.tuning_log import TuningLog

    log = TuningLog.create(tmp_path / "autotune.log")
    service = TuningService(TuningConfig(max_samples=3, sampling_confidence_time=1.0,
                                         min_windows=2, warmup_time=0.0, seed=1), log)  # fmt: skip
    for gradient_bytes, windows in ((2**20, 500), (2**22, 0), (2**24, 8)):
        reply = service.register(
            "m", Registration.from_json({**FACTS, "gradient_bytes": gradient_bytes})
        )
        for train_iter in range(1, windows + 1):
            reply = report(service, "m", reply, train_iter, 50)
            if reply.completed:
                break
    log.close()
    status = service.status()
    assert [e["samples"] for e in status["models"]["m"]["earlier"]] == [3, 0]
    assert status["models"]["m"]["samples"] >= 1
    labels = [line.split("  ")[0] for line in format_table(status).splitlines()[1:]]
    assert labels == [run.name for run in read_log(tmp_path / "autotune.log")]
    assert labels == ["m (registration 1 of 2)", "m (registration 2 of 2)"]
