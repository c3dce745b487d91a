import signal
import sys

from bench.cli import main


def _terminate(signum, frame):  # SIGTERM stops a run like Ctrl-C: its worker processes are killed too
    raise KeyboardInterrupt(f"signal {signum}")


signal.signal(signal.SIGTERM, _terminate)
try:
    sys.exit(main())
except KeyboardInterrupt:
    print("interrupted: finished records are kept; the same command resumes the run", file=sys.stderr)  # noqa: T201
    sys.exit(130)
