"""stateful-async: Apache Flink's Async I/O operator for Python and PySpark.

The public surface is re-exported here; everything in underscore modules is private.
The PySpark adapter lives in ``stateful_async.spark`` (imported on demand, so the core
works without Spark installed).

* ``AsyncWaitOperator`` — the operator, with ``OutputMode`` (``ORDERED``, ``UNORDERED``)
  and ``RetryStrategy`` (its settings), and ``OperatorMetrics``, its counters
  (``op.metrics``);
* ``AsyncFunction``, ``ThreadPoolAsyncFunction`` — what it calls;
* ``StreamRecord``, ``Watermark`` — its elements; ``StreamElement`` is either one (what
  ``snapshot_state`` returns and ``open(restored)`` takes);
* ``Clock`` — the processing time it runs on (``clock=``): ``SystemClock`` by default,
  ``VirtualClock`` in tests (``stateful_async.testing``);
* ``StatefulAsyncError`` — the base of every error: ``ConfigurationError`` (and its
  ``FunctionNotSerializableError``), ``OperatorStateError``, ``ElementFailedError`` (with
  ``AsyncFunctionError``, ``InvalidResultError``, ``AsyncTimeoutError``,
  ``TimeoutHandlerError``), ``ResultSchemaError``, ``InputMismatchError`` and
  ``DeltaSinkError`` (with ``SinkSchemaMismatchError``); the ``checkpoint`` package's
  ``CheckpointError`` is one too.
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
