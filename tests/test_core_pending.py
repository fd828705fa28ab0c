"""_core.pending: one Py_AddPendingCall binding that every user can share."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_launcher_heartbeat_and_inprocess_watchdogs_share_the_pending_call_binding():
    # Regression: each user set argtypes on ctypes.pythonapi.Py_AddPendingCall (one object per
    # process); importing trainguard.inprocess under the launcher killed the launcher's automatic
    # heartbeat thread with ctypes.ArgumentError, and the rank was later killed as hung.
    code = textwrap.dedent("""
        import threading, time
        from trainguard.fault_tolerance import _bootstrap
        errors = []
        threading.excepthook = lambda args: errors.append(repr(args.exc_value))
        words = memoryview(bytearray(16)).cast("Q")
        hb = _bootstrap._AutoHeartbeat(words, 0, 0.01)  # as a worker under the launcher
        import trainguard.inprocess.progress_watchdog  # noqa: F401  the worker imports these
        import trainguard.inprocess._watchdog  # noqa: F401
        def stamps_advance():
            first, end = words[0], time.monotonic() + 5
            while words[0] == first and time.monotonic() < end:
                sum(range(1000))  # Python bytecode: pending calls run here
            return words[0] != first
        for _ in range(5):
            assert stamps_advance(), ("heartbeat stopped", errors)
        assert not errors, errors
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
