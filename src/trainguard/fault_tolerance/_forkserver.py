"""Per-node fork server: imports torch (and ``--ft-preload`` modules) once, forks workers.

A restarted worker forked from here skips the interpreter start and ``import torch`` (13-17 ms
to a torch-ready child vs 1.4-1.65 s cold on the reference machine). Safety rules:

* CUDA is never touched here: after the preload the server checks
  ``torch.cuda.is_initialized()`` and refuses to serve (the launcher falls back to cold spawns
  and logs the reason) if a preloaded module initialised it;
* the worker's environment, working directory, ports and stdio are set in the child after the
  fork, from the request; nothing of a previous cycle is inherited;
* the server and each child set ``PR_SET_PDEATHSIG`` so they die with their parent.

Protocol (``_core.ipc`` messages, kind 1, on a socketpair with the launcher):
``{"op": "ready", "preload": [...]}`` or ``{"op": "error", "reason": ...}`` once; then per
request ``{"op": "spawn", "id", "mode", "target", "args", "env", "cwd"}`` followed by two file
descriptors (stdout, stderr) via ``SCM_RIGHTS``, answered ``{"op": "spawned", "id", "pid"}``; the
server reports ``{"op": "exited", "pid", "status"}`` (negative = signal) for every child it reaps.
"""

from __future__ import annotations

import importlib
import os
import select
import signal
import socket
import sys
import time
from typing import Any

from trainguard._core.ipc import FrameReader, decode_msg, send_msg
from trainguard.fault_tolerance import _bootstrap

MSG = 1


#: imported besides torch, best effort: DDP's first construction lazily imports torch._dynamo
#: (and sympy, ~800 modules, 1.5-4 s per fresh process); a forked worker inherits them
DEFAULT_PRELOAD = ("torch.distributed", "torch.nn.parallel", "torch._dynamo")


def _preload(modules: list[str]) -> str | None:
    """Import torch, :data:`DEFAULT_PRELOAD` and ``modules``; the reason not to serve, or None."""
    try:
        import torch

        for name in DEFAULT_PRELOAD:
            try:
                importlib.import_module(name)
            except ImportError:
                pass  # older torch: the worker imports it itself
        for name in modules:
            importlib.import_module(name)
        if torch.cuda.is_initialized():
            return "CUDA was initialised while preloading (a preloaded module touched the GPU)"
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher, which spawns cold
        return f"preload failed: {type(exc).__name__}: {exc}"
    return None


def _child(sock: socket.socket, req: dict[str, Any], fds: list[int]) -> None:
    """In the forked worker: never returns."""
    code = 1
    try:
        sock.close()
        os.setpgid(0, 0)
        _bootstrap.set_pdeathsig(int(req["parent"]))
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (null, *fds):
            os.close(fd)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        code = _bootstrap.run_worker(req["mode"], req["target"], list(req["args"]))
    except BaseException:  # noqa: BLE001 - a child must never return into the server loop
        code = 1
    _bootstrap.finish(code)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        send_msg(sock.fileno(), MSG, {"op": "exited", "pid": pid, "status": code})


def serve(fd: int, preload: list[str], parent: int) -> None:
    _bootstrap.set_pdeathsig(parent)
    _bootstrap.prepare_title()  # while the environment is still this process's own
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to forward
    sock = socket.socket(fileno=fd)
    t0 = time.monotonic()
    reason = _preload(preload)
    if reason:
        send_msg(fd, MSG, {"op": "error", "reason": reason})
        return
    send_msg(fd, MSG, {"op": "ready", "preload": preload, "load_s": time.monotonic() - t0})
    reader = FrameReader(fd, 4096)
    while True:
        ready, _, _ = select.select([fd], [], [], 0.02)
        _reap(sock)
        if not ready:
            continue
        try:
            req, _ = decode_msg(reader.recv()[1])
        except (EOFError, OSError, ValueError):
            return  # launcher gone
        if req.get("op") == "stop":
            return
        _, fds, _, _ = socket.recv_fds(sock, 1, 2)
        pid = os.fork()
        if pid == 0:
            _child(sock, req, fds)
        for f in fds:
            os.close(f)
        send_msg(fd, MSG, {"op": "spawned", "id": req["id"], "pid": pid})


def main() -> None:
    fd, parent, preload = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    try:
        serve(fd, [p for p in preload if p], parent)
    except (BrokenPipeError, ConnectionError):
        pass
    # Nothing is left to clean up (every worker was stopped and reaped by the launcher); an
    # interpreter shutdown with torch loaded takes about a second, which the launcher's own
    # exit (a fenced node's included) would otherwise wait for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
