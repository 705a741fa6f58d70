"""The level-2 ``DISTUNE_*`` variables: what the launcher writes, every rank reads back."""

from __future__ import annotations

from pathlib import Path

import pytest

from distune.trial_settings import (
    BF16,
    CHECKPOINTING,
    MEASURED_STEPS,
    ZERO_STAGE,
    TrialSettings,
    TrialSettingsError,
)


def test_settings_round_trip_through_the_environment() -> None:
    settings = TrialSettings(4, 2, 3, True, 2**30, Path("/tmp/trial"), 0, 3, bf16=True)
    assert TrialSettings.from_env(settings.to_env()) == settings
    assert settings.to_env()[BF16] == "1"


def test_unset_knobs_leave_the_scripts_own_values() -> None:
    settings = TrialSettings.from_env({})
    assert settings == TrialSettings()
    assert not settings.is_trial
    assert TrialSettings().to_env() == {}


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({ZERO_STAGE: "4"}, "DISTUNE_ZERO_STAGE must be 0, 1, 2 or 3"),
        ({CHECKPOINTING: "2"}, "DISTUNE_CHECKPOINTING must be 0 or 1"),
        ({BF16: "2"}, "DISTUNE_BF16 must be 0 or 1"),
        ({MEASURED_STEPS: "1"}, "DISTUNE_TRIAL_STEPS must be at least 2"),
        ({ZERO_STAGE: "x"}, "DISTUNE_ZERO_STAGE must be an integer"),
    ],
)
def test_bad_values_name_the_variable(environ: dict[str, str], message: str) -> None:
    with pytest.raises(TrialSettingsError, match=message):
        TrialSettings.from_env(environ)
