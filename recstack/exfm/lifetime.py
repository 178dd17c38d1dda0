"""Helper processes that end with the process that started them.

The experiment runner starts the DAS and a pool of task workers. When it ends normally it stops them; when it is
killed (SIGKILL, an out-of-memory kill) nothing of it runs any more, so each helper watches its parent instead:
a daemon thread checks every ``poll_s`` whether the parent is still the process it was started by (a dead
parent's children are handed to init or a subreaper, so ``os.getppid()`` changes) and ends the helper at once.
Polling, not Linux's ``PR_SET_PDEATHSIG``: that signal fires when the parent *thread* that started the child
ends, which for a pool worker need not be the main thread.
"""

from __future__ import annotations

import os
import threading
import time


def exit_with_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """End this process (exit status 1, without cleanup: the parent that would use its results is gone) as soon
    as ``parent_pid`` is no longer its parent, checked every ``poll_s`` seconds in a daemon thread."""
    if os.getppid() != parent_pid:  # died before we got here
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
