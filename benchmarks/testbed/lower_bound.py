"""The lower bound of a training step on the testbed: max(compute-only time, link time).

A data-parallel step cannot be faster than its computation alone, nor than the time the
gradient bytes need to cross the busiest link, even with communication perfectly overlapped
with backward. On the testbed every node has one link of rate R in each direction, and the
busiest link is a node's link (both directions carry the same bytes). For G gradient bytes,
K nodes and N ranks a node:

* flat ring allreduce over all n = K N ranks: ranks are numbered node by node, so the ring
  enters and leaves each node once, and that one ring edge carries what every edge carries,
  2 (n - 1) / n G (reduce-scatter (n - 1)/n G, allgather as much). With N = 1 this is
  2 (K - 1)/K G.
* hierarchical (intra-node reduce, ring allreduce among the K node leaders, intra-node
  broadcast): only the leaders' ring crosses nodes, 2 (K - 1) / K G. That is also the least any
  allreduce algorithm can send through a node's link (each node must send out the other nodes'
  share of its partial sums and receive the totals of its own share), so it is the physical bound.

Intra-node traffic is taken as free (it does not use the shaped link). Link time divides by the
rate usable for TCP payload: tbf counts whole Ethernet frames, so at MTU 9000 the usable rate is
R (9000 - 52) / (9000 + 14), 99.3 % of R (52 bytes of TCP/IP headers with timestamps, 14 of
Ethernet). Compute-only time is the step time without any allreduce, measured with all ranks
running at once, since the testbed's nodes share this machine's cores.

Usage::

    python -m benchmarks.testbed.lower_bound --gradient-bytes 13.3e6 --nodes 2 \\
        --nproc-per-node 2 --compute-seconds 0.05 --rates 1gbit 2gbit 5gbit
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from benchmarks.testbed.network import DEFAULT_MTU
from benchmarks.testbed.rate import LinkRate, rate_argument

if TYPE_CHECKING:
    from torch import nn

SHAPES = ("flat", "hierarchical")


def busiest_link_bytes(gradient_bytes: float, nodes: int, ranks_per_node: int, shape: str) -> float:
    """Bytes one allreduce of ``gradient_bytes`` sends through a node's link, each direction."""
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    if nodes < 1 or ranks_per_node < 1 or gradient_bytes < 0:
        raise ValueError(
            f"need nodes >= 1, ranks_per_node >= 1, gradient_bytes >= 0: "
            f"{nodes}, {ranks_per_node}, {gradient_bytes}"
        )
    ring = nodes * ranks_per_node if shape == "flat" else nodes
    return 2 * (ring - 1) / ring * gradient_bytes if nodes > 1 else 0.0


@dataclass(frozen=True)
class StepLowerBound:
    """The two limits of a step and the bound they make."""

    compute_seconds: float
    link_bytes: float
    link_seconds: float

    @property
    def seconds(self) -> float:
        """The lower bound of the step time."""
        return max(self.compute_seconds, self.link_seconds)

    @property
    def bound_by(self) -> str:
        """ "compute" or "link": which limit sets the bound."""
        return "link" if self.link_seconds > self.compute_seconds else "compute"


def step_lower_bound(
    *,
    compute_seconds: float,
    gradient_bytes: float,
    nodes: int,
    ranks_per_node: int,
    rate: LinkRate,
    shape: str = "hierarchical",
    mtu: int = DEFAULT_MTU,
) -> StepLowerBound:
    """The step's lower bound for one allreduce shape (the default, hierarchical, is physical)."""
    if compute_seconds < 0:
        raise ValueError(f"compute_seconds must be >= 0, got {compute_seconds}")
    link_bytes = busiest_link_bytes(gradient_bytes, nodes, ranks_per_node, shape)
    return StepLowerBound(
        compute_seconds=compute_seconds,
        link_bytes=link_bytes,
        link_seconds=link_bytes / rate.payload_bytes_per_second(mtu),
    )


def gradient_bytes(module: nn.Module) -> int:
    """Bytes of the gradients a data-parallel step averages (trainable parameters, tied once)."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the bound for each rate and shape as a Markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gradient-bytes", type=float, required=True)
    parser.add_argument("--compute-seconds", type=float, default=0.0, help="compute-only step")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument("--rates", nargs="+", type=rate_argument, default=["1gbit"])
    parser.add_argument("--mtu", type=int, default=DEFAULT_MTU)
    args = parser.parse_args(argv)
    if None in args.rates:
        parser.error("--rates: a bound needs a link rate, not 'none'")
    print("| rate | shape | bytes on busiest link | link s | compute s | bound s | bound by |")
    print("|---|---|---|---|---|---|---|")
    for rate in args.rates:
        for shape in SHAPES:
            bound = step_lower_bound(
                compute_seconds=args.compute_seconds,
                gradient_bytes=args.gradient_bytes,
                nodes=args.nodes,
                ranks_per_node=args.nproc_per_node,
                rate=rate,
                shape=shape,
                mtu=args.mtu,
            )
            print(
                f"| {rate} | {shape} | {bound.link_bytes:,.0f} | {bound.link_seconds:.4f} "
                f"| {bound.compute_seconds:.4f} | {bound.seconds:.4f} | {bound.bound_by} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
