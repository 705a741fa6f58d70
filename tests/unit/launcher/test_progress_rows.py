"""The launcher's progress lines against the real service in this process: one line per log
row, whatever the rows per sample (a close call's legs) and the registrations of a model."""

import csv
import io
import random

from distune.launcher.progress import ProgressMonitor
from distune.tuning_service.config import TuningConfig
from distune.tuning_service.messages import Registration, Report
from distune.tuning_service.service import TuningService
from distune.tuning_service.session import StaleGroupError
from distune.tuning_service.tuning_log import TuningLog
from tests.support.models import SINGLE_NODE_REGISTRATION as FACTS

#: A close call's sample runs in 4 legs, each a log row of the same sample number.
CONFIG = TuningConfig(
    max_samples=5,
    sampling_confidence_time=1.0,
    min_windows=2,
    warmup_time=0.0,
    seed=2,
    close_call_time=4.0,
)


class InProcessService:
    """What the monitor reads of the service process it started, from a service object."""

    alive = True
    log_file = None
    returncode = None

    def __init__(self, service: TuningService) -> None:
        self.service = service

    def status(self):
        return self.service.status()

    def log(self, name):
        return self.service.log_csv(name)


def drive(service, facts, done, noise):
    """Half-second windows of a job where 2^22 B buckets are 4% faster, with 3% noise."""
    reply, step = service.register("m", Registration.from_json(facts)), 0
    while not done(service.status()["models"]["m"]):
        hp = reply.group.hyperparameters
        rate = 100 * (1.04 if hp.bucket_size_2p == 22 else 1.0) * (1 + noise.gauss(0, 0.03))
        step += 1
        try:
            reply = service.report("m", Report(reply.group.id, step, round(rate * 0.5), 0.5))
        except StaleGroupError as error:
            reply = error.reply


def test_samples_after_a_close_call_are_printed_in_the_next_registration():
    # The head's session ends in a close call: its last two samples wrote 4 rows each. The
    # monitor compared /status's sample count with the rows it had printed, so the unfrozen
    # model's samples waited until they outnumbered the head's extra rows (or completion).
    service, noise = TuningService(CONFIG), random.Random(1)
    out = io.StringIO()
    monitor = ProgressMonitor(InProcessService(service), out=out)
    drive(service, {**FACTS, "gradient_bytes": 2**24}, lambda s: s["state"] == "completed", noise)
    monitor.poll()
    head_lines = out.getvalue().splitlines()
    rows = service.log_csv("m").splitlines()[1:]
    assert len([line for line in head_lines if " sample " in line]) == len(rows) - 1
    assert len(rows) - 1 > service.status()["models"]["m"]["samples"], "no close call"
    drive(service, {**FACTS, "gradient_bytes": 2**26}, lambda s: s["samples"] >= 2, noise)
    monitor.poll()
    lines = out.getvalue().splitlines()[len(head_lines) :]
    assert lines[0].startswith("autotune m: registered again with other facts")
    samples = [line for line in lines if " sample " in line]
    assert [line.split()[3].rstrip(":") for line in samples][:2] == ["1/5", "2/5"], lines


def test_a_dead_service_never_names_an_earlier_registrations_choice(tmp_path):
    # The service died while the unfrozen model's session sampled. The monitor names the group
    # each completed model keeps, from the log's completed rows: before, the head's completed
    # row made it say "m keeps <the head's choice>", which the re-wrapped model never ran.
    path = tmp_path / "tuning.log"
    service, noise = TuningService(CONFIG, log=TuningLog.create(path)), random.Random(1)
    process = InProcessService(service)
    process.log_file = str(path)
    out = io.StringIO()
    monitor = ProgressMonitor(process, out=out)
    drive(service, {**FACTS, "gradient_bytes": 2**24}, lambda s: s["state"] == "completed", noise)
    drive(service, {**FACTS, "gradient_bytes": 2**26}, lambda s: s["samples"] >= 1, noise)
    monitor.poll()
    process.alive, process.returncode = False, -9
    monitor.poll()
    death = out.getvalue().splitlines()[-1]
    assert death.startswith("distune: the tuning service stopped unexpectedly (exit code -9)")
    assert death.endswith("training goes on: each model keeps the last group the service gave "
                          "it (rank 0 names it)"), death  # fmt: skip


