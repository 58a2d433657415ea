"""Run the quantkit CLI in this process and, at exit, write this process image's peak RSS to a file.

  python -m quantkit.bench.peak_rss OUT.txt quantize MODEL --out DIR ...

Why not the parent's os.wait4 / ru_maxrss: Linux carries ru_maxrss across fork and exec, so a child
started by a parent that holds N GiB reports at least N GiB, whatever it used itself. VmHWM in
/proc/self/status is the high-water mark of the current address space, which exec starts afresh.

Also what the engine benchmarks read of their peers' processes: resident set now (VmRSS) and CPU time used.
"""

from __future__ import annotations

import atexit
import os
import re
import sys
from pathlib import Path


def _status_kib(field: str, pid: int | str) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", status).group(1)) * 1024


def peak_rss_bytes() -> int:
    """High-water resident set of this process image (VmHWM), in bytes; Linux only."""
    return _status_kib("VmHWM", "self")


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set of process `pid` now (VmRSS), in bytes; Linux only."""
    return _status_kib("VmRSS", pid)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time process `pid` has used, all its threads (/proc/PID/stat); Linux only."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    out, args = Path(sys.argv[1]), sys.argv[2:]
    atexit.register(lambda: out.write_text(str(peak_rss_bytes())))
    sys.argv = ["quantkit", *args]
    from quantkit.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
