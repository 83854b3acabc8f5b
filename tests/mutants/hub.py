"""The models users shard: KerasHub's causal LMs under their authors' layout maps (issue 64)."""

from __future__ import annotations

from tests.mutants import Case, Mutant, Patch, TORCH, fit_ids


def hub_ids(*names: str) -> tuple[str, ...]:
    return tuple(f"conformance/test_hub.py::test_hub[{n}]" for n in names)


DISTRIBUTION = "keras/src/distribution/distribution_lib.py"
CORE = TORCH + "ops/core.py"
#: Gemma's cells the default build passes, on its authors' map, a user's map and DataParallel, and a training
#: cell of the suite's own attention model (3-D kernels too) on column-split kernels.
HUB_TIER = (*hub_ids("gemma-fit-sgd-authors", "gemma-fit-adamw-authors", "gemma-fit-sgd-ffn-only",
                     "gemma-fit-sgd-dataparallel", "gemma-lora-authors"),
            *fit_ids("attention-adam-arrays-nojit-colshard"))
#: generate's cells: the nightly fails them (its slice_update writes into a batch-sharded DTensor in place).
GENERATE_TIER = (*hub_ids("gemma-generate-authors", "gemma-fit-sgd-authors"),)
UNMUTATED_FAILS = {"test_hub[gemma-generate-authors]": "error"}

#: A correct ``slice_update`` written out of place (the nightly clones and writes in place, with ``copy_`` or
#: ``index_put_``): the update padded to the input's shape, where a mask of its region selects it. KerasHub's
#: sampler and KV cache update through it.
_SLICE_FAST = "        outputs = torch.clone(inputs)\n        outputs[tuple(slices)] = updates\n        return outputs\n"
_SLICE_SLOW = "    start_indices = convert_to_tensor(start_indices, dtype=\"int64\")\n    outputs = inputs.clone()\n"
_SLICE_DEF = "def slice_update(inputs, start_indices, updates):\n"


def _placed(shift: str = "") -> str:
    return ("def _placed(inputs, starts, updates):\n"
            "    \"\"\"``inputs`` with ``updates`` written at ``starts``, out of place.\"\"\"\n"
            "    pads = []\n"
            "    for dim in reversed(range(inputs.ndim)):\n"
            f"        start = int(starts[dim]){shift}\n"
            "        pads += [start, inputs.shape[dim] - updates.shape[dim] - start]\n"
            "    mask = torch.nn.functional.pad(torch.ones(updates.shape, dtype=torch.bool, device=inputs.device), pads)\n"
            "    return torch.where(mask, torch.nn.functional.pad(updates, pads).to(inputs.dtype), inputs)\n\n\n")


def _out_of_place(name: str, imitates: str, shift: str = "") -> Mutant:
    return Mutant(name, imitates, (
        Patch(CORE, _SLICE_FAST, "        return _placed(inputs, [s.start for s in slices], updates)  # out of place\n"),
        Patch(CORE, _SLICE_SLOW, "    return _placed(inputs, convert_to_tensor(start_indices, dtype=\"int64\"), updates)\n"
                                 "    outputs = inputs.clone()\n"),
        Patch(CORE, _SLICE_DEF, _placed(shift) + _SLICE_DEF),
    ))


HUB_CASES = (
    Case(
        Mutant(
            "einsum-kernels-ignore-the-map",
            "ModelParallel lays out the variables its LayoutMap names unless they have three dimensions: the "
            "attention's 3-D EinsumDense kernels stay whole, replicated",
            (Patch(DISTRIBUTION,
                   "        variable_layout = self._layout_map[variable.path]\n        if variable_layout is not None:\n"
                   "            return variable_layout\n",
                   "        variable_layout = self._layout_map[variable.path]\n"
                   "        if variable_layout is not None and len(variable.shape) < 3:  # mutant: 3-D kernels left out\n"
                   "            return variable_layout\n"),),
        ),
        {"test_hub[gemma-fit-sgd-authors]": "sharding-lost", "test_hub[gemma-fit-adamw-authors]": "sharding-lost",
         "test_hub[gemma-lora-authors]": "sharding-lost", "test_fit[attention-adam-arrays-nojit-colshard]": "sharding-lost"},
        tier=HUB_TIER,
    ),
    Case(
        Mutant(
            "unnamed-variables-sharded",
            "ModelParallel gives a variable its LayoutMap does not name a default layout split on the model axis "
            "where it divides, instead of replicating it (KerasHub's norms, the attention model's LayerNormalization)",
            (Patch(DISTRIBUTION,
                   "        if variable_layout is not None:\n            return variable_layout\n"
                   "        variable_shard_spec = [None] * len(variable.shape)\n"
                   "        return TensorLayout(variable_shard_spec, self.device_mesh)\n\n"
                   "    def get_tensor_layout(self, path):\n        return self._layout_map[path]\n",
                   "        if variable_layout is not None:\n            return variable_layout\n"
                   "        variable_shard_spec = [None] * len(variable.shape)\n"
                   "        model = self.device_mesh.shape[self.device_mesh.axis_names.index('model')]\n"
                   "        if len(variable.shape) == 1 and variable.shape[0] % model == 0:  # mutant\n"
                   "            variable_shard_spec = ['model']\n"
                   "        return TensorLayout(variable_shard_spec, self.device_mesh)\n\n"
                   "    def get_tensor_layout(self, path):\n        return self._layout_map[path]\n"),),
        ),
        # The suite's attention model too: its LayerNormalization's scale and offset (8 each) split.
        {"test_hub[gemma-fit-sgd-authors]": "sharding-lost", "test_hub[gemma-fit-adamw-authors]": "sharding-lost",
         "test_hub[gemma-fit-sgd-ffn-only]": "sharding-lost", "test_hub[gemma-lora-authors]": "sharding-lost",
         "test_fit[attention-adam-arrays-nojit-colshard]": "sharding-lost"},
        tier=HUB_TIER,
    ),
    Case(
        Mutant(
            "lora-update-lost-under-model-parallel",
            "under ModelParallel the train step leaves LoRA's kernels out of the variables it updates: fine-tuning "
            "trains nothing, and the frozen backbone stays as it was",
            (Patch(TORCH + "trainer.py",
                   "            trainable_weights = self.trainable_weights[:]\n",
                   "            trainable_weights = [  # mutant: LoRA's kernels left out under ModelParallel\n"
                   "                v for v in self.trainable_weights\n"
                   "                if not isinstance(distribution(), ModelParallel) or \"lora_kernel\" not in v.path\n"
                   "            ]\n"),),
        ),
        {"test_hub[gemma-lora-authors]": "numerics"},
        tier=HUB_TIER,
    ),
    # A correct build written differently: slice_update out of place. generate then runs on a batch-sharded
    # prompt and gives one process's ids, where the nightly raises.
    Case(_out_of_place("slice-update-out-of-place",
                       "a correct rewrite, not a bug: slice_update (KerasHub's sampler and KV cache) out of place"),
         {}, tier=GENERATE_TIER),
    Case(_out_of_place("kv-cache-written-one-late",
                       "slice_update, out of place as the rewrite, writes a one-position update of a sharded tensor "
                       "one position late (an index taken from the local shard's offset): the KV cache's entry and "
                       "the sampler's next token land beside their place",
                       shift=(" + (isinstance(inputs, DTensor) and dim == 1 and updates.shape[1] == 1"
                              " and int(starts[dim]) + 1 < inputs.shape[1])")),
         {"test_hub[gemma-generate-authors]": "numerics"}, tier=GENERATE_TIER),
)

CASES = HUB_CASES
