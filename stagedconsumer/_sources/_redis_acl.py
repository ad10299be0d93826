"""What a RedisBroker may need to run on Redis, and a check that it may.

A Redis user (ACL) for one broker namespace needs the commands of
:func:`required_commands` on the keys ``<namespace>:*``: the commands the broker
sends itself and the ones its Lua scripts call (Redis checks those against the
user running the script too). :func:`check_permissions` asks the server, in one
``EVAL`` of ``redis.acl_check_cmd`` calls (Redis 7.0 and later), whether the
connection's user may run each of them on a key of the namespace, so that a user
missing one fails entering the broker, naming the commands and the key pattern,
instead of failing every pull or rebalance of a running consumer.

:func:`describe_script_refusal` does the same for a script that failed on a
permission (Redis's own message does not say which command it refused).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from . import _redis_scripts

__all__ = (
    "CONDITIONAL_COMMANDS",
    "OPTIONAL_COMMANDS",
    "acl_rule",
    "acl_rules",
    "check_permissions",
    "describe_script_refusal",
    "required_commands",
    "script_commands",
)

DIRECT_COMMANDS = (
    "PING",  # entering the broker
    "HGET",  # topic queue counts, lock owners
    "HSETNX",  # create_topic
    "GET",  # a queue's max offset
    "XRANGE",  # pulls
    "XREAD",  # pulls that wait for new messages (long polling)
    "ZREM",  # a member leaving its group
    "EVALSHA",  # every script
    "EVAL",  # a script the server does not have yet
)
"""Commands the broker and its coordinator send themselves (besides the scripts)."""

OPTIONAL_COMMANDS = {
    "PTTL": "stagedconsumer group show (how long the lock of an owner that left has to run)",
    "ZCARD": "RedisBroker.delayed_count()",
    "SCAN": "RedisBroker.delete_namespace()",
    "TYPE": "RedisBroker.attach_stream() (on the attached streams' keys)",
    "EXISTS": "RedisBroker.attach_stream() (on the attached streams' keys)",
    "XINFO": "RedisBroker.attach_stream() (on the attached streams' keys)",
}
"""Commands only some methods need, and which."""

CONDITIONAL_COMMANDS = {
    "XTRIM": "retention: trimming a stream the broker writes (StreamRetention)",
    "LPOP": "retention: dropping the oldest of a stream's storage times",
    "HDEL": "retention: forgetting a group that reported no offsets for group_ttl",
    "LTRIM": "a retry delay set's garbage member, moved aside (the last 1,000 kept)",
}
"""Commands of the broker's scripts that run only on some paths, and which: required
(a user without them fails when the path is taken), but not seen in every run."""

_CALL = re.compile(r"redis\.p?call\(\s*'([A-Za-z]+)'")
_REFUSED = (
    "can't run this command",
    "can't access at least one of the keys",
    "NOPERM",
    "no permissions",
)
"""How Redis says a script's call was refused (7.x: "The user executing the script
can't run this command or subcommand", "... can't access at least one of the keys")."""


def script_commands(lua: str) -> list[str]:
    """The commands a Lua script calls (``redis.call('XADD', ...)``), upper case."""
    return sorted({name.upper() for name in _CALL.findall(lua)})


def required_commands() -> list[str]:
    """Every command a producer and a consumer group member need, sorted (measured:
    ``tests/redis/test_acl.py`` runs them, and the operator commands, under exactly
    these; :data:`OPTIONAL_COMMANDS` lists what only some methods need)."""
    scripts = [value for name, value in vars(_redis_scripts).items() if name.endswith("_LUA")]
    found = set(DIRECT_COMMANDS)
    for lua in scripts:
        found.update(script_commands(lua))
    return sorted(found)


def acl_rules(namespace: str) -> str:
    """The ACL rules of a user of one namespace: its keys, no channels, the commands."""
    commands = " ".join(f"+{c.lower()}" for c in required_commands())
    return f"resetkeys ~{namespace}:* resetchannels -@all {commands}"


