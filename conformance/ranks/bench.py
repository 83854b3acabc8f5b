"""Rank side of step-time benchmarks: time one training step on every rank, inside the ranks.

Timing across the pipe to the controller would add the dispatch to every round and hide
what a step costs; here each round is: a barrier, a device sync, as many ``train_on_batch``
calls as fill ``round_seconds`` (calibrated once, after warm-up, the same count on every rank),
a device sync, reported per step; its wall time is the maximum over ranks (the slowest rank
sets the pace of synchronous training), and so is its CPU time. Warm-up steps run first, so
compilation is not timed; every rank is told the same number of rounds, so all of them join
every collective. ``open_bench`` and
``time_rounds`` are separate calls so the controller can interleave one benchmark's rounds
with another pool's (another build, or the single-process step) round by round.
"""

from __future__ import annotations

import math
import time

import numpy as np
from keras_dtensor_conformance import rank_context

from conformance.ranks import train as rank_train
from conformance.ranks.step_communication import measure_step_communication

BATCH = 64


def _bench_model(name: str):
    """Larger than the conformance models, so a step costs milliseconds, well above timer noise."""
    import keras

    if name == "mlp":
        return keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu", name="dense_a"),
                                 keras.layers.Dense(256, activation="relu", name="dense_c"),
                                 keras.layers.Dense(8, name="dense_b")], name="mlp")
    if name == "attention":
        inputs = keras.Input((16, 32))
        h = keras.layers.MultiHeadAttention(num_heads=4, key_dim=8, use_bias=False, name="attention")(inputs, inputs)
        h = keras.layers.GlobalAveragePooling1D()(keras.layers.LayerNormalization()(h + inputs))
        return keras.Model(inputs, keras.layers.Dense(8, name="dense_b")(h), name="attn")
    if name == "embedding":
        return keras.Sequential([keras.Input((16,), dtype="int32"), keras.layers.Embedding(1024, 32, name="embedding"),
                                 keras.layers.Flatten(), keras.layers.Dense(8, name="dense_b")], name="emb")
    raise ValueError(f"unknown benchmark model {name!r}")


def _batch(model: str):
    rng = np.random.default_rng(0)
    y = rng.standard_normal((BATCH, 8)).astype("float32")
    if model == "embedding":
        return rng.integers(0, 1024, (BATCH, 16)).astype("int32"), y
    if model == "attention":
        return rng.standard_normal((BATCH, 16, 32)).astype("float32"), y
    return rng.standard_normal((BATCH, 64)).astype("float32"), y


def _sync(ctx) -> None:
    if ctx.backend == "nccl":
        import torch

        torch.cuda.synchronize()


#: The shortest a timed round may be. Rounds of a few steps (tens of ms) on this 2-core machine
#: are dominated by when the scheduler happens to run each rank: five-step rounds of a 12 ms step
#: varied by a factor of two, a paired log-ratio's standard deviation was 0.25. Longer rounds
#: average that out, as pytest-benchmark's own ``min_time`` calibration of iterations does.
ROUND_SECONDS = 0.1

#: Steps timed to calibrate a round's step count, after warm-up.
CALIBRATION_STEPS = 3

#: The model a benchmark's first call built and warmed up, timed by the calls that continue it
#: (``isolate=False``): one benchmark's rounds can then interleave with another pool's rounds.
_OPEN: dict = {}


