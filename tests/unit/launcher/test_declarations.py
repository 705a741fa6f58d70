"""One declaration per setting: the launcher's flags, config keys, service flags and README
table all come from the fields of AutotuneOptions and TuningConfig."""

from dataclasses import fields
from pathlib import Path

import pytest

from distune import trial_settings
from distune.launcher.options import AutotuneOptions, build_parser, flag_table, flags, parse
from distune.launcher.plan import plan_launch
from distune.tuning_service.config import (
    OptimizerSettings,
    TuningConfig,
    declared,
    setting_table,
)
from distune.tuning_service.server import _config, _parser
from distune.worker_settings import variable_table

REPO = Path(__file__).resolve().parents[3]
README = REPO / "README.md"


def test_readme_flag_table_is_the_declared_one():
    assert flag_table() in README.read_text(encoding="utf-8"), (
        "README's launcher table differs from the flags' declarations; paste flag_table()"
    )


def test_readme_variable_table_is_the_declared_one():
    assert variable_table(trial_settings.VARIABLES) in README.read_text(encoding="utf-8"), (
        "README's DISTUNE_* table differs from the VARIABLES of worker_settings and trial_settings; paste variable_table()"
    )


def test_the_tuning_service_page_shows_the_declared_settings():
    page = (REPO / "docs" / "tuning_service.md").read_text(encoding="utf-8")
    for settings in (TuningConfig, OptimizerSettings):
        assert setting_table(settings) in page, (
            f"docs/tuning_service.md's {settings.__name__} table differs from its declaration; "
            "paste setting_table()"
        )


def test_every_autotune_flag_is_declared_and_parsed_in_both_spellings():
    parser = build_parser()
    spelled = {option for action in parser._actions for option in action.option_strings}
    for dest, _ in flags():
        assert f"--{dest}" in spelled and f"--{dest.replace('_', '-')}" in spelled
    assert {dest for dest, _ in flags()} == {item.name for item in fields(AutotuneOptions)}


def test_every_tuning_setting_is_declared_with_help_and_a_check():
    for settings in (TuningConfig, OptimizerSettings):
        names = {item.name for item, _ in declared(settings)}
        assert names == {item.name for item in fields(settings)}
        for _, declaration in declared(settings):
            assert declaration.help and callable(declaration.check)


def test_service_flags_are_the_flagged_tuning_settings():
    flagged = [item.name for item, setting in declared(TuningConfig) if setting.flag]
    spelled = {option for action in _parser()._actions for option in action.option_strings}
    for name in flagged:
        assert f"--{name.replace('_', '-')}" in spelled and f"--{name}" in spelled


def test_launcher_flags_reach_the_service_config_unchanged():
    # Every launcher flag that names a tuning setting: its value, through the service's own
    # command line, becomes that TuningConfig field.
    argv = [
        "--nproc_per_node", "2",
        "--autotune_level", "1",
        "--autotune_max_samples", "9",
        "--autotune_sampling_confidence_time", "2.5",
        "--autotune_warmup_time", "4",
        "--default_bucket_size", "1048576",
        "--autotune_retune_drift", "0.25",
        "--autotune_close_call_time", "3",
        "t.py",
    ]  # fmt: skip
    args, options = parse(argv)
    service_args = list(plan_launch(args, options).service_args)
    config = _config(_parser().parse_args(service_args))
    assert (config.max_samples, config.sampling_confidence_time) == (9, 2.5)
    assert (config.warmup_time, config.default_bucket_size) == (4.0, 2**20)
    assert (config.retune_drift, config.close_call_time) == (0.25, 3.0)
    tuned = {d.service for _, d in flags() if d.service in TuningConfig.__dataclass_fields__}
    assert tuned == {
        "max_samples",
        "sampling_confidence_time",
        "warmup_time",
        "default_bucket_size",
        "retune_drift",
        "close_call_time",
    }


def test_a_value_the_service_would_refuse_is_refused_by_the_launcher_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as info:
        parse(["--autotune_max_samples", "20000", "t.py"])
    assert info.value.code == 2
    assert "argument --autotune_max_samples: must be in [1, 10000], got 20000" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit) as info:
        parse(["--autotune_close_call_time", "0.5", "t.py"])
    assert info.value.code == 2
    error = capsys.readouterr().err
    assert "--autotune_close_call_time" in error and "must be a number of at least 1" in error
