"""The training and op cells' blind spots, one mutant each (the oracle, local batches, slots, compile,
op placement, communication, agreement, top-k), on the kit's small tier."""

from __future__ import annotations

from tests.mutants import Case, Mutant, Patch, TIER, TORCH, cell_ids

_SHARDED = ("sgd-arrays-nojit-colshard", "adam-arrays-nojit-colshard", "adam-dataloader-nojit-rowshard",
            "adam-arrays-nojit-batchshard")
_FIT = (*_SHARDED, "adam-arrays-nojit-replicated", "adam-arrays-nojit-dataparallel", "sgd-arrays-jit-dataparallel")


#: The agreement cells the metrics mutants run: DataParallel's, and ModelParallel's that they must not reach.
AGREEMENT_TIER = tuple(f"conformance/test_agreement.py::{cell}" for cell in (
    "test_metrics[mae-dataparallel]", "test_metrics[weighted-mae-dataparallel]",
    "test_callbacks[earlystopping-dataparallel]", "test_callbacks[reducelronplateau-dataparallel]",
    "test_callbacks[modelcheckpoint-dataparallel]", "test_metrics[accuracy-colshard]",
    "test_metrics[mae-batchshard]", "test_callbacks[earlystopping-batchshard]"))




FIT_AND_OP_CASES = (
    Case(
        Mutant(
            "promotion-off",
            "set_distribution never enters KerasDTensorPromotionMode: ops mixing DTensors and plain tensors",
            (Patch(TORCH + "ops/core.py",
                   "    if _get_dtensor_promotion_mode() is None:\n        KerasDTensorPromotionMode().__enter__()\n",
                   "    return  # mutant: the promotion dispatch mode is never entered\n"),),
        ),
        {**{c: "mixed-tensor" for c in cell_ids(*_SHARDED, "adam-arrays-nojit-replicated")},
         "test_op[subtract-tensor-shard1-eager]": "mixed-tensor",
         "test_op[matmul-tensor-first-shard0-eager]": "mixed-tensor"},
    ),
    Case(
        Mutant(
            "foreach-plain-lr",
            "an optimizer's torch._foreach_* update mixes a plain learning-rate tensor into DTensor weights "
            "(the promotion mode does not see _foreach_ ops)",
            (Patch(TORCH + "ops/core.py",
                   "        if kwargs is None:\n            kwargs = {}\n\n        flat_args",
                   "        if kwargs is None:\n            kwargs = {}\n"
                   "        if \"_foreach_\" in str(func):  # mutant: optimizer updates are not promoted\n"
                   "            return func(*args, **kwargs)\n\n        flat_args"),),
        ),
        # Replicated too: under ModelParallel the inputs are DTensors, so the gradients of the
        # plain Parameters come out DTensors, and the unpromoted update mixes them with the weights.
        {c: "mixed-tensor" for c in cell_ids(*_SHARDED, "adam-arrays-nojit-replicated")},
    ),
    Case(
        Mutant(
            "batch-wrong-placement",
            "input batches made DTensors sharded on the feature axis instead of the batch axis",
            (Patch(TORCH + "distribution_lib.py",
                   "    return torch_distributed_tensor.DTensor.from_local(\n        per_process_batch,\n"
                   "        device_mesh=layout.device_mesh,\n        placements=layout.placements,\n",
                   "    return torch_distributed_tensor.DTensor.from_local(\n        per_process_batch,\n"
                   "        device_mesh=layout.device_mesh,\n        placements=[  # mutant: batch sharded on dim 1\n"
                   "            torch_distributed_tensor.Shard(1) if isinstance(p, torch_distributed_tensor.Shard) else p\n"
                   "            for p in layout.placements\n        ],\n"),),
        ),
        {"test_fit[adam-arrays-nojit-batchshard]": "error"},
    ),
    Case(
        Mutant(
            "variables-replicated",
            "variables created as plain replicated Parameters whatever the LayoutMap says",
            (Patch(TORCH + "ops/core.py",
                   "        dist = distribution()\n        if dist is None:\n            return None\n",
                   "        dist = distribution()\n        if True:  # mutant: never distribute a variable\n"
                   "            return None\n"),),
        ),
        {c: "sharding-lost" for c in cell_ids(*_SHARDED)},
    ),
    Case(
        Mutant(
            "slots-plain",
            "optimizer slots created as plain tensors, ignoring their variable's layout",
            (Patch("keras/src/optimizers/base_optimizer.py",
                   "            layout=getattr(reference_variable, \"_layout\", None),\n",
                   "            layout=None,  # mutant: slots never sharded\n"),),
        ),
        {c: "sharding-lost" for c in cell_ids("adam-arrays-nojit-colshard", "adam-dataloader-nojit-rowshard",
                                          "adam-arrays-nojit-batchshard")},
    ),
    Case(
        Mutant(
            "grad-scale-one-rank",
            # Scaled and shifted: Adam's update is invariant to a scale alone (up to epsilon), so a
            # bare `g * 2` passes Adam cells within tolerance; the shift is what no optimizer cancels.
            # On the local shard: a shift of a Partial DTensor would redistribute it, a collective
            # that rank 0 never joins (a crash, which is not the bug this imitates).
            "a gradient corrupted (scaled and shifted) on rank 1 only (a wrong reduction or scale on one rank)",
            (Patch(TORCH + "trainer.py",
                   "            # Update weights\n            with torch.no_grad():\n",
                   "            # Update weights\n"
                   "            if torch.distributed.is_initialized() and torch.distributed.get_rank() == 1:\n"
                   "                from torch.distributed.tensor import DTensor  # mutant\n"
                   "                gradients = [  # mutant\n"
                   "                    None if g is None else DTensor.from_local(\n"
                   "                        g.to_local() * 2 + 1e-2, g.device_mesh, g.placements,\n"
                   "                        run_check=False, shape=g.shape, stride=g.stride())\n"
                   "                    if isinstance(g, DTensor) else g * 2 + 1e-2\n"
                   "                    for g in gradients\n"
                   "                ]\n"
                   "            with torch.no_grad():\n"),),
        ),
        {c: "numerics" for c in cell_ids(*_FIT)},
    ),
    Case(
        Mutant(
            "rank0-waits",
            "rank 0 waits in a communication the other ranks never enter (as a rank-0-only collective does)",
            (Patch(TORCH + "trainer.py",
                   "            # Update weights\n            with torch.no_grad():\n",
                   "            # Update weights\n"
                   "            if torch.distributed.is_initialized() and torch.distributed.get_rank() == 0:\n"
                   "                torch.distributed.recv(torch.zeros(1), src=1)  # mutant: never sent\n"
                   "            with torch.no_grad():\n"),),
        ),
        {"test_fit[sgd-arrays-nojit-colshard]": "hang"},
        tier=(TIER[0], TIER[-2], TIER[-1]),
        rank_timeout=20,
    ),
    Case(
        Mutant(
            "jit-disabled",
            "jit_compile=True silently runs eagerly (also where compiling works, under DataParallel)",
            (Patch(TORCH + "trainer.py",
                   "    def _use_torch_compile(self):\n        if self.run_eagerly or not self.jit_compile:\n",
                   "    def _use_torch_compile(self):\n        if True:  # mutant: never compile\n"),),
        ),
        {"test_fit[sgd-arrays-jit-dataparallel]": "compile-fallback"},
    ),
    # One section per blind spot that a mutant proves closed; each Case goes right below its marker.
    # [oracle]
    Case(
        Mutant(
            "adam-bias-correction-ahead",
            "Adam's bias correction a step ahead (beta**(iterations + 2)): a maths bug the single-process "
            "reference shares, so only the NumPy oracle sees it (+0 would divide 0 by 0: NaN, which the "
            "reference comparison already catches)",
            (Patch(TORCH + "optimizers/torch_adam.py",
                   "        local_step = ops.cast(self.iterations + 1, dtype)\n",
                   "        local_step = ops.cast(self.iterations + 2, dtype)  # mutant: a step ahead\n"),),
        ),
        {c: "numerics" for c in cell_ids("adam-arrays-nojit-colshard", "adam-dataloader-nojit-rowshard",
                                     "adam-arrays-nojit-replicated", "adam-arrays-nojit-batchshard",
                                     "adam-arrays-nojit-dataparallel")},
        tier=TIER[:7],  # the fit cells: a training-maths bug, which op and setup cells never reach
    ),
    # [local-batches]
    Case(
        Mutant(
            "dataparallel-no-allreduce",
            "DataParallel never all-reduces gradients (train_step bypasses the DistributedDataParallel "
            "forward, so DDP's reducer never runs): each process steps on its local batch's gradient. "
            "Invisible while every rank fed the whole batch; each rank feeding its own part of the global "
            "batch (rank_train.batch_part) exposes it",
            (Patch(TORCH + "trainer.py",
                   "        # Compute predictions\n        model = self.ddp_model or self\n",
                   "        # Compute predictions\n        model = self  # mutant: DDP forward bypassed\n"),),
        ),
        {c: "numerics" for c in cell_ids("adam-arrays-nojit-dataparallel", "sgd-arrays-jit-dataparallel")},
    ),
    # [slots]
    Case(
        Mutant(
            "slots-renamed",
            "optimizer slots named without their variable's path (momentum_3 instead of "
            "mlp_dense_a_kernel_momentum): a slot check that matches slots by Keras' naming finds none",
            (Patch("keras/src/optimizers/base_optimizer.py",
                   "            name = f\"{reference_variable.path.replace('/', '_')}_{name}\"\n",
                   "            name = f\"{name}_{len(self._variables)}\"  # mutant: no variable path\n"),),
        ),
        # SGD keeps no slot; replicated and DataParallel cells shard no variable.
        {c: "sharding-lost" for c in cell_ids("adam-arrays-nojit-colshard", "adam-dataloader-nojit-rowshard",
                                          "adam-arrays-nojit-batchshard")},
    ),
    # [compile]
    Case(
        Mutant(
            "graph-break-mid-step",
            "a compiled train step that breaks between the loss and the backward: graphs still "
            "compile, but the code between them runs eagerly",
            (Patch(TORCH + "trainer.py",
                   "        # Compute gradients\n        if self.trainable_weights:\n",
                   "        torch._dynamo.graph_break()  # mutant: the step splits before the backward\n"
                   "        # Compute gradients\n        if self.trainable_weights:\n"),),
        ),
        {"test_fit[sgd-arrays-jit-dataparallel]": "compile-fallback"},
    ),
    # [op-placement]
    Case(
        Mutant(
            "add-gathers",
            "keras.ops.add gathers its DTensor result to a plain tensor (right values, sharding lost)",
            (Patch(TORCH + "ops/numpy.py",
                   "    return torch.add(x1, x2)\n",
                   "    result = torch.add(x1, x2)\n"
                   "    return result.full_tensor() if hasattr(result, \"full_tensor\") else result  # mutant\n"),),
        ),
        {"test_op[add-scalar-shard0-eager]": "sharding-lost",
         "test_op[add-tensor-shard1-eager]": "sharding-lost",
         "test_op[add-dtensor-shard0-eager]": "sharding-lost"},
        tier=("conformance/test_ops.py::test_op[add-scalar-shard0-eager]",
              "conformance/test_ops.py::test_op[add-tensor-shard1-eager]",
              "conformance/test_ops.py::test_op[add-dtensor-shard0-eager]",
              "conformance/test_ops.py::test_op[subtract-tensor-shard1-eager]",
              "conformance/test_ops.py::test_op[relu-shard0-eager]",
              "conformance/test_setup.py::test_setup[list-devices]"),
    ),
    # A correct build written differently: max along an axis as torch.max(x, dim).values, which on a
    # DTensor sharded along that axis completes the reduction (a replicated result) where the
    # twin, torch.amax, leaves it pending (P(max)). Both are right: every cell must pass.
    Case(
        Mutant(
            "max-as-torch-max",
            "a correct rewrite, not a bug: keras.ops.max along one axis as torch.max(x, dim).values",
            (Patch(TORCH + "ops/numpy.py",
                   "        result = torch.amax(x, dim=axis, keepdim=keepdims)\n",
                   "        result = (torch.max(x, dim=axis, keepdim=keepdims).values if isinstance(axis, int)\n"
                   "                  else torch.amax(x, dim=axis, keepdim=keepdims))  # rewrite\n"),),
        ),
        {},
        tier=("conformance/test_ops.py::test_op[max-axis0-shard0-eager]",
              "conformance/test_ops.py::test_op[max-axis1-shard1-eager]",
              "conformance/test_ops.py::test_op[max-axis1-shard0-eager]",
              "conformance/test_ops.py::test_op[max-axis0-replicate-eager]"),
    ),
    # [communication]
    Case(
        Mutant(
            "gradients-gathered",
            "every sharded gradient made a full tensor (full_tensor()) before the optimizer update, the "
            "kind of fix a mixed-tensor error invites: the promotion mode slices the update back onto the "
            "shards, so values and placements stay right while every rank materialises every full "
            "gradient every step",
            (Patch(TORCH + "trainer.py",
                   "            # Update weights\n            with torch.no_grad():\n"
                   "                self.optimizer.apply(gradients, trainable_weights)\n",
                   "            # Update weights\n"
                   "            from torch.distributed.tensor import DTensor  # mutant\n"
                   "            gradients = [  # mutant: every sharded gradient made whole\n"
                   "                g.full_tensor() if isinstance(g, DTensor) else g for g in gradients\n"
                   "            ]\n"
                   "            with torch.no_grad():\n"
                   "                self.optimizer.apply(gradients, trainable_weights)\n"),),
        ),
        {c: "over-budget" for c in cell_ids("sgd-arrays-nojit-colshard", "adam-arrays-nojit-colshard",
                                        "adam-dataloader-nojit-rowshard")},
        tier=TIER[:7],
    ),
    # [no-distribution]
    # [scenarios]
    # [agreement]
    Case(
        Mutant(
            "dataparallel-metrics-not-reduced",
            "DataParallel stops all-reducing metric variables: each replica reports its own local batch's "
            "metrics (and loss), so callbacks on different ranks decide on different values",
            (Patch(TORCH + "trainer.py",
                   "    def get_metrics_result(self):\n        if not torch.distributed.is_initialized():\n",
                   "    def get_metrics_result(self):\n"
                   "        if not torch.distributed.is_initialized() or isinstance(\n"
                   "            distribution(), DataParallel\n"
                   "        ):  # mutant: replicas report their own batch\n"),),
        ),
        {**{f"test_metrics[{m}-dataparallel]": "numerics" for m in ("mae", "weighted-mae")},
         **{f"test_callbacks[{c}-dataparallel]": "numerics"
            for c in ("earlystopping", "reducelronplateau", "modelcheckpoint")}},
        tier=AGREEMENT_TIER,
    ),
    # A correct build written differently: metrics that see the global batch (DataParallel gathers
    # y, y_pred and sample weights before updating the compiled metrics; ModelParallel's DTensor
    # states already hold it), so only the loss tracker's local sums are all-reduced. A running
    # maximum is then the global one, as in one process: every agreement cell must pass, the max
    # cells that the nightly fails (by summing maxima) included.
    Case(
        Mutant(
            "metrics-over-global-batch",
            "a correct rewrite, not a bug: metrics updated on the gathered global batch, only the loss "
            "tracker all-reduced",
            (Patch(TORCH + "trainer.py",
                   "    def get_metrics_result(self):\n        if not torch.distributed.is_initialized():\n",
                   "    def compute_metrics(self, x, y, y_pred, sample_weight=None):  # rewrite\n"
                   "        active = distribution()\n"
                   "        if torch.distributed.is_initialized() and not isinstance(active, ModelParallel):\n"
                   "            group = None if active is None else active.device_mesh.backend_mesh.get_group(\n"
                   "                active.batch_dim_name)\n"
                   "\n"
                   "            def gather(t):\n"
                   "                if not isinstance(t, torch.Tensor):\n"
                   "                    return t\n"
                   "                t = t.detach().contiguous()\n"
                   "                parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]\n"
                   "                dist.all_gather(parts, t, group=group)\n"
                   "                return torch.cat(parts)\n"
                   "\n"
                   "            y, y_pred, sample_weight = tree.map_structure(gather, (y, y_pred, sample_weight))\n"
                   "        return super().compute_metrics(x, y, y_pred, sample_weight=sample_weight)\n"
                   "\n"
                   "    def get_metrics_result(self):\n        if not torch.distributed.is_initialized():\n"),
             Patch(TORCH + "trainer.py",
                   "            reduced_vars = []\n            for v in self.metrics_variables:\n",
                   "            reduced_vars = []\n"
                   "            loss_state = {id(v) for v in self._loss_tracker.variables}  # rewrite\n"
                   "            for v in self.metrics_variables:\n"),
             Patch(TORCH + "trainer.py",
                   "                    ).to_local()\n                dist.all_reduce(\n",
                   "                    ).to_local()  # rewrite: already the global batch's\n"
                   "                elif id(v) in loss_state:  # rewrite: only the loss tracker is local\n"
                   "                  dist.all_reduce(\n"),
             ),
        ),
        {},
        tier=(*AGREEMENT_TIER, "conformance/test_agreement.py::test_metrics[max-dataparallel]",
              "conformance/test_agreement.py::test_metrics[max-batchshard]"),
    ),
)


