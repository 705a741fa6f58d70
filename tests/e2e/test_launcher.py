"""distune-run end to end: the README's main job, signals, failures, restarts, level 0, configs."""

from __future__ import annotations

import csv
import json
import os
import signal
import stat
import time
from urllib.parse import urlsplit

import pytest
import requests
from torch.distributed.run import get_args_parser

from distune.cli.main import main as distune_command
from tests.support.launcher_process import FAST_TUNING, isolated_rendezvous, processes_with
from tests.support.local_host import port_is_free

from .conftest import SCRIPTS, SMALL_MLP

pytestmark = pytest.mark.slow

#: The installed torchrun's flags.
TORCHRUN_FLAGS = set(get_args_parser()._option_string_actions)
BAGUA_COLUMNS = ["bucket_size_2p", "is_hierarchical_reduce", "score", "train_iter"]
TOKEN = "e2e-secret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def poll_status(url: str, until, timeout: float) -> dict:
    """GET /status until ``until(status)`` holds."""
    deadline = time.monotonic() + timeout
    status: dict = {}
    while time.monotonic() < deadline:
        try:
            status = requests.get(url + "/api/v1/status", headers=AUTH, timeout=5).json()
            if until(status):
                return status
        except requests.RequestException:
            pass
        time.sleep(0.2)
    pytest.fail(f"status never satisfied the condition; last: {status}")


def test_main_job_tunes_writes_log_and_leaves_nothing_behind(launch, tmp_path):
    log, best = tmp_path / "tune.log", tmp_path / "best.json"
    run = launch(
        [
            "--nproc_per_node", "2", "--autotune_level", "1", *FAST_TUNING,
            "--autotune_log_file", str(log), "--autotune_best_file", str(best),
            *SMALL_MLP, "--seconds", "25",
        ],
        env={"DISTUNE_SERVICE_TOKEN": TOKEN},
    )  # fmt: skip
    url = run.service_url()
    assert urlsplit(url).hostname == "127.0.0.1"  # single node: loopback only
    status = poll_status(url, lambda s: "mlp" in s.get("models", {}), timeout=60)
    assert status["models"]["mlp"]["max_samples"] == 4
    assert run.wait(timeout=150) == 0, run.output

    with log.open() as handle:
        rows = list(csv.reader(handle))
    assert rows[0][:4] == BAGUA_COLUMNS
    assert len(rows) - 1 >= 3, rows
    assert "autotune mlp: warmup over, sampling up to 4 groups" in run.output
    assert "autotune mlp sample 1/4: bucket 2^21 B (2 MiB), flat -> " in run.output
    assert "autotune mlp: completed, chose bucket 2^" in run.output
    assert "model mlp: completed" in run.output
    assert "chosen group:  bucket 2^" in run.output
    assert f"autotune log: {log}" in run.output
    chosen = json.loads(best.read_text())
    assert {"bucket_size", "hierarchical_reduce", "autotune_result"} <= set(chosen)
    assert run.leftovers() == []
    assert port_is_free(urlsplit(url).port)


def test_sigterm_mid_run_stops_workers_and_service(launch, capsys):
    run = launch(["--nproc_per_node", "2", "--autotune_level", "1", *SMALL_MLP, "--seconds", "120"])
    url = run.service_url()
    # The job's own random token was never shown: distune status and the dashboard could not
    # be used on it. It is handed over in a file of the user's, named with the command.
    token_file = run.wait_for(
        rf"^distune: watch it with: distune status --watch --service {url} --token-file (\S+) ",
        timeout=10,
    ).group(1)
    assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
    run.wait_for(r"^step \d+", timeout=60)  # the workers are training
    assert distune_command(["status", "--service", url, "--token-file", token_file]) == 0
    assert capsys.readouterr().out.startswith("MODEL ")
    run.process.send_signal(signal.SIGTERM)
    assert run.wait(timeout=60) == 128 + signal.SIGTERM
    assert run.leftovers() == []
    assert port_is_free(urlsplit(url).port)
    assert not os.path.exists(token_file)


def test_failing_worker_fails_the_launch_and_stops_the_service(launch):
    run = launch(
        [
            "--nproc_per_node",
            "2",
            "--autotune_level",
            "1",
            str(SCRIPTS / "flaky_worker.py"),
            "--fail-attempts",
            "1",
        ]
    )
    url = run.service_url()
    assert run.wait(timeout=90) == 3  # flaky_worker.FAILURE_EXIT_CODE: the worker's own
    assert "injected failure on attempt 0" in run.output
    assert run.leftovers() == []
    assert port_is_free(urlsplit(url).port)


def test_a_script_failing_before_wrapping_is_not_said_to_wrap_no_model(launch, tmp_path):
    """The summary said the script wrapped no model in distune's wrapper, when it had failed
    before getting there (a bad path, an import error)."""
    script = tmp_path / "fails_early.py"
    script.write_text("import sys\nsys.exit(5)\n")
    run = launch(["--nproc_per_node", "2", "--autotune_level", "1", str(script)])
    assert run.wait(timeout=60) == 5
    assert (
        "distune: no model registered with the tuning service: nothing was tuned (the job "
        "ended with exit code 5 before any model registered; see above why)"
    ) in run.output
    assert "wrapped no model" not in run.output
    # Stopped before the script wrapped anything: not said to have wrapped none either.
    script.write_text("import time\nprint('ready', flush=True)\ntime.sleep(60)\n")
    run = launch(["--nproc_per_node", "2", "--autotune_level", "1", str(script)])
    run.wait_for("^ready", timeout=60)
    run.process.send_signal(signal.SIGTERM)
    assert run.wait(timeout=60) == 128 + signal.SIGTERM
    assert f"the job ended with exit code {128 + signal.SIGTERM} before any model" in run.output


