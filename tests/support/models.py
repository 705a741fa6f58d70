"""The jobs the tests register: the facts a model's registration carries, written once.

``MULTI_NODE`` (8 ranks on 2 nodes of 4, so hierarchical allreduce is in the space) and
``SINGLE_NODE`` (2 ranks on one node: flat only) as :class:`~distune.space.ModelFacts`, and
each as the JSON body of ``POST /api/v1/models/<name>/register``.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from distune.space import ModelFacts

#: 8 ranks on 2 nodes of 4, 16 MiB of gradients: both knobs tuned.
MULTI_NODE = ModelFacts(world_size=8, nnodes=2, local_world_size=4, gradient_bytes=2**24)
#: 8 ranks on 2 nodes of 4, 256 MiB of gradients: the REST tests' registration body.
MULTI_NODE_LARGE_REGISTRATION: dict[str, Any] = {**asdict(MULTI_NODE), "gradient_bytes": 2**28}
#: 2 ranks on one node, 16 MiB of gradients: flat allreduce only.
SINGLE_NODE = ModelFacts(world_size=2, nnodes=1, local_world_size=2, gradient_bytes=2**24)
#: SINGLE_NODE as a registration body.
SINGLE_NODE_REGISTRATION: dict[str, Any] = asdict(SINGLE_NODE)
