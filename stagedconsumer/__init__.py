"""stagedconsumer: staged-concurrent ordered message consumption.

Messages inside a stage run concurrently; stage ``k + 1`` starts only after every
message of stage ``k`` finished (Apache RocketMQ's RIP-22, done correctly).
"""

from typing import TYPE_CHECKING, Any

from ._core import TAIL_STAGE as TAIL_STAGE
from ._core import ProcessQueueStatistics as ProcessQueueStatistics
from ._core import StageDefinition as StageDefinition
from ._core import StageKey as StageKey
from ._exceptions import ConfigurationError as ConfigurationError
from ._exceptions import ConsumerStateError as ConsumerStateError
from ._exceptions import HandlerError as HandlerError
from ._exceptions import InvalidMessageError as InvalidMessageError
from ._exceptions import InvalidOptionError as InvalidOptionError
from ._exceptions import InvalidStageDefinitionError as InvalidStageDefinitionError
from ._exceptions import LeaseEndedError as LeaseEndedError
from ._exceptions import ListenerTypeError as ListenerTypeError
from ._exceptions import ProducerStateError as ProducerStateError
from ._exceptions import SendTimeoutError as SendTimeoutError
from ._exceptions import SourceClosedError as SourceClosedError
from ._exceptions import SourceError as SourceError
from ._exceptions import SourcePermissionError as SourcePermissionError
from ._exceptions import StagedConsumerError as StagedConsumerError
from ._exceptions import UnknownTopicError as UnknownTopicError
from ._exceptions import WrongThreadError as WrongThreadError
from ._listeners import ConsumeConcurrentlyContext as ConsumeConcurrentlyContext
from ._listeners import ConsumeConcurrentlyStatus as ConsumeConcurrentlyStatus
from ._listeners import ConsumeOrderlyContext as ConsumeOrderlyContext
from ._listeners import ConsumeOrderlyStatus as ConsumeOrderlyStatus
from ._listeners import ConsumeStagedConcurrentlyContext as ConsumeStagedConcurrentlyContext
from ._listeners import MessageListener as MessageListener
from ._listeners import MessageListenerConcurrently as MessageListenerConcurrently
from ._listeners import MessageListenerOrderly as MessageListenerOrderly
from ._listeners import MessageListenerStagedConcurrently as MessageListenerStagedConcurrently
from ._listeners import MessageQueueListener as MessageQueueListener
from ._listeners import Ordering as Ordering
from ._message import Message as Message
from ._message import MessageQueue as MessageQueue
from ._message import OutgoingMessage as OutgoingMessage
from ._message import SendResult as SendResult
from ._message import SendStatus as SendStatus
from ._observability._hooks import ConsumeMessageContext as ConsumeMessageContext
from ._observability._hooks import ConsumeMessageHook as ConsumeMessageHook
from ._observability._hooks import ConsumeReturnType as ConsumeReturnType
from ._observability._hooks import PullContext as PullContext
from ._observability._hooks import SettleContext as SettleContext
from ._observability._hooks import SettleOutcome as SettleOutcome
from ._observability._send_hooks import ProducerStatistics as ProducerStatistics
from ._observability._send_hooks import ProducerView as ProducerView
from ._observability._send_hooks import SendMessageContext as SendMessageContext
from ._observability._send_hooks import SendMessageHook as SendMessageHook
from ._observability._send_trace_hook import SendMessageTraceHook as SendMessageTraceHook
from ._observability._trace_codec import RMQ_SYS_TRACE_TOPIC as RMQ_SYS_TRACE_TOPIC
from ._observability._trace_codec import TraceBean as TraceBean
from ._observability._trace_codec import TraceContext as TraceContext
from ._observability._trace_codec import TraceMessage as TraceMessage
from ._observability._trace_codec import TraceType as TraceType
from ._observability._trace_codec import decode_trace_data as decode_trace_data
from ._observability._trace_codec import encode_trace_context as encode_trace_context
from ._observability._trace_dispatcher import AsyncTraceDispatcher as AsyncTraceDispatcher
from ._observability._trace_dispatcher import TraceDispatcherStatistics as TraceDispatcherStatistics
from ._observability._trace_hook import ConsumeMessageTraceHook as ConsumeMessageTraceHook
from ._observability._trace_query import query_message_trace as query_message_trace
from ._observability._trace_query import read_trace_file as read_trace_file
from ._observability._trace_query import read_trace_topic as read_trace_topic
from ._observability._trace_query import trace_messages_of as trace_messages_of
from ._observability._trace_sinks import FileTraceSink as FileTraceSink
from ._observability._trace_sinks import SourceTraceSink as SourceTraceSink
from ._observability._trace_sinks import TraceSink as TraceSink
from ._observability._trace_sinks import TraceSinkFull as TraceSinkFull
from ._observability._traceparent import inject_traceparent as inject_traceparent
from ._observability._view import ConsumerStatistics as ConsumerStatistics
from ._observability._view import ConsumerView as ConsumerView
from ._options import ConsumeFromWhere as ConsumeFromWhere
from ._options import ConsumerOptions as ConsumerOptions
from ._options import ProducerOptions as ProducerOptions
from ._runtime._consumer import PushConsumer as PushConsumer
from ._runtime._producer import Producer as Producer
from ._runtime._simple import AckFuture as AckFuture
from ._runtime._simple import SimpleConsumer as SimpleConsumer
from ._runtime._simple import SimpleConsumerOptions as SimpleConsumerOptions
from ._runtime._simple_worker import SimpleWorker as SimpleWorker
from ._sources._gray import AllocateMessageQueueByGray as AllocateMessageQueueByGray
from ._sources._gray import GrayStatistics as GrayStatistics
from ._sources._group import AllocateMessageQueueAveragely as AllocateMessageQueueAveragely
from ._sources._group import (
    AllocateMessageQueueByConsistentHash as AllocateMessageQueueByConsistentHash,
)
from ._sources._group import AllocateMessageQueueStrategy as AllocateMessageQueueStrategy
from ._sources._group import GroupCoordinator as GroupCoordinator
from ._sources._group import GroupOptions as GroupOptions
from ._sources._kafka_broker import KafkaBroker as KafkaBroker
from ._sources._kafka_broker import KafkaBrokerStatistics as KafkaBrokerStatistics
from ._sources._kafka_broker import SelectMessageQueueByKafkaKey as SelectMessageQueueByKafkaKey
from ._sources._kafka_group import KafkaOffsetStore as KafkaOffsetStore
from ._sources._memory import MemoryBroker as MemoryBroker
from ._sources._memory import MemoryBrokerStatistics as MemoryBrokerStatistics
from ._sources._pop import InvalidReceiptHandleError as InvalidReceiptHandleError
from ._sources._pop import ReceivedMessage as ReceivedMessage
from ._sources._redis_tls import RedisTLS as RedisTLS
from ._sources._selectors import MessageQueueSelector as MessageQueueSelector
from ._sources._selectors import SelectMessageQueueByGray as SelectMessageQueueByGray
from ._sources._selectors import SelectMessageQueueByHash as SelectMessageQueueByHash
from ._sources._selectors import SelectMessageQueueByRandom as SelectMessageQueueByRandom
from ._sources._source import MessageSource as MessageSource
from ._sources._source import PullResult as PullResult
from ._sources._source import SendBackResult as SendBackResult
from ._sources._source import TraceWriter as TraceWriter
from ._sources._source import UndecodableEntry as UndecodableEntry
from ._version import __version__ as __version__

