"""A process's memory as the kernel counts it (/proc/<pid>/status), for the benchmarks that measure it.

VmRSS is what is resident now, the sum of RssAnon (the process's own data), RssFile (mapped files: library code
the kernel may drop under memory pressure and fault in again) and RssShmem; VmHWM is the peak of VmRSS since the
process started, or since `reset_peak` (Linux >= 4.0), which lets a process measure the peak of one phase above
its own idle size. The kernel keeps no peak of RssAnon: `PeakSampler` samples it.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path


def vm_kib(pid: int | str, field: str) -> int:
    """One VmXXX field of /proc/<pid>/status in KiB (0 if the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def reset_peak() -> None:
    """Restart this process's VmHWM from its current RSS (writing 5 to clear_refs), so that a later VmHWM is the
    peak of what ran in between; without it the peak of the imports and warm-up would hide a smaller phase."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError as err:
        raise RuntimeError(f"cannot reset the peak RSS (/proc/self/clear_refs: {err}); needs Linux >= 4.0") from None


class PeakSampler:
    """The largest value of one of this process's /proc fields (e.g. RssAnon, which VmHWM has no peak of), read
    every `interval_s` by a thread from now until `stop`; a spike shorter than the interval can be missed, the
    value at `stop` cannot."""

    def __init__(self, field: str, interval_s: float = 0.005):
        self.field, self.interval_s, self.peak_kib = field, interval_s, vm_kib("self", field)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_kib = max(self.peak_kib, vm_kib("self", self.field))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak_kib = max(self.peak_kib, vm_kib("self", self.field))
        return self.peak_kib


def trim_heap() -> bool:
    """Ask glibc to return its free heap memory to the kernel (malloc_trim); False where there is no glibc."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False
