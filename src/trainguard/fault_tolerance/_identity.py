"""Who this launcher is, from the engine that started it: node rank, run id, rendezvous host.

One launcher runs per node. Its identity comes from the first source that has one:

==========================  ==========================================================
``--node-rank`` (CLI)       explicitly given on the command line
``PET_NODE_RANK``           torchrun's env form; Kubeflow Trainer v2 sets it from the
                            Job completion index
``SLURM_PROCID``            the task rank of ``srun --ntasks-per-node=1``
``JOB_COMPLETION_INDEX``    Kubernetes indexed Jobs and JobSets
sorted address              ``None`` here: the rendezvous orders nodes by address
==========================  ==========================================================

Also resolved here (pure functions of the environment, no process is started, no ``scontrol``):
the run id (``--rdzv-id`` > ``PET_RDZV_ID`` > ``SLURM_ARRAY_JOB_ID`` > ``SLURM_JOB_ID`` >
``TORCHELASTIC_RUN_ID``), the rendezvous host on Slurm when none is given (the first host of
``SLURM_JOB_NODELIST``, expanded by :func:`expand_hostlist`), and two refusals: a loopback
endpoint on a multi-node job (every node would form its own world and wait forever), and several
launchers on one node.

Collaborators: ``_args`` calls :func:`resolve_identity` while parsing; the multi-node rendezvous
reads :attr:`NodeIdentity.node_rank` (``None`` = order by address).

Follows: torchrun (``PET_*`` env, ``TORCHELASTIC_RUN_ID``), NVRx ``ft_launcher`` (one launcher per
node, "infra rank" from ``SLURM_PROCID``), Slurm's hostlist syntax (``scontrol show hostnames``);
differences: ``JOB_COMPLETION_INDEX`` is honoured, the host list is expanded in-process.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import re
import socket
from collections.abc import Mapping

from trainguard.fault_tolerance.errors import LaunchConfigError

__all__ = [
    "ENV_SIMULATED_NODES",
    "NodeIdentity",
    "check_one_launcher_per_node",
    "expand_hostlist",
    "is_loopback",
    "resolve_identity",
    "slurm_nnodes",
]

_log = logging.getLogger("trainguard.fault_tolerance")

#: Set to 1 to run several launchers of one multi-node job on one machine (tests, the netns
#: harness, a laptop): lifts the one-launcher-per-node and loopback-endpoint refusals.
ENV_SIMULATED_NODES = "TRAINGUARD_SIMULATED_NODES"
_MAX_HOSTS = 1_000_000  # a hostlist expanding past this is a typo, not a cluster
_spares_note_logged = False


@dataclasses.dataclass(frozen=True)
class NodeIdentity:
    """This node's identity and where each part came from.

    Attributes:
        node_rank: group rank of this node, or ``None`` when the rendezvous decides by address.
        source: ``--node-rank`` | ``PET_NODE_RANK`` | ``SLURM_PROCID`` |
            ``JOB_COMPLETION_INDEX`` | ``address``.
        run_id: the job id shared by every node (``TORCHELASTIC_RUN_ID`` of the workers).
        run_id_source: ``--rdzv-id`` | ``PET_RDZV_ID`` | ``SLURM_ARRAY_JOB_ID`` |
            ``SLURM_JOB_ID`` | ``TORCHELASTIC_RUN_ID`` | ``pid``.
        scheduler: ``slurm`` | ``kubernetes`` | ``none`` (from the environment).
        hosts: the expanded ``SLURM_JOB_NODELIST`` (empty elsewhere).
        rdzv_host: the rendezvous / master host to use when none was given, or ``None``.
        rdzv_host_source: where ``rdzv_host`` came from (``SLURM_JOB_NODELIST`` or ``''``).
        env_nnodes: node count announced by the engine (``SLURM_NNODES``, ``PET_NNODES``
            maximum), 0 when unknown.
    """

    node_rank: int | None
    source: str
    run_id: str
    run_id_source: str
    scheduler: str = "none"
    hosts: tuple[str, ...] = ()
    rdzv_host: str | None = None
    rdzv_host_source: str = ""
    env_nnodes: int = 0


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets."""
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise LaunchConfigError(f"SLURM_JOB_NODELIST {text!r}: unbalanced ']'")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise LaunchConfigError(f"SLURM_JOB_NODELIST {text!r}: unbalanced '['")
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _range_values(body: str, whole: str) -> list[str]:
    """``001-003,7`` -> ['001', '002', '003', '7'] (width of the lower bound kept)."""
    out: list[str] = []
    for item in body.split(","):
        item = item.strip()
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise LaunchConfigError(f"SLURM_JOB_NODELIST {whole!r}: {item!r} is not N or N-M")
        if not sep:
            out.append(lo)
            continue
        start, stop = int(lo), int(hi)
        if stop < start or stop - start >= _MAX_HOSTS:
            raise LaunchConfigError(f"SLURM_JOB_NODELIST {whole!r}: bad range {item!r}")
        width = len(lo) if lo.startswith("0") else 0
        out.extend(str(n).zfill(width) for n in range(start, stop + 1))
    return out


