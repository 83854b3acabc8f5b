"""The data of a training cell, which the rank side feeds and the judge reasons about: neither
side's module, so the judge (the NumPy oracle, the batch geometry) imports no rank code.

The global data (``make_arrays``), its batches (``BATCH`` rows, ``STEPS`` of them), each process'
part of every global batch (``batch_part``, ``local_rows``, ``local_part``), and the mesh
geometry they follow (``mesh_shape``, ``mesh_coordinate``, ``shard_size``). NumPy only.
"""

from __future__ import annotations

import numpy as np

STEPS = 4
#: The global batch. Divisible by every batch-shard count a cell can have (1, 2, 3, 4 and 8
#: processes on the batch axis), so every process feeds a local part of the same size.
BATCH = 24
SAMPLES = STEPS * BATCH
VOCAB = 20
#: The mesh axes of a layout, in order, unless it names its own (``axes``, with its ``batch_axis``:
#: a mesh ordered ``("model", "batch")``, or whose batch axis is called ``"data"``).
MESH_AXES = ("batch", "model")
#: The MLP with LoRA of this rank on both Dense layers (``ranks/train.build_model``), fed the MLP's
#: data; ``lora-sharded``'s LayoutMap also shards the LoRA kernels along their base kernel's split
#: (``axes.lora_layout``), ``lora``'s leaves them to the build.
LORA_MODELS = ("lora", "lora-sharded")
LORA_RANK = 2
#: A causal language model's transformer block as users write one (``ranks/train.build_model``): token and
#: position embeddings (``VOCAB`` and ``SEQUENCE`` rows), MultiHeadAttention with Keras' defaults (biases on),
#: a residual, LayerNormalization, a feed-forward block, next-token logits. ``transformer-dropout`` adds
#: dropout (unseeded, as users write it: attention probabilities and both residual branches) and is judged
#: by the ranks' agreement, its dropout-free twin ``transformer`` by numbers; ``transformer-frozen-ln``
#: freezes the LayerNormalizations.
TRANSFORMER_MODELS = ("transformer", "transformer-dropout", "transformer-frozen-ln")
DROPOUT_MODELS = ("transformer-dropout",)
DROPOUT = 0.1
SEQUENCE = 6
#: The dtype policies a training cell can run under (``keras.config.set_dtype_policy``): the first is
#: every cell's unless it names another; the mixed ones compute in 16 bits and keep float32 variables
#: (``mixed_float16`` with the loss scaling Keras' ``compile`` wraps the optimizer in).
POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")


def policy(spec: dict) -> str:
    """The dtype policy of a cell's spec: its ``policy``, or float32 (what a spec without one runs)."""
    return spec.get("policy", POLICIES[0])


def mesh_shape(layout: dict, nproc: int) -> tuple[int, ...]:
    """The mesh of a layout, its sizes in the order of ``mesh_axes``; "nproc" stands for the number of ranks."""
    return tuple(nproc if d == "nproc" else d for d in layout.get("mesh", (1, "nproc")))


def mesh_axes(layout: dict) -> tuple[str, ...]:
    """The names of a layout's mesh axes, in mesh order (``MESH_AXES`` unless it names its own)."""
    return tuple(layout.get("axes", MESH_AXES))


def batch_axis(layout: dict) -> str:
    """The name of the mesh axis a layout's batches are sharded over (its ``batch_dim_name``)."""
    return layout.get("batch_axis", MESH_AXES[0])


def mesh_coordinate(rank: int, mesh: tuple[int, ...]) -> tuple[int, ...]:
    """Where ``rank`` sits in ``mesh``: Keras' DeviceMesh reshapes the device list row-major."""
    coordinate = []
    for size in reversed(mesh):
        coordinate.append(rank % size)
        rank //= size
    return tuple(reversed(coordinate))


def shard_size(n: int, shards: int, index: int) -> int:
    """Rows of a dimension of ``n`` that shard ``index`` of ``shards`` holds (torch.chunk rule)."""
    chunk = -(-n // shards)
    return max(0, min(chunk, n - index * chunk))

def make_arrays(model: str, seed: int = 0) -> tuple[dict | np.ndarray, np.ndarray, np.ndarray]:
    """(x, y, sample_weight) for ``model``: the global data, identical on every rank and in the
    reference; each rank then feeds only its ``local_part`` of it."""
    rng = np.random.default_rng(seed)
    y = rng.standard_normal((SAMPLES, 4)).astype("float32")
    weights = rng.uniform(0.5, 1.5, (SAMPLES,)).astype("float32")
    if model in TRANSFORMER_MODELS:  # tokens, and the next token at each position as the label
        x = rng.integers(0, VOCAB, (SAMPLES, SEQUENCE)).astype("int32")
        y = np.concatenate([x[:, 1:], rng.integers(0, VOCAB, (SAMPLES, 1))], axis=1).astype("int32")
    elif model == "embedding":
        x = rng.integers(0, VOCAB, (SAMPLES, 6)).astype("int32")
    elif model == "attention":
        x = rng.standard_normal((SAMPLES, 6, 8)).astype("float32")
    elif model == "twoinput":
        x = {"a": rng.standard_normal((SAMPLES, 4)).astype("float32"),
             "b": rng.standard_normal((SAMPLES, 4)).astype("float32")}
    else:
        x = rng.standard_normal((SAMPLES, 8)).astype("float32")
    return x, y, weights


def batch_part(layout: dict, rank: int, nproc: int) -> tuple[int, int]:
    """(index, count): this rank's position along the mesh's batch axis, and that axis' size.

    Keras' multi-process contract (torch ``distribute_data_input``: ``DTensor.from_local`` of the
    per-process batch; JAX ``make_array_from_process_local_data``) is that each process feeds
    its LOCAL part and the global batch is their concatenation along the batch axis. Ranks with
    the same batch coordinate (the model axis of a 2x2 mesh) feed the same rows; a ``(1, n)``
    mesh has one batch shard, so every rank feeds the whole global batch. Derived from the
    layout (devices fill the mesh in row-major order), not from the build's mesh, so a build
    that builds the mesh wrong is not fed to match it.
    """
    if layout["kind"] == "single":
        return 0, 1
    if layout["kind"] == "data-parallel":
        return rank, nproc
    mesh = mesh_shape(layout, nproc)
    dim = mesh_axes(layout).index(batch_axis(layout))
    return mesh_coordinate(rank, mesh)[dim], mesh[dim]


def local_rows(index: int, count: int) -> np.ndarray:
    """Global row numbers a rank at batch position ``index`` of ``count`` feeds, in order: its
    ``BATCH // count`` rows of every global batch."""
    local = BATCH // count
    return np.concatenate([np.arange(s * BATCH + index * local, s * BATCH + (index + 1) * local)
                           for s in range(STEPS)])


def local_part(array, rows: np.ndarray):
    """``array`` (or a dict of arrays) restricted to ``rows``."""
    return {k: v[rows] for k, v in array.items()} if isinstance(array, dict) else array[rows]