def test_service_outlives_a_worker_restart(launch):
    # torch 2.13 restarts gloo workers reliably only with c10d rendezvous and a store of the
    # workers' own: torchrun's static default keeps one store for every attempt and hands a
    # restarted worker its predecessor's address (pytorch/pytorch#135712). README: restarts.
    rendezvous, env = isolated_rendezvous()
    run = launch(
        [
            "--nproc_per_node", "2", "--autotune_level", "1", "--max_restarts", "1",
            *rendezvous,
            str(SCRIPTS / "flaky_worker.py"), "--fail-attempts", "1", "--seconds", "4",
        ],
        env=env,
    )  # fmt: skip
    assert run.wait(timeout=120) == 0, run.output
    assert "injected failure on attempt 0" in run.output
    assert "rank 0 attempt 1 finished" in run.output
    assert run.output.count("tuning service at") == 1  # one service for both attempts
    assert "model flaky:" in run.output  # the summary came from the same service
    assert run.leftovers() == []


def test_level_0_starts_no_service(launch, tmp_path):
    # A log asked for at level 0 (--autotune_level 1 forgotten) is never written: said so.
    # A DISTUNE_TRIAL_DIR left in the shell made every rank a level-2 trial's: the job ended
    # after seven steps with exit code 0, having printed nothing.
    log = tmp_path / "never.log"
    run = launch(["--nproc_per_node", "2", "--autotune_log_file", str(log), *SMALL_MLP,
                  "--steps", "200"], env={"DISTUNE_TRIAL_DIR": str(tmp_path)})  # fmt: skip
    run.wait_for(r"^(step|done)", timeout=60)
    assert all(b"distune.tuning_service" not in _cmdline(pid) for pid in _family(run))
    assert run.wait(timeout=60) == 0, run.output
    assert "tuning service" not in run.output
    assert (
        "distune-run: warning: --autotune_log_file: it takes effect only where a job is tuned, "
        "and this job is level 0, the default: ignored; add --autotune_level 1 to tune"
    ) in run.output
    assert not log.exists()
    assert f"DISTUNE_TRIAL_DIR={tmp_path} in the environment does not reach the workers" in (
        run.output
    )
    assert "done: 200 steps" in run.output
    # The default 2^25 is clamped to the model's 1.004 MiB of gradients: one bucket of 2^21.
    assert "bucket 2^21 B (2 MiB), flat" in run.output


def test_one_rank_at_level_1_trains_untuned_and_says_why(launch, tmp_path):
    # It sampled groups on noise (nothing is exchanged) and claimed a gain within it.
    script = tmp_path / "one_rank.py"
    script.write_text("import os\nprint('level', os.environ['DISTUNE_AUTOTUNE_LEVEL'], "
                      "'service', os.environ.get('DISTUNE_SERVICE_URL'))\n")  # fmt: skip
    run = launch(["--autotune_level", "1", str(script)])
    assert run.wait(timeout=60) == 0, run.output
    assert "level 1 service None" in run.output
    assert (
        "distune-run: note: this job has one rank (--nnodes 1, --nproc_per_node 1), which "
        "exchanges no gradients, so level 1 has nothing to tune and no service starts: it "
        "trains untuned, as at --autotune_level 0"
    ) in run.output
    assert "tuning service" not in run.output


def test_config_fixing_every_knob_runs_without_service(launch, tmp_path):
    config = tmp_path / "fixed.yaml"
    config.write_text("autotune_level: 1\nbucket_size: 131072\n")
    # torchrun's --virtual-local-rank (newer torch) gives every worker LOCAL_RANK=0: the
    # wrapper still runs.
    virtual = [flag for flag in ["--virtual-local-rank"] if flag in TORCHRUN_FLAGS]
    # A DISTUNE_SERVICE_URL exported for `distune status` reached the workers, which
    # reported to it ("tuning service at http://127.0.0.1:9 cannot be reached").
    run = launch(
        ["--nproc_per_node", "2", *virtual, "--autotune_config", str(config),
         *SMALL_MLP, "--seconds", "4"],
        env={"DISTUNE_SERVICE_URL": "http://127.0.0.1:9"},
    )  # fmt: skip
    assert run.wait(timeout=60) == 0, run.output
    groups = [line.split("(", 1)[1] for line in run.output.splitlines() if line.startswith("step ")]
    assert groups and all(group == "bucket 2^17 B (128 KiB), flat)" for group in groups)
    assert "tuning service" not in run.output


def test_invalid_flag_exits_2_before_anything_starts(launch):
    run = launch(["--autotune_level", "1", "--autotune_max_samples", "0", *SMALL_MLP])
    assert run.wait(timeout=30) == 2
    assert run.output.strip().splitlines() == [
        "distune-run: error: argument --autotune_max_samples/--autotune-max-samples: "
        "must be an integer of at least 1, got '0'"
    ]


def _family(run) -> list[int]:
    return processes_with(run.marker)


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read()
    except OSError:
        return b""