def _expand_one(name: str, whole: str) -> list[str]:
    """Expand every bracket group of one host pattern (cartesian product, left to right)."""
    open_at = name.find("[")
    if open_at < 0:
        return [name]
    close_at = name.find("]", open_at)
    inner = name[open_at + 1 : close_at]
    if "[" in inner:
        raise LaunchConfigError(f"SLURM_JOB_NODELIST {whole!r}: nested '[' in {name!r}")
    prefix, rest = name[:open_at], _expand_one(name[close_at + 1 :], whole)
    out = [prefix + v + r for v in _range_values(inner, whole) for r in rest]
    if len(out) > _MAX_HOSTS:
        raise LaunchConfigError(f"SLURM_JOB_NODELIST {whole!r} expands past {_MAX_HOSTS} hosts")
    return out


def expand_hostlist(text: str) -> list[str]:
    """Expand a Slurm host list, as ``scontrol show hostnames`` does, without calling it.

    ``gpu[001-003,007],login1`` -> ``gpu001 gpu002 gpu003 gpu007 login1``; several bracket groups
    in one name multiply (``r[1-2]n[1-2]`` -> ``r1n1 r1n2 r2n1 r2n2``); a lower bound with a
    leading zero sets the width. Order is kept, duplicates are dropped. Pure, never blocks.

    Raises:
        LaunchConfigError: unbalanced or nested brackets, a range that is not ``N`` or ``N-M``
            with ``N <= M``, or more than a million hosts.
    """
    seen: dict[str, None] = {}
    for part in _split_top(text.strip()):
        for host in _expand_one(part, text):
            seen.setdefault(host, None)
    return list(seen)


