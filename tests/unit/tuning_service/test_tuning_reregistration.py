"""A model registered again with other facts, driven by scripted registrations and reports.

The two ordinary cases: a model wrapped again after unfreezing layers (more gradient bytes),
and a job restarted on another number of nodes (another world size). Each is tuned afresh in a
new session, whose group ids continue the old one's; the old session's rows and result stay.
A report from the replaced registration (two models under one name at once) is told apart: 409
with state ``superseded``, counted in ``/status``. Registering the same facts again resumes.
"""

import csv
import io
import json
import logging

import jsonschema
import pytest

from distune.tuning_service.app import create_app
from distune.tuning_service.config import TuningConfig
from distune.tuning_service.messages import Registration, Report
from distune.tuning_service.service import TuningService
from distune.tuning_service.tuning_log import TuningLog
from tests.support.models import MULTI_NODE_LARGE_REGISTRATION, SINGLE_NODE_REGISTRATION
from tests.unit.tuning_service.test_tuning_decisions import StepExecutor

CONFIG = TuningConfig(
    max_samples=4, sampling_confidence_time=2.0, min_windows=2, warmup_time=0.0, seed=3
)
#: A frozen backbone: the head's gradients only.
HEAD = {**SINGLE_NODE_REGISTRATION, "gradient_bytes": 2**20}
#: The same model unfrozen and wrapped again: every layer's gradients.
UNFROZEN = {**SINGLE_NODE_REGISTRATION, "gradient_bytes": 2**26}
#: The job of MULTI_NODE_LARGE_REGISTRATION (2 nodes x 4) restarted on one node of its 4 ranks.
SHRUNK = {**MULTI_NODE_LARGE_REGISTRATION, "world_size": 4, "nnodes": 1}


def rate(hyperparameters: dict) -> float:
    """Iterations per second: larger buckets are faster, hierarchical a little more."""
    return (
        50.0
        + 5.0 * hyperparameters["bucket_size_2p"]
        + 3.0 * hyperparameters["is_hierarchical_reduce"]
    )


class Job:
    """A job's leader over the REST API: it registers, and reports the group it last heard of."""

    def __init__(self, client, name: str = "m") -> None:
        self.client, self.name = client, name
        self.group: dict = {}
        self.step = 0

    def register(self, facts: dict) -> dict:
        response = self.client.post(f"/api/v1/models/{self.name}/register", json=facts)
        assert response.status_code == 200, response.get_json()
        self.group = response.get_json()["group"]
        return response.get_json()

    def report(self, group_id: int | None = None):
        """One second of training under the current group (or under ``group_id``)."""
        self.step += 10
        group_id = self.group["id"] if group_id is None else group_id
        iterations = round(rate(self.group["hyperparameters"]))
        body = {"group_id": group_id, "train_iter": self.step, "iterations": iterations,
                "seconds": 1.0}  # fmt: skip
        response = self.client.post(f"/api/v1/models/{self.name}/report", json=body)
        assert response.status_code in (200, 409), response.get_json()
        if response.get_json()["state"] != "superseded":
            self.group = response.get_json()["group"]
        return response

    def run_until(self, done, limit: int = 200) -> None:
        for _ in range(limit):
            if done(self.status()):
                return
            self.report()
        raise AssertionError(f"not done after {limit} reports: {self.status()}")

    def status(self) -> dict:
        return self.client.get("/api/v1/status").get_json()["models"][self.name]

    def log_rows(self) -> list[dict]:
        text = self.client.get(f"/api/v1/models/{self.name}/log").get_data(as_text=True)
        return list(csv.DictReader(io.StringIO(text)))


def make_job(tmp_path=None, config=CONFIG, name="m"):
    log = None if tmp_path is None else TuningLog.create(tmp_path / "tuning.log")
    best = None if tmp_path is None else tmp_path / "best.json"
    service = TuningService(config, log=log, best_path=best)
    return Job(create_app(service).test_client(), name)


def completed(status: dict) -> bool:
    return status["state"] == "completed"


