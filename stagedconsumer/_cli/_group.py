"""``stagedconsumer group show``: the live members of a consumer group on a RedisBroker,
with their gray flag and ratio (gray release), the owner of each of the group's retry
queues, and with ``--topic`` the owner of each queue of that topic.

A member's gray flag and ratio travel in its id (``...@gray[0.1]``). While a gray
member is live, the gray queues (the last ``ceil(n * ratio)`` of a topic, with the
largest ratio of the live gray members; the last retry queue) are marked ``gray``.

An owner that is not a live member (killed without leaving, e.g. ``kill -9``) still
holds its queues until its lock expires (``GroupOptions.lock_ttl``, 60 s by
default); it is marked ``not live``, with the seconds left. No other member consumes
those queues until then.

The embedded broker's groups live inside the consumers' process: see
``MemoryBroker.group_coordinator().statistics()`` there.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import anyio

from .._exceptions import StagedConsumerError
from .._message import MessageQueue
from .._sources._gray import gray_ratio_of, split_gray
from .._sources._redis_url import redact_url
from .._sources._source import retry_topic
from ._redis_args import add_redis_arguments, operator_broker

__all__ = ("register",)


def _owner_text(owner: str | None, members: Sequence[str], expires_in: float | None) -> str:
    if owner is None:
        return "-"
    if owner in members:
        return owner
    if expires_in is None:  # expired between the two reads
        return f"{owner} (not live: its lock just expired)"
    return f"{owner} (not live: lock held until it expires, in {expires_in:.0f} s)"


async def _show(args: argparse.Namespace) -> int:
    retry_queues: Sequence[MessageQueue] = ()
    try:
        async with operator_broker(args) as broker:
            coordinator = broker.group_coordinator()
            members = await coordinator.members(args.group)
            queues = list(await broker.get_queues(args.topic)) if args.topic else []
            retry_queues = await broker.get_queues(retry_topic(args.group))
            lines: list[str] = []
            ratios = [r for r in map(gray_ratio_of, members) if r is not None]
            gray = set(split_gray([*queues, *retry_queues], max(ratios)).gray) if ratios else set()
            for mq in [*queues, *retry_queues]:
                owner = await coordinator.lock_owner(args.group, mq)
                expires_in = None
                if owner is not None and owner not in members:
                    expires_in = await coordinator.lock_expires_in(args.group, mq)
                text = _owner_text(owner, members, expires_in)
                lines.append(f"  {mq}: {text}{'  gray' if mq in gray else ''}")
    except ImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except StagedConsumerError as exc:
        print(f"error: {redact_url(args.redis)}: {exc}", file=sys.stderr)
        return 1
    print(f"group {args.group}: {len(members)} live member(s)")
    for member in members:
        ratio = gray_ratio_of(member)
        kind = "normal" if ratio is None else f"gray (ratio {ratio})"
        print(f"  {member}  {kind}")
    if queues:
        print(f"queues of topic {args.topic}:")
    for line in lines[: len(queues)]:
        print(line)
    print(f"retry queues of group {args.group}:")
    for line in lines[len(queues) :]:
        print(line)
    return 0


def _handle_show(args: argparse.Namespace) -> int:
    return anyio.run(_show, args)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "group",
        help="show the live members of a consumer group (gray flag and ratio) on Redis",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="group_command", metavar="ACTION", title="actions")

    def no_action(args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(handler=no_action)
    show = commands.add_parser(
        "show",
        help="print the live members and queue owners",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    show.add_argument("--group", required=True, help="consumer group")
    show.add_argument("--topic", help="also print the owner of each queue of this topic")
    add_redis_arguments(show, url_help="RedisBroker URL", required=True)
    show.set_defaults(handler=_handle_show)