def test_a_dead_service_never_names_a_choice_logged_late_by_an_earlier_registration(tmp_path):
    # The head's choice was still being made (the decisions worker busy) when the model was
    # wrapped again, and was logged after the unfrozen model's first sample: the log's last
    # completed row is the head's, though the re-wrapped model runs the new session's groups.
    from tests.unit.tuning_service.test_tuning_decisions import StepExecutor

    path, worker = tmp_path / "tuning.log", StepExecutor()
    config = TuningConfig(
        max_samples=2, sampling_confidence_time=1.0, min_windows=2, warmup_time=0.0, seed=0
    )
    service = TuningService(config, log=TuningLog.create(path), decisions=worker)
    process = InProcessService(service)
    process.log_file = str(path)

    def sample(step: int) -> int:
        for train_iter in range(step, step + 3):  # a discarded window, then a sample's two
            service.report("m", Report(service.views()[0].current.id, train_iter, 100, 1.0))
        return step + 3

    service.register("m", Registration.from_json({**FACTS, "gradient_bytes": 2**20}))
    step = sample(0)
    worker.run_all()
    step = sample(step)  # the head's choice is pending
    service.register("m", Registration.from_json({**FACTS, "gradient_bytes": 2**24}))
    sample(step)
    worker.run_all()
    assert path.read_text().splitlines()[-1].split(",")[7] == "completed"
    out = io.StringIO()
    monitor = ProgressMonitor(process, out=out)
    monitor.poll()
    process.alive, process.returncode = False, -9
    monitor.poll()
    assert (
        out.getvalue()
        .splitlines()[-1]
        .endswith(
            "training goes on: each model keeps the last group the service gave it (rank 0 names it)"
        )
    )


def test_gains_say_they_compare_with_the_default_s_first_sample_until_it_has_a_second():
    # A row's gain divides by the default's score at that moment: its first sample alone (the
    # job's first after warmup) until it is measured again. A line read "+71 % vs default"
    # against that slow first sample while the summary rightly claimed nothing.
    service, noise = TuningService(CONFIG), random.Random(1)
    out = io.StringIO()
    monitor = ProgressMonitor(InProcessService(service), out=out)
    drive(service, {**FACTS, "gradient_bytes": 2**24}, lambda s: s["state"] == "completed", noise)
    drive(service, {**FACTS, "gradient_bytes": 2**26}, lambda s: s["samples"] >= 2, noise)
    monitor.poll()
    rows = list(csv.DictReader(io.StringIO(service.log_csv("m"))))
    rows = [row for row in rows if row["phase"] != "completed"]
    lines = [line for line in out.getvalue().splitlines() if " sample " in line]
    assert len(lines) == len(rows)
    head = next(i for i, row in enumerate(rows[1:], 1) if row["phase"] == "default")
    default = [(r["bucket_size_2p"], r["is_hierarchical_reduce"]) for r in (rows[0], rows[head])]
    again = next(
        i
        for i, row in enumerate(rows[1:head], 1)
        if (row["bucket_size_2p"], row["is_hierarchical_reduce"]) == default[0]
    )
    assert 1 < again < head, "the default was not measured again"
    for start, end in ((0, again), (head, len(rows))):
        assert lines[start].endswith(" it/s (the default group)"), lines[start]
        for line in lines[start + 1 : end]:
            assert line.endswith(" vs the default's first sample)"), line
    for line in lines[again:head]:
        assert line.endswith("% vs default)") and " ± " in line, line
    assert head + 1 < len(rows)
