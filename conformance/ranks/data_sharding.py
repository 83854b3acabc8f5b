"""Rank side of a Keras-sharded data cell: every process hands ``fit`` / ``evaluate`` / ``predict``
the GLOBAL dataset, with the distribution's default ``auto_shard_dataset=True``, and records which
global rows its own steps actually received.

This is the other half of Keras' data contract from the hand-fed training cells (``ranks/train.py``
feeds each process its part itself, with ``auto_shard_dataset=False``, and tests
``distribute_data_input``). Here Keras' data adapters must do the sharding: per process a
distinct part of every epoch, and together the whole (``judge/data_sharding.py`` judges it).

Rows are told apart by value: every row of ``x`` is a distinct random vector, so a batch a step
receives (a DTensor's local part: what this process fed) maps back to global row numbers exactly.
Predictions are mapped back the same way, through a NumPy forward pass of the trained weights; the
same pass gives each row's loss, from which the judge computes what ``evaluate`` must return.
"""

from __future__ import annotations

import numpy as np
from keras_dtensor_conformance import rank_context

from conformance import cell_data
from conformance.ranks import train as rank_train

#: Steps per epoch, and the global batch (as in the hand-fed cells): each process's batch is
#: ``BATCH // shards``, because Keras' adapters hand each process whole batches of ``batch_size``.
STEPS = cell_data.STEPS
BATCH = cell_data.BATCH
EPOCHS = 2
#: Rows of an uneven cell: not a multiple of any process count's batch, nor of 2, 3 or 4 processes.
UNEVEN_SAMPLES = STEPS * BATCH + 7


def samples(spec: dict) -> int:
    return UNEVEN_SAMPLES if spec.get("uneven") else STEPS * BATCH


