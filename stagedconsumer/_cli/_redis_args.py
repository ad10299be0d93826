"""The ``--redis`` options the operator commands share, and the broker they open.

Every command that reads a RedisBroker takes ``--redis URL``, ``--redis-namespace NS``
(also spelled ``--namespace``), ``--redis-cluster`` and the TLS files ``--redis-ca``,
``--redis-cert``, ``--redis-key`` (:class:`~stagedconsumer.RedisTLS`), and opens the
broker with short timeouts: an operator command gives up on an unreachable Redis
after seconds, not the 30 s a consumer keeps retrying for.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .._sources._redis_broker import RedisBroker

__all__ = ("add_redis_arguments", "operator_broker")

_OPERATOR_TIMEOUT = 2.0
"""Seconds an operator command waits on Redis (send, socket and connect timeouts)."""


def add_redis_arguments(
    parser: argparse.ArgumentParser,
    *,
    url_help: str,
    required: bool = False,
    url_group: argparse._MutuallyExclusiveGroup | None = None,
) -> None:
    """Add ``--redis`` (to ``url_group`` when it is one of a mutually exclusive
    choice), ``--redis-namespace``/``--namespace`` and ``--redis-cluster``."""
    (url_group or parser).add_argument("--redis", required=required, metavar="URL", help=url_help)
    parser.add_argument(
        "--redis-namespace",
        "--namespace",
        dest="redis_namespace",
        default="sc",
        metavar="NS",
        help="RedisBroker namespace (default sc)",
    )
    parser.add_argument(
        "--redis-cluster",
        action="store_true",
        help="the --redis URL is a node of a Redis Cluster (RedisBroker(cluster=True))",
    )
    tls = parser.add_argument_group(
        "Redis TLS", "TLS to the --redis server (a rediss:// URL alone: the system's CAs)"
    )
    tls.add_argument(
        "--redis-ca", metavar="FILE", help="CA certificates (PEM) of the server's certificate"
    )
    tls.add_argument(
        "--redis-cert", metavar="FILE", help="client certificate (PEM), for mutual TLS"
    )
    tls.add_argument("--redis-key", metavar="FILE", help="the client certificate's key (PEM)")


def operator_broker(args: argparse.Namespace) -> RedisBroker:
    """The RedisBroker of ``--redis``; raises ``ImportError`` (with the install hint)
    without redis-py."""
    try:
        from .._sources._redis_broker import RedisBroker  # optional: needs redis-py
    except ImportError as exc:
        raise ImportError(f"{exc} (pip install 'stagedconsumer[redis]')") from exc
    from .._sources._redis_tls import RedisTLS

    files = (args.redis_ca, args.redis_cert, args.redis_key)
    tls = (
        RedisTLS(ca_file=args.redis_ca, cert_file=args.redis_cert, key_file=args.redis_key)
        if any(f is not None for f in files)
        else None
    )
    return RedisBroker(
        args.redis,
        ssl=tls,
        namespace=args.redis_namespace,
        send_timeout=_OPERATOR_TIMEOUT,
        socket_timeout=_OPERATOR_TIMEOUT,
        connect_timeout=_OPERATOR_TIMEOUT,
        check_acl=False,  # an operator's user may only read: a refused command says so
        cluster=args.redis_cluster,
    )
