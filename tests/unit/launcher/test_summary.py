"""The launcher's end-of-run summary."""

from distune.launcher.summary import format_summary

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
    assert "bucket 2^22 B (4 MiB), flat, 12.3 it/s" in text
    assert "default group: 11.8 it/s; gain +4.2%" in text
    assert "autotune log: /tmp/distune_autotune_x.log" in text
    assert "best-file: /tmp/best.json" in text


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


def test_unanswered_status_says_so():
    assert "did not answer" in format_summary(None, None, None)[0]
