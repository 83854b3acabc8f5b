"""Keras' own per-process data sharding (the Keras-sharded family and the hand-fed sources), and the
2x2 data x model mesh, where 1 < batch shards < processes."""

from __future__ import annotations

from tests.mutants import Case, DATA_ADAPTERS, Mutant, Patch, TORCH, fit_ids, sharded_ids

#: get_data_adapter's multi-process guard (written for tf.data on JAX and TensorFlow) lifted, so the
#: array and DataLoader adapters shard themselves: the rewrite adapters-shard-arrays-and-dataloaders,
#: and the base of the mutants that break that sharding.
_GUARD_LIFTED = Patch(DATA_ADAPTERS + "__init__.py",
                      '        and getattr(distribution, "_is_multi_process", False)\n',
                      '        and False  # rewrite: the torch adapters shard arrays and DataLoaders themselves\n')


#: The default tier's Keras-sharded cells, and the hand-fed ones of the same sources.
_KERAS_SHARDED_DEFAULT = (
    *sharded_ids("arrays-dataparallel", "tensors-batchshard", "dataloader-dataparallel",
                  "dataloader-sampler-batchshard", "iterable-dataparallel", "pydataset-dataparallel",
                  "pydataset-batchshard", "pydataset-colshard"),
    *fit_ids("adam-arrays-nojit-dataparallel", "adam-dataloader-nojit-batchshard"),
)




DATA_SHARDING_CASES = (
    # [issue 19: data sharding] Keras' own per-process sharding (test_data_sharding.py, the
    # Keras-sharded family) and the hand-fed sources off the column-sharded layout (item 4).
    Case(
        Mutant(
            "pydataset-not-sharded",
            "the PyDataset adapter ignores auto_shard_dataset: every process iterates every batch of the "
            "global dataset (the data-parallel replicas train on the same rows)",
            (Patch(DATA_ADAPTERS + "py_dataset_adapter.py",
                   '        if dist is not None and getattr(dist, "auto_shard_dataset", False):\n',
                   '        if False:  # mutant: never shard across processes\n'),),
        ),
        # colshard has one batch shard (every process is fed everything anyway); the hand-fed cells
        # set auto_shard_dataset=False: both must pass.
        {"test_keras_sharded[pydataset-dataparallel]": "data-not-sharded",
         "test_keras_sharded[pydataset-batchshard]": "data-not-sharded"},
        tier=(*sharded_ids("pydataset-dataparallel", "pydataset-batchshard", "pydataset-colshard"),
              *fit_ids("adam-pydataset-nojit-dataparallel", "adam-arrays-nojit-dataparallel")),
    ),
    # A correct build written differently: get_data_adapter's multi-process guard (written for tf.data
    # on JAX and TensorFlow) lifted, so the array and DataLoader adapters' own per-process sharding
    # runs, as the torch roadmap (keras-team/keras#23418) has it. The Keras-sharded cells the
    # nightly fails by refusing (UNMUTATED_FAILS) must pass; nothing else may change.
    Case(
        Mutant(
            "adapters-shard-arrays-and-dataloaders",
            "a correct rewrite, not a bug: arrays, tensors and DataLoaders sharded by their adapters",
            (_GUARD_LIFTED,),
        ),
        {},
        tier=_KERAS_SHARDED_DEFAULT,
    ),
    # The same rewrite with a DistributedSampler that each process seeds with its own rank: every
    # process shuffles alike within itself but the parts are cut from different permutations, so
    # rows overlap and others are never seen.
    Case(
        Mutant(
            "sampler-seed-per-rank",
            "the DataLoader adapter's DistributedSampler seeded per process (seed=rank): the shards come from "
            "different permutations, overlapping and missing rows",
            (_GUARD_LIFTED,
             Patch(DATA_ADAPTERS + "torch_data_loader_adapter.py",
                   "                    rank=self._data_shard_id,\n",
                   "                    rank=self._data_shard_id,\n"
                   "                    seed=self._data_shard_id,  # mutant: a seed per process\n"),),
        ),
        {"test_keras_sharded[dataloader-sampler-batchshard]": "data-not-sharded"},
        tier=sharded_ids("dataloader-sampler-batchshard", "dataloader-dataparallel", "arrays-dataparallel"),
    ),
    # Item 4: ModelParallel's _distribute_data leaves the sample weights the local plain tensor. With a
    # batch axis of one shard (colshard) the local part is the global batch and the promotion mode
    # makes it a correct replicated DTensor: only a batch-sharded cell sees the bug.
    Case(
        Mutant(
            "sample-weights-not-distributed",
            "under ModelParallel the trainer distributes x and y but leaves the sample weights the "
            "process's local plain tensor",
            (Patch(TORCH + "trainer.py",
                   "            layouts = tree.map_structure(get_layout, data)\n"
                   "        return tree.map_structure(\n"
                   "            lambda d, l: distribute_data_input(d, l),\n"
                   "            data,\n"
                   "            layouts,\n"
                   "        )\n",
                   "            layouts = tree.map_structure(get_layout, data)\n"
                   "        distributed = tree.map_structure(\n"
                   "            lambda d, l: distribute_data_input(d, l),\n"
                   "            data,\n"
                   "            layouts,\n"
                   "        )\n"
                   "        if isinstance(data, tuple) and len(data) == 3 and data[2] is not None:\n"
                   "            distributed = (*distributed[:2], convert_to_tensor(data[2]))  # mutant\n"
                   "        return distributed\n"),),
        ),
        {"test_fit[adam-sample-weights-nojit-batchshard]": "error"},
        tier=fit_ids("adam-sample-weights-nojit-batchshard", "adam-sample-weights-nojit-colshard",
                      "adam-sample-weights-nojit-dataparallel", "adam-dict-nojit-batchshard",
                      "adam-arrays-nojit-batchshard"),
    ),
)


