"""The shapes of the user's callbacks, checked once when they are handed over.

Listener methods, stage callbacks, queue listeners and hooks are called by the
runtime with fixed arguments, some awaited, some not. A callback that cannot be
called that way would fail on every call (or, async where a plain ``def`` is
expected, silently do nothing): :func:`check_method` refuses it up front with a
:class:`~stagedconsumer.ListenerTypeError` naming what it found and what is expected.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from .._exceptions import ConfigurationError, ListenerTypeError
from .._listeners import (
    MessageListener,
    MessageListenerOrderly,
    MessageListenerStagedConcurrently,
    MessageQueueListener,
    Ordering,
    is_async_callable,
)

__all__ = (
    "check_client",
    "check_hook",
    "check_listener",
    "check_method",
    "check_queue_listener",
    "overrides",
)

_Options = TypeVar("_Options")


def check_client(
    group: object,
    source: object,
    options: _Options | None,
    options_type: type[_Options],
    *,
    consumer: bool,
    hint: str = "",
) -> _Options:
    """Check what a client (``PushConsumer``, ``SimpleConsumer``, ``Producer``) is made
    with: a group name (a consumer group's may not start with ``%`` or a space), a
    :class:`~stagedconsumer.MessageSource` and options of ``options_type``. Returns the
    options (default ones for ``None``)."""
    from .._sources._source import MessageSource

    if not isinstance(group, str) or not group or (consumer and group.startswith(("%", " "))):
        raise ConfigurationError(f"group must be a non-empty name, got {group!r}")
    if not isinstance(source, MessageSource):
        raise ConfigurationError(f"source must be a MessageSource, got {type(source).__name__}")
    if options is None:
        return options_type()
    if not isinstance(options, options_type):
        raise ConfigurationError(
            f"options must be {options_type.__name__}, got {type(options).__name__}{hint}"
        )
    return options


def overrides(obj: object, base: type, name: str) -> bool:
    """Whether ``obj``'s class defines ``name`` otherwise than ``base`` does."""
    return getattr(type(obj), name) is not getattr(base, name)


def check_listener(listener: object) -> None:
    """A listener instance whose methods that the consumer calls can be called the
    way it calls them (checked once, here, rather than found out per message)."""
    kinds = (
        "a MessageListenerConcurrently, MessageListenerOrderly or MessageListenerStagedConcurrently"
    )
    if isinstance(listener, type):
        if issubclass(listener, MessageListener):
            raise ListenerTypeError(
                f"listener must be an instance, got the class {listener.__name__}:"
                f" pass an instance, {listener.__name__}(...)"
            )
        raise ListenerTypeError(
            f"listener must be an instance of {kinds}, got the class {listener.__name__}"
        )
    if not isinstance(listener, MessageListener):
        return  # the caller names the expected kinds
    check_method(listener, "consume_message", ("msgs", "context"), handler=True)
    if isinstance(listener, MessageListenerStagedConcurrently):
        base: type = MessageListenerStagedConcurrently
        if not overrides(listener, base, "get_stage_definition_strategies"):
            check_method(listener, "get_stage_definitions", ())
        for name, params in _STAGE_CALLBACKS:
            if overrides(listener, base, name):
                check_method(listener, name, params)
    elif (
        isinstance(listener, MessageListenerOrderly)
        and listener.ordering is Ordering.BY_KEY
        and overrides(listener, MessageListenerOrderly, "compute_key")
    ):
        check_method(listener, "compute_key", ("msg",))


_STAGE_CALLBACKS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("get_stage_definition_strategies", ()),
    ("compute_strategy", ("msg",)),
    ("compute_group", ("msg",)),
    ("reset_current_stage_offset_if_need", ("topic", "current")),
)
"""The staged listener's callbacks with the arguments the consumer passes them
(positionally); the defaults of the base class need no check."""