def is_loopback(host: str) -> bool:
    """True for ``localhost``, 127.0.0.0/8, ``::1`` or a name that resolves only to those.

    Blocks for at most one name lookup (the system resolver's own timeout); an unresolvable name
    is not loopback (the rendezvous reports it).
    """
    text = host.strip().strip("[]")
    if text.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(text).is_loopback
    except ValueError:
        pass
    try:
        addrs = {str(i[4][0]) for i in socket.getaddrinfo(text, None)}
    except OSError:
        return False
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def _int_env(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise LaunchConfigError(f"{name}={raw!r} is not an integer; unset it or fix the job "
                                "spec") from None
    if value < 0:
        raise LaunchConfigError(f"{name}={value} must be >= 0")
    return value


def _node_rank(cli_node_rank: int | None, env: Mapping[str, str]) -> tuple[int | None, str]:
    if cli_node_rank is not None:
        return cli_node_rank, "--node-rank"
    for name in ("PET_NODE_RANK", "SLURM_PROCID", "JOB_COMPLETION_INDEX"):
        value = _int_env(env, name)
        if value is not None:
            return value, name
    return None, "address"


def _run_id(cli_run_id: str | None, env: Mapping[str, str], pid: int) -> tuple[str, str]:
    if cli_run_id and cli_run_id != "none":
        return cli_run_id, "--rdzv-id"
    for name in ("PET_RDZV_ID", "SLURM_ARRAY_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        value = env.get(name, "").strip()
        if value and value != "none":
            return value, name
    return f"tg{pid}", "pid"


def _env_nnodes(env: Mapping[str, str]) -> int:
    """Largest node count the engine announced (``SLURM_NNODES``, ``PET_NNODES`` MIN:MAX)."""
    counts = [0]
    slurm = env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES", "")).strip()
    if slurm.isdigit():
        counts.append(int(slurm))
    pet = env.get("PET_NNODES", "").strip()
    if pet:
        top = pet.split(":")[-1].strip()
        if top.isdigit():
            counts.append(int(top))
    return max(counts)


def _scheduler(env: Mapping[str, str]) -> str:
    if env.get("SLURM_JOB_ID"):
        return "slurm"
    if env.get("KUBERNETES_SERVICE_HOST") or "JOB_COMPLETION_INDEX" in env \
            or "PET_NNODES" in env:
        return "kubernetes"
    return "none"


def resolve_identity(cli_node_rank: int | None, cli_run_id: str | None,
                     env: Mapping[str, str], endpoint_host: str | None, pid: int,
                     nnodes_max: int = 1) -> NodeIdentity:
    """Resolve node rank, run id and the default rendezvous host; apply the refusals.

    Args:
        cli_node_rank: ``--node-rank`` when given on the command line, else ``None``.
        cli_run_id: ``--rdzv-id`` when given on the command line, else ``None``.
        env: the launcher's environment (``os.environ``; a dict in tests).
        endpoint_host: host of ``--rdzv-endpoint``/``--master-addr`` when one was given (CLI or
            ``PET_*``), else ``None``.
        pid: this launcher's pid (the last-resort run id ``tg<pid>``).
        nnodes_max: the ``--nnodes`` maximum (CLI or ``PET_NNODES``).

    Blocks at most one resolver lookup (the loopback check). Logs once per process, on Slurm
    multi-node jobs, that spares and node exclusion need ``srun --kill-on-bad-exit=0``.

    Raises:
        LaunchConfigError: a non-integer rank variable, a node rank other than 0 on one node, a bad
            ``SLURM_JOB_NODELIST``, a loopback endpoint on a job the engine says spans several
            nodes, or several launchers on one Slurm node (see
            :func:`check_one_launcher_per_node`); each message says how to fix it.
    """
    rank, source = _node_rank(cli_node_rank, env)
    if rank is not None and nnodes_max <= 1 and rank != 0:
        # one node: rank must be 0; several: ranks >= MAX are hot spares (they park)
        raise LaunchConfigError(
            f"node rank {rank} (from {source}) on a one-node job (--nnodes 1): run one launcher "
            "per node with --nnodes set to the node count, or unset the rank variable")
    run_id, run_source = _run_id(cli_run_id, env, pid)
    nodelist = env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "")).strip()
    hosts = tuple(expand_hostlist(nodelist)) if nodelist else ()
    env_nnodes = _env_nnodes(env)
    simulated = env.get(ENV_SIMULATED_NODES, "") in ("1", "true", "yes")
    rdzv_host, host_source = None, ""
    if endpoint_host is None and hosts and max(env_nnodes, nnodes_max) > 1:
        rdzv_host, host_source = hosts[0], "SLURM_JOB_NODELIST"
    effective = endpoint_host or rdzv_host or "127.0.0.1"
    if env_nnodes > 1 and not simulated and is_loopback(effective):
        given = "" if endpoint_host else " (none given: the default)"
        raise LaunchConfigError(
            f"rendezvous host {effective!r}{given} is a loopback address but the job spans "
            f"{env_nnodes} nodes (SLURM_NNODES/PET_NNODES): each node would rendezvous with "
            "itself and wait forever; give --rdzv-endpoint <first node>:<port> (on Slurm omit it "
            f"to use the first host of SLURM_JOB_NODELIST), or set {ENV_SIMULATED_NODES}=1 to "
            "run several nodes on one machine")
    scheduler = _scheduler(env)
    if scheduler == "slurm":
        check_one_launcher_per_node(env)
        if max(env_nnodes, nnodes_max) > 1:
            _spares_note()
    return NodeIdentity(rank, source, run_id, run_source, scheduler, hosts, rdzv_host,
                        host_source, env_nnodes)


