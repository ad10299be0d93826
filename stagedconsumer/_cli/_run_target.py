"""What ``stagedconsumer run MODULE:ATTR`` runs: the attribute, and the units it stands for.

``ATTR`` (dotted for a nested attribute: ``app:settings.consumer``) is one of

- a :class:`~stagedconsumer.PushConsumer`, a :class:`~stagedconsumer.SimpleWorker`
  (a ``SimpleConsumer`` and its handler) or a :class:`~stagedconsumer.Producer`;
- any other async context manager (a ``RedisBroker``, a ``SqlOffsetStore``, what an
  ``@asynccontextmanager`` function returns): entered and left around the rest; what
  its ``__aenter__`` gives (the value an ``@asynccontextmanager`` yields) is run too
  when it is one of these shapes (consumers it started itself are watched, not
  started again);
- a list or tuple of these, entered in its order and left in the reverse order (a
  broker before the consumers that pull from it);
- a factory: a callable taking no arguments, sync or ``async def``, returning one
  of these.

Other shapes plug in through :data:`ADAPTERS` (a ``SimpleConsumer`` loop, say): an
adapter turns a value into a :class:`Unit` whose context manager runs the loop on
entering and stops it on leaving, or returns ``None`` for values it does not know.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from typing import Any, Protocol, cast

import attrs

from .._runtime._consumer import PushConsumer
from .._runtime._producer import Producer

__all__ = ("ADAPTERS", "Probe", "TargetError", "Unit", "enter_target", "load_target")

SHAPES = (
    "a PushConsumer, a SimpleWorker, a Producer, an async context manager (a broker,"
    " an offset store, an @asynccontextmanager function's result), a list of them, or a"
    " factory (a function, sync or async, taking no arguments) returning one of these"
)


class TargetError(Exception):
    """``MODULE:ATTR`` cannot be run; the message names what was not found or is wrong."""


class Probe(Protocol):
    """What a unit an adapter made tells the run (its log lines, ``/readyz``, metrics)."""

    def leaving(self) -> str:
        """What leaving it does, for the log line of the first signal."""
        ...

    def abandoned(self) -> str | None:
        """What exiting at once abandons (``None``: nothing)."""
        ...

    async def readiness(self) -> dict[str, Any]:
        """Its entry in ``/readyz``'s ``consumers``, with ``ready``."""
        ...

    def prepare_metrics(self, meter_provider: Any) -> None:
        """Register metrics hooks, before it is entered."""
        ...


@attrs.define(eq=False)
class Unit:
    """One thing a run enters and leaves, in the order the target gives."""

    name: str
    """How the log names it: ``consumer orders (host@1234)``, ``RedisBroker``."""
    context: AbstractAsyncContextManager[Any] | None
    """What the run enters (``None``: it was running already; only watched)."""
    consumer: PushConsumer | None = None
    producer: Producer | None = None
    probe: Probe | None = None
    """Set by an adapter: what the run's log and probes ask of the unit."""


Adapter = Callable[[object], Unit | None]

ADAPTERS: list[Adapter] = []
"""Turn values of other shapes into units (tried in order, before the error for a value
of no known shape). A :class:`~stagedconsumer.SimpleWorker` registers one here
(:mod:`._run_simple`): its context starts the receive loop on ``__aenter__`` and, on
``__aexit__``, stops receiving and lets the handler calls in flight finish and ack
within its shutdown timeout."""


