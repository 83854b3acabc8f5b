"""Pure torch DTensor functions the self-tests run on the ranks: no Keras needed.

Each one is a real distributed computation or a real way for a rank to fail, so the
harness is proven against the behaviour it must survive, not against mocks.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
from keras_dtensor_conformance import torch_internals
from keras_dtensor_conformance.rank import context as rank_context
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor


def _mesh():
    ctx = rank_context.current()
    return init_device_mesh("cuda" if ctx.backend == "nccl" else "cpu", (ctx.world_size,))


def sharded_matmul() -> dict:
    """A row-sharded DTensor matmul; every rank returns its shard and the gathered result. The
    operands are made on the rank's device: ``distribute_tensor`` moves them to the mesh's, and the
    plain product they are checked against must be computed there too (cuda under NCCL)."""
    mesh = _mesh()
    torch.manual_seed(0)
    device = rank_context.current().torch_device()
    a = torch.randn(8, 4).to(device)
    b = torch.randn(4, 3).to(device)
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


def hold_gil_on_rank(bad_rank: int) -> int:
    """``bad_rank`` is stuck in one C call that never releases the GIL (the regex engine
    backtracking through 2**40 ways to split the a's); the others block in a collective."""
    if dist.get_rank() == bad_rank:
        re.match(r"(a+)+$", "a" * 40 + "b")
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


def segfault_while_peer_in_collective(bad_rank: int) -> int:
    """``bad_rank`` segfaults once the others are inside an all-reduce it never joins (they then
    raise "Connection reset by peer"): the crash is the cause, the others' errors its consequence.

    It has a dozen idle Python threads, as a Keras rank has (executors, prefetchers), so
    faulthandler's dump of every thread is longer than the tail of stderr a story shows."""
    if dist.get_rank() == bad_rank:
        idle = threading.Event()
        for _ in range(12):
            threading.Thread(target=idle.wait, daemon=True).start()
        time.sleep(1.0)  # let the others enter the collective first
        print("about to segfault", file=sys.stderr)
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.all_reduce(torch.ones(1))
    return dist.get_rank()


def no_strategy_then_crash_on_rank(bad_rank: int) -> list:
    """The others hit a real DTensor bug (aten.searchsorted has no sharding strategy in torch 2.13)
    and return; ``bad_rank`` dies a second later, of a cause of its own. The first failure is the bug."""
    mesh = _mesh()
    sorted_rows = DTensor.from_local(torch.arange(8.0).reshape(1, 8), mesh, [Replicate()], run_check=False)
    if dist.get_rank() == bad_rank:
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGSEGV)
    return torch.searchsorted(sorted_rows, sorted_rows).tolist()


def raise_on_rank_only(bad_rank: int) -> int:
    """``bad_rank`` raises; the others return at once (no collective, so none of them waits)."""
    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank} only")
    return dist.get_rank()


def _long_trace(x, steps: int):
    for _ in range(steps):  # dynamo unrolls the loop: one traced op after another
        x = x * 1.0001 + 1
    return x


def compile_for_long(steps: int = 10**6) -> float:
    """torch.compile of a Python loop of ``steps`` steps: dynamo unrolls and traces it op by op
    (about 80 steps a second measured on the 2-core development machine), so the rank is still
    compiling, neither deadlocked nor asleep, long after a short timeout."""
    compiled = torch.compile(_long_trace, backend="eager")
    return float(compiled(torch.ones(2), steps).sum())


def compile_on_rank(bad_rank: int) -> float:
    """``bad_rank`` compiles for long; the others wait for it in a barrier."""
    if dist.get_rank() == bad_rank:
        return compile_for_long()
    dist.barrier()
    return 0.0


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


def _fresh_training_mesh():
    """A (1, world) mesh, as every training cell makes: torch creates a subgroup per dimension."""
    return init_device_mesh("cpu", (1, rank_context.current().world_size), mesh_dim_names=("batch", "model"))


def build_2d_mesh() -> tuple[int, int]:
    _fresh_training_mesh()
    return threads_and_groups()


def threads_and_groups() -> tuple[int, int]:
    return len(os.listdir(f"/proc/{os.getpid()}/task")), len(torch_internals.process_groups())


def mesh_op_then_collective() -> float:
    """A fresh (1, world) mesh, a DTensor op (sharding propagation caches its output spec), then a
    collective on the result: in a later call, a stale cached spec would point at a dead group."""
    mesh = _fresh_training_mesh()
    x = distribute_tensor(torch.ones(4, 4), mesh, [Replicate(), Shard(0)])
    y = x * 2
    # Replicate on mesh dim 0 broadcasts over that dim's group: a per-rank subgroup (size-1 dim).
    z = distribute_tensor(torch.ones(4, 4), y.device_mesh, [Replicate(), Shard(0)])
    return float((y + z).full_tensor().sum())


def forked_ready() -> dict:
    """Whether this rank was forked from its pool's zygote with the build imported and the baseline
    taken (``isolation.inherited_build``), and its parent's pid."""
    from keras_dtensor_conformance.rank import isolation

    return {"inherited": isolation.inherited_build() is not None, "ppid": os.getppid(), "pid": os.getpid()}


def trace_file(path: str) -> dict:
    """Compile and run the function ``traced`` of the module at ``path`` (a file no trace of this
    session read before): whether dynamo had read the file before, and has after."""
    import importlib.util

    read_before = path in torch_internals.source_names_read()
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.compile(module.traced, backend="eager")(torch.ones(2))
    return {"read_before": read_before, "read_after": path in torch_internals.source_names_read()}


def source_names_as_read(path: str) -> dict:
    """Whether dynamo's names for the lines of ``path`` were read before this rank asked, and are those
    reading it now gives."""
    from torch._dynamo import funcname_cache

    had = funcname_cache.cache.get(path)
    funcname_cache.cache.pop(path, None)
    funcname_cache.get_funcname(path, 0)
    return {"read": had is not None, "same": had == funcname_cache.cache[path]}


def imported(modules: list[str]) -> dict:
    """Which of ``modules`` this rank had imported when the call began."""
    return {name: name in sys.modules for name in modules}
