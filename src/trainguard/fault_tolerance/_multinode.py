"""The launcher across nodes: one global cycle per rendezvous round.

Each launcher joins round N (see ``_rdzv``); members start their workers with ranks from their
group rank, spares park. Any worker failure or hang on any node, a member whose lease lapses, or
a member that leaves ends round N everywhere: every node stops its workers and joins round N+1
(``TORCHELASTIC_RESTART_COUNT`` = N, the global cycle). A node that cannot renew its own lease
stops its workers and exits :data:`EXIT_STORE_LOST`.

Exit codes beyond the single-node ones: ``75`` store lost (self-fenced; requeue ok); ``95``
this node failed its health check (it left without closing the rendezvous); ``1`` too few nodes
within the join timeout, no restart left, or this node was excluded; ``2`` bad input, including
a duplicate identity or mismatched ``--nnodes``; ``--ft-no-restart-exit-code`` (93) on every
launcher once more nodes failed than ``--ft-max-node-failures`` allows (do not requeue: the
allocation keeps losing nodes).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Sequence

from trainguard._core.clock import Deadline
from trainguard._core.net import reserve_port
from trainguard._core.store import StoreCallTimeout
from trainguard.fault_tolerance import _cycle
from trainguard.fault_tolerance._agent import EXIT_FAILED, Launcher
from trainguard.fault_tolerance._args import LaunchSpec
from trainguard.fault_tolerance._healthport import LauncherState
from trainguard.fault_tolerance._rdzv import (
    EXIT_STORE_LOST,
    NodeIdentity,
    Rendezvous,
    Round,
    resolve_identity,
)
from trainguard.fault_tolerance._report import after_failure, preload_summary
from trainguard.fault_tolerance.errors import EXIT_UNHEALTHY, LaunchConfigError, LauncherError
from trainguard.fault_tolerance.health import as_probe

__all__ = ["EXIT_STORE_LOST", "MultiNodeLauncher"]

_log = logging.getLogger("trainguard.fault_tolerance")

HealthCheck = Callable[[], object]


class MultiNodeLauncher(Launcher):
    """A :class:`Launcher` whose cycles are rendezvous rounds shared by every node.

    Args:
        spec: validated launch spec (``spec.multinode`` is True).
        health_checks: callables run before each join; one that raises or returns a non-empty
            value marks the node unhealthy: it leaves without closing the rendezvous (exit 95).
            Default: the ``--ft-health-check`` checks (``health.launch_checks``) as one probe.
        identity: this node's identity (default :func:`resolve_identity`).
    """

    def __init__(self, spec: LaunchSpec, health_checks: Sequence[HealthCheck] = (),
                 identity: NodeIdentity | None = None) -> None:
        super().__init__(spec)
        with self._undo_on_error():  # closes the health port, log pump, pipes the base opened
            self.identity = identity or resolve_identity(spec, os.environ)
        self.join_probes: list[HealthCheck] = list(health_checks) or (
            [as_probe(self.health_checks, spec.health_check_timeout_s)]
            if self.health_checks else [])
        self.group_rank = self.identity.node_rank or 0
        self.world_nodes = 1
        self.master: tuple[str, int] = ("127.0.0.1", 0)
        self._held_master: socket.socket | None = None
        self.rdzv: Rendezvous | None = None
        self._lease_r, self._lease_w = os.pipe()
        os.set_blocking(self._lease_w, False)
        self.round_n = 0
        self._final = ""

    # -- hooks used by Launcher / _cycle -------------------------------------------------
    def rank_of(self, local_rank: int) -> int:
        return self.group_rank * self.spec.nproc_per_node + local_rank

    def worker_env(self, cycle: int, local_rank: int, port: int) -> dict[str, str]:
        env = super().worker_env(cycle, local_rank, port)
        nproc, world = self.spec.nproc_per_node, self.world_nodes * self.spec.nproc_per_node
        env.update({
            "WORLD_SIZE": str(world), "ROLE_WORLD_SIZE": str(world),
            "GROUP_RANK": str(self.group_rank), "GROUP_WORLD_SIZE": str(self.world_nodes),
            "MASTER_ADDR": self.master[0], "MASTER_PORT": str(self.master[1]),
            "LOCAL_WORLD_SIZE": str(nproc), "TRAINGUARD_NODE": self.identity.name,
        })
        if env.pop("TRAINGUARD_QUIET_CPP", None):
            env.pop("TORCH_CPP_LOG_LEVEL", None)
        return env

    def _reserve_ports(self) -> tuple[list[socket.socket], int, int]:
        held = [reserve_port("127.0.0.1")]
        if self._held_master is not None:
            held.append(self._held_master)
            self._held_master = None
        return held, self.master[1], int(held[0].getsockname()[1])

    def extra_fds(self) -> list[int]:
        return [self._lease_r]

    def check_external(self, res: _cycle.CycleResult, ready: list[int]) -> None:
        """End the cycle when the rendezvous moved on (another node failed), the job is over,
        or this node lost its lease."""
        if self._lease_r in ready:
            os.read(self._lease_r, 4096)
        if self.rdzv is None or self.rdzv.keeper is None:
            return
        state = self.rdzv._state(self.round_n)
        if state is None or res.outcome is not _cycle.Outcome.RUNNING:
            return
        now = time.monotonic_ns()
        if state.kind == "fenced":
            res.fail(_cycle.Failure(-1, "fence", "this node lost its lease on the rendezvous "
                                    "store (self-fence)", now))
        elif state.kind == "retry":
            res.fail(_cycle.Failure(-1, "peer", f"round {self.round_n} ended on another node",
                                    now))
        elif state.kind == "done" and not state.detail.startswith("ok"):
            res.fail(_cycle.Failure(-1, "peer", f"job ended: {state.detail}", now))

    # -- main loop -----------------------------------------------------------------------
    def _teardown(self) -> None:
        try:
            super()._teardown()
        finally:
            if self.rdzv is not None:
                self.rdzv.close(self._final)
            os.close(self._lease_r)
            os.close(self._lease_w)

    def _setup(self) -> None:
        self.rdzv = Rendezvous(self.spec, self.identity, self._lease_w)
        self.rdzv.interrupted = self._pending_stop
        try:
            self.rdzv.start()
        except LaunchConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - one line for the user, not a traceback
            first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            raise LauncherError(f"the rendezvous store failed while joining: {first}") from None
        _log.info("node %s joined rendezvous generation %d of run %r (lease %.3g s)",
                  self.identity.name, self.rdzv.gen, self.spec.run_id, self.spec.lease_s)
        super()._setup()
        preload_summary()  # a fenced node's exit must not wait for an import

    def _pending_stop(self) -> int:
        """A SIGTERM/SIGINT/SIGHUP/SIGQUIT received outside a cycle (others are dropped)."""
        stops = [s for s in self.take_signals()
                 if s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)]
        if stops:
            self._signals.insert(0, stops[0])  # keep it visible until handled
        return stops[0] if stops else 0

    def _healthy(self) -> str:
        for check in self.join_probes:
            try:
                out = check()
            except Exception as exc:  # noqa: BLE001 - any error means unhealthy
                return f"{getattr(check, '__name__', check)}: {exc}"
            if out:
                return f"{getattr(check, '__name__', check)}: {out}"
        return ""

    def _loop(self) -> int:
        """Rounds until the job ends; a store error in the main thread is retried until the
        lease keeper either renews again (a blip) or fences this node (store lost)."""
        rdzv = self.rdzv
        assert rdzv is not None and rdzv.keeper is not None
        while True:
            try:
                return self._rounds()
            except (StoreCallTimeout, RuntimeError, OSError) as exc:
                first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
                _log.warning("rendezvous store call failed (%s); retrying while the lease "
                             "holds", first)
                deadline, seen_ok = Deadline(self.spec.lease_s + 1.0), rdzv.keeper.last_ok
                while not rdzv.keeper.fenced and not deadline.expired():
                    if rdzv.keeper.last_ok > seen_ok:  # renewed since: a blip, go on
                        break
                    time.sleep(0.05)
                if rdzv.keeper.fenced:
                    return self._fenced()

    def _rounds(self) -> int:
        rdzv = self.rdzv
        assert rdzv is not None
        while True:
            sick = self._healthy()
            if sick:
                _log.error("node %s failed its health check (%s): leaving the rendezvous",
                           self.identity.name, sick)
                self._final = "left"
                over = rdzv.node_failed(f"node {self.identity.name} unhealthy")
                return self.spec.ft.no_restart_exit_code if over else EXIT_UNHEALTHY
            n, done = rdzv.current_round()
            if done:
                return self._done(done)
            self.liveness.enter(LauncherState.RENDEZVOUS, n,
                                wait_s=rdzv.st.join_timeout_s + self.spec.lease_s + 5.0)
            rnd = rdzv.join(n)
            code = self._settle(rnd)
            if code is not None:
                return code
            if rnd.kind != "member":
                continue
            code = self._member(rnd)
            if code is not None:
                return code

    def _settle(self, rnd: Round) -> int | None:
        """Handle a non-member outcome; None = go round again (or run, for a member)."""
        rdzv = self.rdzv
        assert rdzv is not None
        if rnd.kind == "signalled":
            _log.warning("received signal %s while not training: leaving the rendezvous",
                         rnd.detail)
            self._final = "left"
            return 128 + int(rnd.detail)
        if rnd.kind == "fenced":
            return self._fenced()
        if rnd.kind == "done":
            return self._done(rnd.detail)
        if rnd.kind == "too_few":
            _log.error("%s: ending the job (requeue ok, exit %d)", rnd.detail, EXIT_FAILED)
            rdzv.finish(f"fail:{EXIT_FAILED}:{rnd.detail}")
            self._final = "exit"
            return EXIT_FAILED
        if rnd.kind == "spare":
            _log.info("round %d is %s: node %s parks as a hot spare", rnd.n, rnd.detail,
                      self.identity.name)
            self.event("spare", round=rnd.n)
            self.liveness.enter(LauncherState.RENDEZVOUS, rnd.n, wait_s=3600.0 + 5.0)  # parked
            while True:
                state = rdzv.wait_change(rnd.n, 3600.0)
                if state is not None:
                    return self._settle(state) if state.kind != "retry" else None
        return None

    def _member(self, rnd: Round) -> int | None:
        rdzv, spec = self.rdzv, self.spec
        assert rdzv is not None and rdzv.keeper is not None
        self.round_n, self.group_rank, self.world_nodes = rnd.n, rnd.group_rank, len(rnd.members)
        rdzv.keeper.watch_round(rnd.n, {tok: name for name, tok, _ in rnd.members})
        if rnd.group_rank == 0:
            bind = self.identity.addr if spec.local_addr else "0.0.0.0"
            self._held_master = reserve_port(bind, spec.master_port or 0)
            port = int(self._held_master.getsockname()[1])
            rdzv.publish_master(rnd.n, self.identity.addr, port)
            self.master = (self.identity.addr, port)
        else:
            got = rdzv.master(rnd.n)
            if isinstance(got, Round):
                return self._settle(got)
            self.master = got
        names = ", ".join(name for name, _, _ in rnd.members)
        _log.info("round %d: node %s is group rank %d of %d (%s); rank-0 host %s:%d",
                  rnd.n, self.identity.name, rnd.group_rank, len(rnd.members), names,
                  self.master[0], self.master[1])
        self.event("round", round=rnd.n, group_rank=rnd.group_rank, nodes=len(rnd.members),
                   master=f"{self.master[0]}:{self.master[1]}")
        res = self._run_cycle(rnd.n)
        self.results.append(res)
        return self._after(res, rnd)  # members stay watched: one may die before the job is done

    def _after(self, res: _cycle.CycleResult, rnd: Round) -> int | None:
        rdzv = self.rdzv
        assert rdzv is not None
        if res.outcome is _cycle.Outcome.SUCCEEDED:
            rdzv.succeeded(rnd.n, len(rnd.members))
            while True:  # wait for every member (or a failure elsewhere: next round)
                state = rdzv.wait_change(rnd.n, 3600.0)
                if state is not None:
                    return self._settle(state) if state.kind != "retry" else None
        if res.outcome is _cycle.Outcome.SIGNALLED:
            rdzv.end_round(rnd.n, f"node {self.identity.name}'s launcher got signal "
                                  f"{res.signum}")
            self._final = "left"
            ok = res.exits and all(c == 0 for c in res.exits.values())
            return 0 if ok else 128 + res.signum
        root = res.root_cause
        if root is not None and root.kind == "fence":
            return self._fenced()
        if root is not None and root.kind == "peer":
            state = rdzv._state(rnd.n)
            return self._settle(state) if state is not None and state.kind != "retry" else None
        if "exclude_this_node" in self.stop_requested:
            over = rdzv.node_failed(f"node {self.identity.name} excluded")
            left = self.spec.ft.no_restart_exit_code if over else EXIT_FAILED
            _log.error("%s: node %s leaves the job; %s (exit %d)", self.stop_requested,
                       self.identity.name, "too many node failures: the job ends" if over
                       else "a spare takes its place", left)
            rdzv.end_round(rnd.n, f"node {self.identity.name} excluded")
            self._final = "left"
            return left
        code = after_failure(self, res)
        detail = f"{root.detail} (rank {root.rank}, node {self.identity.name})" if root else ""
        if code is not None:
            rdzv.finish(f"fail:{code}:{detail}")
            self._final = "exit"
            return code
        rdzv.end_round(rnd.n, detail or "worker failure")
        return None

    def _done(self, value: str) -> int:
        self._final = "exit"
        if value == "ok":
            _log.info("job done: every node's workers exited 0")
            return 0
        _, code, reason = value.split(":", 2)
        _log.error("job ended: %s (exit %s)", reason, code)
        return int(code)

    def _fenced(self) -> int:
        self.event("fenced", lease_s=self.spec.lease_s)  # every worker is stopped by now
        _log.error("node %s lost its lease on the rendezvous store for %.3g s: workers stopped, "
                   "exiting %d (store lost)", self.identity.name, self.spec.lease_s,
                   EXIT_STORE_LOST)
        return EXIT_STORE_LOST
