"""The PySpark adapter: Flink's async I/O operator inside Spark tasks.

Spark stays at the edge: the operator and the snapshot store know nothing of Spark; this
package turns them into ``mapInArrow`` functions and a Delta sink.
"""

from ._adapter import ordered_wait, unordered_wait
from ._config import CheckpointConfig
from ._metrics import EnrichmentMetrics
from ._session import local_session
from ._sink import clean_orphan_files, register_delta_sink

__all__ = [
    "CheckpointConfig",
    "EnrichmentMetrics",
    "clean_orphan_files",
    "local_session",
    "ordered_wait",
    "register_delta_sink",
    "unordered_wait",
]
