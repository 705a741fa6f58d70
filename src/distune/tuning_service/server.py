"""``python -m distune.tuning_service``: the service as a process, served by waitress.

Once its socket is bound it prints exactly one line to stdout, a JSON object a launcher can
read (``--port 0`` picks a free port)::

    {"event": "listening", "url": "http://127.0.0.1:41234", "host": "127.0.0.1",
     "port": 41234, "log_file": "/tmp/distune_autotune_k2j4.log"}

Nothing else goes to stdout; diagnostics go to stderr. SIGTERM and SIGINT stop it cleanly
(exit code 0). If ``DISTUNE_SERVICE_TOKEN`` is in its environment, every request but the health
check needs ``Authorization: Bearer <token>``; the token is never taken from the command line,
where ``ps`` would show it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from types import FrameType

from flask import Flask
from waitress.server import BaseWSGIServer, create_server

from distune.errors import ConfigError
from distune.space import FixedKnobs, HyperparameterError
from distune.tuning_service.app import MAX_BODY_BYTES, create_app
from distune.tuning_service.best_file import BestFileError, check_path
from distune.tuning_service.config import TuningConfig, declared, value_type
from distune.tuning_service.service import TuningService
from distune.tuning_service.tuning_log import LogFileError, TuningLog
from distune.worker_settings import SERVICE_TOKEN

logger = logging.getLogger("distune.tuning_service")

#: waitress buffers a whole body before the app sees it; past this it refuses (plain-text 413)
#: without reading it. Between MAX_BODY_BYTES and this, the app answers a JSON 413.
SERVER_BODY_LIMIT = 4 * MAX_BODY_BYTES


def _parser() -> argparse.ArgumentParser:
    defaults = TuningConfig()
    parser = argparse.ArgumentParser(
        prog="python -m distune.tuning_service",
        description="The distune tuning service: REST API v1 over HTTP (docs/tuning_service.md).",
    )

    def option(*names: str, **kwargs: object) -> None:
        # Both --a-b and --a_b spellings, as the launcher (and torchrun) accept.
        spellings = [*names, *("--" + n[2:].replace("-", "_") for n in names if "-" in n[2:])]
        parser.add_argument(*spellings, **kwargs)  # type: ignore[arg-type]

    option(
        "--host",
        metavar="H",
        default="127.0.0.1",
        help="address to listen on (default: %(default)s)",
    )
    option("--port", metavar="P", type=int, default=0, help="port; 0 picks a free one (default: 0)")
    logs = parser.add_mutually_exclusive_group()
    logs.add_argument("--log-file", "--log_file", metavar="PATH", help="write the CSV log to PATH")
    logs.add_argument(
        "--log-dir",
        "--log_dir",
        metavar="DIR",
        help="write the CSV log to DIR/distune_autotune_<random>.log",
    )
    for item, declaration in declared(TuningConfig):
        if declaration.flag:
            default = getattr(defaults, item.name)
            option(
                f"--{item.name.replace('_', '-')}",
                metavar=declaration.metavar,
                type=value_type(TuningConfig, item.name),
                default=default,
                help=declaration.help + ("" if default is None else " (default: %(default)s)"),
            )
    option(
        "--fixed",
        nargs="+",
        action="extend",
        default=[],
        metavar="KNOB=VALUE",
        help="pin a knob for every model, e.g. bucket_size_2p=22 is_hierarchical_reduce=false",
    )
    option("--best-file", metavar="PATH", help="write the chosen groups as JSON to PATH")
    option(
        "--threads", metavar="N", type=int, default=8, help="request threads (default: %(default)s)"
    )
    option(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="info",
        help="diagnostics on stderr from this level up (default: %(default)s); the launcher "
        "prints its own progress lines and asks for warnings only",
    )
    return parser


def _config(args: argparse.Namespace) -> TuningConfig:
    flags = {item.name: getattr(args, item.name) for item, s in declared(TuningConfig) if s.flag}
    return TuningConfig(**flags, fixed=FixedKnobs.parse(args.fixed))


def _stop(signum: int, frame: FrameType | None) -> None:
    # waitress's loop ends on SystemExit and lets its request threads finish.
    raise SystemExit(0)


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        stream=sys.stderr, level=level.upper(), format="%(name)s %(levelname)s: %(message)s"
    )
    # waitress warns of every queued request under load ("Task queue depth is N"): at 64
    # models that is a line per request on the launcher's stderr, and nothing to act on.
    logging.getLogger("waitress.queue").setLevel(logging.ERROR)


def _service(
    parser: argparse.ArgumentParser, args: argparse.Namespace, decisions: Executor
) -> TuningService:
    """The service the arguments ask for, its log and best-file checked; exit 2 otherwise."""
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in [0, 65535], got {args.port}")
    if not 1 <= args.threads <= 256:
        parser.error(f"--threads must be in [1, 256], got {args.threads}")
    try:
        config = _config(args)
    except (ConfigError, HyperparameterError) as error:
        parser.error(str(error))
    best_path = None if args.best_file is None else Path(args.best_file)
    try:
        if best_path is not None:
            check_path(best_path)
        log = None
        if args.log_file is not None or args.log_dir is not None:
            log = TuningLog.create(path=args.log_file, directory=args.log_dir)
    except (BestFileError, LogFileError) as error:
        parser.error(str(error))
    return TuningService(config, log, best_path, decisions)


def _listen(
    parser: argparse.ArgumentParser, args: argparse.Namespace, app: Flask
) -> BaseWSGIServer | None:
    """A server bound to one address, or None (said on stderr) when the port is taken."""
    try:
        server = create_server(
            app,
            host=args.host,
            port=args.port,
            threads=args.threads,
            ident="distune",
            max_request_body_size=SERVER_BODY_LIMIT,
        )
    except OSError as error:
        print(
            f"distune.tuning_service: cannot listen on {args.host}:{args.port}: {error}",
            file=sys.stderr,
        )
        return None
    if not isinstance(server, BaseWSGIServer):
        # A name resolving to several addresses gets one socket (and, with port 0, one port)
        # each; a launcher could reach only one of them.
        server.close()
        parser.error(f"--host must name a single address, got {args.host!r}; give an IP address")
    return server


def _announcement(server: BaseWSGIServer, log: TuningLog | None) -> str:
    host, port = str(server.effective_host), int(server.effective_port)
    url_host = f"[{host}]" if ":" in host else host
    return json.dumps(
        {
            "event": "listening",
            "url": f"http://{url_host}:{port}",
            "host": host,
            "port": port,
            "log_file": None if log is None else str(log.path),
        }
    )


def main(argv: list[str] | None = None) -> int:
    """Run the service until SIGTERM or SIGINT; returns the exit code (2: bad arguments)."""
    parser = _parser()
    args = parser.parse_args(argv)
    _configure_logging(args.log_level)
    # One worker chooses next groups (Gaussian-process fits) off the request path.
    decisions = ThreadPoolExecutor(max_workers=1, thread_name_prefix="distune-decisions")
    service = _service(parser, args, decisions)
    token = os.environ.get(SERVICE_TOKEN) or None
    server = _listen(parser, args, create_app(service, token=token))
    if server is None:
        return 1
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    print(_announcement(server, service.log), flush=True)
    if service.log is not None:
        logger.info("tuning log: %s", service.log.path)
    if token is None:
        logger.warning("no %s in the environment: requests are not authenticated", SERVICE_TOKEN)
    try:
        server.run()
    finally:
        server.close()
        # A choice being made finishes (its log row is written); queued ones are dropped.
        decisions.shutdown(wait=True, cancel_futures=True)
        if service.log is not None:
            service.log.close()
    return 0
