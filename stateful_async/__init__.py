"""stateful-async: Apache Flink's Async I/O operator for Python and PySpark.

The public surface is re-exported here; everything in underscore modules is private.
The PySpark adapter lives in ``stateful_async.spark`` (imported on demand, so the core
works without Spark installed).
"""

from ._elements import StreamElement, StreamRecord, Watermark
from ._exceptions import (
    AsyncFunctionError,
    AsyncTimeoutError,
    ConfigurationError,
    DeltaSinkError,
    ElementFailedError,
    FunctionNotSerializableError,
    InputMismatchError,
    InvalidResultError,
    OperatorStateError,
    ResultSchemaError,
    SinkSchemaMismatchError,
    StatefulAsyncError,
    TimeoutHandlerError,
)
from ._function import AsyncFunction, ThreadPoolAsyncFunction
from ._operator import AsyncWaitOperator, OperatorMetrics, OutputMode
from ._retry import RetryStrategy
from ._timers import Clock, SystemClock, VirtualClock

__version__ = "0.1.0"

__all__ = [
    "AsyncFunction",
    "AsyncFunctionError",
    "AsyncTimeoutError",
    "AsyncWaitOperator",
    "Clock",
    "ConfigurationError",
    "DeltaSinkError",
    "ElementFailedError",
    "FunctionNotSerializableError",
    "InputMismatchError",
    "InvalidResultError",
    "OperatorMetrics",
    "OperatorStateError",
    "OutputMode",
    "ResultSchemaError",
    "RetryStrategy",
    "SinkSchemaMismatchError",
    "StatefulAsyncError",
    "StreamElement",
    "StreamRecord",
    "SystemClock",
    "ThreadPoolAsyncFunction",
    "TimeoutHandlerError",
    "VirtualClock",
    "Watermark",
    "__version__",
]
