"""Rank side of step-time benchmarks: time one training step on every rank, inside the ranks.

Timing across the pipe to the controller would add the dispatch to every round and hide
what a step costs; here each round is: a barrier, a device sync, one ``train_on_batch``, a
device sync, and the round's time is the maximum over ranks (the slowest rank sets the pace
of synchronous training). A round is ``STEPS_PER_ROUND`` steps, reported per step. Warm-up steps run first, so compilation is not timed; every rank
is told the same number of rounds, so all of them join every collective.
"""

from __future__ import annotations

import time

import numpy as np

from conformance import rank_train
from keras_dtensor_conformance import rank_context

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


#: Steps per timed round: a round's barrier and all-reduce then weigh less against the work.
STEPS_PER_ROUND = 5


def step_times(spec: dict, warmup: int, rounds: int, distributed: bool = True) -> dict:
    """Per-step time of each round in seconds (max over ranks), after ``warmup`` untimed steps."""
    import keras
    import torch
    import torch.distributed as dist

    # Every pool process has a context, the single-process reference's included (world size 1,
    # the session's backend): its steps run and are timed on the same device type as the ranks'.
    ctx = rank_context.current()
    if distributed:
        keras.distribution.set_distribution(rank_train.make_distribution(spec["layout"]))
    keras.utils.set_random_seed(0)
    model = _bench_model(spec["model"])
    model.compile(optimizer=rank_train.build_optimizer(spec["optimizer"]), loss="mse",
                  jit_compile=spec["compile"] == "jit")
    x, y = _batch(spec["model"])
    for _ in range(warmup):
        model.train_on_batch(x, y)
    times = []
    for _ in range(rounds):
        if distributed:
            dist.barrier()
        _sync(ctx)
        start = time.perf_counter()
        for _ in range(STEPS_PER_ROUND):
            model.train_on_batch(x, y)
        _sync(ctx)
        elapsed = torch.tensor([(time.perf_counter() - start) / STEPS_PER_ROUND], dtype=torch.float64,
                               device=ctx.torch_device())  # on the group's device: NCCL takes no CPU tensor
        if distributed:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed.item()))
    return {"times": times, "batch": BATCH}
