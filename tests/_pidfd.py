"""Signals to processes a test found by PID, sent through pidfds (``os.pidfd_open``, Linux 5.3+).

A PID held while its process ends is recycled by the kernel (pid_max is 32,768 on CI's machine and the suite
starts thousands of processes), and ``os.kill`` on it then stops or continues whichever process holds the
number now: a throttler that SIGSTOPs a rank's PID 99% of every second for minutes once stopped another
test's training process that way. A pidfd names one process; once it has ended, signals to it fail with
ProcessLookupError and reach no one else.
"""

from __future__ import annotations

import os
import signal


class Held:
    """One process, held by a pidfd from the moment it was found."""

    def __init__(self, pid: int):
        self.pid = pid
        self.fd = os.pidfd_open(pid)

    def send(self, sig: int) -> bool:
        """Send ``sig``; False if the process has ended (nothing is sent)."""
        try:
            signal.pidfd_send_signal(self.fd, sig)
        except ProcessLookupError:
            return False
        return True

    def alive(self) -> bool:
        return self.send(0)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def hold(pids) -> list[Held]:
    """A pidfd for each PID still running (one that ended in the meantime is left out)."""
    out = []
    for pid in pids:
        try:
            out.append(Held(pid))
        except ProcessLookupError:
            continue
    return out
