"""``python -m distune.run``: the same as the ``distune-run`` command."""

import sys

from distune.launcher import main as _launch


def main() -> None:
    """Console entry point of ``distune-run``."""
    sys.exit(_launch())


if __name__ == "__main__":
    main()
