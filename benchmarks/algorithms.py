"""Every algorithm against gradient allreduce and torch DDP on the shaped testbed.

    sudo .venv/bin/python -m benchmarks.algorithms --rate 1gbit --output /tmp/algorithms \\
        --plot docs/images/bench_algorithms.png

Brings up a testbed of 2 nodes (network namespaces, each node's link shaped to ``--rate``),
runs ``benchmarks/algorithms_job.py`` under torchrun with 2 ranks per node, and reports, per
variant, the median step time over the rounds, its ratio to distune's gradient allreduce and to
torch DDP, and the held-out loss after the same number of steps (the convergence cost).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.testbed import Testbed
from benchmarks.testbed.distune_job import TORCHRUN, run_distune

JOB = Path(__file__).with_name("algorithms_job.py")


def summarize(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """Median step time and loss per variant, with ratios to the two baselines."""
    rows = []
    for name, runs in raw["results"].items():
        rows.append(
            {
                "variant": name,
                "step_s": statistics.median(r["step_s"] for r in runs),
                "loss": statistics.median(r["loss"] for r in runs),
            }
        )
    base = {r["variant"]: r["step_s"] for r in rows}
    for row in rows:
        row["vs_gradient_allreduce"] = row["step_s"] / base["GradientAllReduce"]
        row["vs_torch_ddp"] = row["step_s"] / base["torch DDP"]
    return rows


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["variant"] for r in rows]
    positions = range(len(rows))
    left.barh(positions, [1e3 * r["step_s"] for r in rows], color="#1f77b4")
    left.set_yticks(positions, names)
    left.invert_yaxis()
    left.set_xlabel("step time, ms (median over rounds)")
    right.barh(positions, [r["loss"] for r in rows], color="#ff7f0e")
    right.set_yticks(positions, [""] * len(rows))
    right.invert_yaxis()
    right.set_xlabel("held-out loss after the same steps")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="1gbit", help="each node's link rate (tc syntax)")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--timeout", type=float, default=1500.0)
    parser.add_argument("job", nargs=argparse.REMAINDER, help="after --: the job's arguments")
    args = parser.parse_args(argv)
    extra = args.job[1:] if args.job[:1] == ["--"] else args.job
    args.output.mkdir(parents=True, exist_ok=True)
    with Testbed(args.nodes, args.rate) as bed:
        print(bed.describe(), flush=True)
        results = run_distune(
            bed,
            [str(JOB), "--output", str(args.output), *extra],
            nproc_per_node=args.nproc_per_node,
            launcher=TORCHRUN,
            timeout=args.timeout,
            output_dir=args.output,
            echo=True,
        )
    if not all(r.ok for r in results):
        print("the job failed: see node*.log in the output directory", file=sys.stderr)
        return 1
    raw = json.loads((args.output / "algorithms.json").read_text())
    rows = summarize(raw)
    (args.output / "summary.json").write_text(json.dumps(rows, indent=1))
    title = (
        f"{args.nodes} nodes x {args.nproc_per_node} ranks, links {args.rate}, "
        f"{raw['gradient_bytes'] / 2**20:.1f} MiB of gradients"
    )
    print(title)
    print(f"{'variant':<32}{'step ms':>9}{'vs GAR':>8}{'vs DDP':>8}{'loss':>10}")
    for r in rows:
        print(
            f"{r['variant']:<32}{1e3 * r['step_s']:>9.1f}{r['vs_gradient_allreduce']:>8.2f}"
            f"{r['vs_torch_ddp']:>8.2f}{r['loss']:>10.4f}"
        )
    if args.plot:
        plot(rows, args.plot, title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
