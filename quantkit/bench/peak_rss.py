"""Run the quantkit CLI in this process and, at exit, write this process image's peak RSS to a file.

  python -m quantkit.bench.peak_rss OUT.txt quantize MODEL --out DIR ...

Why not the parent's os.wait4 / ru_maxrss: Linux carries ru_maxrss across fork and exec, so a child
started by a parent that holds N GiB reports at least N GiB, whatever it used itself. VmHWM in
/proc/self/status is the high-water mark of the current address space, which exec starts afresh.
"""

from __future__ import annotations

import atexit
import re
import sys
from pathlib import Path


def peak_rss_bytes() -> int:
    """High-water resident set of this process image (VmHWM), in bytes; Linux only."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024


def main() -> None:
    out, args = Path(sys.argv[1]), sys.argv[2:]
    atexit.register(lambda: out.write_text(str(peak_rss_bytes())))
    sys.argv = ["quantkit", *args]
    from quantkit.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
