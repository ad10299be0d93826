"""TLS settings of a RedisBroker: one ``ssl.SSLContext`` for both clients.

``RedisBroker(url, ssl=...)`` takes an :class:`ssl.SSLContext` of the caller's, or a
:class:`RedisTLS` (CA, client certificate and key files), or ``True`` (the system's
CAs). Either way the broker hands the same context to redis-py (asyncio) and to
coredis (trio), so certificate and host name checks are the same on both: the host
name is checked unless the context says otherwise (``check_hostname=False``).
"""

from __future__ import annotations

import os
import ssl
import urllib.parse
from typing import TypeAlias

import attrs

from .._exceptions import ConfigurationError

__all__ = ("RedisTLS", "TLSSetting", "resolve_tls")


def _optional_path(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)):
        return os.fspath(value)
    raise ConfigurationError(f"a TLS file must be a path, got {type(value).__name__}")


@attrs.frozen(kw_only=True)
class RedisTLS:
    """TLS to Redis from files: ``RedisBroker(url, ssl=RedisTLS(ca_file="ca.pem"))``.

    - ``ca_file``: the CA certificates (PEM) that signed the server's certificate;
      ``None``: the system's trusted CAs.
    - ``cert_file`` and ``key_file``: this client's certificate and private key
      (PEM), for a server that asks for one (``tls-auth-clients yes``: mutual TLS).
      ``key_file`` may be left out when ``cert_file`` holds the key too.
    - ``check_hostname``: the server's certificate must name the host of the URL
      (``True``, the default; turn it off only for a server reached by an address
      its certificate does not name, and only with your own ``ca_file``).

    The files are read when the broker is made: a missing or unreadable file is a
    :class:`~stagedconsumer.ConfigurationError` there, not at the first connection.
    """

    ca_file: str | None = attrs.field(default=None, converter=_optional_path)
    """The CA certificates (PEM) the server's certificate must chain to (``None``:
    the system's)."""
    cert_file: str | None = attrs.field(default=None, converter=_optional_path)
    """This client's certificate (PEM), for mutual TLS."""
    key_file: str | None = attrs.field(default=None, converter=_optional_path)
    """This client's private key (PEM), when ``cert_file`` does not hold it."""
    check_hostname: bool = True
    """Whether the server's certificate must name the URL's host."""

    def __attrs_post_init__(self) -> None:
        if self.key_file is not None and self.cert_file is None:
            raise ConfigurationError("RedisTLS: key_file needs cert_file")
        if not isinstance(self.check_hostname, bool):
            raise ConfigurationError(
                f"RedisTLS: check_hostname must be True or False, got {self.check_hostname!r}"
            )

    def context(self) -> ssl.SSLContext:
        """A new client context: these CAs (or the system's), this certificate,
        certificates required, the host name checked unless turned off."""
        try:
            context = ssl.create_default_context(cafile=self.ca_file)
            if self.cert_file is not None:
                context.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigurationError(f"RedisTLS: cannot load {self!r}: {exc}") from exc
        context.check_hostname = self.check_hostname
        return context


TLSSetting: TypeAlias = "ssl.SSLContext | RedisTLS | bool | None"
"""What ``RedisBroker(ssl=...)`` takes."""

_URL_TLS_OPTIONS = "ssl_"
"""URL query parameters the clients would read as TLS options (``ssl_ca_certs``,
``ssl_cert_reqs``, ...): each client reads them differently, so the broker refuses
them and takes its ``ssl`` argument instead."""


def resolve_tls(url: str, setting: object) -> ssl.SSLContext | None:
    """The context for ``url`` and the ``ssl`` argument, or ``None`` (plain TCP).

    ``rediss://`` without ``ssl`` means ``ssl=True``; ``ssl`` given with
    ``redis://`` turns TLS on as well. ``ssl=False`` with ``rediss://`` is a
    contradiction, as are TLS options in the URL's query."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return None  # the client refuses the URL with its own words
    scheme = parts.scheme.lower()
    query_options = sorted(
        {
            name
            for name, _ in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
            if name.lower().startswith(_URL_TLS_OPTIONS) and name.lower() != "ssl_password"
        }
    )
    if query_options:
        raise ConfigurationError(
            f"TLS options in the Redis URL ({', '.join(query_options)}) are not used:"
            " pass ssl=RedisTLS(ca_file=..., cert_file=..., key_file=...) or an"
            " ssl.SSLContext to RedisBroker instead (the CLI: --redis-ca, --redis-cert,"
            " --redis-key)"
        )
    if setting is None:
        setting = scheme == "rediss"
    if isinstance(setting, bool):
        if not setting:
            if scheme == "rediss":
                raise ConfigurationError("ssl=False contradicts the rediss:// URL")
            return None
        setting = RedisTLS()
    if not isinstance(setting, (RedisTLS, ssl.SSLContext)):
        raise ConfigurationError(
            "ssl must be an ssl.SSLContext, a RedisTLS, True or False,"
            f" got {type(setting).__name__}"
        )
    if scheme == "unix":
        raise ConfigurationError("TLS is for TCP connections, not a unix:// socket")
    return setting.context() if isinstance(setting, RedisTLS) else setting
