"""The sans-I/O core: stage arithmetic, process queues, dispatch and offsets.

Nothing in this package awaits, reads a clock or logs: the anyio shell passes the
current time in and acts on the decisions returned.
"""

from ._backoff import Backoff as Backoff
from ._backoff import TakeoverBackoff as TakeoverBackoff
from ._backoff import TakeoverBackoffStatistics as TakeoverBackoffStatistics
from ._dispatcher import Dispatcher as Dispatcher
from ._process_queue import DEFAULT_STRATEGY as DEFAULT_STRATEGY
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
from ._stages import TAIL_STAGE as TAIL_STAGE
from ._stages import StageDefinition as StageDefinition

__all__ = (
    "DEFAULT_STRATEGY",
    "DELAY_LEVELS",
    "TAIL_STAGE",
    "Backoff",
    "Batch",
    "ConsumeMode",
    "Dispatcher",
    "EraseStatus",
    "FlowControl",
    "ProcessQueue",
    "ProcessQueueStatistics",
    "StageDefinition",
    "StageKey",
    "StagePlan",
    "TakeoverBackoff",
    "TakeoverBackoffStatistics",
    "clamp_suspend_millis",
    "retry_delay_seconds",
)