def check_queue_listener(listener: MessageQueueListener) -> None:
    """The methods of a :class:`MessageQueueListener` that ``listener`` overrides can be
    awaited with the list of queues, as the consumer calls them."""
    for name in ("on_queues_assigned", "on_queues_revoked"):
        if overrides(listener, MessageQueueListener, name):
            check_method(listener, name, ("queues",), awaited=True)


def check_method(
    listener: object,
    name: str,
    params: tuple[str, ...],
    *,
    handler: bool = False,
    awaited: bool = False,
) -> None:
    """Raise :class:`ListenerTypeError` unless ``listener.<name>`` can be called with
    the positional arguments ``params``, as the consumer calls it.

    ``handler``: it may be ``async def`` (``consume_message``); ``awaited``: it must be
    (the queue listener's methods); otherwise it must be a
    plain function, whose return value the consumer uses as is. Generator functions
    are refused (they return a generator, not a result). Only what certainly fails
    is refused: ``*args``, defaults, keyword-only parameters with defaults,
    ``functools.partial``, callable objects, static and class methods pass, and so
    does a callable whose signature cannot be read (some builtins)."""
    owner = type(listener).__name__
    call = f"{name}({', '.join(params)})"
    expected = f"def {name}({', '.join(('self', *params))})"
    if handler:
        expected = f"async def or {expected}"
    elif awaited:
        expected = f"async {expected}"
    method = getattr(listener, name, None)
    if not callable(method):
        raise ListenerTypeError(
            f"{owner}.{name} must be a method ({expected}), got {type(method).__name__} {method!r}"
        )
    if inspect.isasyncgenfunction(method) or inspect.isgeneratorfunction(method):
        what = "an async generator" if inspect.isasyncgenfunction(method) else "a generator"
        raise ListenerTypeError(
            f"{owner}.{name} is {what} function (its body has yield): the consumer calls"
            f" {call} for its result, and would get a generator every time; expected"
            f" {expected} without yield"
        )
    if awaited and not is_async_callable(method):
        raise ListenerTypeError(
            f"{owner}.{name} is a plain def: the consumer awaits {call}, which needs a"
            f" coroutine; expected {expected}"
        )
    if not handler and not awaited and is_async_callable(method):
        raise ListenerTypeError(
            f"{owner}.{name} is async def: the consumer calls {call} synchronously, so"
            f" the coroutine it returns would never run; expected {expected}"
        )
    # A bound method is checked through its function with ``self`` bound, so that a
    # method without ``self`` is reported too (its bound signature cannot be read).
    target: Callable[..., Any] = method
    bound: tuple[object, ...] = ()
    if inspect.ismethod(method):
        target, bound = method.__func__, (method.__self__,)
    try:
        # the callable itself, not what a decorator wraps: that is what gets called
        signature = inspect.signature(target, follow_wrapped=False)
    except (TypeError, ValueError):
        return  # no signature to read (a builtin, an extension type): trust it
    try:
        signature.bind(*bound, *params)
    except TypeError as exc:
        hint = ""
        first = next(iter(signature.parameters), None)
        if bound and first not in ("self", "cls") and _binds(signature, params):
            hint = " (is self missing? a method's first parameter receives the listener)"
        shown = signature.replace(
            parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
            return_annotation=signature.empty,
        )
        raise ListenerTypeError(
            f"{owner}.{name}{shown} cannot be called as {call} ({exc}){hint}; expected {expected}"
        ) from None


def _binds(signature: inspect.Signature, args: tuple[object, ...]) -> bool:
    try:
        signature.bind(*args)
    except TypeError:
        return False
    return True


def check_hook(hook: object, base: type, methods: tuple[str, ...]) -> None:
    """The ``methods`` of a hook (``consume_message_before``, ...) that ``hook``
    overrides can be called with the context, synchronously, as the runtime calls them
    (an ``async def`` one would return a coroutine nobody awaits)."""
    for name in methods:
        if overrides(hook, base, name):
            check_method(hook, name, ("context",))