# [issue 27, item 4: the data x model mesh] Only on the 2x2 mesh (4 ranks) are there more batch shards
# than one and fewer than processes: ranks (0, 1) form one batch shard and (2, 3) the other. Both cases
# lift get_data_adapter's multi-process guard (as adapters-shard-arrays-and-dataloaders does), so the
# array and DataLoader adapters shard too and the shard count reaches three sources; DataParallel (a
# shard per process) is the cell where a shard count from the process count is still right.
_MESH_SHARDED = sharded_ids("pydataset-batchxmodel", "arrays-batchxmodel", "dataloader-sampler-batchxmodel",
                             "pydataset-dataparallel")
MESH_CASES = (
    Case(
        Mutant(
            "data-shards-from-process-count",
            "the number of data shards taken from the process count wherever the batch is split at all "
            "(keras-team/keras#23045's review): 4 shards on the 2x2 mesh, whose shard ids are 0 and 1",
            (_GUARD_LIFTED,
             Patch("keras/src/distribution/distribution_lib.py",
                   "        return min(self.num_model_replicas, self.num_processes)\n",
                   "        return self.num_processes if self.num_model_replicas > 1 else 1  # mutant\n"),),
        ),
        {"test_keras_sharded[pydataset-batchxmodel]": "data-not-sharded",
         "test_keras_sharded[arrays-batchxmodel]": "data-not-sharded",
         "test_keras_sharded[dataloader-sampler-batchxmodel]": "data-not-sharded"},
        tier=_MESH_SHARDED,
        nproc=4,
    ),
    # A correct build written differently: the shard id as the process's proportion of the shard count,
    # with the guard lifted; every cell of the mesh tier passes, the two the nightly refuses included.
    Case(
        Mutant(
            "data-shard-id-by-proportion",
            "a correct rewrite, not a bug: data_shard_id = process_id * num_data_shards // num_processes, "
            "and the array and DataLoader adapters shard",
            (_GUARD_LIFTED,
             Patch("keras/src/distribution/distribution_lib.py",
                   "        num_model_replicas = self.num_model_replicas\n"
                   "        if num_model_replicas >= self.num_processes:\n",
                   "        return self._process_id * self.num_data_shards // self.num_processes  # rewrite\n"
                   "        num_model_replicas = self.num_model_replicas\n"
                   "        if num_model_replicas >= self.num_processes:\n"),),
        ),
        {},
        tier=_MESH_SHARDED,
        nproc=4,
    ),
)

CASES = (*DATA_SHARDING_CASES, *MESH_CASES)
