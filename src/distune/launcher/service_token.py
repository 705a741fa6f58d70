"""The bearer token that guards the tuning service: given to the launcher, or made for the job.

Where it comes from, in the order the ``distune`` commands also follow:

* ``DISTUNE_SERVICE_TOKEN``: the token itself;
* ``DISTUNE_SERVICE_TOKEN_FILE``: a file whose first line is the token. A file that its group or
  others may read is refused, as ssh refuses such a private key: chmod 600 it (Kubernetes: mount
  the Secret with ``defaultMode: 0400``);
* neither: a random token for a single-node job. A multi-node job needs the same token on every
  node, so there it is an error: the service listens on the network.

The token must be printable ASCII without spaces (it goes into an HTTP header). The launcher
hands it to the service and the workers through their environment only, and never prints it.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping

from distune.cli.service_client import SERVICE_TOKEN_FILE, ServiceError, read_token_file
from distune.launcher.options import OptionError
from distune.worker_settings import SERVICE_TOKEN


def _checked(token: str, source: str) -> str:
    if not all("!" <= character <= "~" for character in token):
        # Never echo the value: a malformed token may still be someone's secret.
        raise OptionError(f"the token in {source} must be printable ASCII without spaces")
    return token


def job_token(environ: Mapping[str, str], multi_node: bool) -> str:
    """The token for this job's service, from ``environ`` or made here (single node only)."""
    if environ.get(SERVICE_TOKEN):
        return _checked(environ[SERVICE_TOKEN], SERVICE_TOKEN)
    if environ.get(SERVICE_TOKEN_FILE):
        try:
            return _checked(read_token_file(environ[SERVICE_TOKEN_FILE]), SERVICE_TOKEN_FILE)
        except ServiceError as error:
            raise OptionError(f"{SERVICE_TOKEN_FILE}: {error}") from None
    if multi_node:
        raise OptionError(
            f"multi-node tuning needs {SERVICE_TOKEN} or {SERVICE_TOKEN_FILE} set to the same "
            "secret on every node (the service is reachable from the network)"
        )
    return secrets.token_urlsafe(32)
