"""Rank side of setup cells: the keras.distribution entry points, each checked on its own.

The training and op cells build meshes from explicit device names instead of calling these,
so that a bug here fails only its own cell.
"""

from __future__ import annotations

from keras_dtensor_conformance import rank_context


def list_devices() -> None:
    import keras

    ctx = rank_context.current()
    devices = keras.distribution.list_devices()
    assert devices == ctx.device_names(), f"list_devices() returned {devices}, expected {ctx.device_names()}"


def initialize() -> None:
    """initialize() must find the harness' process group already up and keep it."""
    import keras
    import torch.distributed as dist

    ctx = rank_context.current()
    keras.distribution.initialize()
    assert dist.is_initialized() and dist.get_world_size() == ctx.world_size and dist.get_rank() == ctx.rank


def device_mesh() -> None:
    import keras

    ctx = rank_context.current()
    mesh = keras.distribution.DeviceMesh((1, ctx.world_size), ["batch", "model"], ctx.device_names())
    backend = mesh.backend_mesh
    assert tuple(backend.mesh.shape) == (1, ctx.world_size), backend
    assert tuple(backend.mesh_dim_names) == ("batch", "model"), backend.mesh_dim_names


def layout_map() -> None:
    """Keys are regexes matched with re.fullmatch against variable paths."""
    import keras

    ctx = rank_context.current()
    mesh = keras.distribution.DeviceMesh((1, ctx.world_size), ["batch", "model"], ctx.device_names())
    layouts = keras.distribution.LayoutMap(mesh)
    layouts[".*dense.*kernel"] = (None, "model")
    found = layouts["sequential/dense_1/kernel"]
    assert found is not None and tuple(found.axes) == (None, "model"), found
    assert layouts["sequential/dense_1/bias"] is None


def model_parallel() -> None:
    import keras

    ctx = rank_context.current()
    mesh = keras.distribution.DeviceMesh((1, ctx.world_size), ["batch", "model"], ctx.device_names())
    layouts = keras.distribution.LayoutMap(mesh)
    layouts[".*kernel"] = (None, "model")
    distribution = keras.distribution.ModelParallel(layout_map=layouts, batch_dim_name="batch")
    data_layout = distribution.get_data_layout((8, 4))
    assert tuple(data_layout.axes) == ("batch", None), data_layout.axes


def data_parallel() -> None:
    import keras

    ctx = rank_context.current()
    mesh = keras.distribution.DeviceMesh((ctx.world_size,), ["batch"], ctx.device_names())
    distribution = keras.distribution.DataParallel(device_mesh=mesh)
    assert distribution.batch_dim_name == "batch"
    assert tuple(distribution.get_data_layout((8, 4)).axes) == ("batch", None)


SETUP_CELLS = ("list_devices", "initialize", "device_mesh", "layout_map", "model_parallel", "data_parallel")