def test_a_model_wrapped_again_after_unfreezing_is_tuned_afresh(tmp_path):
    job = make_job(tmp_path)
    job.register(HEAD)
    job.run_until(completed)
    head = job.status()
    old_ids = {int(row["group_id"]) for row in job.log_rows()}

    # Before: 409 "already registered with other facts", and the unfrozen phase ran untuned.
    again = job.register(UNFROZEN)
    assert again["state"] == "sampling" and not again["completed"]
    assert again["group"]["id"] > max(old_ids), "group ids continue across registrations"
    assert again["group"]["hyperparameters"] == {"bucket_size_2p": 25,
                                                 "is_hierarchical_reduce": False}  # fmt: skip
    status = job.status()
    assert status["registration"] == {**UNFROZEN, "fixed": {}}
    assert status["samples"] == 0 and status["best"] is None
    [earlier] = status["earlier"]
    assert earlier["registration"] == {**HEAD, "fixed": {}}
    assert earlier["state"] == "completed" and earlier["best"] == head["best"]
    assert earlier["superseded_reports"] == 0

    job.run_until(completed)
    status = job.status()
    assert (
        status["samples"] >= 2 and status["best"]["group"]["hyperparameters"]["bucket_size_2p"] > 20
    ), "the unfrozen model's larger buckets were searched"
    rows = job.log_rows()
    head_rows = [row for row in rows if int(row["group_id"]) in old_ids]
    assert len(head_rows) == head["samples"] + 1, "the first session's rows are kept in /log"
    assert [row["phase"] for row in rows].count("completed") == 2
    # The file holds both sessions' rows, as /log does.
    with open(tmp_path / "tuning.log", newline="") as file:
        assert list(csv.DictReader(file)) == rows


def test_a_job_restarted_on_fewer_nodes_is_tuned_afresh():
    job = make_job()
    job.register(MULTI_NODE_LARGE_REGISTRATION)
    job.run_until(lambda status: status["samples"] >= 2)
    before = job.status()
    # A node lost, the elastic agent restarted the job on the one left (torchrun's --nnodes 1:2).
    job.register(SHRUNK)
    status = job.status()
    assert status["registration"]["nnodes"] == 1 and status["samples"] == 0
    assert status["earlier"][0]["state"] == "sampling"
    assert status["earlier"][0]["samples"] == before["samples"]
    job.run_until(completed)
    measured = {row["is_hierarchical_reduce"] for row in job.log_rows()[-job.status()["samples"] :]}
    assert measured == {"False"}, "one node: hierarchical is no knob of the new session"


def test_the_same_facts_resume_before_and_after_a_replacement():
    job = make_job()
    job.register(HEAD)
    job.run_until(lambda status: status["samples"] >= 1)
    resumed = job.register(HEAD)  # a restarted job: the same session, its group
    assert resumed["group"] == job.status()["current"] and job.status()["earlier"] == []
    job.register(UNFROZEN)
    job.run_until(lambda status: status["samples"] >= 1)
    now = job.status()
    resumed = job.register(UNFROZEN)
    assert resumed["group"] == now["current"]
    assert job.status()["samples"] == now["samples"] and len(job.status()["earlier"]) == 1
    # The first facts again (the job back on its old shape): another registration, tuned afresh.
    back = job.register(HEAD)
    assert back["group"]["id"] > now["current"]["id"]
    assert [e["registration"]["gradient_bytes"] for e in job.status()["earlier"]] == [
        HEAD["gradient_bytes"],
        UNFROZEN["gradient_bytes"],
    ]


