"""Multi-process gloo jobs on this machine for the worker runtime's integration tests.

A test file names its scenarios (functions of the output directory, run on every rank with the
process group initialized) and runs itself as the worker script: ``run_job`` starts one process
per rank with torchrun's environment (``RANK``, ``LOCAL_RANK``, ``GROUP_RANK``, ...), so several
simulated nodes are just processes whose ``GROUP_RANK`` differ. Each rank's scenario returns a
JSON-able result; a failing rank fails the test with its stderr.

A process start costs seconds on a loaded machine (importing torch, most of it): each rank is
forked from a process of its rank that imported torch once (tests/support/zygote.py), and a
file whose scenarios need the same ranks and environment runs them in one job with
``run_scenarios`` (from a module-scoped fixture), each test asserting on its scenario's results.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.support.zygote import ForkedRank, Zygote

Scenario = Callable[[Path], Any]


def free_port() -> int:
    """A TCP port nothing listens on right now, on loopback."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_job(
    script: str,
    scenario: str,
    out_dir: Path,
    *,
    nodes: int = 1,
    per_node: int = 2,
    env: Mapping[str, str] | None = None,
    timeout: float = 90.0,
) -> list[Any]:
    """Run ``scenario`` of ``script`` on ``nodes`` x ``per_node`` ranks; return each rank's
    result, by rank. Fails (with the ranks' stderr) if a rank fails or the job outlives
    ``timeout`` seconds; no process is left behind either way."""
    out_dir.mkdir(parents=True, exist_ok=True)
    world_size = nodes * per_node
    procs = start_ranks([script, scenario, str(out_dir)], out_dir, nodes, per_node, env)
    deadline = time.monotonic() + timeout
    failed_at = None
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if any(p.returncode not in (None, 0) for p in procs):
                # A failed rank leaves its peers waiting in a collective: give them a moment.
                failed_at = failed_at or now
                if now - failed_at > 3:
                    break
            if now > deadline:
                break
            time.sleep(0.05)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    problems = [
        f"rank {rank} exited {proc.returncode}:\n{_tail(out_dir / f'rank{rank}.err')}"
        for rank, proc in enumerate(procs)
        if proc.returncode != 0
    ]
    if problems:
        timed_out = time.monotonic() > deadline
        header = f"job {scenario!r} timed out after {timeout} s\n" if timed_out else ""
        raise AssertionError(header + "\n".join(problems))
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(world_size)]


def start_ranks(
    argv: list[str],
    out_dir: Path,
    nodes: int,
    per_node: int,
    env: Mapping[str, str] | None = None,
) -> list[ForkedRank]:
    """Start ``nodes`` x ``per_node`` gloo ranks of ``python *argv`` on loopback, forked from
    the ranks' zygotes, each rank's stderr in ``out_dir/rank{r}.err``; the caller waits for
    them and must kill them."""
    world_size = nodes * per_node
    base = {k: v for k, v in os.environ.items() if not k.startswith("DISTUNE_")}
    base.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(per_node),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    base.update(env or {})
    zygotes = [_zygote(rank) for rank in range(world_size)]  # the first job's import at once
    return [
        zygotes[rank].fork(
            argv,
            dict(
                base,
                RANK=str(rank),
                GROUP_RANK=str(rank // per_node),
                LOCAL_RANK=str(rank % per_node),
            ),
            out_dir / f"rank{rank}.err",
        )
        for rank in range(world_size)
    ]


@functools.cache
def _zygote(rank: int) -> Zygote:
    """The zygote of ``rank``, started at its first job; it ends with this test session."""
    from tests.support.zygote import Zygote  # here: the ranks import this file, not tests/

    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTUNE_")}
    return Zygote(dict(env, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))


def run_scenarios(script: str, names: list[str], out_dir: Path, **job: Any) -> dict[str, list[Any]]:
    """Run the scenarios ``names`` of ``script`` one after the other in one job (``job``: as
    :func:`run_job`'s keywords); return each scenario's results by rank. A scenario that fails
    fails the job, naming it in the ranks' stderr."""
    if len(names) == 1:  # a single scenario's rank gives its result alone
        return {names[0]: run_job(script, names[0], out_dir, **job)}
    ranks = run_job(script, ",".join(names), out_dir, **job)
    return {name: [rank[name] for rank in ranks] for name in names}


def _tail(path: Path, size: int = 6000) -> str:
    return path.read_bytes()[-size:].decode(errors="replace")


def worker_main(scenarios: Mapping[str, Scenario]) -> None:
    """Entry point of a worker process: ``script SCENARIO[,SCENARIO...] OUT_DIR`` (several
    scenarios: a result of each, by name)."""
    import torch
    import torch.distributed as dist

    name, out_dir = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
    try:
        if "," in name:
            result = {one: scenarios[one](out_dir) for one in name.split(",")}
        else:
            result = scenarios[name](out_dir)
    finally:
        dist.destroy_process_group()
    (out_dir / f"rank{os.environ['RANK']}.json").write_text(json.dumps(result))
    # As examples/job.py's leave(): exiting through interpreter finalization can abort while a
    # gloo worker thread still releases a tensor (pytorch/pytorch#190489).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
