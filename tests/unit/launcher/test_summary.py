"""The launcher's end-of-run summary."""

import pytest
from torch.distributed import DistError

from distune.launcher.main import main
from distune.launcher.summary import format_summary
from tests.support.local_host import free_port_pair

GROUP = {"id": 3, "hyperparameters": {"bucket_size_2p": 22, "is_hierarchical_reduce": False}}
DEFAULT = {"id": 0, "hyperparameters": {"bucket_size_2p": 25, "is_hierarchical_reduce": False}}


def test_completed_model_shows_choice_scores_gain_and_files():
    status = {
        "models": {
            "model0": {
                "state": "completed",
                "samples": 8,
                "max_samples": 20,
                "current": GROUP,
                "best": {"group": GROUP, "score": 12.3, "gain_vs_default": 0.042},
                "default_score": 11.8,
            }
        }
    }
    text = "\n".join(format_summary(status, "/tmp/distune_autotune_x.log", "/tmp/best.json"))
    assert "model model0: completed after 8 of at most 20 samples" in text
    assert "chosen group:  bucket 2^22 B (4 MiB), flat, 12.3 it/s" in text
    assert "default group: 11.8 it/s; gain +4.2%" in text
    assert "autotune log: /tmp/distune_autotune_x.log" in text
    assert "best-file: /tmp/best.json" in text


def test_a_budget_of_one_sample_reads_in_the_singular():
    status = {"models": {"m": {"state": "completed", "samples": 1, "max_samples": 1}}}
    assert "model m: completed after 1 of at most 1 sample\n" in "\n".join(
        [*format_summary(status, None, None), ""]
    )


def test_model_without_a_choice_shows_its_current_group():
    status = {
        "models": {
            "m": {
                "state": "warmup",
                "samples": 0,
                "max_samples": 20,
                "current": DEFAULT,
                "best": None,
                "default_score": None,
            }
        }
    }
    text = "\n".join(format_summary(status, None, None))
    assert "current group: bucket 2^25 B (32 MiB), flat (nothing chosen yet)" in text
    assert "log" not in text


def test_a_model_still_sampling_shows_its_best_so_far_not_a_choice():
    status = {
        "models": {
            "m": {
                "state": "sampling",
                "samples": 9,
                "max_samples": 20,
                "current": DEFAULT,
                "best": {"group": GROUP, "score": 28.0, "gain_vs_default": 0.072},
                "default_score": 26.1,
            }
        }
    }
    text = "\n".join(format_summary(status, None, None))
    assert "chosen" not in text
    assert (
        "best so far:   bucket 2^22 B (4 MiB), flat, 28 it/s "
        "(sampling bucket 2^25 B (32 MiB), flat when the job ended)"
    ) in text
    assert "gain +7.2%" in text


def test_unanswered_status_says_so():
    assert "did not answer" in format_summary(None, None, None)[0]


def test_after_the_service_died_the_summary_shows_the_last_state_without_repeating_it():
    last = {
        "models": {
            "m": {
                "state": "sampling",
                "samples": 2,
                "max_samples": 20,
                "current": GROUP,
                "best": {"group": DEFAULT, "score": 10.0, "gain_vs_default": 0.0},
                "default_score": 10.0,
            }
        }
    }
    lines = format_summary(last, "/tmp/x.log", None, service_gone=True)
    assert lines[0] == "distune: model m: sampling after 2 of at most 20 samples (as last reported)"
    assert lines[-1] == "distune: autotune log: /tmp/x.log"
    text = "\n".join(lines)
    assert "did not answer" not in text and "stopped" not in text
    # Died before answering once: only where the log is.
    assert format_summary(None, "/tmp/x.log", None, service_gone=True) == [
        "distune: autotune log: /tmp/x.log"
    ]


def test_the_gain_carries_its_interval_and_says_when_it_is_within_the_noise():
    def summary(gain: float, margin: float, faster: bool) -> str:
        best = {"group": GROUP, "score": 10.1, "gain_vs_default": gain}
        best |= {"gain_margin": margin, "measurably_faster": faster}
        model = {"state": "sampling", "samples": 15, "max_samples": 20, "current": GROUP}
        model |= {"best": best, "default_score": 10.0}
        return "\n".join(format_summary({"models": {"m": model}}, None, None))

    assert "gain +1.0% ± 2.3% (within the noise)" in summary(0.010, 0.023, False)
    assert "gain +8.0% ± 2.0% (measurably faster)" in summary(0.080, 0.020, True)
    # The default group leads (its interval against itself is 0 wide): no gain, said plainly,
    # not "+0.0% ± 0.0% (within the noise)".
    leads = summary(0.0, 0.0, False)
    assert "gain none: the default group is the best measured" in leads and "±" not in leads


def test_a_default_group_that_leads_is_said_once():
    # A completed run printed "gain none: the default group is the best measured" and, on
    # the next line, the service's verdict "the default group is the fastest measured".
    best = {"group": GROUP, "score": 10.0, "gain_vs_default": 0.0, "gain_margin": 0.0}
    model = {"state": "completed", "samples": 4, "max_samples": 4, "current": GROUP}
    model |= {"best": best, "default_score": 10.0}
    model |= {"verdict": "the default group is the fastest measured"}
    lines = format_summary({"models": {"m": model}}, None, None)
    assert (
        lines[-1] == "  default group: 10 it/s; gain none: the default group is the best measured"
    )
    assert not any("fastest measured" in line for line in lines)
    # Another verdict adds what the gain does not say: it stays.
    faster = {**best, "gain_vs_default": 0.1, "gain_margin": 0.02, "measurably_faster": True}
    verdict = "+10.0% vs the default (95% interval +8.0% to +12.0%)"
    lines = format_summary(
        {"models": {"m": {**model, "best": faster, "verdict": verdict}}}, None, None
    )
    assert lines[-1] == f"  {verdict}"


