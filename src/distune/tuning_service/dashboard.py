"""The live dashboard: one page at ``/`` showing each model's state, its current and best group,
and a chart of its samples that updates as they arrive.

The page, its script and its style are files of this package (``static/``), served by the
service itself, so the dashboard works with no internet access. They hold code and no data, so
they answer without the token: the page asks for the token (or takes ``?token=``, which it moves
out of the address at once) and sends it with every API call it makes. Strict headers: the page
runs only its own script and talks only to this service.
"""

from __future__ import annotations

from importlib import resources

from flask import Flask, Response, abort

#: The page's endpoint and the endpoint of its files; neither needs the token.
ENDPOINTS = frozenset({"dashboard", "dashboard_asset"})
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


def add_dashboard(app: Flask) -> None:
    """Serve the dashboard from ``app``: ``GET /`` and ``GET /dashboard/<asset>``."""
    static = resources.files(__package__).joinpath("static")
    files = {name: static.joinpath(name).read_bytes() for name in (PAGE, *ASSETS)}

    def serve(name: str, mimetype: str) -> Response:
        return Response(files[name], mimetype=mimetype, headers=_HEADERS)

    @app.get("/", endpoint="dashboard")
    def page() -> Response:
        return serve(PAGE, "text/html")

    @app.get("/dashboard/<asset>", endpoint="dashboard_asset")
    def asset(asset: str) -> Response:
        if asset not in ASSETS:
            abort(404, f"the dashboard has no file {asset!r}; it has {', '.join(sorted(ASSETS))}")
        return serve(asset, ASSETS[asset])
