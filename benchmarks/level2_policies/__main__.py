"""Level 2's search against a DeepSpeed-style policy and the seed's hand-tuning policy.

    .venv/bin/python -m benchmarks.level2_policies measure OUT_DIR -- DISTUNE_RUN_ARGS...
    .venv/bin/python -m benchmarks.level2_policies replay OUT_DIR/grid.json

``measure`` runs the exhaustive grid of the job's level-2 space as real trials (an hour on a
small machine for the GPT example: about 40 trials); ``replay`` runs every policy against it
and prints the comparison as a Markdown table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.level2_policies.grid import measure_grid
from benchmarks.level2_policies.policies import compare_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    measure = commands.add_parser("measure", help="measure the grid as real trials")
    measure.add_argument("out", type=Path)
    measure.add_argument("launcher_argv", nargs=argparse.REMAINDER)
    replay = commands.add_parser("replay", help="replay the policies against a grid")
    replay.add_argument("grid", type=Path)
    args = parser.parse_args()
    if args.command == "measure":
        args.out.mkdir(parents=True, exist_ok=True)
        argv = [a for a in args.launcher_argv if a != "--"]
        measure_grid(argv, args.out)
    else:
        print(compare_table(json.loads(args.grid.read_text(encoding="utf-8"))))


if __name__ == "__main__":
    main()
