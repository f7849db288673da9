"""End a torch process without Python's interpreter finalization.

A process that imported torch and transformers spends about a second after its last line tearing down their
module graph, work nobody needs: the OS frees the memory anyway. A run pays it once per rank and once per engine,
the engines one after another. `quick_exit` does what a normal exit does that matters (every atexit hook, the
standard streams flushed) and then leaves at once.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def quick_exit(code: int | None) -> NoReturn:
    """sys.exit(code) minus the interpreter's finalization; a plain sys.exit while a non-daemon thread still runs
    (a normal exit waits for it, and so does this)."""
    main = threading.main_thread()
    if any(t is not main and not t.daemon and t.is_alive() for t in threading.enumerate()):
        sys.exit(code)
    atexit._run_exitfuncs()  # logging's flush, tensorboard's and wandb's close, multiprocessing's cleanup
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can reach it
            pass
    os._exit(code or 0)
