"""What the reducer follows of a forward's output: the tensors in it, what a forward that
armed the reducer records for the hooks on them, and whether the backward running now
accumulates into some leaf reachable from them (``backward()`` does, ``autograd.grad`` does
not). :meth:`.Reducer.watch` says what the hooks do with these.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch


@dataclasses.dataclass
class WatchedForward:
    """A forward that armed the reducer: what its output's hooks need to know."""

    #: The reducer's averaged backward passes before this forward.
    iterations: int
    #: Whether a backward has reached the output.
    reached: bool = False


def accumulates_from(nodes: Sequence[Any]) -> bool:
    """Whether the backward running now accumulates a gradient into some leaf reachable from
    ``nodes`` (``backward()``, unlike ``autograd.grad``, which accumulates into none)."""
    # The nodes seen, held (not only their ids): a node's Python object may be made afresh on
    # each access, and a freed one's id reused.
    seen: dict[int, Any] = {}
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        if hasattr(node, "variable"):  # an AccumulateGrad node: a leaf
            try:
                if torch._C._will_engine_execute_node(node):
                    return True
            except RuntimeError:
                # torch refuses the question inside autograd.grad(), which accumulates nothing.
                return False
        stack.extend(following for following, _ in node.next_functions)
    return False


def tensors_in(output: Any) -> list[torch.Tensor]:
    """The tensors in a forward's output: nested in lists, tuples, mappings (Hugging Face's
    ``ModelOutput`` is one) and dataclasses, as torch DDP finds them."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, list | tuple):
        return [t for item in output for t in tensors_in(item)]
    if isinstance(output, Mapping):
        return [t for item in output.values() for t in tensors_in(item)]
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        return [t for f in dataclasses.fields(output) for t in tensors_in(getattr(output, f.name))]
    return []
