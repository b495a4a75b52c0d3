"""Command line of the reference chaos job (see ``stateful_async.chaos._job``)::

    python -m stateful_async.chaos.job --master spark://127.0.0.1:7077 \\
        --service-url http://127.0.0.1:8099 --checkpoint /tmp/chk --output /tmp/enriched \\
        --rows 10000 --partitions 2 --mode ordered [--fault crash-at=1234] \\
        [--restore-from latest|N] [--report run.json]

Prints ``app_id <id>`` once the Spark session is up and a summary line at the end; exits
0 when the output is committed, 1 (with the error on stderr) when the job fails.
"""

from __future__ import annotations

import sys

from ._job import main

if __name__ == "__main__":
    sys.exit(main())