def global_data(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(x, y): ``n`` distinct rows, identical on every rank (a fixed seed, not Keras')."""
    rng = np.random.default_rng(1)
    return rng.standard_normal((n, 8)).astype("float32"), rng.standard_normal((n, 4)).astype("float32")


def sources(x: np.ndarray, y: np.ndarray, batch: int) -> dict:
    """name -> a function returning (args, kwargs) that hand ``fit`` the global (x, y) through that
    source, batched ``batch`` rows a process, shuffled where the source can be (see
    ``axes.KERAS_SHARDED_SOURCES``: the names and what shuffles them)."""
    import torch
    from torch.utils.data import DataLoader, IterableDataset, RandomSampler, TensorDataset

    def tensors():
        return TensorDataset(torch.from_numpy(x), torch.from_numpy(y))

    def iterable():
        class Rows(IterableDataset):
            def __iter__(self):
                for i in range(len(y)):
                    yield torch.from_numpy(x[i]), torch.from_numpy(y[i])

        return (DataLoader(Rows(), batch_size=batch),), {}

    def pydataset(workers: int):
        import keras

        class Batches(keras.utils.PyDataset):
            def __len__(self):
                return (len(y) + batch - 1) // batch  # the last batch partial

            def __getitem__(self, i):
                return x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]

        return (Batches(workers=workers, use_multiprocessing=False),), {"shuffle": True}

    # A DataLoader "with a sampler": a RandomSampler, seeded alike on every rank, which Keras must
    # replace by a shuffling DistributedSampler; without one it must add a non-shuffling one.
    seeded = torch.Generator().manual_seed(0)
    return {
        "arrays": lambda: ((x, y), {"batch_size": batch, "shuffle": True}),
        "tensors": lambda: ((torch.from_numpy(x), torch.from_numpy(y)), {"batch_size": batch, "shuffle": True}),
        "dataloader": lambda: ((DataLoader(tensors(), batch_size=batch),), {}),
        "dataloader-sampler": lambda: ((DataLoader(tensors(), batch_size=batch,
                                                   sampler=RandomSampler(tensors(), generator=seeded)),), {}),
        "dataloader-workers": lambda: ((DataLoader(tensors(), batch_size=batch, num_workers=2),), {}),
        "iterable": iterable,
        "pydataset": lambda: pydataset(1),
        "pydataset-workers": lambda: pydataset(2),
    }


def _rows_of(index: dict, batch) -> list[int]:
    """Global row numbers of the rows of ``batch`` (this process's part: a DTensor's local shard);
    -1 for a row that is in no global row (the judge names it)."""
    local = batch.to_local() if hasattr(batch, "to_local") else batch
    array = np.asarray(local.detach().cpu() if hasattr(local, "detach") else local, dtype="float32")
    return [index.get(row.tobytes(), -1) for row in array.reshape(len(array), -1)]


def _spy(model, method: str, index: dict, record: list) -> None:
    """Make ``model.<method>`` (train_step, test_step, predict_step) append to ``record[-1]`` the
    global rows of each batch it is given, then run as before. On the instance, past Keras'
    attribute tracking, as ``ranks/train`` spies on the optimizer."""
    original = getattr(model, method)

    def step(data):
        x = data[0] if isinstance(data, (tuple, list)) else data
        record[-1].append(_rows_of(index, x))
        return original(data)

    model.__dict__[method] = step


def forward(weights: list[np.ndarray], x: np.ndarray) -> np.ndarray:
    """The MLP's forward pass (``train.build_model('mlp')``: Dense 16 relu, Dense 4) in NumPy."""
    kernel_a, bias_a, kernel_b, bias_b = weights
    return np.maximum(x @ kernel_a + bias_a, 0) @ kernel_b + bias_b


def returned_rows(prediction: np.ndarray, expected: np.ndarray) -> list[int]:
    """Which global row each returned prediction is: the nearest of the NumPy forward pass's rows,
    or -1 where none is near (a prediction of no row)."""
    rows = []
    for row in np.asarray(prediction, dtype="float64"):
        distance = np.abs(expected - row).max(axis=1)
        best = int(distance.argmin())
        rows.append(best if distance[best] <= 1e-3 * (1 + np.abs(row).max()) else -1)
    return rows


def run(spec: dict) -> dict:
    """Fit ``EPOCHS`` epochs, evaluate and predict on the global dataset through ``spec['source']``
    with Keras' default sharding; return, per phase, the global rows each step received."""
    import keras

    ctx = rank_context.current()
    distribution = rank_train.make_distribution(spec["layout"])
    distribution.auto_shard_dataset = True  # Keras' default: Keras shards the global dataset itself
    keras.distribution.set_distribution(distribution)
    keras.utils.set_random_seed(0)
    shards = cell_data.batch_part(spec["layout"], ctx.rank, ctx.world_size)[1]
    batch = BATCH // shards
    x, y = global_data(samples(spec))
    index = {row.tobytes(): i for i, row in enumerate(x)}
    make = sources(x, y, batch)[spec["source"]]

    model = rank_train.build_model("mlp")
    model.compile(optimizer="adam", loss="mse", jit_compile=False)
    fit_rows: list[list] = []
    evaluate_rows: list[list] = [[]]
    predict_rows: list[list] = [[]]
    _spy(model, "train_step", index, fit_rows)
    _spy(model, "test_step", index, evaluate_rows)
    _spy(model, "predict_step", index, predict_rows)

    class Epochs(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            fit_rows.append([])

    args, kwargs = make()
    model.fit(*args, epochs=EPOCHS, verbose=0, callbacks=[Epochs()], **kwargs)
    args, kwargs = make()
    kwargs.pop("shuffle", None)
    loss = model.evaluate(*args, verbose=0, **kwargs)
    args, kwargs = make()
    kwargs.pop("shuffle", None)
    prediction = model.predict(*args[:1], verbose=0, **kwargs)  # x alone: y is not predict's
    expected = forward(model.get_weights(), x.astype("float64"))
    return {
        "rank": ctx.rank,
        "samples": len(x),
        "fit": fit_rows,
        "evaluate": evaluate_rows[0],
        "predict_fed": predict_rows[0],
        "predict_returned": returned_rows(prediction, expected),
        "evaluate_loss": float(loss),
        "row_losses": ((expected - y) ** 2).mean(axis=1).tolist(),  # mse per global row
    }
