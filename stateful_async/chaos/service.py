"""Command line of the mock enrichment service (see ``stateful_async.chaos._service``)::

    python -m stateful_async.chaos.service --port 8099 [--host 127.0.0.1] \\
        [--config '{"latency_ms": 5, "error_rate": 0.01}']

Prints ``listening on <host>:<port>`` once it accepts requests; stops on SIGTERM/SIGINT.
"""

from __future__ import annotations

import sys

from ._service import main

if __name__ == "__main__":
    main(sys.argv[1:])
