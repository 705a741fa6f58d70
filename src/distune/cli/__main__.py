"""``python -m distune.cli``: the same as the ``distune`` command."""

import sys

from distune.cli.main import main

sys.exit(main())
