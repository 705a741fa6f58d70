"""The A/B switch of zero1's broadcast for whole testbed trials (a benchmark harness only).

Python imports ``sitecustomize`` at start-up from the first directory on ``sys.path`` that has
one, so a trial whose environment puts this directory first on ``PYTHONPATH`` runs every
``ZeroRedundancyOptimizer`` it builds with ``parameters_as_bucket_view`` forced to
``ZERO1_AB_BUCKET_VIEW`` (``1`` or ``0``), whatever the worker runtime passes. Without the
variable nothing is changed. Used as::

    ZERO1_AB_BUCKET_VIEW=0 PYTHONPATH=benchmarks/testbed/zero1_variant \\
        .venv/bin/python -m benchmarks.level2_policies measure --only zero1:2x16 ...
"""

import os
import sys

_FORCED = os.environ.get("ZERO1_AB_BUCKET_VIEW")

if _FORCED is not None:
    if _FORCED not in ("0", "1"):
        raise SystemExit(f"ZERO1_AB_BUCKET_VIEW must be 0 or 1, got {_FORCED!r}")
    from torch.distributed.optim import ZeroRedundancyOptimizer

    _init = ZeroRedundancyOptimizer.__init__

    def _forced_init(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        kwargs["parameters_as_bucket_view"] = _FORCED == "1"
        # In the rank's log, so a trial shows which variant it ran.
        print(f"ZERO1_AB_BUCKET_VIEW={_FORCED}: parameters_as_bucket_view forced", file=sys.stderr)
        _init(self, *args, **kwargs)

    ZeroRedundancyOptimizer.__init__ = _forced_init  # type: ignore[method-assign]
