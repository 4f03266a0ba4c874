"""Child processes that end with their parent.

A sweep's workers and the search's forked lanes are children of the ``planner`` process. If
that process is killed outright (``kill -9``, the out-of-memory killer), nothing of Python's
runs to stop them, and they would go on computing for a parent that is gone. On Linux each
child asks the kernel for a signal when its parent dies (``prctl(PR_SET_PDEATHSIG)``), set in
the child itself since a fork clears it. The signal follows the thread that started the child,
so only children the main thread starts ask for it. Ctrl-C reaches every process of the
terminal's group: children ignore it and the parent, which keeps what finished, stops them.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """End this process (SIGTERM) when its parent dies, where the kernel offers it (Linux);
    ignore Ctrl-C, which the parent handles. A no-op for the signal elsewhere."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not sys.platform.startswith("linux"):
        return
    # The parent that started this child (it may have died, and this child been handed to
    # another, before the request below: then end now)
    started_by = multiprocessing.parent_process()
    parent = started_by.pid if started_by is not None and started_by.pid else os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        done = libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0
    except (OSError, AttributeError):  # no C library to ask: nothing to set
        return
    if done and os.getppid() != parent:  # the parent died before the request took hold
        os._exit(1)
