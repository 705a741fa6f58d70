"""Landscapes: the true throughput of every group of a search space.

A landscape is a table, so measured oracle tables (every group run long enough to be trusted)
and analytic models plug in the same way. The measured tables are JSON files in
``oracle_tables/``, written by the end-to-end benchmark on the shaped testbed
(``python -m benchmarks.end_to_end --oracle-tables``; format: :meth:`Landscape.load`). Two
analytic families are here:

- :func:`cluster_landscape`, a cost model of data-parallel training on a GPU cluster: buckets of
  gradients are allreduced while the backward pass goes on; small buckets pay a per-message
  latency (and a launch overhead on the compute stream) many times, large ones leave the last
  bucket's communication exposed after the backward pass. Flat allreduce is a ring over every
  rank; hierarchical reduces inside each node over NVLink, allreduces among node leaders, and
  broadcasts back. This gives the shapes seen in practice: a hump in log2(bucket size) with a
  plateau where communication hides behind compute, shifted by the allreduce shape.
- :func:`hump_landscape`, the same shape written down directly, to place the peak and the
  plateau where a test wants them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from distune.space import Hyperparameters, ModelFacts, SearchSpace

#: Where the measured oracle tables live.
ORACLE_TABLES = Path(__file__).with_name("oracle_tables")


@dataclass(frozen=True)
class Landscape:
    """True throughput (iterations per second) of every group of the model's search space."""

    name: str
    facts: ModelFacts
    throughput: Mapping[Hyperparameters, float]

    @classmethod
    def tabulate(
        cls, name: str, facts: ModelFacts, function: Callable[[Hyperparameters], float]
    ) -> Landscape:
        """Evaluate ``function`` on every group of the space of ``facts``."""
        space = SearchSpace.for_model(facts)
        return cls(name, facts, {hp: function(hp) for hp in space})

    @classmethod
    def load(cls, path: Path) -> Landscape:
        """A measured oracle table: JSON ``{"name", "facts": {ModelFacts' fields},
        "throughput": [{"bucket_size_2p", "is_hierarchical_reduce", "throughput"}, ...]}``
        with one entry for every group of the facts' search space (other keys are notes)."""
        data = json.loads(path.read_text())
        facts = ModelFacts(**data["facts"])
        table = {
            Hyperparameters(row["bucket_size_2p"], row["is_hierarchical_reduce"]): float(
                row["throughput"]
            )
            for row in data["throughput"]
        }
        expected = set(SearchSpace.for_model(facts))
        if set(table) != expected:
            raise ValueError(
                f"{path}: the table must hold exactly the {len(expected)} groups of its space; "
                f"missing {sorted(map(str, expected - set(table)))}, "
                f"extra {sorted(map(str, set(table) - expected))}"
            )
        if any(not (math.isfinite(t) and t > 0) for t in table.values()):
            raise ValueError(f"{path}: throughputs must be positive and finite")
        return cls(data["name"], facts, table)

    def dump(self, path: Path, **notes: Any) -> None:
        """Write the table in :meth:`load`'s format, with ``notes`` as extra keys."""
        rows = [{**hp.to_dict(), "throughput": t} for hp, t in self.throughput.items()]
        data = {"name": self.name, "facts": asdict(self.facts), "throughput": rows, **notes}
        path.write_text(json.dumps(data, indent=1) + "\n")

    @property
    def space(self) -> SearchSpace:
        """The search space the tuners explore (nothing fixed)."""
        return SearchSpace.for_model(self.facts)

    @property
    def oracle(self) -> float:
        """The best true throughput."""
        return max(self.throughput.values())

    def fraction(self, hp: Hyperparameters) -> float:
        """``hp``'s true throughput as a fraction of the oracle's."""
        return self.throughput[hp] / self.oracle

    @property
    def default_fraction(self) -> float:
        """The default group's fraction of the oracle."""
        return self.fraction(self.space.default)

    @property
    def near_optimal(self) -> int:
        """How many groups are within 2% of the oracle (fewer: a harder landscape)."""
        return sum(t >= 0.98 * self.oracle for t in self.throughput.values())


@dataclass(frozen=True)
class Cluster:
    """A GPU cluster and a model, for :func:`cluster_landscape`. Bandwidths in bytes/s, times
    in seconds; gradients are fp32 (4 bytes a parameter)."""

    parameters: float
    nodes: int
    gpus_per_node: int = 8
    inter_node_gbit: float = 100.0
    nvlink_bytes_per_s: float = 150e9
    inter_node_latency: float = 10e-6
    nvlink_latency: float = 3e-6
    bucket_overhead: float = 30e-6
    flops_per_s: float = 150e12
    tokens_per_gpu: int = 8192

    @property
    def facts(self) -> ModelFacts:
        world = self.nodes * self.gpus_per_node
        return ModelFacts(world, self.nodes, self.gpus_per_node, int(4 * self.parameters))


