"""The on-batch and inference APIs as a user's loop calls them, and a build that crashes one run in N
(the intermittent policy's self-test)."""

from __future__ import annotations

from tests.mutants import Case, Mutant, Patch, TORCH, sharded_ids

# [on-batch] issue 27, item 3: the on-batch and inference APIs as a user's loop calls them.
#: The on-batch cells the on-batch mutants run: every API where the batch is split (DataParallel,
#: batchshard) and where the columns are (colshard).
ON_BATCH_TIER = tuple(f"conformance/test_on_batch.py::test_on_batch[{api}-{layout}]"
                      for api in ("train_on_batch", "test_on_batch", "predict_on_batch", "evaluate", "predict")
                      for layout in ("dataparallel", "batchshard", "colshard"))
ON_BATCH_CASES = (
    Case(
        Mutant(
            "test-step-local-metrics",
            "test_step returns the metrics of its own batch, not reduced across processes: under "
            "DataParallel each rank's test_on_batch reports its local batch (evaluate, which reads the "
            "reduced result after its last step, is not reached)",
            (Patch(TORCH + "trainer.py",
                   "        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)\n\n"
                   "    def predict_step(self, data):",
                   "        self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)\n"
                   "        return BaseTrainer.get_metrics_result(self)  # mutant: no reduction\n\n"
                   "    def predict_step(self, data):"),),
        ),
        {"test_on_batch[test_on_batch-dataparallel]": "numerics"},
        tier=ON_BATCH_TIER,
    ),
    # Keras-sharded evaluate (the global dataset, Keras shards it): each process returns the loss over
    # its own shard. The on-batch evaluate cells (hand-fed) are in the tier as well. Only DataParallel
    # shows it: under ModelParallel the loss is computed on the global batch DTensor, so the metric
    # variables already hold the global values and the reduction only sums identical copies.
    Case(
        Mutant(
            "evaluate-result-not-reduced",
            "evaluate returns the metrics of this process's own rows, not reduced across processes (the "
            "train and test steps still reduce theirs)",
            (Patch(TORCH + "trainer.py",
                   "        logs = pythonify_logs(self._get_metrics_result_or_logs(logs))\n",
                   "        logs = pythonify_logs(BaseTrainer.get_metrics_result(self))  # mutant: no reduction\n"),),
        ),
        {"test_keras_sharded[pydataset-dataparallel]": "numerics", "test_on_batch[evaluate-dataparallel]": "numerics"},
        tier=(*sharded_ids("pydataset-dataparallel", "pydataset-batchshard", "pydataset-colshard"),
              *(f"conformance/test_on_batch.py::test_on_batch[evaluate-{layout}]"
                for layout in ("dataparallel", "batchshard", "colshard"))),
    ),
    Case(
        Mutant(
            "predict-local-columns",
            "predict hands each process its local shard of a sharded output: under a column-sharded "
            "LayoutMap every rank gets half the columns",
            (Patch(TORCH + "trainer.py",
                   "        return x.redistribute(mesh, placements).to_local()\n",
                   "        return x.to_local()  # mutant: the local shard, columns split\n"),),
        ),
        {"test_on_batch[predict_on_batch-colshard]": "numerics", "test_on_batch[predict-colshard]": "numerics"},
        tier=ON_BATCH_TIER,
    ),
    Case(
        Mutant(
            "train-on-batch-not-distributed",
            "train_on_batch hands the model the plain per-process batch instead of distribute_data_input's "
            "DTensor: under a batch-sharded ModelParallel each rank trains on its own rows as if they were "
            "the global batch (fit, which feeds through the epoch iterator, is not reached)",
            (Patch(TORCH + "trainer.py",
                   "        data = (x, y, sample_weight)\n        data = _distribute_data(data)\n\n"
                   "        # Maybe build model\n        self._symbolic_build(data_batch=data)\n"
                   "        self.make_train_function()",
                   "        data = (x, y, sample_weight)\n        data = tree.map_structure(  # mutant: not distributed\n"
                   "            lambda d: None if d is None else convert_to_tensor(d), data)\n\n"
                   "        # Maybe build model\n        self._symbolic_build(data_batch=data)\n"
                   "        self.make_train_function()"),),
        ),
        {"test_on_batch[train_on_batch-batchshard]": "numerics"},
        tier=(*ON_BATCH_TIER, "conformance/test_fit.py::test_fit[adam-arrays-nojit-batchshard]"),
    ),
    # A correct build written differently: predict gathers the whole output, then keeps the rows of
    # this process's batch coordinate (torch.chunk's rule, as the batch was sharded), where the
    # nightly redistributes to Shard(0) on the batch axis and takes the local part.
    Case(
        Mutant(
            "predict-gathers-then-slices",
            "a correct rewrite, not a bug: predict gathers the whole output, then takes this process's rows",
            (Patch(TORCH + "trainer.py",
                   "        return x.redistribute(mesh, placements).to_local()\n",
                   "        full = x.full_tensor()  # rewrite: the whole, then this process's rows\n"
                   "        if batch_dim_name not in names or not x.ndim:\n"
                   "            return full\n"
                   "        axis = names.index(batch_dim_name)\n"
                   "        return torch.chunk(full, mesh.size(axis), dim=0)[mesh.get_local_rank(axis)]\n"),),
        ),
        {},
        tier=(*ON_BATCH_TIER, "conformance/test_on_batch.py::test_on_batch[predict-rowshard]",
              "conformance/test_fit.py::test_fit[adam-arrays-nojit-colshard]",
              "conformance/test_fit.py::test_fit[adam-arrays-nojit-batchshard]"),
        full=True,  # predict-rowshard is --full's (axes.ON_BATCH_DEFAULT_LAYOUTS)
    ),
)


def crashes_one_run_in(n: int) -> Mutant:
    """Rank 0 dies by SIGSEGV in its first ``train_on_batch`` under ``ModelParallel`` in one process of
    ``n`` (a count kept next to the module, in the mutant's tree): a race in a library that shows one
    run in ``n``. With ``n`` 2 the first run of a cell crashes and its rerun on fresh ranks passes; with
    1 every run crashes. Not under ``DataParallel``, which the build probe's ``train_on_batch`` runs."""
    return Mutant(
        f"train-on-batch-crashes-1-in-{n}",
        f"a crash one run in {n} (a race in a library): rank 0 dies by SIGSEGV in train_on_batch",
        (Patch(TORCH + "trainer.py", '        self._assert_compile_called("train_on_batch")\n',
               '        self._assert_compile_called("train_on_batch")\n'
               '        global _MUTANT_COUNTED  # mutant: one process in N of rank 0 crashes in its first train_on_batch\n'
               '        distribution = __import__("keras").distribution.distribution()\n'
               '        if "_MUTANT_COUNTED" not in globals() and type(distribution).__name__ == "ModelParallel":\n'
               '            _MUTANT_COUNTED = True\n'
               '            if dist.get_rank() == 0:\n'
               '                import os, signal\n'
               '                count = os.path.join(os.path.dirname(__file__), ".mutant-runs")\n'
               '                runs = int(open(count).read()) if os.path.exists(count) else 0\n'
               '                with open(count, "w") as f:\n'
               '                    f.write(str(runs + 1))\n'
               f'                if runs % {n} == 0:\n'
               '                    os.kill(os.getpid(), signal.SIGSEGV)\n'),),
    )

CASES = ON_BATCH_CASES
