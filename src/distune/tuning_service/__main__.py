"""``python -m distune.tuning_service``: see :mod:`distune.tuning_service.server`."""

import sys

from distune.tuning_service.server import main

sys.exit(main())