def acl_rule(namespace: str, user: str = "<user>", password: str = "<password>") -> str:
    """The ``ACL SETUSER`` command for a user of one namespace."""
    return f"ACL SETUSER {user} on >{password} {acl_rules(namespace)}"


def _check_args(command: str, key: str) -> list[str]:
    """Arguments for ``redis.acl_check_cmd``: the command with ``key`` where a key goes
    (the check looks at the command and its keys, not at the rest)."""
    if command in ("PING", "TIME", "SCAN"):
        return [command]
    if command == "XREAD":
        return [command, "COUNT", "1", "STREAMS", key, "0"]
    if command == "EVAL":
        return [command, "return 1", "1", key]
    if command == "EVALSHA":
        return [command, "0" * 40, "1", key]
    if command == "XINFO":
        return [command, "STREAM", key]
    return [command, key]


_CHECK_LUA = """
local refused = {}
local i = 1
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  local args = {}
  for j = 1, n do args[j] = ARGV[i + j] end
  local ok, allowed = pcall(redis.acl_check_cmd, unpack(args))
  if ok and not allowed then refused[#refused + 1] = args[1] end
  i = i + n + 1
end
return refused
"""
"""Every command of ``ARGV`` (each as a count, then that many arguments) that the user
running the script may not run; a command the server does not know is skipped."""

_NO_ACL_CHECK = "acl_check_cmd"
"""In the error of a server older than 7.0 (its Lua has no ``redis.acl_check_cmd``)."""

Execute = Callable[..., Awaitable[Any]]


async def refused_commands(execute: Execute, commands: Iterable[str], key: str) -> list[str] | None:
    """The ``commands`` the connection's user may not run on ``key``; ``None`` when
    the server cannot tell (older than Redis 7.0). A refused ``EVAL`` raises the
    client's error (``NOPERM ... 'eval' command``)."""
    argv: list[str | int] = []
    for command in commands:
        args = _check_args(command, key)
        argv += [len(args), *args]
    try:
        reply = await execute("EVAL", _CHECK_LUA, 0, *argv, keys=())
    except Exception as exc:
        if _NO_ACL_CHECK in str(exc):
            return None
        raise
    return [r.decode() if isinstance(r, bytes) else str(r) for r in reply]


def permission_message(
    refused: Sequence[str], namespace: str, user: str, *, what: str = "a RedisBroker"
) -> str:
    return (
        f"the Redis user {user!r} may not run {', '.join(refused)} on the keys"
        f" {namespace}:* (NOPERM), which {what} of namespace {namespace!r} needs:"
        f" grant at least `{acl_rule(namespace, user)}`"
    )


async def check_permissions(execute: Execute, namespace: str) -> list[str] | None:
    """The required commands the connection's user may not run on the namespace's
    keys (empty: none), or ``None`` when the server cannot tell."""
    key = f"{namespace}:{{acl-check}}"
    return await refused_commands(execute, required_commands(), key)


def is_refusal(exc: BaseException) -> bool:
    """Whether a client's error is Redis refusing a command or key to the user."""
    text = str(exc)
    return any(marker in text for marker in _REFUSED)


async def describe_script_refusal(
    execute: Execute, lua: str, keys: Sequence[str], exc: BaseException
) -> str:
    """Redis's refusal of a script (``exc``), with the commands of the script the
    user may not run on its keys added: Redis does not name them."""
    commands = script_commands(lua)
    refused: set[str] = set()
    try:
        for key in keys or ("",):
            found = await refused_commands(execute, commands, key)
            if found is None:
                return str(exc)
            refused.update(found)
    except Exception:
        return str(exc)
    if not refused:
        return str(exc)
    keys_text = f" on {', '.join(keys)}" if keys else ""
    return f"{exc} (refused: {', '.join(sorted(refused))}{keys_text})"
