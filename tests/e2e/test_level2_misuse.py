"""Level-2 trials of scripts and flags a tuner does not expect: one real trial each, of one
gloo rank, run by the launcher's :class:`TrialRunner` as ``distune-run`` runs it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distune.launcher.level2 import free_port
from distune.launcher.options import parse
from distune.launcher.trial_runner import TrialRunner, descendants
from distune.trial_settings import TrialSettings
from distune.tuning_service.trials.trial_result import CRASH, INVALID, OK, TIMEOUT
from tests.e2e.conftest import SCRIPTS

pytestmark = pytest.mark.slow
WORKER = str(SCRIPTS / "level2_worker.py")
TRIAL_TIMEOUT = 25.0


def one_trial(tmp_path: Path, argv: list[str], timeout: float = TRIAL_TIMEOUT) -> TrialRunner:
    args, _ = parse(["--nproc_per_node", "1", *argv])
    return TrialRunner(args, timeout, tmp_path / "trials")


def test_a_script_that_fails_before_distune_sees_it_crashes_with_its_own_traceback(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text("import no_such_module_for_distune\n")
    run = one_trial(tmp_path, [str(script)]).run(0, TrialSettings(), [], free_port())
    assert run.outcome == CRASH
    assert run.error is not None
    # The failing rank's own stderr, not torch's failure summary that ends the trial's log.
    assert run.error.startswith("rank 0 exited with status 1")
    assert run.error.splitlines()[-1] == (
        "ModuleNotFoundError: No module named 'no_such_module_for_distune'"
    )


def test_a_run_path_trial_ends_once_measured_rather_than_at_its_time_out(tmp_path):
    runner = one_trial(tmp_path, ["--run-path", WORKER])
    run = runner.run(
        0, TrialSettings(micro_batch=2, accumulation=1), ["--steps", "40"], free_port()
    )
    assert run.outcome == OK, run.error
    assert run.duration < TRIAL_TIMEOUT


def test_a_script_that_ends_before_the_trials_steps_is_told_how_many_it_needs(tmp_path):
    run = one_trial(tmp_path, [WORKER]).run(
        0, TrialSettings(micro_batch=2, accumulation=1), ["--steps", "4"], free_port()
    )
    assert run.outcome == INVALID
    assert run.error == (
        "the script ended after 4 optimizer step(s); a trial runs 7 (2 warm-up, 5 measured): "
        "give it at least 7 in level 2 (its own steps, max_steps or epochs flag)"
    )
    assert run.steps == 4  # it took part: a fact carried to level 2, not read from the text


def test_a_script_that_never_reaches_distune_times_out_saying_so(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text("import time\ntime.sleep(60)\n")  # a loop distune never sees
    run = one_trial(tmp_path, [str(script)], timeout=2.0).run(0, TrialSettings(), [], free_port())
    assert run.outcome == TIMEOUT
    assert run.error == (
        "no rank reached distune.prepare or distune.DistributedDataParallel within the trial "
        "time-out (2 s): the script hangs before it (in its start-up or its process group's "
        "rendezvous), or uses neither, or its start-up (loading data, say) takes longer than "
        "that: give --autotune_trial_timeout more seconds than it"
    )
    assert run.steps is None


def test_a_script_that_changes_its_directory_is_measured_under_a_relative_results_dir(
    tmp_path, monkeypatch
):
    # As Hydra's job.chdir does: the script runs in a directory of its own.
    elsewhere = tmp_path / "outputs"
    elsewhere.mkdir()
    script = tmp_path / "moves.py"
    script.write_text(f"import os, runpy\nos.chdir({str(elsewhere)!r})\n")
    script.write_text(script.read_text() + f"runpy.run_path({WORKER!r}, run_name='__main__')\n")
    monkeypatch.chdir(tmp_path)
    args, _ = parse(["--nproc_per_node", "1", str(script)])
    runner = TrialRunner(args, TRIAL_TIMEOUT, Path("results") / "trials")
    run = runner.run(0, TrialSettings(micro_batch=2, accumulation=1), [], free_port())
    assert run.outcome == OK, run.error
    assert (tmp_path / "results" / "trials" / "trial-000" / "result.json").exists()


# Calls distune.prepare, then builds its batches from its own --batch-size.
OWN_BATCHES = """
import os, sys, torch, torch.distributed as dist
from torch import nn
import distune
dist.init_process_group("gloo")
model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
run = distune.prepare(model, optimizer, micro_batch_size=2, gradient_accumulation_steps=1)
for _ in range(20):
    run.model(torch.randn(2, 16)).sum().backward()  # 2, whatever run.micro_batch_size says
    run.optimizer.step()
    run.optimizer.zero_grad()
