"""distune.algorithms without processes: argument checks, peer schedules, 8-bit quantization."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest
import torch

import distune
from distune.worker_runtime.algorithms.decentralized import peers
from distune.worker_runtime.algorithms.low_precision import dequantize, quantize


def test_bad_arguments_are_named() -> None:
    algorithms = distune.algorithms
    with pytest.raises(algorithms.AlgorithmError, match="bits must be 8 or 16"):
        algorithms.LowPrecision(bits=4)
    with pytest.raises(ValueError, match="dtype must be one of"):
        algorithms.LowPrecision(bits=16, dtype="fp8")
    with pytest.raises(ValueError, match="give no dtype"):
        algorithms.LowPrecision(bits=8, dtype="fp16")
    with pytest.raises(ValueError, match="peer_selection must be one of ring, shift_one"):
        algorithms.Decentralized(peer_selection="random")
    with pytest.raises(algorithms.AlgorithmError, match=r"interval \(steps\) must be in \[1,"):
        algorithms.Decentralized(interval=0)
    with pytest.raises(ValueError, match="interval_seconds"):
        algorithms.AsyncModelAverage(interval_seconds=-1)


def test_which_knobs_each_algorithm_lets_the_tuner_touch() -> None:
    algorithms = distune.algorithms
    uses = {
        type(a).__name__: (a.uses_bucket_size, a.uses_hierarchical, a.averages_gradients)
        for a in (
            algorithms.GradientAllReduce(),
            algorithms.LowPrecision(),
            algorithms.Decentralized(),
            algorithms.AsyncModelAverage(),
        )
    }
    assert uses == {
        "GradientAllReduce": (True, True, True),
        "LowPrecision": (True, False, True),
        "Decentralized": (False, False, False),
        "AsyncModelAverage": (False, False, False),
    }


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
def test_shift_one_pairs_every_two_ranks_once_per_cycle(world: int) -> None:
    seats = world + world % 2
    met = set()
    for exchange in range(seats - 1):
        partner = {r: peers(r, world, "shift_one", exchange) for r in range(world)}
        for rank, chosen in partner.items():
            assert len(chosen) <= 1
            for other in chosen:
                assert partner[other] == [rank]  # symmetric: both average the same pair
                met.add(frozenset((rank, other)))
        idle = [r for r, chosen in partner.items() if not chosen]
        assert len(idle) == world % 2
    assert met == {frozenset(p) for p in itertools.combinations(range(world), 2)}


def test_ring_peers() -> None:
    assert [peers(r, 4, "ring", 0) for r in range(4)] == [[1, 3], [0, 2], [1, 3], [0, 2]]
    assert peers(0, 2, "ring", 5) == [1]
    assert peers(0, 1, "ring", 0) == []


def test_quantization_error_is_at_most_half_a_step_per_chunk() -> None:
    chunks = torch.randn(4, 1000) * torch.tensor([[1.0], [10.0], [1e-3], [0.0]])
    codes, scales = quantize(chunks)
    assert codes.dtype == torch.uint8
    error = (dequantize(codes, scales) - chunks).abs()
    steps = (chunks.amax(1) - chunks.amin(1)) / 255
    assert bool((error <= steps[:, None] / 2 * (1 + 1e-5) + 1e-7).all())
    assert torch.equal(dequantize(codes, scales)[3], chunks[3])  # a constant chunk is exact


def test_importing_distune_keeps_torch_out() -> None:
    code = "import sys, distune; assert 'torch' not in sys.modules; print(distune.__all__)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "algorithms" in run.stdout and "fuse_optimizer" in run.stdout
