"""Checkpoints of a ``distune.prepare`` run in real 2-rank gloo jobs: the whole state saved once
and loaded on every rank resumes as if never stopped under every ZeRO stage, and a state-dict
collective that not every rank makes fails in seconds instead of hanging.

This file is also the worker script (see ddp_launch); the configuration reaches ``prepare``
through the ``DISTUNE_*`` variables the launcher sets, set here in-process between runs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from ddp_launch import run_job, worker_main
from test_level2_strategies import Net
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel

import distune
from distune.trial_settings import ACCUMULATION, BF16, CHECKPOINTING, MICRO_BATCH, ZERO_STAGE
from distune.worker_runtime.sharded_state import CheckpointCallError

pytestmark = pytest.mark.slow
SCENARIOS = {}
BATCH = 4
#: Short enough for a test, long enough for two ranks on a loaded 2-core machine to meet.
TIMEOUT = 3.0


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def prepared(stage: int, seed: int = 0, timeout: float = TIMEOUT) -> distune.Prepared:
    os.environ.update(
        {
            BF16: "0",
            ZERO_STAGE: str(stage),
            CHECKPOINTING: "0",
            MICRO_BATCH: str(BATCH),
            ACCUMULATION: "1",
        }
    )
    torch.manual_seed(seed)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return distune.prepare(model, optimizer, micro_batch_size=BATCH, checkpoint_timeout=timeout)


def step(run: distune.Prepared, number: int) -> float:
    """One optimizer step on this rank's data for step ``number``; its loss."""
    data = torch.Generator().manual_seed(1000 * number + torch.distributed.get_rank())
    x, y = torch.randn(BATCH, 8, generator=data), torch.randn(BATCH, 1, generator=data)
    loss = nn.functional.mse_loss(run.model(x), y)
    loss.backward()
    run.optimizer.step()
    run.optimizer.zero_grad()
    return loss.item()


def same_state(state: dict, reference: dict) -> bool:
    """Two optimizer state dicts in torch's format hold the same numbers and groups."""
    if state["param_groups"] != reference["param_groups"] or state["state"].keys() != (
        reference["state"].keys()
    ):
        return False
    return all(
        torch.allclose(torch.as_tensor(value), torch.as_tensor(reference["state"][p][key]))
        for p, entry in state["state"].items()
        for key, value in entry.items()
    )


@scenario
def a_checkpoint_saved_once_resumes_on_every_rank(out: Path) -> dict:
    """Under each stage: 4 uninterrupted steps; then 2 steps, both state dicts taken on every
    rank and written by rank 0 alone, a fresh run (another seed) loading that file on every
    rank, and 2 more steps (the loss of the fourth is the first to see the loaded optimizer
    state: a step's loss is computed before its update)."""
    rank = torch.distributed.get_rank()
    results: dict = {}
    reference_state = None
    for stage in (0, 1, 2, 3):
        run = prepared(stage)
        uninterrupted = [step(run, n) for n in range(4)]
        run = prepared(stage)
        first = [step(run, n) for n in range(2)]
        model_state, optimizer_state = run.model.state_dict(), run.optimizer.state_dict()
        path = out / f"stage{stage}.pt"
        if rank == 0:
            torch.save({"model": model_state, "optimizer": optimizer_state}, path)
        torch.distributed.barrier()
        reference_state = reference_state or optimizer_state  # ddp's, the first stage
        saved = torch.load(path, weights_only=True)
        # Before any run loads it: a loaded state's tensors become the optimizer's (torch's).
        torchs = torchs_own_calls(run, stage, saved, first) if stage > 0 else {}
        resumed = prepared(stage, seed=1)
        resumed.model.load_state_dict(saved["model"])
        resumed.optimizer.load_state_dict(saved["optimizer"])
        results[f"zero{stage}"] = {
            "uninterrupted": uninterrupted,
            "resumed": [*first, step(resumed, 2), step(resumed, 3)],
            "state is ddp's": same_state(optimizer_state, reference_state),
            **torchs,
        }
    return results


