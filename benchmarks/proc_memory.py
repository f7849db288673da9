"""A process's memory as the kernel counts it (/proc/<pid>/status), for the benchmarks that measure it.

VmRSS is what is resident now; VmHWM the peak resident size since the process started, or since
`reset_peak` (Linux >= 4.0), which lets a process measure the peak of one phase above its own idle size.
"""

from __future__ import annotations

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
