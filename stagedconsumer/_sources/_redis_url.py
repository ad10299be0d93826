"""A Redis URL fit to print: its password replaced by ``***``.

Every message, log line, ``repr`` and CLI error that names a Redis server goes
through :func:`redact_url` (the offset store's URLs are shown the same way:
``scheme://user:***@host``). No dependency on a Redis client: the CLI uses it too.
"""

from __future__ import annotations

import re
import urllib.parse

__all__ = ("redact_url", "redis_source_id")

_MASK = "***"
_QUERY_SECRETS = frozenset({"password", "ssl_password"})
"""Query parameters of a Redis URL that hold a secret (both clients read ``password``)."""
_USERINFO = re.compile(r"^(?P<scheme>[^:/?#]*://)(?P<user>[^:@/]*):(?P<secret>.*)@(?P<rest>[^@]*)$")


def redact_url(url: object) -> str:
    """``url`` with the password of its user info and of its query (``password=``,
    ``ssl_password=``) replaced by ``***``: ``redis://default:***@host:6379/0``.

    Never raises: a URL that does not parse is masked from its last ``@`` back to
    the first ``:`` after the scheme, and anything that is not a string is
    described by its type only.
    """
    if not isinstance(url, str):
        return f"<{type(url).__name__}>"
    try:
        parts = urllib.parse.urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, host = netloc.rsplit("@", 1)
            if ":" in userinfo:
                user = userinfo.split(":", 1)[0]
                netloc = f"{user}:{_MASK}@{host}"
        query = parts.query
        if query:
            pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
            if any(name.lower() in _QUERY_SECRETS for name, _ in pairs):
                query = "&".join(
                    f"{name}={_MASK}"
                    if name.lower() in _QUERY_SECRETS
                    else urllib.parse.urlencode({name: value})
                    for name, value in pairs
                )
        if netloc == parts.netloc and query == parts.query:
            return url
        return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=query))
    except ValueError:
        match = _USERINFO.match(url)
        if match is None:
            return url if "@" not in url else _MASK
        return f"{match['scheme']}{match['user']}:{_MASK}@{match['rest']}"


def redis_source_id(url: str, namespace: str, *, cluster: bool) -> str:
    """The identity of a Redis broker's log: ``redis://host:port/db#namespace``
    (``unix:///path?db=N#namespace`` for a socket; ``redis-cluster://host:port#namespace``
    for a cluster, whose node given is one of many: its address still names the
    cluster as the user configured it). No user, password or TLS: the same data
    reached over TLS, or by another user, is the same log."""
    parts = urllib.parse.urlsplit(url)
    query = dict(urllib.parse.parse_qsl(parts.query))
    if parts.scheme == "unix":
        return f"unix://{parts.path}?db={query.get('db', '0')}#{namespace}"
    host = parts.hostname or "localhost"
    if ":" in host:
        host = f"[{host}]"
    address = f"{host}:{parts.port or 6379}"
    if cluster:
        return f"redis-cluster://{address}#{namespace}"
    db = parts.path.strip("/") or query.get("db", "0")
    return f"redis://{address}/{db}#{namespace}"