def load_target(spec: str) -> tuple[object, str]:
    """Import ``MODULE`` of ``MODULE:ATTR`` and return ``ATTR`` of it, with its name.

    The current directory comes first on ``sys.path`` (as with ``python -m``), so
    ``stagedconsumer run app:make`` finds ``./app.py``. Raises :class:`TargetError`
    naming the part that was not found; an error raised while the module itself is
    imported (a module *it* imports is missing, a syntax error) comes out as itself.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise TargetError(
            f"{spec!r} is not MODULE:ATTR: give the module to import and the attribute"
            " to run, e.g. 'myapp.consumers:make_consumer'"
        )
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise TargetError(
                f"module {module_name!r} not found (no {missing!r} on the import path:"
                f" the current directory {cwd} and sys.path)"
            ) from None
        raise
    value: object = module
    done = module_name
    for part in attr.split("."):
        try:
            value = getattr(value, part)
        except AttributeError:
            where = f"module {module_name!r}" if done == module_name else repr(done)
            raise TargetError(f"{where} has no attribute {part!r} (looking for {spec})") from None
        done = f"{done}:{part}" if done == module_name else f"{done}.{part}"
    return value, spec


def _is_context(value: object) -> bool:
    return (
        not isinstance(value, type) and hasattr(value, "__aenter__") and hasattr(value, "__aexit__")
    )


def _consumer_unit(consumer: PushConsumer) -> Unit:
    started = consumer._state.started
    return Unit(
        name=f"consumer {consumer.group} ({consumer.client_id})",
        context=None if started else consumer,
        consumer=consumer,
    )


def _producer_unit(producer: Producer) -> Unit:
    return Unit(
        name=f"producer {producer.group}",
        context=None if producer._started else producer,
        producer=producer,
    )


def _unit_of(value: object) -> Unit | None:
    if isinstance(value, PushConsumer):
        return _consumer_unit(value)
    if isinstance(value, Producer):
        return _producer_unit(value)
    for adapt in ADAPTERS:
        unit = adapt(value)
        if unit is not None:
            return unit
    if _is_context(value):  # any object with __aenter__ and __aexit__, as `async with` takes
        func = getattr(value, "func", None)  # what an @asynccontextmanager function returned
        if func is not None and hasattr(value, "gen"):
            name = f"{func.__module__}.{func.__qualname__}()"
        else:
            name = type(value).__name__
        return Unit(name=name, context=cast("AbstractAsyncContextManager[Any]", value))
    return None


def _runnable(value: object) -> bool:
    """Whether ``value`` is meant to be run: a unit, or a list with one (whose other
    items then get an error naming them)."""
    if isinstance(value, list | tuple):
        return any(_runnable(item) for item in value)
    return _unit_of(value) is not None


def _type_name(value: object) -> str:
    return "None" if value is None else f"a {type(value).__module__}.{type(value).__qualname__}"


async def enter_target(
    target: object,
    where: str,
    stack: AsyncExitStack,
    units: list[Unit],
    prepare: Callable[[Unit], None] = lambda unit: None,
) -> None:
    """Enter everything ``target`` stands for on ``stack``, in order, appending each
    :class:`Unit` to ``units`` as it is entered; ``prepare`` sees each unit first
    (to register hooks on a consumer not started yet)."""
    if not _runnable(target) and callable(target):
        _check_no_arguments(target, where)
        result = target()
        if inspect.isawaitable(result):
            result = await result
        if not _runnable(result) and not (isinstance(result, list | tuple) and not result):
            raise TargetError(
                f"{where} returned {_type_name(result)}; a factory must return {SHAPES}"
            )
        target, where = result, f"what {where}() returned"
    await _enter(target, where, stack, units, prepare)


async def _enter(
    value: object,
    where: str,
    stack: AsyncExitStack,
    units: list[Unit],
    prepare: Callable[[Unit], None],
) -> None:
    if isinstance(value, list | tuple):
        if not value:
            raise TargetError(f"{where} is empty: nothing to run")
        for index, item in enumerate(value):
            await _enter(item, f"{where}[{index}]", stack, units, prepare)
        return
    unit = _unit_of(value)
    if unit is None:
        raise TargetError(f"{where} is {_type_name(value)}; expected {SHAPES}")
    prepare(unit)
    if unit.context is None:  # started by the application itself: watched only
        units.append(unit)
        return
    entered = await stack.enter_async_context(unit.context)
    units.append(unit)
    if (
        entered is not None
        and entered is not value
        and unit.consumer is None
        and unit.producer is None
        and _runnable(entered)
    ):
        await _enter(entered, f"what {where} gave", stack, units, prepare)


def _check_no_arguments(target: Callable[..., object], where: str) -> None:
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # a builtin without a signature: just call it
        return
    required = [
        p.name
        for p in signature.parameters.values()
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    if required:
        raise TargetError(
            f"{where} takes arguments ({', '.join(required)}); a factory must take none"
            " (read settings from the environment or a file inside it)"
        )
