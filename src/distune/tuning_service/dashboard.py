"""The live dashboard, as one Flask blueprint: the page at ``/`` and its files at
``/dashboard/<asset>``, showing each model's state, its current and best group, and a chart of
its samples that updates as they arrive.

The page, its script and its style are files of this package (``static/``), served by the
service itself, so the dashboard works with no internet access. They hold code and no data, so
they answer without the token: the page asks for the token (or takes ``?token=``, which it moves
out of the address at once) and sends it with every API call it makes. Strict headers: the page
runs only its own script and talks only to this service. docs/views.md shows it.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from flask import Blueprint, Response, abort

#: The page's endpoint and the endpoint of its files; neither needs the token.
ENDPOINTS = frozenset({"dashboard.page", "dashboard.asset"})
PAGE = "index.html"
#: The page's files besides itself, by name, with their media types.
ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}

_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    # A ?token= in the page's address must not travel onward in a Referer header.
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

blueprint = Blueprint("dashboard", __name__)


@cache
def _file(name: str) -> bytes:
    # Read once per process: the files are part of the installed package.
    return resources.files("distune.tuning_service").joinpath("static").joinpath(name).read_bytes()


def _serve(name: str, mimetype: str) -> Response:
    return Response(_file(name), mimetype=mimetype, headers=_HEADERS)


@blueprint.get("/")
def page() -> Response:
    """The dashboard's page."""
    return _serve(PAGE, "text/html")


@blueprint.get("/dashboard/<asset>")
def asset(asset: str) -> Response:
    """One of the page's files (script, style)."""
    if asset not in ASSETS:
        abort(404, f"the dashboard has no file {asset!r}; it has {', '.join(sorted(ASSETS))}")
    return _serve(asset, ASSETS[asset])
