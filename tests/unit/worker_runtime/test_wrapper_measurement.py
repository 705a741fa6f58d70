"""A level-2 trial of a script that never calls ``distune.prepare``: measured through
``distune.DistributedDataParallel`` (steps end with each synchronised backward), in a gloo world
of one rank. A trial's rank ends its process, so each trial runs in a child process (forked from
one that has imported torch: tests/support/zygote.py)."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import distune
from distune.trial_settings import TRIAL_DIR
from distune.worker_runtime.trial_measurement import preparing
from tests.support.zygote import run_python

# A script as a user writes it: DDP only, its own micro-batch and accumulation under no_sync,
# the data drawn inside the loop (so it is part of the step's time).
SCRIPT = textwrap.dedent(
    """
    import contextlib, sys
    import torch, torch.distributed as dist
    from torch import nn
    import distune

    micro, accumulation = int(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    torch.manual_seed(0)
    model = distune.DistributedDataParallel(
        nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 32))
    )
    optimizer = torch.optim.Adam(model.parameters())
    for step in range(100):
        optimizer.zero_grad()
        for m in range(accumulation):
            last = m == accumulation - 1
            with contextlib.nullcontext() if last else model.no_sync():
                x = torch.randn(micro, 32)
                model(x).pow(2).mean().backward()
            with torch.no_grad():
                model(x)  # an evaluation forward is no micro-step
        optimizer.step()
    print("the trial should have ended the process", flush=True)
    sys.exit(3)
    """
)

PARAMETER_BYTES = (32 * 256 + 256 + 256 * 32 + 32) * 4

# A GAN: two models handed to distune, through prepare or wrapped; the discriminator steps
# first in each iteration, so its steps would end the trial first if each model had its own.
GAN = textwrap.dedent(
    """
    import sys
    import torch, torch.distributed as dist
    from torch import nn
    import distune

    micro, api = int(sys.argv[1]), sys.argv[3]
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 16))
    d = nn.Sequential(nn.Linear(16, 512), nn.ReLU(), nn.Linear(512, 1))
    if api == "prepare":
        g = distune.prepare(g, torch.optim.Adam(g.parameters()), micro_batch_size=micro)
        # The discriminator declares no blocks: ZeRO-3 could not wrap the job's every model.
        d = distune.prepare(
            d, torch.optim.Adam(d.parameters()), micro_batch_size=micro, blocks=()
        )
        G, D, og, od = g.model, d.model, g.optimizer, d.optimizer
    elif api == "wrapper":
        G, D = distune.DistributedDataParallel(g), distune.DistributedDataParallel(d)
        og, od = torch.optim.Adam(G.parameters()), torch.optim.Adam(D.parameters())
    else:  # the generator wrapped, then the discriminator through prepare
        G = distune.DistributedDataParallel(g)
        d = distune.prepare(d, torch.optim.Adam(d.parameters()), micro_batch_size=micro)
    bce = nn.BCEWithLogitsLoss()
    for step in range(100):
        fake = G(torch.randn(micro, 8))
        real = bce(D(torch.randn(micro, 16)), torch.ones(micro, 1))
        od.zero_grad()
        (real + bce(D(fake.detach()), torch.zeros(micro, 1))).backward()
        od.step()
        og.zero_grad()
        bce(D(fake), torch.ones(micro, 1)).backward()
        og.step()
    sys.exit(3)
    """
)
GAN_BYTES = (8 * 256 + 256 + 256 * 16 + 16 + 16 * 512 + 512 + 512 + 1) * 4


def trial(
    tmp_path: Path,
    micro: int,
    accumulation: int,
    text: str = SCRIPT,
    args: tuple[str, ...] = (),
    **env: str,
) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(text)
    trial_dir = tmp_path / "trial"
    trial_dir.mkdir()
    environ = {
        k: v for k, v in os.environ.items() if not k.startswith(("DISTUNE_", "TORCHELASTIC"))
    }
    environ.update(
        {
            TRIAL_DIR: str(trial_dir),
            "DISTUNE_TRIAL_WARMUP_STEPS": "1",
            "DISTUNE_TRIAL_STEPS": "3",
            **env,
        }
    )
    # Forked from a process that has imported torch (as subprocess.run otherwise).
    return run_python([str(script), str(micro), str(accumulation), *args], environ, timeout=120)


def test_a_wrapper_only_script_is_measured_step_by_step_with_its_batch_learned(tmp_path):
    done = trial(tmp_path, 5, 3, DISTUNE_DEVICE_MEMORY=str(64 * 2**20))
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "trial" / "result.json").read_text())
    assert result["api"] == "wrapper"
    assert result["config"] == {
        "micro_batch": 5,
        "accumulation": 3,
        "stage": 0,
        "checkpointing": False,
    }
    assert result["parameter_bytes"] == result["gradient_bytes"] == PARAMETER_BYTES
    assert len(result["step_seconds_all"]) == 3
    assert result["throughput"] == pytest.approx(15 / result["step_seconds"])
    # Parameters, gradients (the buckets, counted once learned) and Adam's two moments.
    assert result["peak_memory_bytes"] >= 4 * PARAMETER_BYTES
    assert result["activation_bytes_per_sample"] > 0
    assert json.loads((tmp_path / "trial" / "progress").read_text()) == {"steps": 4}
    assert json.loads((tmp_path / "trial" / "rank0.json").read_text())["outcome"] == "ok"


def test_a_script_that_ignores_the_trials_micro_batch_crashes_naming_arg_mappings(tmp_path):
    done = trial(tmp_path, 5, 2, DISTUNE_MICRO_BATCH="4", DISTUNE_ACCUMULATION="2")
    assert done.returncode != 0
    report = json.loads((tmp_path / "trial" / "rank0.json").read_text())
    assert report["outcome"] == "crash"
    assert "train_micro_batch_size_per_gpu=4" in report["error"]
    assert "arg_mappings" in report["error"]
    assert not (tmp_path / "trial" / "result.json").exists()


def test_the_cap_applies_through_the_wrapper_as_an_out_of_memory(tmp_path):
    done = trial(tmp_path, 5, 1, DISTUNE_DEVICE_MEMORY=str(3 * PARAMETER_BYTES))
    assert done.returncode != 0
    assert json.loads((tmp_path / "trial" / "rank0.json").read_text())["outcome"] == "oom"


def test_a_wrapper_made_by_prepare_is_not_measured_twice(tmp_path, monkeypatch):
    monkeypatch.setenv(TRIAL_DIR, str(tmp_path))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with preparing():
            model = distune.DistributedDataParallel(nn.Linear(4, 4))
        model(torch.randn(2, 4)).sum().backward()
    finally:
        dist.destroy_process_group()
    assert list(tmp_path.iterdir()) == []  # no pid, progress or result file


@pytest.mark.parametrize("api", ["prepare", "wrapper"])
def test_a_gans_two_models_are_both_in_the_trials_sizes_and_memory(tmp_path, api):
    done = trial(tmp_path, 4, 1, GAN, (api,), DISTUNE_DEVICE_MEMORY=str(64 * 2**20))
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "trial" / "result.json").read_text())
    assert result["api"] == api
    # Both models' sizes (each model's own measurement ended the trial with its own alone).
    assert result["parameter_bytes"] == result["gradient_bytes"] == GAN_BYTES
    # Through prepare, Adam's two moments and step counts of both models' 8 parameters (the
    # wrapper never sees the optimizer).
    assert result["optimizer_state_bytes"] == (2 * GAN_BYTES + 8 * 4 if api == "prepare" else 0)
    # A step is the first model's optimizer step: the whole iteration, of 4 samples.
    assert result["config"]["micro_batch"] == 4
    assert result["throughput"] == pytest.approx(4 / result["step_seconds"])
    assert result["peak_memory_bytes"] >= (4 if api == "prepare" else 2) * GAN_BYTES
    # The generator's two Linear layers are repeated blocks; the discriminator has none.
    assert result.get("repeated_block_classes") == (0 if api == "prepare" else None)


def test_prepare_after_another_model_was_wrapped_crashes_saying_the_order(tmp_path):
    done = trial(tmp_path, 4, 1, GAN, ("mixed",))
    assert done.returncode != 0
    report = json.loads((tmp_path / "trial" / "rank0.json").read_text())
    assert report["outcome"] == "crash"
    assert (
        "distune.prepare was called after another model was wrapped in "
        "distune.DistributedDataParallel" in report["error"]
    )
    assert not (tmp_path / "trial" / "result.json").exists()


# fairseq-style: a batch that runs out of memory is skipped, the error caught (the cap's here).
SKIPS_OOM = textwrap.dedent(
    """
    import sys
    import torch, torch.distributed as dist
    from torch import nn
    import distune

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    model = nn.Linear(16, 1)
    run = distune.prepare(model, torch.optim.SGD(model.parameters()), micro_batch_size=2)
    for step in range(100):
        try:
            with run.accumulate(0):
                if step == 2:
                    torch.empty(2**20, dtype=torch.uint8)  # over the cap
                run.model(torch.randn(2, 16)).sum().backward()
            run.optimizer.step()
        except torch.OutOfMemoryError:
            print("out of memory, skipping batch", flush=True)
        run.optimizer.zero_grad()
    sys.exit(3)
    """
)


def test_an_out_of_memory_error_the_script_catches_ends_the_trial_as_oom(tmp_path):
    done = trial(tmp_path, 2, 1, SKIPS_OOM, DISTUNE_DEVICE_MEMORY=str(2**19))
    assert "skipping batch" in done.stdout
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads((tmp_path / "trial" / "rank0.json").read_text())
    assert report["outcome"] == "oom"
    assert report["error"].startswith("distune device memory cap: ")
    assert report["error"].endswith("(the script caught the error and went on)")
    assert not (tmp_path / "trial" / "result.json").exists()


# Inputs whose first dimension is not the batch: an LSTM's (time, batch, features) with its
# hidden state (torch's word_language_model), and a detection model's list of images.
LAYOUTS = textwrap.dedent(
    """
    import sys
    import torch, torch.distributed as dist
    from torch import nn
    import distune

    class SequenceFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.out = nn.LSTM(8, 16), nn.Linear(16, 8)

        def forward(self, x, hidden):
            return self.out(self.rnn(x, hidden)[0])

    class Images(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, images):
            return self.conv(torch.stack(images))

    micro, layout = int(sys.argv[1]), sys.argv[3]
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    model = distune.DistributedDataParallel(SequenceFirst() if layout == "seq" else Images())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(100):
        optimizer.zero_grad()
        if layout == "seq":  # 7 time steps of micro sequences
            hidden = (torch.zeros(1, micro, 16), torch.zeros(1, micro, 16))
            model(torch.randn(7, micro, 8), hidden).pow(2).mean().backward()
        else:  # micro images of 3 channels
            model([torch.randn(3, 6, 6) for _ in range(micro)]).pow(2).mean().backward()
        optimizer.step()
    sys.exit(3)
    """
)


@pytest.mark.parametrize("layout", ["seq", "list"])
def test_a_micro_batch_the_trial_sets_is_found_in_any_dimension_of_the_input(tmp_path, layout):
    done = trial(tmp_path, 5, 1, LAYOUTS, (layout,), DISTUNE_MICRO_BATCH="5")
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "trial" / "result.json").read_text())
    assert result["config"]["micro_batch"] == 5  # not 7 time steps, nor 3 channels
    # Where it was found, for the launcher to check against the profile: (7, 5, 8)'s dimension
    # 1; after the image's (3, 6, 6), the list's length.
    assert result["batch_dimensions"] == ([1] if layout == "seq" else [3])
    assert result["throughput"] == pytest.approx(5 / result["step_seconds"])
