"""stagedconsumer.testing: property-based ordering tests for your own listeners.

Needs the ``testing`` extra (``pip install 'stagedconsumer[testing]'``: hypothesis and
trio). The pieces:

- hypothesis strategies for workloads: :func:`messages`, :func:`stage_definitions`,
  :func:`failure_schedules`, :func:`handler_costs`;
- :class:`RecordingListener`, which logs every handler call in a :class:`CallLog`
  without changing what the listener does;
- checkers returning :class:`Violation` values (:func:`check_staged`,
  :func:`check_orderly`, :func:`check_key_order`, :func:`check_at_least_once`) and
  ``assert_*`` variants raising :class:`OrderingViolation`, and :func:`stage_of`,
  the naive stage model they use;
- :func:`run_virtual`, which runs the real consumer in virtual time on the embedded
  broker, with scheduled failures and crashes, and returns a :class:`VirtualRun`;
- :data:`HYPOTHESIS_PROFILE`, a hypothesis settings profile for such properties;
- a pytest plugin (loaded through its entry point): the ``memory_broker`` fixture
  and the ``--stagedconsumer-seed`` option.
"""

from ._checks import Assignment as Assignment
from ._checks import OrderingViolation as OrderingViolation
from ._checks import StagePlan as StagePlan
from ._checks import Violation as Violation
from ._checks import assert_at_least_once as assert_at_least_once
from ._checks import assert_key_order as assert_key_order
from ._checks import assert_orderly as assert_orderly
from ._checks import assert_staged as assert_staged
from ._checks import check_at_least_once as check_at_least_once
from ._checks import check_key_order as check_key_order
from ._checks import check_orderly as check_orderly
from ._checks import check_staged as check_staged
from ._checks import stage_of as stage_of
from ._log import CallLog as CallLog
from ._log import DeadLetter as DeadLetter
from ._log import HandlerCall as HandlerCall
from ._log import Outcome as Outcome
from ._log import RecordingListener as RecordingListener
from ._log import origin_id as origin_id

try:
    from ._strategies import HYPOTHESIS_PROFILE as HYPOTHESIS_PROFILE
    from ._strategies import FailureKind as FailureKind
    from ._strategies import FailureSchedule as FailureSchedule
    from ._strategies import MessageSpec as MessageSpec
    from ._strategies import failure_schedules as failure_schedules
    from ._strategies import handler_costs as handler_costs
    from ._strategies import messages as messages
    from ._strategies import stage_definitions as stage_definitions
except ModuleNotFoundError as exc:
    if exc.name != "hypothesis":
        raise
    raise ModuleNotFoundError(
        "stagedconsumer.testing needs the 'testing' extra (hypothesis is not installed):"
        " pip install 'stagedconsumer[testing]'",
        name=exc.name,
    ) from exc
from ._virtual import InjectedFailure as InjectedFailure
from ._virtual import VirtualRun as VirtualRun
from ._virtual import run_virtual as run_virtual

__all__ = (
    "HYPOTHESIS_PROFILE",
    "Assignment",
    "CallLog",
    "DeadLetter",
    "FailureKind",
    "FailureSchedule",
    "HandlerCall",
    "InjectedFailure",
    "MessageSpec",
    "OrderingViolation",
    "Outcome",
    "RecordingListener",
    "StagePlan",
    "Violation",
    "VirtualRun",
    "assert_at_least_once",
    "assert_key_order",
    "assert_orderly",
    "assert_staged",
    "check_at_least_once",
    "check_key_order",
    "check_orderly",
    "check_staged",
    "failure_schedules",
    "handler_costs",
    "messages",
    "origin_id",
    "run_virtual",
    "stage_definitions",
    "stage_of",
)
