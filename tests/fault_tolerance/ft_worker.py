"""Worker for the launcher fault matrix: ``ft_worker.py FAULT [RANK] [options]``.

The fault fires on rank RANK (default 1) in cycle 0 only (``TORCHELASTIC_RESTART_COUNT``), so a
restarted job succeeds. Options: ``--every-cycle`` (fault in every cycle), ``--client`` (use the
RankMonitorClient: heartbeats every 0.05 s), ``--steps N``.
"""

import ctypes
import os
import re
import signal
import subprocess
import sys
import time

args = sys.argv[1:]
fault = args[0]
victim = int(args[1]) if len(args) > 1 and args[1].isdigit() else 1
rank = int(os.environ["RANK"])
cycle = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
fire = rank == victim and (cycle == 0 or "--every-cycle" in args)
steps = int(args[args.index("--steps") + 1]) if "--steps" in args else 10
print(f"start rank={rank} cycle={cycle} pid={os.getpid()}", flush=True)

client = None
if "--client" in args:
    from trainguard.fault_tolerance import RankMonitorClient

    client = RankMonitorClient()
    client.init_workload_monitoring()


def step(i: int) -> None:
    if client is not None:
        client.send_heartbeat()
        client.progress(1)
    time.sleep(0.05)


for i in range(steps):
    step(i)
    if not fire or i != 3:
        continue
    print(f"inject {fault}", flush=True)
    if fault == "exception":
        raise RuntimeError("injected failure on purpose")
    if fault == "exit":
        sys.exit(7)
    if fault == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "segv":
        ctypes.string_at(0)
    if fault == "hang_c":
        time.sleep(3600)  # in C, GIL released: no bytecode runs
    if fault == "hang_gil":
        re.match(r"(a+)+$", "a" * 64 + "b")  # C code holding the GIL
    if fault == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if fault == "setsid":
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"],
                         start_new_session=True)
        time.sleep(3600)
    if fault == "ignore_term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ignoring SIGTERM", flush=True)
        time.sleep(3600)
    if fault == "python_loop":
        while True:  # Python keeps running: only client heartbeats can tell
            pass
print(f"done rank={rank}", flush=True)