def slurm_nnodes(env: Mapping[str, str]) -> int:
    """The node count to use when neither ``--nnodes`` nor ``PET_NNODES`` was given: Slurm's
    ``SLURM_NNODES`` (or ``SLURM_JOB_NUM_NODES``) when it is > 1 and this node runs one task of
    the step (``srun --ntasks-per-node=1``, one launcher per node); 0 otherwise (keep torchrun's
    default of one node). Pure, never blocks.

    Follows: torchrun defaults ``--nnodes`` to 1 whatever the scheduler says; under Slurm with
    one launcher per node the allocation's node count is what a user means.
    """
    if not env.get("SLURM_JOB_ID"):
        return 0
    raw = env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES", "")).strip()
    if not raw.isdigit() or int(raw) <= 1 or _tasks_on_this_node(env) != 1:
        return 0
    return int(raw)


def _tasks_on_this_node(env: Mapping[str, str]) -> int:
    """Tasks of this ``srun`` step on this node (``SLURM_STEP_TASKS_PER_NODE`` / ``SLURM_NTASKS_
    PER_NODE``, e.g. ``2`` or ``2(x3),1``: the node's own entry by ``SLURM_NODEID``); 1 outside a
    step (the batch script itself runs once, whatever ``--ntasks-per-node`` it asked for)."""
    if "SLURM_STEP_ID" not in env and "SLURM_STEPID" not in env:
        return 1
    raw = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE") or ""
    counts: list[int] = []
    for part in raw.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m:
            counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    node = env.get("SLURM_NODEID", "").strip()
    if counts and node.isdigit() and int(node) < len(counts):
        return counts[int(node)]
    return max(counts, default=1)


def check_one_launcher_per_node(env: Mapping[str, str]) -> None:
    """Refuse several launchers of one Slurm step on one node.

    Two launchers on one node would each start ``--nproc-per-node`` workers on the same devices
    and claim two node ranks. Detected inside an ``srun`` step from its tasks per node (> 1) or
    a task with ``SLURM_LOCALID`` > 0; the batch script itself (no ``SLURM_STEP_ID``) runs once
    and passes. Lifted by ``TRAINGUARD_SIMULATED_NODES=1``. Pure, never blocks.

    Follows: NVRx ``ft_launcher`` (refuses unless ``NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE=1``).

    Raises:
        LaunchConfigError: more than one task of this step runs on this node.
    """
    if env.get(ENV_SIMULATED_NODES, "") in ("1", "true", "yes"):
        return
    tasks = _tasks_on_this_node(env)
    local = _int_env(env, "SLURM_LOCALID") or 0
    if tasks > 1 or local > 0:
        raise LaunchConfigError(
            f"{max(tasks, local + 1)} launchers in this Slurm step on one node (tasks per node "
            f"{tasks}, SLURM_LOCALID {local}): run one launcher per node (srun "
            "--ntasks-per-node=1; the launcher starts --nproc-per-node workers itself), or set "
            f"{ENV_SIMULATED_NODES}=1 to simulate several nodes on one machine")


def _spares_note() -> None:
    global _spares_note_logged
    if _spares_note_logged:
        return
    _spares_note_logged = True
    _log.info("Slurm: hot spares and node exclusion need 'srun --kill-on-bad-exit=0': an "
              "unhealthy or excluded node's launcher exits non-zero, and with "
              "--kill-on-bad-exit=1 Slurm would then kill every other launcher of the step")
