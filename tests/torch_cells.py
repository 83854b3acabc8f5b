"""Pure torch DTensor functions the self-tests run on the ranks: no Keras needed.

Each one is a real distributed computation or a real way for a rank to fail, so the
harness is proven against the behaviour it must survive, not against mocks.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from keras_dtensor_conformance import rank_context


def _mesh():
    ctx = rank_context.current()
    return init_device_mesh("cuda" if ctx.backend == "nccl" else "cpu", (ctx.world_size,))


def sharded_matmul() -> dict:
    """A row-sharded DTensor matmul; every rank returns its shard and the gathered result."""
    mesh = _mesh()
    torch.manual_seed(0)
    a = torch.randn(8, 4)
    b = torch.randn(4, 3)
    da = distribute_tensor(a, mesh, [Shard(0)])
    db = distribute_tensor(b, mesh, [Replicate()])
    out = da @ db
    return {
        "rank": dist.get_rank(),
        "pid": os.getpid(),
        "placements": [str(p) for p in out.placements],
        "local_shape": tuple(out.to_local().shape),
        "max_error": float((out.full_tensor() - a @ b).abs().max()),
    }


def whoami() -> tuple[int, int]:
    return dist.get_rank(), os.getpid()


def raise_on_rank(bad_rank: int) -> int:
    """``bad_rank`` raises; the others then wait in a barrier the bad rank never joins."""
    print(f"rank {dist.get_rank()} says hello on stdout")
    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    dist.barrier()
    return dist.get_rank()


def hang_on_rank(bad_rank: int) -> int:
    """``bad_rank`` sleeps forever in Python; the others block in a collective."""
    if dist.get_rank() == bad_rank:
        while True:
            time.sleep(0.1)
    dist.barrier()
    return dist.get_rank()


def crash_on_rank(bad_rank: int, how: str) -> int:
    """``bad_rank`` dies: ``exit`` (os._exit(3)), ``segv`` or ``kill`` (SIGKILL, as the OOM killer)."""
    if dist.get_rank() == bad_rank:
        print("about to die", file=sys.stderr)
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGSEGV if how == "segv" else signal.SIGKILL)
    dist.barrier()
    return dist.get_rank()


def leak_state() -> None:
    """Changes what isolation must undo: environment, seeds, grad mode."""
    os.environ["KDC_LEAKED"] = "yes"
    torch.manual_seed(1234)
    torch.set_grad_enabled(False)


def observe_state() -> dict:
    return {
        "leaked_env": os.environ.get("KDC_LEAKED"),
        "first_random": float(torch.rand(1)),
        "grad_enabled": torch.is_grad_enabled(),
    }


def raise_everywhere() -> None:
    raise RuntimeError(f"every rank fails, this is rank {dist.get_rank()}")


def return_unpicklable():
    return lambda: None


def spawn_child_and_wait(seconds: float, token: str) -> int:
    """Starts a grandchild process (as a DataLoader worker would) marked by ``token``, then sleeps."""
    import subprocess

    child = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep(600)  # {token}"])
    time.sleep(seconds)
    return child.pid


def build_2d_mesh() -> tuple[int, int]:
    """A (1, world) mesh, as every training cell makes: torch creates a subgroup per dimension."""
    ctx = rank_context.current()
    init_device_mesh("cpu", (1, ctx.world_size), mesh_dim_names=("batch", "model"))
    return threads_and_groups()


def threads_and_groups() -> tuple[int, int]:
    from torch.distributed import distributed_c10d as c10d

    return len(os.listdir(f"/proc/{os.getpid()}/task")), len(c10d._world.pg_map)


def mesh_op_then_collective() -> float:
    """A fresh (1, world) mesh, a DTensor op (sharding propagation caches its output spec), then a
    collective on the result: in a later call, a stale cached spec would point at a dead group."""
    ctx = rank_context.current()
    mesh = init_device_mesh("cpu", (1, ctx.world_size), mesh_dim_names=("batch", "model"))
    x = distribute_tensor(torch.ones(4, 4), mesh, [Replicate(), Shard(0)])
    y = x * 2
    # Replicate on mesh dim 0 broadcasts over that dim's group: a per-rank subgroup (size-1 dim).
    z = distribute_tensor(torch.ones(4, 4), y.device_mesh, [Replicate(), Shard(0)])
    return float((y + z).full_tensor().sum())
