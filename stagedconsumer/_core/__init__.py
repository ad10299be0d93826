"""The sans-I/O core: stage arithmetic, process queues, dispatch and offsets.

Nothing in this package awaits, reads a clock or logs: the anyio shell passes the
current time in and acts on the decisions returned.
"""

from ._backoff import Backoff as Backoff
from ._backoff import TakeoverBackoff as TakeoverBackoff
from ._backoff import TakeoverBackoffStatistics as TakeoverBackoffStatistics
from ._dispatcher import Dispatcher as Dispatcher
from ._effects import COMMITTED as COMMITTED
from ._effects import DRAINED as DRAINED
from ._effects import HELD as HELD
from ._effects import NOTHING as NOTHING
from ._effects import READY as READY
from ._effects import ROOM as ROOM
from ._effects import TIMER as TIMER
from ._effects import Effects as Effects
from ._effects import describe_effects as describe_effects
from ._ownership import LockOutcome as LockOutcome
from ._ownership import LockPlan as LockPlan
from ._ownership import Lost as Lost
from ._ownership import OwnershipState as OwnershipState
from ._ownership import QueueOwnership as QueueOwnership
from ._ownership import QueueOwnershipStatistics as QueueOwnershipStatistics
from ._process_queue import DEFAULT_STRATEGY as DEFAULT_STRATEGY
from ._process_queue import NO_LEASE as NO_LEASE
from ._process_queue import AssignmentFailure as AssignmentFailure
from ._process_queue import Batch as Batch
from ._process_queue import ConsumeMode as ConsumeMode
from ._process_queue import EraseStatus as EraseStatus
from ._process_queue import FlowControl as FlowControl
from ._process_queue import ProcessQueue as ProcessQueue
from ._process_queue import ProcessQueueStatistics as ProcessQueueStatistics
from ._process_queue import StageKey as StageKey
from ._process_queue import StagePlan as StagePlan
from ._retry import DELAY_LEVELS as DELAY_LEVELS
from ._retry import clamp_suspend_millis as clamp_suspend_millis
from ._retry import retry_delay_seconds as retry_delay_seconds
from ._settlement import Settlement as Settlement
from ._settlement import SettleOutcome as SettleOutcome
from ._settlement import split_exhausted as split_exhausted
from ._stages import TAIL_STAGE as TAIL_STAGE
from ._stages import StageDefinition as StageDefinition

__all__ = (
    "COMMITTED",
    "DEFAULT_STRATEGY",
    "DELAY_LEVELS",
    "DRAINED",
    "HELD",
    "NO_LEASE",
    "NOTHING",
    "READY",
    "ROOM",
    "TAIL_STAGE",
    "TIMER",
    "AssignmentFailure",
    "Backoff",
    "Batch",
    "ConsumeMode",
    "Dispatcher",
    "Effects",
    "EraseStatus",
    "FlowControl",
    "LockOutcome",
    "LockPlan",
    "Lost",
    "OwnershipState",
    "ProcessQueue",
    "ProcessQueueStatistics",
    "QueueOwnership",
    "QueueOwnershipStatistics",
    "SettleOutcome",
    "Settlement",
    "StageDefinition",
    "StageKey",
    "StagePlan",
    "TakeoverBackoff",
    "TakeoverBackoffStatistics",
    "clamp_suspend_millis",
    "describe_effects",
    "retry_delay_seconds",
    "split_exhausted",
)