def test_a_job_that_registered_no_model_says_how_a_model_takes_part():
    (line,) = format_summary({"models": {}}, None, None)
    assert line.startswith("distune: no model registered with the tuning service: nothing was")
    assert "distune.DistributedDataParallel" in line
    assert "torch's own DistributedDataParallel is not tuned" in line


def test_a_job_that_failed_before_any_model_registered_is_not_said_to_wrap_none():
    (line,) = format_summary({"models": {}}, None, None, exit_code=3)
    assert line == (
        "distune: no model registered with the tuning service: nothing was tuned (the job "
        "ended with exit code 3 before any model registered; see above why)"
    )
    (line,) = format_summary({"models": {}}, None, None, exit_code=0)
    assert "wrapped no model" in line


def test_a_launcher_that_stopped_on_an_error_does_not_blame_the_script():
    (line,) = format_summary({"models": {}}, None, None, launcher_failed=True)
    assert line == (
        "distune: nothing was tuned: the launcher stopped on an error before any model "
        "registered (see its error)"
    )


@pytest.mark.slow
def test_a_rendezvous_that_times_out_is_summed_up_as_the_launchers_error(
    tmp_path, monkeypatch, capsys
):
    # Node 0 of two, the other never comes: torch's static rendezvous gives up (1 s here, 600 s
    # by default) with an exception the launcher does not catch; no worker ever ran.
    monkeypatch.setenv("DISTUNE_SERVICE_TOKEN", "a-token-of-this-job")
    script = tmp_path / "t.py"
    script.write_text("pass\n")
    port = free_port_pair()
    argv = ["--nnodes", "2", "--node_rank", "0", "--master_addr", "127.0.0.1",
            "--master_port", str(port), "--rdzv_conf", "timeout=1",
            "--nproc_per_node", "1", "--autotune_level", "1", str(script)]  # fmt: skip
    with pytest.raises(DistError):
        main(argv)
    out = capsys.readouterr().out
    assert "the launcher stopped on an error before any model registered" in out
    assert "wrapped no model" not in out
    # What it waited for was said as it began (torch's rendezvous itself is silent).
    assert (
        f"distune: node 0 of 2: waiting for the other nodes in torch's static rendezvous at "
        f"127.0.0.1:{port} (up to 1 s; --rdzv_conf timeout=S changes it)"
    ) in out


def registration(world_size, nnodes, gradient_bytes):
    return {"world_size": world_size, "nnodes": nnodes, "local_world_size": world_size // nnodes,
            "gradient_bytes": gradient_bytes, "fixed": {}}  # fmt: skip


def test_a_model_registered_again_shows_its_earlier_registrations():
    # Wrapped again after unfreezing (more gradient bytes): the lines are the latest session's,
    # then each earlier one's outcome; a report after replacement warns of two models.
    head = {
        "state": "completed",
        "samples": 5,
        "max_samples": 20,
        "current": GROUP,
        "best": {"group": GROUP, "score": 12.3, "gain_vs_default": 0.042},
        "default_score": 11.8,
        "registration": registration(8, 2, 2**20),
        "superseded_reports": 0,
    }
    status = {
        "models": {
            "model0": {
                "state": "sampling",
                "samples": 2,
                "max_samples": 20,
                "current": DEFAULT,
                "best": None,
                "default_score": 20.0,
                "registration": registration(8, 2, 2**26),
                "earlier": [head, {**head, "best": None, "superseded_reports": 3}],
            }
        }
    }
    lines = format_summary(status, None, None)
    assert lines[:4] == [
        "distune: model model0: sampling after 2 of at most 20 samples",
        "  as registered last (8 ranks (2 nodes x 4), 67108864 gradient bytes); before:",
        "  8 ranks (2 nodes x 4), 1048576 gradient bytes: completed after 5 samples; "
        "bucket 2^22 B (4 MiB), flat, 12.3 it/s, gain +4.2%",
        "  8 ranks (2 nodes x 4), 1048576 gradient bytes: completed after 5 samples; "
        "nothing chosen",
    ]
    assert "two models trained under this name at once" in lines[4]
    assert lines[5] == "  current group: bucket 2^25 B (32 MiB), flat (nothing chosen yet)"


def test_the_best_file_line_says_when_no_model_completed_or_an_earlier_shape_did():
    # The service writes the best-file only when a model completes: before, a job that ended
    # while sampling was told "best-file: PATH", which held nothing of this job (or an earlier
    # run's file).
    sampling = {"state": "sampling", "samples": 2, "max_samples": 20, "current": DEFAULT,
                "best": None, "default_score": 20.0}  # fmt: skip
    lines = format_summary({"models": {"m": sampling}}, None, "/tmp/best.json")
    assert lines[-1] == (
        "distune: best-file: not written: no model completed tuning "
        "(/tmp/best.json is left as it was)"
    )
    # A model wrapped again after unfreezing, whose new session did not complete: the file
    # holds the head's choice, which is not the last shape's.
    head = {**sampling, "state": "completed", "best": {"group": GROUP, "score": 12.3},
            "registration": registration(2, 1, 2**20), "superseded_reports": 0}  # fmt: skip
    status = {"models": {"m": {**sampling, "earlier": [head]}}}
    assert format_summary(status, None, "/tmp/best.json")[-1] == (
        "distune: best-file: /tmp/best.json (for m, the choice of an earlier registration: "
        "its last registration, with other facts, did not complete)"
    )
    done = {"models": {"m": {**sampling, "state": "completed"}}}
    assert format_summary(done, None, "/tmp/best.json")[-1] == "distune: best-file: /tmp/best.json"
