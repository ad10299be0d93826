"""Run consumers and producers as a service: ``stagedconsumer run MODULE:ATTR``.

``MODULE:ATTR`` names a ``PushConsumer``, a ``SimpleWorker`` (a ``SimpleConsumer`` and
its handler), a ``Producer``, an async context manager (a broker, an offset store, an
``@asynccontextmanager`` function's result), a list of them, or a factory (a function,
sync or ``async def``, taking no arguments) returning one of these. They are entered
in order (a broker before its consumers) and left in the reverse order.

SIGTERM or SIGINT leaves gracefully: the consumers stop pulling, let the handler calls
in flight finish within their ``shutdown_timeout``, commit and hand their queues back,
and the command exits 0. A second signal exits at once (status 128 + the signal's
number) and logs what it abandoned. Exit status 2: ``MODULE:ATTR`` cannot be run (the
message names what was not found); 1: a consumer stopped because of a failure.
"""

from __future__ import annotations

import argparse
import sys

from ._run_logging import LOG_FORMATS, configure_logging

__all__ = ("register",)

_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _workers(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of processes, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1, got {value}")
    return value


def _level(text: str) -> str:
    if text.upper() not in _LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(_LEVELS)}, got {text!r}")
    return text.upper()


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run consumers and producers as a service (graceful SIGTERM, workers, probes)",
        description=__doc__,
    )
    parser.add_argument(
        "target",
        metavar="MODULE:ATTR",
        help="what to run, e.g. myapp.consumers:make (the current directory is importable)",
    )
    parser.add_argument(
        "--backend", choices=("asyncio", "trio"), default="asyncio", help="the event loop"
    )
    parser.add_argument(
        "--workers",
        type=_workers,
        default=1,
        metavar="N",
        help="processes of the same group, supervised (restarted with backoff when they"
        " die); default 1, in this process",
    )
    parser.add_argument(
        "--log-level",
        type=_level,
        default="INFO",
        metavar="LEVEL",
        help=f"one of {', '.join(_LEVELS)} (default INFO)",
    )
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="text lines, or one JSON object per line (default text)",
    )
    parser.add_argument(
        "--http",
        metavar="[HOST:]PORT",
        help="serve /healthz, /readyz and /metrics there (host 127.0.0.1 when only a port"
        " is given; with --workers, worker i serves on PORT + i)",
    )
    parser.set_defaults(handler=_run)


def _error(message: str) -> int:
    print(f"stagedconsumer run: error: {message}", file=sys.stderr, flush=True)
    return 2


def _run(args: argparse.Namespace) -> int:
    from ._run_service import EXIT_TARGET, RunSettings, run_target
    from ._run_target import TargetError, load_target
    from ._serve_http import bind, parse_address

    configure_logging(args.log_level, args.log_format)
    address: tuple[str, int] | None = None
    if args.http is not None:
        try:
            address = parse_address(args.http)
        except ValueError as exc:
            return _error(str(exc))
        try:
            import hypercorn  # noqa: F401
        except ImportError:
            return _error("--http needs Hypercorn: pip install 'stagedconsumer[run]'")
    if args.workers > 1:
        from ._supervise import supervise

        worker_args = []
        for index in range(args.workers):
            argv = [
                "run",
                args.target,
                "--backend",
                args.backend,
                "--log-level",
                args.log_level,
                "--log-format",
                args.log_format,
            ]
            if address is not None:
                host, port = address
                argv += ["--http", f"[{host}]:{port and port + index}"]
            worker_args.append(argv)
        return supervise(worker_args, args.backend)
    try:
        target, where = load_target(args.target)
    except TargetError as exc:
        return _error(str(exc))
    settings = RunSettings(backend=args.backend)
    if address is not None:
        try:
            settings.http = bind(*address)
        except OSError as exc:
            return _error(str(exc))
    try:
        return run_target(target, where, settings)
    except TargetError as exc:
        _error(str(exc))
        return EXIT_TARGET
