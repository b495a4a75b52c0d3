"""The PySpark adapter: Flink's async I/O operator inside Spark tasks.

Spark stays at the edge: the operator and the snapshot store know nothing of Spark; this
package turns them into ``mapInArrow`` functions and a Delta sink.
"""

from ._session import local_session

__all__ = ["local_session"]
