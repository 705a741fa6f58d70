"""The service's command line, in-process: flags map onto TuningConfig; bad ones exit 2."""

import pytest

from distune.space import FixedKnobs
from distune.tuning_service.server import _config, _parser, main


def test_flags_map_onto_the_tuning_config_in_both_spellings():
    args = _parser().parse_args(
        [
            "--max-samples", "7",
            "--sampling_confidence_time", "2.5",
            "--warmup-time", "0",
            "--fixed", "bucket_size_2p=22", "is_hierarchical_reduce=false",
            "--default_bucket_size", "1048576",
            "--seed", "3",
        ]
    )  # fmt: skip
    config = _config(args)
    assert config.max_samples == 7 and config.sampling_confidence_time == 2.5
    assert config.warmup_time == 0 and config.seed == 3
    assert config.fixed == FixedKnobs(bucket_size_2p=22, is_hierarchical_reduce=False)
    assert config.default_bucket_size == 2**20


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-samples", "0"], "max_samples must be in"),
        (["--fixed", "colour=blue"], "unknown hyperparameter(s) 'colour'"),
        (["--fixed", "bucket_size_2p"], "expected NAME=VALUE"),
        (["--sampling-confidence-time", "nan"], "sampling_confidence_time"),
        (["--warmup-time", "-1"], "warmup_time"),
        (["--port", "70000"], "--port"),
        (["--best-file", "/nonexistent-dir/best.json"], "no such directory"),
        (["--log-file", "/nonexistent-dir/log.csv"], "cannot write the tuning log"),
        (["--log-file", "a", "--log-dir", "b"], "not allowed with"),
    ],
)
def test_bad_arguments_exit_2_naming_the_problem(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err
