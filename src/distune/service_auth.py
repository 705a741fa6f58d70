"""The bearer token that guards the tuning service, as its users give it.

Users give it in the environment, never on a command line (where any user's ``ps`` shows it):

* ``DISTUNE_SERVICE_TOKEN``: the token itself;
* ``DISTUNE_SERVICE_TOKEN_FILE``: a file whose first line is the token. A file that its group or
  others may read is refused, as ssh refuses such a private key: chmod 600 it (Kubernetes: mount
  the Secret with ``defaultMode: 0400``).

The launcher and the ``distune`` commands read it the same way, here. A token is printable ASCII
without spaces (it goes into an HTTP header), and no message ever contains it. Like ``space``,
this module imports neither torch nor the service.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from distune.errors import DistuneError
from distune.worker_settings import SERVICE_TOKEN

if TYPE_CHECKING:
    import requests

#: A file holding the service's token (first line), for when the environment should not.
SERVICE_TOKEN_FILE = "DISTUNE_SERVICE_TOKEN_FILE"
#: A token file is read up to this many bytes; a token is far shorter.
_TOKEN_FILE_LIMIT = 4096


class TokenError(DistuneError, ValueError):
    """A token or token file that cannot be used; the message says why, never what it holds."""


def check_token(token: str, source: str) -> str:
    """``token`` if it can go into an HTTP header; ``source`` names where it came from."""
    if not token or not all("!" <= character <= "~" for character in token):
        # Never echo the value: a malformed token may still be someone's secret.
        raise TokenError(f"the token in {source} must be printable ASCII without spaces")
    return token


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The token in the first line of ``path``, a regular file no group or other user may read."""
    path = Path(path)
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise TokenError(f"the token file {path} is not a regular file")
        if info.st_mode & (stat.S_IRGRP | stat.S_IROTH):
            raise TokenError(
                f"the token file {path} is readable by other users "
                f"(mode {stat.S_IMODE(info.st_mode):04o}); make it private: chmod 600 {path}"
            )
        with path.open("rb") as file:
            data = file.read(_TOKEN_FILE_LIMIT)
    except OSError as error:
        raise TokenError(f"cannot read the token file {path}: {error.strerror}") from None
    lines = data.decode("utf-8", "replace").splitlines()
    token = lines[0].strip() if lines else ""
    if not token:
        raise TokenError(f"the token file {path} is empty")
    return check_token(token, str(path))


def bearer_headers(token: str | None) -> dict[str, str]:
    """The HTTP headers that present ``token`` to the service: none without a token."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def direct_session() -> requests.Session:
    """A ``requests`` session for the tuning service, which reaches it directly: it ignores
    the environment's proxies (``http_proxy``, ``https_proxy``, ``all_proxy``) and ``.netrc``
    (which would replace the bearer header), keeping only its CA bundle
    (``REQUESTS_CA_BUNDLE``, ``CURL_CA_BUNDLE``) for a service behind a TLS proxy. The service
    is on the job's own network (loopback on one node), which a proxy set for the internet
    cannot reach: with ``http_proxy`` set and no ``no_proxy``, the launcher's health checks
    went to the proxy and the job failed after a minute, and the workers would have handed
    the proxy their token."""
    import requests  # the service's own modules never need it

    session = requests.Session()
    session.trust_env = False
    session.verify = (
        os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE") or True
    )
    return session


def token_from_environment(environ: Mapping[str, str]) -> str | None:
    """The token ``DISTUNE_SERVICE_TOKEN`` or ``DISTUNE_SERVICE_TOKEN_FILE`` gives, if any."""
    if environ.get(SERVICE_TOKEN):
        return check_token(environ[SERVICE_TOKEN], SERVICE_TOKEN)
    if environ.get(SERVICE_TOKEN_FILE):
        try:
            return read_token_file(environ[SERVICE_TOKEN_FILE])
        except TokenError as error:
            raise TokenError(f"{SERVICE_TOKEN_FILE}: {error}") from None
    return None
