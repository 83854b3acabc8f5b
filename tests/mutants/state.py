"""What Keras must do itself with variables between processes: reconcile, checkpoints."""

from __future__ import annotations

from tests.mutants import Case, Mutant, Patch, TORCH

# [state] issue 19, items 2 and 3: what Keras must do itself with variables between processes.
#: The state cells the state mutants run (the default tier's), and a few others that they must not reach.
STATE_TIER = (*(f"conformance/test_state.py::{cell}" for cell in (
    "test_reconcile[colshard]", "test_checkpoint[optimizer-roundtrip-colshard]",
    "test_checkpoint[reshard-to-rowshard-colshard]")),
    "conformance/test_fit.py::test_fit[adam-arrays-nojit-dataparallel]",
    "conformance/test_ops.py::test_op[add-scalar-shard0-eager]",
    "conformance/test_setup.py::test_setup[list-devices]")
STATE_CASES = (
    Case(
        Mutant(
            "sharded-init-local-shape",
            "a sharded variable initialised shard by shard, each for its LOCAL shape with the process' own "
            "random stream (DTensor.from_local of a local draw): the ranks agree on the assembled tensor, "
            "which no global initialisation could have drawn (Glorot's bounds for the shard's fans are wider)",
            (Patch(TORCH + "ops/core.py",
                   "            value = initializer(self._shape, dtype=self._dtype)\n",
                   "            value = initializer(self._shape, dtype=self._dtype)\n"
                   "            if any(isinstance(p, torch.distributed.tensor.Shard)\n"
                   "                   for p in self._layout.placements):  # mutant: a local draw per shard\n"
                   "                from torch.distributed.tensor._utils import compute_local_shape_and_global_offset\n"
                   "                local_shape, _ = compute_local_shape_and_global_offset(\n"
                   "                    self._shape, self._layout.device_mesh, self._layout.placements)\n"
                   "                local = initializer(tuple(local_shape), dtype=self._dtype)\n"
                   "                local = local.to(self._layout.device_mesh.device_type)\n"
                   "                return torch.nn.Parameter(DTensor.from_local(\n"
                   "                    local, self._layout.device_mesh, self._layout.placements,\n"
                   "                    run_check=False), requires_grad=self.trainable)\n"),),
        ),
        {"test_reconcile[colshard]": "numerics"},
        tier=STATE_TIER,
    ),
    Case(
        Mutant(
            "load-skips-dtensor-slots",
            "loading a checkpoint skips the optimizer variables that are DTensors: sharded slots keep their "
            "fresh values (zeros) while iterations and the weights load, so training resumes with the "
            "moments lost",
            (Patch("keras/src/optimizers/base_optimizer.py",
                   "        for i, variable in enumerate(self.variables):\n            variable.assign(store[str(i)])\n",
                   "        for i, variable in enumerate(self.variables):\n"
                   "            if type(getattr(variable.value, \"data\", variable.value)).__name__ == \"DTensor\":\n"
                   "                continue  # mutant: sharded slots are not loaded\n"
                   "            variable.assign(store[str(i)])\n"),),
        ),
        {"test_checkpoint[optimizer-roundtrip-colshard]": "numerics",
         "test_checkpoint[reshard-to-rowshard-colshard]": "numerics"},
        tier=STATE_TIER,
    ),
    Case(
        Mutant(
            "load-drops-layout",
            "loading a checkpoint replaces each serialized variable (a Dense kernel and bias) by a plain "
            "Parameter of the saved array instead of assigning into the DTensor: the loaded model's weights "
            "are whole on every rank",
            (Patch("keras/src/layers/layer.py",
                   "            target.assign(value)\n            idx += 1\n",
                   "            target._value = __import__(\"torch\").nn.Parameter(  # mutant: the layout dropped\n"
                   "                __import__(\"torch\").as_tensor(__import__(\"numpy\").asarray(value)),\n"
                   "                requires_grad=target.trainable)\n"
                   "            idx += 1\n"),),
        ),
        {"test_checkpoint[optimizer-roundtrip-colshard]": "sharding-lost",
         "test_checkpoint[reshard-to-rowshard-colshard]": "sharding-lost"},
        tier=STATE_TIER,
    ),
    # A correct build written differently: a variable the layout leaves replicated is initialised on
    # every rank and then broadcast from rank 0 when it is created (DataParallel's, and ModelParallel's
    # unmapped ones), where the nightly leaves each rank its own draw until DDP wraps the model. The
    # reconcile cell the nightly fails then passes: the check passes a build that reconciles at build.
    Case(
        Mutant(
            "replicated-broadcast-at-build",
            "a correct rewrite, not a bug: replicated variables broadcast from rank 0 as they are created",
            (Patch(TORCH + "ops/core.py",
                   "            if all(axis is None for axis in self._layout.axes):\n                return None\n",
                   "            if all(axis is None for axis in self._layout.axes):\n"
                   "                if not torch.distributed.is_initialized():\n"
                   "                    return None\n"
                   "                value = initializer(self._shape, dtype=self._dtype) if callable(\n"
                   "                    initializer) else initializer  # rewrite: rank 0's value everywhere\n"
                   "                value = convert_to_tensor(value, dtype=self._dtype).detach().clone()\n"
                   "                torch.distributed.broadcast(value, src=0)\n"
                   "                return torch.nn.Parameter(value, requires_grad=self.trainable)\n"),),
        ),
        {},
        tier=(*STATE_TIER, "conformance/test_state.py::test_reconcile[dataparallel]"),
    ),
    # A correct build written differently: model.save lets rank 0 alone write the file while every rank
    # still runs the save (and its gathers). ModelCheckpoint with one path on every rank then writes it
    # once, every rank resumes from it, and the cell the nightly fails (two writers) passes; the round
    # trips, whose ranks load rank 0's file when they wrote none of their own, pass too.
    Case(
        Mutant(
            "save-rank0-writes",
            "a correct rewrite, not a bug: model.save writes the .keras file on rank 0 only",
            (Patch("keras/src/saving/saving_lib.py",
                   "        else:\n            with open(filepath, \"wb\") as f:\n"
                   "                _save_model_to_fileobj(model, f)\n",
                   "        elif __import__(\"torch\").distributed.is_initialized() and __import__(\n"
                   "                \"torch\").distributed.get_rank() != 0:  # rewrite: only rank 0 writes\n"
                   "            _save_model_to_fileobj(model, io.BytesIO())\n"
                   "        else:\n            with open(filepath, \"wb\") as f:\n"
                   "                _save_model_to_fileobj(model, f)\n"),),
        ),
        {},
        tier=(*STATE_TIER, "conformance/test_state.py::test_checkpoint[modelcheckpoint-dataparallel]"),
    ),
)

CASES = STATE_CASES
