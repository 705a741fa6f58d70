"""A model's parameters as one flat tensor per (dtype, device), for sending weights around."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class FlatParams:
    """Copies ``params`` into flat tensors and applies averaged ones back.

    ``snapshot()`` returns the current weights as one flat tensor per (dtype, device) (in
    first-seen order); ``apply(snapshot, averaged)`` moves every parameter by ``averaged -
    snapshot``, keeping whatever the optimizer did since the snapshot. When nothing changed
    since, the parameter becomes exactly ``averaged`` (``p - s`` is then exactly zero).
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for param in params:
            groups.setdefault((param.dtype, param.device), []).append(param)
        self.groups = list(groups.values())

    @torch.no_grad()
    def snapshot(self) -> list[torch.Tensor]:
        """The weights now, one flat copy per (dtype, device)."""
        return [torch.cat([p.reshape(-1) for p in group]) for group in self.groups]

    @torch.no_grad()
    def apply(self, snapshot: list[torch.Tensor], averaged: list[torch.Tensor]) -> None:
        """``p <- (p - snapshot) + averaged``, parameter by parameter."""
        for group, before, after in zip(self.groups, snapshot, averaged, strict=True):
            sizes = [p.numel() for p in group]
            befores = [t.view_as(p) for t, p in zip(before.split(sizes), group, strict=True)]
            afters = [t.view_as(p) for t, p in zip(after.split(sizes), group, strict=True)]
            torch._foreach_sub_(group, befores)
            torch._foreach_add_(group, afters)

    @torch.no_grad()
    def assign(self, averaged: list[torch.Tensor]) -> None:
        """``p <- averaged``: every rank that assigns the same tensors ends identical."""
        for group, after in zip(self.groups, averaged, strict=True):
            sizes = [p.numel() for p in group]
            torch._foreach_copy_(
                group, [t.view_as(p) for t, p in zip(after.split(sizes), group, strict=True)]
            )