if TYPE_CHECKING:
    from ._sources._redis_broker import RedisBroker as RedisBroker
    from ._sources._redis_broker import StreamRetention as StreamRetention


def __getattr__(name: str) -> Any:
    # RedisBroker needs the optional redis-py (``stagedconsumer[redis]``): imported on
    # first use, so ``import stagedconsumer`` works without it.
    if name == "RedisBroker":
        from ._sources._redis_broker import RedisBroker

        return RedisBroker
    if name == "StreamRetention":
        from ._sources._redis_broker import StreamRetention

        return StreamRetention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = (
    "AckFuture",
    "ReceivedMessage",
    "InvalidReceiptHandleError",
    "SimpleConsumerOptions",
    "SimpleConsumer",
    "SimpleWorker",
    "RMQ_SYS_TRACE_TOPIC",
    "TAIL_STAGE",
    "AllocateMessageQueueAveragely",
    "AllocateMessageQueueByConsistentHash",
    "AllocateMessageQueueByGray",
    "AllocateMessageQueueStrategy",
    "AsyncTraceDispatcher",
    "ConfigurationError",
    "ConsumeConcurrentlyContext",
    "ConsumeConcurrentlyStatus",
    "ConsumeFromWhere",
    "ConsumeMessageContext",
    "ConsumeMessageHook",
    "ConsumeMessageTraceHook",
    "ConsumeOrderlyContext",
    "ConsumeOrderlyStatus",
    "ConsumeReturnType",
    "ConsumeStagedConcurrentlyContext",
    "ConsumerOptions",
    "ConsumerStateError",
    "ConsumerStatistics",
    "ConsumerView",
    "FileTraceSink",
    "GrayStatistics",
    "GroupCoordinator",
    "GroupOptions",
    "HandlerError",
    "InvalidMessageError",
    "InvalidOptionError",
    "InvalidStageDefinitionError",
    "LeaseEndedError",
    "ListenerTypeError",
    "MemoryBroker",
    "MemoryBrokerStatistics",
    "Message",
    "MessageListener",
    "MessageListenerConcurrently",
    "MessageListenerOrderly",
    "MessageListenerStagedConcurrently",
    "MessageQueue",
    "MessageQueueListener",
    "MessageQueueSelector",
    "MessageSource",
    "Ordering",
    "OutgoingMessage",
    "KafkaBroker",
    "KafkaBrokerStatistics",
    "KafkaOffsetStore",
    "ProcessQueueStatistics",
    "Producer",
    "ProducerOptions",
    "ProducerStateError",
    "ProducerStatistics",
    "ProducerView",
    "PullContext",
    "SettleContext",
    "PullResult",
    "PushConsumer",
    "RedisBroker",
    "RedisTLS",
    "SelectMessageQueueByGray",
    "SelectMessageQueueByHash",
    "SelectMessageQueueByKafkaKey",
    "SelectMessageQueueByRandom",
    "SendBackResult",
    "SendMessageContext",
    "SendMessageHook",
    "SendMessageTraceHook",
    "SendResult",
    "SendStatus",
    "SendTimeoutError",
    "SettleOutcome",
    "SourceClosedError",
    "SourcePermissionError",
    "SourceError",
    "SourceTraceSink",
    "StreamRetention",
    "StageDefinition",
    "StageKey",
    "StagedConsumerError",
    "TraceBean",
    "TraceContext",
    "TraceDispatcherStatistics",
    "TraceMessage",
    "TraceSink",
    "TraceSinkFull",
    "TraceType",
    "TraceWriter",
    "UndecodableEntry",
    "UnknownTopicError",
    "WrongThreadError",
    "decode_trace_data",
    "encode_trace_context",
    "inject_traceparent",
    "query_message_trace",
    "read_trace_file",
    "read_trace_topic",
    "trace_messages_of",
)