def _slowest(values: list[float], distributed: bool) -> list[float]:
    """Each of ``values``, the largest over ranks (on the group's device: NCCL takes no CPU tensor)."""
    if not distributed:
        return values
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64, device=rank_context.current().torch_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def _hub_model(spec: dict, distributed: bool):
    """A KerasHub causal LM of the KerasHub cells (``ranks/hub.py``: its tiny configuration, under its
    layout, the authors' map made from its backbone), compiled with SGD as their ``fit-sgd`` flow is (not
    compiled by torch), and this process's part of the first global batch."""
    from conformance.ranks import hub as rank_hub

    run = rank_hub.Run({"model": spec["model"], "flow": "fit-sgd", "layout": spec["layout"]}, distributed)
    run.distribute()
    lm = run.build()
    run.compile(lm)
    x, y, _ = rank_hub.make_data()
    rows = run.local_rows(rank_hub.ROWS)[:rank_hub.GLOBAL_BATCH // run.part()[1]]
    return lm, ({k: v[rows] for k, v in x.items()}, y[rows]), rank_hub.GLOBAL_BATCH


def _tensor_bytes(tensor) -> int:
    """The bytes this process holds of ``tensor``: a DTensor's local part, else all of it."""
    from torch.distributed.tensor import DTensor

    data = getattr(tensor, "data", tensor)
    local = data.to_local() if isinstance(data, DTensor) else data
    return local.numel() * local.element_size()


def _live_tensor_bytes() -> int:
    """The bytes of every tensor storage alive in this process (each storage once; a DTensor by its local
    part), whoever holds it: what a variable's value, an optimizer slot or a copy kept beside them occupies."""
    import gc

    import torch
    from torch.distributed.tensor import DTensor

    storages = {}
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor):
            continue
        tensor = obj.to_local() if isinstance(obj, DTensor) else obj
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor with no storage of its own (meta, a subclass)
            continue
        if storage.device.type != "meta":
            storages[(storage.device.type, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def held_bytes(model, before: int) -> dict:
    """What this process holds for the model: its variables' and its optimizer's variables' bytes (local
    parts: a sharded layout holds about 1/N of a sharded variable), the same bytes whole (what one process
    holds), and the tensors alive beyond those since ``before`` (``_live_tensor_bytes`` then): a full copy
    kept beside a sharded variable shows there."""
    parameters = sum(_tensor_bytes(v.value) for v in model.weights)
    slots = sum(_tensor_bytes(v.value) for v in model.optimizer.variables)
    whole = sum(math.prod(v.shape) * v.value.element_size() for v in [*model.weights, *model.optimizer.variables])
    return {"parameters": parameters, "slots": slots, "whole": whole,
            "other": max(0, _live_tensor_bytes() - before - parameters - slots)}


def open_bench(spec: dict, warmup: int, distributed: bool = True, round_seconds: float = ROUND_SECONDS) -> dict:
    """Build the cell's model, run ``warmup`` untimed steps (compilation included) and keep it.

    Then time a few steps and choose how many steps a round takes to last ``round_seconds``;
    every rank gets the same count (from the slowest rank), so all of them join every collective.
    What this process holds for the model after warm-up (``held_bytes``) and, distributed, what one
    more step communicates (``measure_step_communication``: bytes and collectives), are returned too.
    """
    import keras

    _OPEN.clear()
    import gc

    gc.collect()
    before = _live_tensor_bytes()
    if spec.get("family") == "kerashub":
        model, (x, y), batch = _hub_model(spec, distributed)
    else:
        if distributed:
            keras.distribution.set_distribution(rank_train.make_distribution(spec["layout"]))
        keras.utils.set_random_seed(0)
        model = _bench_model(spec["model"])
        model.compile(optimizer=rank_train.build_optimizer(spec["optimizer"]), loss="mse",
                      jit_compile=spec["compile"] == "jit")
        (x, y), batch = _batch(spec["model"]), BATCH
    for _ in range(warmup):
        model.train_on_batch(x, y)
    ctx = rank_context.current()
    _sync(ctx)
    start = time.perf_counter()
    for _ in range(CALIBRATION_STEPS):
        model.train_on_batch(x, y)
    _sync(ctx)
    (step,) = _slowest([(time.perf_counter() - start) / CALIBRATION_STEPS], distributed)
    steps = max(1, math.ceil(round_seconds / max(step, 1e-9)))
    _OPEN.update(model=model, batch=(x, y), distributed=distributed, steps=steps)
    gc.collect()
    held = held_bytes(model, before)
    moved = None
    if distributed:
        measured = measure_step_communication(model, x, y)
        moved = {"bytes": measured["bytes"], "collectives": measured["count"]}
    return {"batch": batch, "steps_per_round": steps, "step_s": step, "held": held, "moved": moved}


def time_rounds(rounds: int) -> dict:
    """Per-step wall and CPU time of ``rounds`` rounds of the open benchmark, each the slowest rank's.

    Wall: a round's elapsed time. CPU: the process CPU time (every thread: torch's intra-op pool
    included) a rank spent in the round; a rank that waits in a collective, or is descheduled by
    another process, spends none, so it moves less than wall time with the machine's load.
    """
    import torch.distributed as dist

    ctx = rank_context.current()
    model, (x, y), distributed, steps = _OPEN["model"], _OPEN["batch"], _OPEN["distributed"], _OPEN["steps"]
    wall, cpu = [], []
    for _ in range(rounds):
        if distributed:
            dist.barrier()
        _sync(ctx)
        start, start_cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            model.train_on_batch(x, y)
        _sync(ctx)
        elapsed, elapsed_cpu = _slowest([time.perf_counter() - start, time.process_time() - start_cpu], distributed)
        wall.append(elapsed / steps)
        cpu.append(elapsed_cpu / steps)
    return {"wall": wall, "cpu": cpu}


def step_times(spec: dict, warmup: int, rounds: int, distributed: bool = True,
               round_seconds: float = ROUND_SECONDS) -> dict:
    """Open a benchmark and time ``rounds`` rounds of it in one call (no other pool interleaves)."""
    opened = open_bench(spec, warmup, distributed, round_seconds)
    return {**time_rounds(rounds), **opened}
