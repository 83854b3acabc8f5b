"""Rank side of the JAX reference: the same cell on the same build's JAX backend, in one process.

Runs in a pool of its own (``PoolManager.jax_reference``) started with ``KERAS_BACKEND=jax`` and
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before anything imports JAX or Keras, so
the cell's distribution is built over N virtual CPU devices: the same ``DeviceMesh`` shape, the
same ``LayoutMap`` (``train.make_distribution``), the same model, optimizer and data
(``train.build_model``, ``build_optimizer``, ``make_arrays``). It starts from the weights the
ranks started from (set by path), so the two backends' random streams do not matter, and feeds
the GLOBAL batches in order as numpy arrays: every data source of a cell yields those batches, so
one JAX reference serves every source, compile mode and torch layout with the same mesh and map.
``jit`` compiles its steps with XLA (the controller's choice: ``reference.JIT``).

It returns the numbers the judge compares (``conformance.judge.jax_compare``) and, for every
variable and optimizer slot, the layout JAX gave it (its ``PartitionSpec`` as data), from which
the judge derives the DTensor placements the torch ranks must have. Imports no torch.
"""

from __future__ import annotations

import numpy as np

from conformance.cell_data import DROPOUT_MODELS
from conformance import cell_data
from conformance.ranks import feeding
from conformance.ranks import train as rank_train

#: The persistent compilation cache's events (``jax.monitoring``) this process saw: ``hits`` (an XLA
#: executable loaded instead of compiled) and ``misses`` (compiled, then written to the cache).
XLA_CACHE: dict[str, int] = {}
_CACHE_EVENTS = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "misses"}


def _count_cache_events() -> None:
    import jax

    if not XLA_CACHE:
        XLA_CACHE.update(hits=0, misses=0)

        def listener(event, **_):
            if event in _CACHE_EVENTS:
                XLA_CACHE[_CACHE_EVENTS[event]] += 1

        jax.monitoring.register_event_listener(listener)


class NotComparable(Exception):
    """The JAX backend's model is not the ranks' (other variable paths): no reference for the cell."""


def partition_spec(variable) -> list | None:
    """A variable's ``PartitionSpec`` as data: per dimension None, a mesh axis name, or a list of
    them; None when JAX placed it on one device (no distribution)."""
    value = getattr(variable, "value", variable)
    spec = getattr(getattr(value, "sharding", None), "spec", None)
    if spec is None:
        return None
    dims = list(spec) + [None] * (len(variable.shape) - len(spec))
    return [list(d) if isinstance(d, tuple) else d for d in dims]


def describe(variable) -> dict:
    """What ``train._describe_slots`` records of a variable, the JAX way: its spec, not placements."""
    return {"path": variable.path, "shape": tuple(variable.shape), "spec": partition_spec(variable)}


def train(spec: dict, initial_weights: dict, nproc: int, jit: bool = False, fit: bool = True) -> dict:
    """Fit, evaluate and predict ``spec``'s cell on the JAX backend under its distribution over
    ``nproc`` virtual devices, from ``initial_weights`` (path -> array, the ranks' own).

    ``fit=False`` returns only the layouts (``LAYOUT_KEYS``): the model and its optimizer's
    variables built under the distribution, as the first train step builds them, and no step run.
    The numbers do not depend on the layout, so one fitted run serves every layout of a model,
    optimizer and data, and each other layout costs only this (``reference.JaxReferences``)."""
    import jax
    import keras

    if keras.backend.backend() != "jax":
        raise RuntimeError(f"the JAX reference runs Keras' {keras.backend.backend()!r} backend, not jax")
    _count_cache_events()
    cache_before = dict(XLA_CACHE)
    layout = spec["layout"]
    if layout["kind"] != "single":
        devices = [f"cpu:{d.id}" for d in jax.devices("cpu")[:nproc]]
        if len(devices) < nproc:
            raise RuntimeError(f"{len(devices)} virtual CPU devices, the layout needs {nproc} "
                               "(XLA_FLAGS=--xla_force_host_platform_device_count)")
        keras.distribution.set_distribution(rank_train.make_distribution(layout, nproc, devices))
    rank_train.set_policy(spec)
    model_name = rank_train.model_name(spec)
    if model_name in DROPOUT_MODELS:
        raise NotComparable("dropout: each backend draws its masks from its own random stream")
    model = rank_train.build_model(model_name)
    paths = [v.path for v in model.weights]
    if sorted(paths) != sorted(initial_weights):
        raise NotComparable(f"the JAX model's variables {paths} are not the ranks' {sorted(initial_weights)}")
    for variable in model.weights:
        variable.assign(initial_weights[variable.path])
    model.compile(optimizer=rank_train.build_optimizer(spec["optimizer"]), loss=rank_train.loss_for(model_name),
                  jit_compile=jit)
    if not fit:
        model.optimizer.build(model.trainable_variables)
        return layouts(model)
    x, y, w = cell_data.make_arrays(model_name, seed=spec.get("seed", 0))
    kwargs = {"batch_size": cell_data.BATCH}
    if spec["data"] == "sample-weights":
        kwargs["sample_weight"] = w
    # A PyDataset through the same adapter (it orders its batches itself); every other source
    # yields the arrays' batches in order, so the arrays stand for it (its types may be torch's).
    fit_args, fit_kwargs = ((x, y), dict(kwargs, shuffle=False)) if not spec["data"].startswith("pydataset") \
        else feeding.fit_inputs(spec["data"], x, y, w)

    step_losses: list[float] = []
    history = model.fit(*fit_args, epochs=1, verbose=0, callbacks=[rank_train.step_losses_callback(step_losses)],
                        **fit_kwargs)
    found = layouts(model)
    evaluation = model.evaluate(x, y, verbose=0, **kwargs)
    prediction = model.predict(x, batch_size=cell_data.BATCH, verbose=0)
    return {
        "step_losses": step_losses,
        "epoch_loss": [float(v) for v in history.history["loss"]],
        "evaluate": float(evaluation if np.isscalar(evaluation) else evaluation[0]),
        "predict": np.asarray(prediction),
        "weights": {v.path: np.asarray(v.value) for v in model.weights},
        # The XLA programs this fit, evaluate and predict compiled, and those loaded from the cache.
        "xla_cache": {k: XLA_CACHE[k] - cache_before[k] for k in XLA_CACHE},
        **found,
    }


#: What ``layouts`` returns: the part of a JAX reference that depends on the layout.
LAYOUT_KEYS = ("variables", "slots", "unmatched_optimizer_variables", "unattributed_slots", "mesh_axes", "mesh_shape",
               "jax_version")


def layouts(model) -> dict:
    """Every variable's and optimizer slot's ``PartitionSpec``, and the mesh they refer to."""
    import jax
    import keras

    slots, unmatched = rank_train._describe_slots(model, describe)
    shapes = {v.path: tuple(v.shape) for v in model.optimizer.variables}
    distribution = keras.distribution.distribution()
    mesh = None if distribution is None else distribution.device_mesh
    return {
        "variables": [describe(v) for v in model.weights],
        "slots": slots,
        "unmatched_optimizer_variables": unmatched,
        # Optimizer state no model variable claims (scalars such as iterations aside): slots whose
        # names lost their variable's path, in both backends (``jax_compare.layout_departures``).
        "unattributed_slots": [path for path in unmatched if len(shapes.get(path, ())) > 0],
        "mesh_axes": list(mesh.axis_names) if mesh is not None else [],
        "mesh_shape": list(mesh.shape) if mesh is not None else [],
        "jax_version": jax.__version__,
    }