def torchs_own_calls(run: distune.Prepared, stage: int, saved: dict, first: list) -> dict:
    """torch's own ways to the whole optimizer state still work on run.optimizer (as the
    ``saved`` checkpoint holds it): ZeRO-1's ``consolidate_state_dict`` on every rank, then
    ``state_dict()`` on rank 0 alone; FSDP's ``optim_state_dict`` (keyed by name), which a
    fresh run then resumes from."""
    if stage == 1:
        run.optimizer.consolidate_state_dict(to=0)
        if torch.distributed.get_rank() > 0:
            return {}
        return {"torch's own is ours": same_state(run.optimizer.state_dict(), saved["optimizer"])}
    named = FullyShardedDataParallel.optim_state_dict(run.model, run.optimizer)
    resumed = prepared(stage, seed=1)
    resumed.model.load_state_dict(saved["model"])
    resumed.optimizer.load_state_dict(named)
    return {"resumed from torch's own": [*first, step(resumed, 2), step(resumed, 3)]}


@scenario
def a_collective_state_dict_call_not_every_rank_makes_fails_fast(out: Path) -> dict:
    """Under zero3: ranks making different calls at once, then rank 0 alone saving the model
    (rank 1 going on training, as a DDP script's other ranks do)."""
    rank = torch.distributed.get_rank()
    run = prepared(3)
    step(run, 0)
    result: dict = {}
    try:
        run.model.state_dict() if rank == 0 else run.optimizer.state_dict()
    except CheckpointCallError as error:
        result["different calls"] = str(error)
    started = time.monotonic()
    if rank == 0:
        try:
            run.model.state_dict()
        except CheckpointCallError as error:
            result["rank 0 alone"] = str(error)
            result["seconds"] = time.monotonic() - started
    step(run, 1)  # rank 1 waits here for rank 0, which joins it after its error
    if rank == 1:  # rank 1 alone loading: fails at once, the check's group closed by the error
        started = time.monotonic()
        try:
            run.optimizer.load_state_dict({"state": {}, "param_groups": []})
        except CheckpointCallError as error:
            result["rank 1 alone"] = str(error)
            result["seconds"] = time.monotonic() - started
    step(run, 2)
    return result


def test_a_checkpoint_saved_once_resumes_on_every_rank_as_if_never_stopped(tmp_path):
    results = run_job(__file__, "a_checkpoint_saved_once_resumes_on_every_rank", tmp_path)
    for rank_result in results:
        for stage, result in rank_result.items():
            # Each rank's losses are on its own data: compare within the rank.
            torch.testing.assert_close(
                result["resumed"], result["uninterrupted"], rtol=1e-5, atol=1e-6, msg=stage
            )
            assert result["state is ddp's"], stage
            if "resumed from torch's own" in result:
                torch.testing.assert_close(
                    result["resumed from torch's own"],
                    result["uninterrupted"],
                    rtol=1e-5,
                    atol=1e-6,
                )
        assert results[0]["zero1"]["torch's own is ours"]


def test_a_rank_0_only_state_dict_under_zero3_fails_in_seconds_naming_the_fix(tmp_path):
    results = run_job(
        __file__, "a_collective_state_dict_call_not_every_rank_makes_fails_fast", tmp_path
    )
    made = "rank 0: run.model.state_dict(), rank 1: run.optimizer.state_dict()"
    for result in results:  # both ranks say so, rather than run mismatched collectives
        assert (
            f"the ranks made different state-dict calls at once ({made})"
            in result["different calls"]
        )
    alone = results[0]["rank 0 alone"]
    assert f"not every rank made the call (waited up to {TIMEOUT:g} s; torch: " in alone
    assert "call run.model.state_dict() on every rank" in alone
    assert "write the file on rank 0 only" in alone
    assert "pin zero_optimization.stage to 0 or 1" in alone
    assert "checkpoint_timeout" in alone
    assert TIMEOUT <= results[0]["seconds"] < TIMEOUT + 5
    later = results[1]["rank 1 alone"]
    assert results[1]["seconds"] < TIMEOUT
    assert "run.optimizer.load_state_dict() under ZeRO stage 3 (FSDP) is a collective" in later
    assert "call run.optimizer.load_state_dict() on every rank, each with the whole state" in later


if __name__ == "__main__":
    worker_main(SCENARIOS)
