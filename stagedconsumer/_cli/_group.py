"""``stagedconsumer group show``: the live members of a consumer group on a RedisBroker,
with their gray flag and ratio (gray release), and with ``--topic`` the owner of each
queue of that topic.

A member's gray flag and ratio travel in its id (``...@gray[0.1]``). The embedded
broker's groups live inside the consumers' process: see
``MemoryBroker.group_coordinator().statistics()`` there.
"""

from __future__ import annotations

import argparse

import anyio

from .._exceptions import StagedConsumerError
from .._sources._gray import gray_ratio_of
from ._redis_args import add_redis_arguments, operator_broker

__all__ = ("register",)


async def _show(args: argparse.Namespace) -> int:
    try:
        async with operator_broker(args) as broker:
            coordinator = broker.group_coordinator()
            members = await coordinator.members(args.group)
            queues = await broker.get_queues(args.topic) if args.topic else []
            owners = [(mq, await coordinator.lock_owner(args.group, mq)) for mq in queues]
    except ImportError as exc:
        print(exc)
        return 1
    except StagedConsumerError as exc:
        print(f"{args.redis}: {exc}")
        return 1
    print(f"group {args.group}: {len(members)} live member(s)")
    for member in members:
        ratio = gray_ratio_of(member)
        kind = "normal" if ratio is None else f"gray (ratio {ratio})"
        print(f"  {member}  {kind}")
    for mq, owner in owners:
        print(f"  {mq}: {owner or '-'}")
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
    show = commands.add_parser("show", help="print the live members and queue owners")
    show.add_argument("--group", required=True, help="consumer group")
    show.add_argument("--topic", help="also print the owner of each queue of this topic")
    add_redis_arguments(show, url_help="RedisBroker URL", required=True)
    show.set_defaults(handler=_handle_show)