def cluster_landscape(name: str, cluster: Cluster) -> Landscape:
    """The cost model of the module's docstring, as a landscape."""
    gradient_bytes = 4 * cluster.parameters
    compute = 6 * cluster.parameters * cluster.tokens_per_gpu / cluster.flops_per_s
    forward, backward = compute / 3, 2 * compute / 3
    ranks = cluster.nodes * cluster.gpus_per_node
    inter = cluster.inter_node_gbit * 1e9 / 8

    def message_time(nbytes: float, hierarchical: bool) -> float:
        if not hierarchical:  # a ring over every rank: 2(N-1) steps of nbytes/N
            steps = 2 * (ranks - 1)
            return steps * (cluster.inter_node_latency + nbytes / ranks / inter)
        local = cluster.nvlink_latency + nbytes / cluster.nvlink_bytes_per_s
        steps = 2 * (cluster.nodes - 1)
        leaders = steps * (cluster.inter_node_latency + nbytes / cluster.nodes / inter)
        return 2 * local + leaders  # reduce in the node, ring among leaders, broadcast back

    def throughput(hp: Hyperparameters) -> float:
        buckets = max(1, math.ceil(gradient_bytes / hp.bucket_size))
        message = message_time(gradient_bytes / buckets, hp.is_hierarchical_reduce)
        # Buckets become ready evenly through the backward pass and go out one at a time: the
        # step ends when the backward pass (slowed by per-bucket launches) and the last
        # allreduce are both done.
        backward_done = backward + buckets * cluster.bucket_overhead
        communication_done = max(backward / buckets + buckets * message, backward + message)
        return 1.0 / (forward + max(backward_done, communication_done))

    return Landscape.tabulate(name, cluster.facts, throughput)


def hump_landscape(
    name: str,
    facts: ModelFacts,
    rise_2p: float,
    fall_2p: float,
    width: float = 1.5,
    hierarchical_shift: float = 0.0,
    hierarchical_factor: float = 1.0,
) -> Landscape:
    """A plateau between ``rise_2p`` and ``fall_2p`` (log2 bucket sizes), smooth shoulders of
    ``width``, a gentle 4% crest in its middle so the best is unique; hierarchical groups are
    the same curve shifted by ``hierarchical_shift`` and scaled by ``hierarchical_factor``."""

    def curve(x: float) -> float:
        rise = 1.0 / (1.0 + math.exp(-(x - rise_2p) / (width / 4)))
        fall = 1.0 / (1.0 + math.exp((x - fall_2p) / (width / 4)))
        crest = 1.0 + 0.04 * math.exp(-(((x - (rise_2p + fall_2p) / 2) / width) ** 2))
        return 100.0 * (0.2 + 0.8 * rise * fall) * crest

    def throughput(hp: Hyperparameters) -> float:
        if hp.is_hierarchical_reduce:
            return hierarchical_factor * curve(hp.bucket_size_2p - hierarchical_shift)
        return curve(hp.bucket_size_2p)

    return Landscape.tabulate(name, facts, throughput)


def oracle_tables(directory: Path = ORACLE_TABLES) -> list[Landscape]:
    """The measured oracle tables in ``directory`` (none if it does not exist), by file name."""
    if not directory.is_dir():
        return []
    return [Landscape.load(path) for path in sorted(directory.glob("*.json"))]


def standard_suite(directory: Path = ORACLE_TABLES) -> list[Landscape]:
    """The landscapes the optimizer settings are judged on: clusters from 2 to 64 nodes (and one
    node alone), models from 10M to 10B parameters, 25 to 400 Gbit/s between nodes; a few humps;
    and the oracle tables measured on the testbed."""
    clusters = [
        ("gpt-10M/2n/25G", Cluster(10e6, 2, inter_node_gbit=25)),
        ("gpt-10M/64n/400G", Cluster(10e6, 64, inter_node_gbit=400)),
        ("gpt-100M/4n/100G", Cluster(100e6, 4)),
        ("gpt-100M/64n/25G", Cluster(100e6, 64, inter_node_gbit=25)),
        ("gpt-350M/16n/25G", Cluster(350e6, 16, inter_node_gbit=25)),
        ("gpt-1B/2n/25G", Cluster(1e9, 2, inter_node_gbit=25)),
        ("gpt-1B/8n/400G", Cluster(1e9, 8, inter_node_gbit=400)),
        ("gpt-1B/32n/100G", Cluster(1e9, 32)),
        ("gpt-3B/16n/400G", Cluster(3e9, 16, inter_node_gbit=400)),
        ("gpt-10B/8n/25G", Cluster(10e9, 8, inter_node_gbit=25)),
        ("gpt-10B/64n/100G", Cluster(10e9, 64)),
        ("gpt-100M/1n/nvlink", Cluster(100e6, 1)),
    ]
    two_nodes = ModelFacts(16, 2, 8, 2**29)
    humps = [
        hump_landscape("hump/narrow-flat-wins", two_nodes, 21.5, 24.5, 1.0, 2.0, 0.93),
        hump_landscape("hump/hier-wins-low", two_nodes, 18.0, 23.0, 1.5, -2.0, 1.08),
        hump_landscape("hump/wide-plateau", two_nodes, 18.0, 27.0, 2.0, 1.0, 0.97),
    ]
    analytic = [cluster_landscape(name, c) for name, c in clusters]
    return analytic + humps + oracle_tables(directory)