def test_a_report_from_the_replaced_registration_is_superseded_and_counted(caplog):
    job = make_job()
    first = job.register(HEAD)["group"]
    job.register(UNFROZEN)
    current = job.status()["current"]
    # The first model is still training: two models under one name at once.
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            answer = job.report(group_id=first["id"])
            assert answer.status_code == 409
    body = answer.get_json()
    assert body["state"] == "superseded" and body["completed"] is True
    assert body["group"] == first, "the old registration keeps its own group"
    assert "registered again with other facts" in body["error"]
    assert "give each its own name=" in body["error"]
    status = job.status()
    assert status["current"] == current and status["samples"] == 0, "nothing was merged"
    assert status["earlier"][0]["superseded_reports"] == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "two models may be training under this name" in warnings[0]
    # The new registration's own reports are scored as ever.
    assert job.report().status_code == 200


def test_a_report_is_counted_for_the_registration_that_sent_it():
    job = make_job()
    first = job.register(HEAD)["group"]
    second = job.register(UNFROZEN)["group"]
    job.register(HEAD)  # back on the first shape: a third session
    answer = job.report(group_id=first["id"]).get_json()
    assert answer["group"] == first and "gradient_bytes=67108864" in answer["error"]
    assert job.report(group_id=second["id"]).get_json()["group"] == second
    assert job.report(group_id=second["id"]).status_code == 409
    counts = [e["superseded_reports"] for e in job.status()["earlier"]]
    assert counts == [1, 2]


def test_the_best_file_keeps_the_latest_completed_choice_of_each_model(tmp_path):
    service = TuningService(CONFIG, best_path=tmp_path / "best.json")
    client = create_app(service).test_client()
    job, other = Job(client, "m"), Job(client, "n")
    job.register(HEAD)
    job.run_until(completed)
    head_best = job.status()["best"]["group"]
    job.register(UNFROZEN)
    other.register(HEAD)
    other.run_until(completed)  # the file is written again while m's new session samples
    models = json.loads((tmp_path / "best.json").read_text())["autotune_result"]["models"]
    assert models["m"]["group"] == head_best and "n" in models
    job.run_until(completed)
    models = json.loads((tmp_path / "best.json").read_text())["autotune_result"]["models"]
    assert models["m"]["group"] == job.status()["best"]["group"] != head_best


def test_registrations_with_other_facts_count_against_max_models():
    job = make_job(config=TuningConfig(max_models=2, warmup_time=0.0))
    job.register(HEAD)
    job.register(UNFROZEN)
    response = job.client.post("/api/v1/models/m/register", json=HEAD)
    assert response.status_code == 409
    assert "at most 2 models (a model registered again" in response.get_json()["error"]
    assert job.register(UNFROZEN)["group"]["id"] == 1, "the current facts still resume"


def test_ids_stay_apart_when_a_choice_is_pending_at_the_replacement():
    # The old session's next group is still being chosen in the worker when the model is
    # registered again: that choice takes one more id, which the new session must not reuse.
    executor = StepExecutor()
    service = TuningService(CONFIG, decisions=executor)
    service.register("m", Registration.from_json(HEAD))
    group_id = 0
    for step in range(3):  # a discarded window, then two make the default's sample
        service.report("m", Report(group_id, step, 100, 1.0))
    assert executor.queue, "the next group is being chosen"
    reply = service.register("m", Registration.from_json(UNFROZEN))
    assert reply.group.id == 2
    executor.run_all()
    old, new = service.status()["models"]["m"]["earlier"][0], service.views()[0]
    assert old["current"]["id"] == 1 and new.current.id == 2
    assert service.report("m", Report(2, 10, 100, 1.0)).group.id == 2


@pytest.mark.parametrize("facts", [UNFROZEN, SHRUNK])
def test_status_is_valid_against_the_openapi_document(facts):
    job = make_job()
    job.register(HEAD)
    job.register(facts)
    job.report(group_id=0)
    document = job.client.get("/api/v1/openapi.json").get_json()
    schema = {**document["components"]["schemas"]["Status"], "components": document["components"]}
    jsonschema.Draft202012Validator(schema).validate(job.client.get("/api/v1/status").get_json())
    superseded = job.report(group_id=0).get_json()
    stale = {
        **document["components"]["schemas"]["StaleGroup"],
        "components": document["components"],
    }
    jsonschema.Draft202012Validator(stale).validate(superseded)
