"""How a rank feeds its part of a training cell's data to Keras: one function per data source
(``fit_inputs``), each yielding the same batches in the same order.
"""

from __future__ import annotations

from conformance.cell_data import BATCH


def _batches(x, y, batch: int, w=None):
    for i in range(len(y) // batch):
        s = slice(i * batch, (i + 1) * batch)
        xb = {k: v[s] for k, v in x.items()} if isinstance(x, dict) else x[s]
        yield (xb, y[s]) if w is None else (xb, y[s], w[s])


def fit_inputs(source: str, x, y, w, batch: int = BATCH) -> tuple[tuple, dict]:
    """(args, kwargs) for model.fit / evaluate that feed (x, y, w) through ``source`` in batches
    of ``batch`` rows (a rank's local batch).

    Every source yields the same batches in the same order, so losses and weights are comparable
    to the reference step by step (PyDataset's adapter shuffles its batch order under fit's default
    ``shuffle=True``, by the epoch's number: the same order in every process and backend). Only the
    torch sources import torch: the JAX reference feeds a PyDataset through here too.
    """
    steps = len(y) // batch
    if source in ("arrays", "dict"):
        return (x, y), {"batch_size": batch, "shuffle": False}
    if source == "sample-weights":
        return (x, y), {"batch_size": batch, "shuffle": False, "sample_weight": w}
    if source in ("tensors", "iterable") or source.startswith("dataloader"):
        import torch
    if source == "tensors":
        return (torch.from_numpy(x), torch.from_numpy(y)), {"batch_size": batch, "shuffle": False}
    if source.startswith("dataloader"):
        from torch.utils.data import DataLoader, TensorDataset

        workers = 2 if source.endswith("workers") else 0
        loader = DataLoader(TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), batch_size=batch,
                            shuffle=False, num_workers=workers)
        return (loader,), {}
    if source == "iterable":
        from torch.utils.data import DataLoader, IterableDataset

        class Samples(IterableDataset):
            def __iter__(self):
                for i in range(len(y)):
                    yield torch.from_numpy(x[i]), torch.from_numpy(y[i])

        return (DataLoader(Samples(), batch_size=batch),), {}
    if source.startswith("pydataset"):
        import keras

        class Batches(keras.utils.PyDataset):
            def __len__(self):
                return steps

            def __getitem__(self, i):
                return x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]

        workers = 2 if source.endswith("workers") else 1
        return (Batches(workers=workers, use_multiprocessing=False),), {}
    if source == "generator":
        return (_batches(x, y, batch),), {"steps_per_epoch": steps}
    if source == "tfdata":
        import tensorflow as tf

        return (tf.data.Dataset.from_tensor_slices((x, y)).batch(batch),), {}
    if source == "grain":
        import grain

        ds = grain.MapDataset.source(list(zip(x, y, strict=True))).batch(batch)
        return (ds,), {}
    raise ValueError(f"unknown data source {source!r}")
