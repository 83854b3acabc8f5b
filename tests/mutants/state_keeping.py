"""Correct builds that keep state for their process's life (tests/test_fresh_verdicts.py): not in
the kit's CASES, they change no verdict."""

from __future__ import annotations

from tests.mutants import Mutant, Patch, TORCH

# ---- issue 39: correct builds that keep state for their process's life. Each is right in a fresh
# process; ranks reused across cells must give each cell the verdict it gets there
# (tests/test_fresh_verdicts.py). Not in CASES: they change no verdict.
_ACTIVATE = ("def activate_dtensor_promotion():\n"
             "    if _get_dtensor_promotion_mode() is None:\n"
             "        KerasDTensorPromotionMode().__enter__()\n")
STATE_KEEPING = (
    # The shape the nightly's promotion mode had before it looked at the stack: entered once per
    # process under a module global, never left. A user's process keeps it for its life.
    Mutant("promotion-mode-once", "the promotion mode entered once per process, remembered in a module global "
           "and never left",
           (Patch(TORCH + "ops/core.py", _ACTIVATE,
                  "_PROMOTION_MODE = None  # mutant: entered once per process\n\n\n"
                  "def activate_dtensor_promotion():\n"
                  "    global _PROMOTION_MODE\n"
                  "    if _PROMOTION_MODE is None:\n"
                  "        _PROMOTION_MODE = KerasDTensorPromotionMode()\n"
                  "        _PROMOTION_MODE.__enter__()\n"),
            Patch(TORCH + "ops/core.py", "    mode = _get_dtensor_promotion_mode()\n    # `__exit__` pops",
                  "    return  # mutant: never left\n    mode = _get_dtensor_promotion_mode()\n    # `__exit__` pops"))),
    # A torch function patched on first use, its state in torch alone (no flag in Keras): the
    # optimizers' torch._foreach_mul promotes a plain factor onto the mesh of the first distribution
    # it saw. In a fresh process that is the cell's mesh.
    Mutant("foreach-patched-on-first-use", "torch._foreach_mul patched at the first distribution to promote a plain "
           "factor onto that distribution's mesh, kept in the patch for the process's life",
           (Patch(TORCH + "ops/core.py", _ACTIVATE,
                  "def _patch_foreach_mul():  # mutant: once per process, the state in torch\n"
                  "    if getattr(torch._foreach_mul, '_keras_mesh', None) is not None:\n"
                  "        return\n"
                  "    from keras.src.distribution import distribution_lib as _dl\n"
                  "    from torch.distributed.tensor import DTensor, Replicate\n"
                  "    mesh = _dl.distribution().device_mesh.backend_mesh\n"
                  "    original = torch._foreach_mul\n\n"
                  "    def _foreach_mul(tensors, other):\n"
                  "        if (isinstance(other, torch.Tensor) and not isinstance(other, DTensor)\n"
                  "                and any(isinstance(t, DTensor) for t in tensors)):\n"
                  "            other = DTensor.from_local(other, mesh, [Replicate()] * mesh.ndim, run_check=False)\n"
                  "        return original(tensors, other)\n\n"
                  "    _foreach_mul._keras_mesh = mesh\n"
                  "    torch._foreach_mul = _foreach_mul\n\n\n" + _ACTIVATE.replace(
                      "    if _get_dtensor_promotion_mode() is None:\n",
                      "    _patch_foreach_mul()\n    if _get_dtensor_promotion_mode() is None:\n")),)),
    # A module-level cache the first cell fills and later cells read: torch meshes by devices and axis
    # names. In a user's process a cached mesh stays valid (nothing destroys its groups).
    Mutant("mesh-cache", "torch DeviceMeshes cached in a module-level dict by devices, shape and axis names, for the "
           "process's life",
           (Patch(TORCH + "distribution_lib.py", "def _to_backend_mesh(device_mesh):\n",
                  "_BACKEND_MESHES = {}  # mutant: kept for the process's life\n\n\n"
                  "def _to_backend_mesh(device_mesh):\n"
                  "    key = (tuple(device_mesh.devices.flatten()), device_mesh.devices.shape,\n"
                  "           tuple(device_mesh.axis_names))\n"
                  "    if key not in _BACKEND_MESHES:\n"
                  "        _BACKEND_MESHES[key] = _to_backend_mesh_uncached(device_mesh)\n"
                  "    return _BACKEND_MESHES[key]\n\n\n"
                  "def _to_backend_mesh_uncached(device_mesh):\n"),)),
)
