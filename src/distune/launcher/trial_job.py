"""One level-2 trial's job: ``python -m distune.launcher.trial_job SPEC``.

The launcher starts this in a session of its own, so that it can stop the trial (this process,
torch's elastic agent, and the ranks it spawns) by their ids without touching itself. SPEC is a
JSON file of torchrun's parsed arguments; the trial's configuration is in the environment.
When a rank fails, the first failure (its rank, local rank and exit code) is written as JSON to
``failure.json`` beside SPEC, so the launcher finds that rank's own output without reading the
log.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from distune.launcher.trial_runner import FAILURE_FILE, failure_exit_code


def main(argv: list[str]) -> int:
    """Run the ranks; the exit code is the first failed rank's (128 + N for signal N)."""
    args = argparse.Namespace(**json.loads(Path(argv[0]).read_text(encoding="utf-8")))
    try:
        torchrun.run(args)
    except ChildFailedError as error:
        print(error.format_msg(), file=sys.stderr, flush=True)
        rank, failure = error.get_first_failure()
        code = failure_exit_code(error)
        first = {"rank": rank, "local_rank": failure.local_rank, "exit_code": code}
        Path(argv[0]).with_name(FAILURE_FILE).write_text(json.dumps(first), encoding="utf-8")
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