# [top-k] issue 54, item 4: a top-k metric over logits sharded on the model axis.
TOP_K_TIER = tuple(f"conformance/test_agreement.py::test_metrics[{cell}]" for cell in (
    "top2-colshard", "top2-rowshard", "accuracy-colshard", "mae-dataparallel"))
_TOP_K_INPUT = ("    reshape_matches = False\n    y_pred = ops.convert_to_tensor(y_pred)\n"
                "    y_true_dtype = y_pred.dtype if from_sorted_ids else \"int32\"\n")
TOP_K_CASES = (
    Case(
        Mutant(
            "top-k-over-local-shard",
            "SparseTopKCategoricalAccuracy takes the top k of each rank's local columns of sharded logits",
            (Patch("keras/src/metrics/accuracy_metrics.py", _TOP_K_INPUT,
                   _TOP_K_INPUT.replace("    y_true_dtype",
                                        "    if type(y_pred).__name__ == \"DTensor\":  # mutant: the local shard's top k\n"
                                        "        y_pred = y_pred.to_local()\n    y_true_dtype", 1)),),
        ),
        # column-sharded logits: the top 2 of each rank's own 2 columns; row-sharded ones come out split along
        # the batch, so the local shard has half the rows of the labels
        {"test_metrics[top2-colshard]": "numerics", "test_metrics[top2-rowshard]": "error"},
        tier=TOP_K_TIER,
    ),
    # A correct build written differently: the top k of sharded logits taken over the gathered whole.
    Case(
        Mutant(
            "top-k-over-gathered-logits",
            "a correct rewrite, not a bug: SparseTopKCategoricalAccuracy gathers sharded logits whole first",
            (Patch("keras/src/metrics/accuracy_metrics.py", _TOP_K_INPUT,
                   _TOP_K_INPUT.replace("    y_true_dtype",
                                        "    if type(y_pred).__name__ == \"DTensor\":  # rewrite: over all columns\n"
                                        "        y_pred = y_pred.full_tensor()\n    y_true_dtype", 1)),),
        ),
        {},
        tier=TOP_K_TIER,
    ),
)

CASES = (*FIT_AND_OP_CASES, *TOP_K_CASES)
