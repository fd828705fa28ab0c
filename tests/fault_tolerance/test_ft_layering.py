"""inprocess.Wrapper under trainguard launch: exceptions restart in-process (same processes),
a process death restarts in-job (every worker, full world size)."""

WRAPPED = """
import os, time
from datetime import timedelta
import torch.distributed as dist
from trainguard.inprocess import CallWrapper, Wrapper

cycle = int(os.environ["TORCHELASTIC_RESTART_COUNT"])

@Wrapper(soft_timeout=timedelta(seconds=30), hard_timeout=timedelta(seconds=60))
def train(cw: CallWrapper):
    cw.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"cycle {cycle} iteration {cw.iteration} rank {rank} world {world} pid {os.getpid()}",
          flush=True)
    if cycle == 0 and cw.iteration == 0 and rank == 1:
        raise RuntimeError("in-process fault")
    if cycle == 0 and cw.iteration == 1 and rank == 1:
        os.kill(os.getpid(), 9)
    if cycle == 0:
        time.sleep(30)
    dist.barrier()
    return "done"

if __name__ == "__main__":
    print("result", train(), flush=True)
"""


def test_wrapper_restarts_in_process_and_the_launcher_restarts_dead_processes(launch, tmp_path):
    (tmp_path / "wrapped.py").write_text(WRAPPED)
    r = launch("--nproc-per-node", "2", "--max-restarts", "1", "wrapped.py", timeout=240,
               cold=False)
    assert r.rc == 0, r
    log0, log1 = r.cycle_log(0), r.cycle_log(1)
    pids = {line.split(" pid ")[1] for line in log0.splitlines()
            if ": cycle 0 iteration" in line and " rank 1 " in line}
    assert "iteration 1 rank 1 world 2" in log0 and len(pids) == 1, log0  # same process
    assert "killed by signal SIGKILL" in r.err
    assert "cycle 1 iteration 0 rank 0 world 2" in log1 and "cycle 1 iteration 0 rank 1 world 2" \
        in log1, log1
    assert log1.count("result done") == 2
