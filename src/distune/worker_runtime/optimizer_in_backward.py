"""torch's optimizer in backward (``torch.distributed.optim._apply_optimizer_in_backward``)
under distune's wrapper, as torch's DDP runs it.

``_apply_optimizer_in_backward`` gives each parameter its own optimizers and a hook on its
gradient accumulator that steps them and clears ``.grad`` as soon as the gradient is
accumulated: under data parallelism that is the rank's own gradient, before the average
exists. torch's DDP removes those hooks at its first forward and steps the optimizers once the
parameter's gradient is averaged; so does distune's wrapper, after the reduction of each
averaged backward (the reducer's ``after_reduction``), then clears ``.grad`` as the hook
would have. Without this, the hooks would step on local gradients (the reducer then raises:
``.grad`` cleared during backward).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class InBackwardOptimizers:
    """The in-backward optimizers of some parameters, stepped after their averaging."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self._params = list(params)

    @classmethod
    def take_over(cls, params: Sequence[torch.Tensor]) -> InBackwardOptimizers | None:
        """The in-backward optimizers of ``params``, with torch's stepping hooks removed, or
        ``None`` if none of them has one."""
        owning = [p for p in params if hasattr(p, "_in_backward_optimizers")]
        if not owning:
            return None
        from torch.distributed.optim.apply_optimizer_in_backward import (
            param_to_optim_hook_handle_map,
        )

        for param in owning:
            for handle in param_to_optim_hook_handle_map.get(param, []):
                handle.remove()
        return cls(owning)

    def step(self) -> None:
        """Step each parameter's optimizers on its averaged gradient, then clear ``.grad``
        (a parameter no rank used has none: not stepped, as torch's hook would not run)."""
        for param in self._params:
            if param.grad is None:
                continue
            for optimizer in param._in_backward_optimizers:  # type: ignore[attr-defined]
                optimizer.step()
            param.grad = None
