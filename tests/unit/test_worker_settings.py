"""The DISTUNE_* environment contract between the launcher and the workers."""

import pytest

from distune.worker_settings import SettingsError, WorkerSettings


def test_defaults_mean_no_tuning_and_torch_ddp_bucket():
    settings = WorkerSettings.from_env({})
    assert settings == WorkerSettings()
    assert not settings.tuning
    assert settings.default_bucket_size == 25 * 2**20


def test_round_trip_through_environment():
    settings = WorkerSettings(
        autotune_level=1,
        service_url="http://127.0.0.1:8000",
        service_token="secret",
        bucket_size=4 * 2**20,
        hierarchical_reduce=False,
        default_bucket_size=2**22,
        sync_interval=0.5,
    )
    env = settings.to_env()
    assert env["DISTUNE_SERVICE_URL"] == "http://127.0.0.1:8000"
    assert env["DISTUNE_HIERARCHICAL_REDUCE"] == "0"
    assert WorkerSettings.from_env(env) == settings
    assert settings.tuning


def test_level_one_without_service_does_not_tune():
    assert not WorkerSettings.from_env({"DISTUNE_AUTOTUNE_LEVEL": "1"}).tuning


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"DISTUNE_AUTOTUNE_LEVEL": "2"}, "DISTUNE_AUTOTUNE_LEVEL must be 0 or 1"),
        ({"DISTUNE_AUTOTUNE_LEVEL": "one"}, "DISTUNE_AUTOTUNE_LEVEL must be an integer"),
        ({"DISTUNE_BUCKET_SIZE": "0"}, "DISTUNE_BUCKET_SIZE must be a positive number of bytes"),
        ({"DISTUNE_HIERARCHICAL_REDUCE": "maybe"}, "DISTUNE_HIERARCHICAL_REDUCE must be 1 or 0"),
        ({"DISTUNE_SYNC_INTERVAL": "nan"}, "DISTUNE_SYNC_INTERVAL must be a positive number"),
        ({"DISTUNE_SYNC_INTERVAL": "-1"}, "DISTUNE_SYNC_INTERVAL must be a positive number"),
        # Accepted before: the leader retried an unusable URL as an outage for the whole job.
        (
            {"DISTUNE_SERVICE_URL": "localhost:29600"},
            "DISTUNE_SERVICE_URL must be a URL like http://HOST:PORT, got 'localhost:29600'",
        ),
        ({"DISTUNE_SERVICE_URL": "http://h:port"}, "DISTUNE_SERVICE_URL must be a URL like"),
        ({"DISTUNE_SERVICE_URL": "ftp://h:21"}, "DISTUNE_SERVICE_URL must be a URL like"),
    ],
)
def test_bad_values_name_the_variable(env, message):
    with pytest.raises(SettingsError) as info:
        WorkerSettings.from_env(env)
    assert message in str(info.value)


def test_the_token_stays_out_of_the_settings_repr():
    settings = WorkerSettings(autotune_level=1, service_url="http://h:1", service_token="s3cret")
    assert "s3cret" not in repr(settings)
    assert WorkerSettings.from_env(settings.to_env()).service_token == "s3cret"