"""


def test_a_prepare_script_that_ignores_the_trials_micro_batch_crashes_rather_than_lie(tmp_path):
    script = tmp_path / "own_batches.py"
    script.write_text(OWN_BATCHES)
    settings = TrialSettings(micro_batch=8, accumulation=1)
    run = one_trial(tmp_path, [str(script)]).run(0, settings, [], free_port())
    assert run.outcome == CRASH
    assert run.error is not None
    assert (
        "distune.prepare set the micro-batch to 8, but the model's first forward took an input "
        "of shape (2, 16)" in run.error
    )


# As OWN_BATCHES, with 8 input features: a trial micro-batch of 8 is in its input's shape.
OWN_BATCHES_OF_8_FEATURES = OWN_BATCHES.replace("16", "8")


def test_a_prepare_trial_reports_where_its_micro_batch_was_in_the_input(tmp_path):
    # The script ignores the trial's 8 and runs its own 2, which the first-forward check
    # cannot see ((2, 8) holds an 8): the dimension found (1, where the profile trial would
    # find its 2 in 0) is what lets the launcher refuse the trial rather than measure 2 as 8.
    script = tmp_path / "own_batches.py"
    script.write_text(OWN_BATCHES_OF_8_FEATURES)
    runner = one_trial(tmp_path, [str(script)])
    told_8 = runner.run(1, TrialSettings(micro_batch=8, accumulation=1), [], free_port())
    assert told_8.outcome == OK, told_8.error
    assert told_8.measurements is not None and told_8.measurements["batch_dimensions"] == [1]


# Rank 1's script ends at once; rank 0 then fails, as in its next collective with rank 1.
ENDS_EARLY = """
import os, sys, time
if os.environ["RANK"] == "0":
    time.sleep(1.0)
    sys.exit("Connection closed by peer")
"""


def test_a_rank_whose_script_ended_early_is_named_as_the_cause_of_the_crash(tmp_path):
    script = tmp_path / "ends_early.py"
    script.write_text(ENDS_EARLY)
    args, _ = parse(["--nproc_per_node", "2", str(script)])
    run = TrialRunner(args, TRIAL_TIMEOUT, tmp_path / "trials").run(
        0, TrialSettings(), [], free_port()
    )
    assert run.outcome == CRASH
    assert run.error is not None
    assert run.error.startswith("rank 0 exited with status 1")
    # torch's agent names only rank 0: rank 1 ended well, but first.
    assert run.error.splitlines()[-1].startswith(
        "rank 1 exited with status 0 while the others trained (the script ended early there), "
        "so rank 0 failed in a collective"
    )


# Rank 1 ends through sys.exit in its second step (no excepthook sees it); rank 0 then fails
# in its all-reduce with it and reports that crash.
RANK_1_EXITS = """
import sys, torch, torch.distributed as dist
from torch import nn
import distune
dist.init_process_group("gloo")
model = nn.Linear(4, 1)
run = distune.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=2)
for step in range(20):
    if step == 1 and dist.get_rank() == 1:
        sys.exit("rank 1: corrupt shard 00017.bin")
    run.model(torch.randn(run.micro_batch_size, 4)).sum().backward()
    run.optimizer.step()
    run.optimizer.zero_grad()
"""


def test_the_crash_shown_is_the_rank_that_failed_first_not_its_peers_collective(tmp_path):
    script = tmp_path / "rank_1_exits.py"
    script.write_text(RANK_1_EXITS)
    args, _ = parse(["--nproc_per_node", "2", str(script)])
    started = time.time()
    run = TrialRunner(args, TRIAL_TIMEOUT, tmp_path / "trials").run(
        0, TrialSettings(micro_batch=2, accumulation=1), [], free_port()
    )
    assert run.outcome == CRASH
    assert run.error is not None
    assert "Connection closed by peer" not in run.error  # rank 0's report: a symptom
    assert run.error.startswith("rank 1 exited with status 1")
    assert run.error.splitlines()[-1] == "rank 1: corrupt shard 00017.bin"
    # When the cause failed, which a node's report carries (on two nodes the first to fail is
    # the cause): rank 1's last output, before rank 0's report of its symptom. Rank 0 reports
    # only if its collective fails before torch's agent stops it, which a loaded machine may
    # not reach (CI once saw no rank0.json).
    assert run.failed_at is not None and started < run.failed_at <= time.time()
    symptom_report = run.log_path.parent / "rank0.json"
    if symptom_report.exists():
        symptom = json.loads(symptom_report.read_text())["time"]
        assert symptom - 30 < run.failed_at <= symptom


# Starts helpers it would stop in its `finally`, which a measured rank's os._exit skips: one
# with the rank's environment, one with an environment of its own (no DISTUNE_TRIAL_DIR).
STARTS_A_HELPER = """
import os, subprocess, sys, torch, torch.distributed as dist
from torch import nn
import distune
dist.init_process_group("gloo")
helper = subprocess.Popen(["sleep", "120"])
own_env = subprocess.Popen(["sleep", "120"], env={"PATH": os.environ["PATH"]})
open(sys.argv[1], "w").write(f"{helper.pid} {own_env.pid}")
try:
    model = nn.Linear(4, 1)
    run = distune.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=2)
    for _ in range(20):
        run.model(torch.randn(run.micro_batch_size, 4)).sum().backward()
        run.optimizer.step()
        run.optimizer.zero_grad()
finally:
    helper.terminate()
    own_env.terminate()
"""


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux's /proc")
def test_what_a_measured_rank_left_running_ends_with_its_trial(tmp_path):
    script = tmp_path / "starts_a_helper.py"
    script.write_text(STARTS_A_HELPER)
    pid_file = tmp_path / "helper.pid"
    run = one_trial(tmp_path, [str(script)]).run(
        0, TrialSettings(micro_batch=2, accumulation=1), [str(pid_file)], free_port()
    )
    helpers = [int(pid) for pid in pid_file.read_text().split()]
    try:
        assert run.outcome == OK, run.error
        # They used to run on, children of init, for their 120 s; the one with an environment
        # of its own even after the sweep by DISTUNE_TRIAL_DIR (found now by its session).
        assert [running(pid) for pid in helpers] == [False, False]
    finally:
        for pid in helpers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# A launcher as the trial runner starts a trial, which then dies without stopping it.
LAUNCHER = """
import os, subprocess, sys, time
trial = [sys.executable, "-m", "distune.launcher.trial_job", sys.argv[1], str(os.getpid())]
print(subprocess.Popen(trial, start_new_session=True).pid, flush=True)
time.sleep(120)
"""


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux's /proc")
def test_a_trial_ends_with_its_launcher_even_when_the_launcher_is_killed(tmp_path):
    args, _ = parse(["--nproc_per_node", "1", "--no-python", "sleep", "120"])
    spec = tmp_path / "torchrun.json"
    spec.write_text(json.dumps(vars(args)))
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(spec)], stdout=subprocess.PIPE, text=True
    )
    trial = int(launcher.stdout.readline())
    deadline = time.monotonic() + 60
    while not (ranks := descendants(trial)) and time.monotonic() < deadline:
        time.sleep(0.1)  # until the agent started its rank
    try:
        assert ranks, "the trial's agent started no rank"
        launcher.kill()  # SIGKILL: nothing of the launcher's stops the trial
        launcher.wait()
        deadline = time.monotonic() + 20
        while any(running(pid) for pid in (trial, *ranks)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(running(pid) for pid in (trial, *ranks))
    finally:
        for pid in (trial, *ranks, *descendants(trial)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# A DDP habit: the checkpoint taken on rank 0 alone, a collective under ZeRO-1 (the optimizer's).
SAVES_ON_RANK_0 = """
import torch, torch.distributed as dist
from torch import nn
import distune
dist.init_process_group("gloo")
model = nn.Linear(4, 1)
run = distune.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.1), micro_batch_size=2)
for step in range(20):
    run.model(torch.randn(run.micro_batch_size, 4)).sum().backward()
    run.optimizer.step()
    run.optimizer.zero_grad()
    if dist.get_rank() == 0:
        state = run.optimizer.state_dict()
"""


def test_a_rank_0_checkpoint_in_a_trial_fails_naming_the_call_before_the_watchdog(tmp_path):
    script = tmp_path / "saves_on_rank_0.py"
    script.write_text(SAVES_ON_RANK_0)
    args, _ = parse(["--nproc_per_node", "2", str(script)])
    # 16 s: room for the start-up of two ranks on a loaded machine (it counts against it).
    run = TrialRunner(args, 16.0, tmp_path / "trials").run(
        0, TrialSettings(micro_batch=2, accumulation=1, stage=1), [], free_port()
    )
    # It used to wait the 300 s of checkpoint_timeout's default: a `timeout` "hang" at 16 s.
    assert run.outcome == CRASH, run.error
    assert run.error is not None
    assert "run.optimizer.state_dict() under ZeRO stage 1" in run.error
    assert "waited up to 8 s" in run.error
