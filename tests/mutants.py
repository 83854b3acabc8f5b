"""The mutation kit: patched copies of a Keras build, each imitating a real bug.

A mutant is the default build (an unpacked keras-nightly wheel) with a few exact text
replacements. Every replacement must match exactly once, so a mutant that no longer
applies to a new build fails loudly instead of silently testing the unmodified build.
The copy is made of hard links except for the patched files, so writing one costs
milliseconds.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import shutil

from conformance import axes


@dataclasses.dataclass(frozen=True)
class Patch:
    path: str  # relative to the tree root, e.g. "keras/src/optimizers/base_optimizer.py"
    old: str
    new: str


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    imitates: str  # the real bug it stands for
    patches: tuple[Patch, ...]


def write_mutant(source_tree: str, dest: str, mutant: Mutant) -> str:
    """Copy ``source_tree`` to ``dest`` (hard links, its bytecode too) and apply the mutant's
    patches there; a patched module's bytecode is removed, so it compiles from the patch."""
    if os.path.exists(dest):
        shutil.rmtree(dest)
    shutil.copytree(source_tree, dest, copy_function=os.link)
    for patch in mutant.patches:
        target = os.path.join(dest, patch.path)
        folder, module = os.path.split(target)
        for compiled in glob.glob(os.path.join(folder, "__pycache__", os.path.splitext(module)[0] + ".*.pyc")):
            os.unlink(compiled)
        with open(target, encoding="utf-8") as f:
            text = f.read()
        count = text.count(patch.old)
        if count != 1:
            raise ValueError(f"mutant {mutant.name}: {patch.path} has {count} matches for {patch.old!r}, not 1")
        os.unlink(target)  # break the hard link: the source tree stays unmodified
        with open(target, "w", encoding="utf-8") as f:
            f.write(text.replace(patch.old, patch.new))
    return dest


SLOW_OPTIMIZER = Mutant(
    name="slow-optimizer-update",
    imitates="a step-time regression: extra host work in every optimizer update",
    patches=(
        Patch(
            "keras/src/optimizers/base_optimizer.py",
            "        if len(grads) == 0:\n            # It is possible that the grad is empty. In this case,\n",
            "        __import__(\"time\").sleep(0.1)  # mutant: 100 ms of host work per update\n"
            "        if len(grads) == 0:\n            # It is possible that the grad is empty. In this case,\n",
        ),
    ),
)


_DDP_WRAP = (
    "                object.__setattr__(\n"
    "                    self,\n"
    '                    "ddp_model",\n'
    "                    DistributedDataParallel(\n"
    "                        self,\n"
    "                        device_ids=device_ids,\n"
    "                        process_group=process_group,\n"
    "                        find_unused_parameters=False,\n"
    "                    ),\n"
    "                )\n"
)
_BEFORE_UPDATE = "            # Update weights\n            with torch.no_grad():\n"

#: A correct DataParallel written differently (issue 25, item 5): no DistributedDataParallel; the
#: weights broadcast once from the group's first process, every gradient all-reduced and averaged
#: after backward. It moves each gradient's bytes once, as DDP's buckets do.
DATAPARALLEL_WITHOUT_DDP = Mutant(
    "dataparallel-without-ddp",
    "a DataParallel trainer that synchronises by hand: weights broadcast once, each gradient all-reduced once",
    (Patch("keras/src/backend/torch/trainer.py",
           "        if torch.distributed.is_initialized() and self.ddp_model is None:\n",
           "        if (torch.distributed.is_initialized() and self.ddp_model is None\n"
           "                and getattr(self, '_sync_group', None) is None):  # mutant\n"),
     Patch("keras/src/backend/torch/trainer.py", _DDP_WRAP,
           "                group = process_group or dist.group.WORLD  # mutant: no DDP\n"
           "                for v in self.weights:\n"
           "                    dist.broadcast(v.value.data, src=dist.get_global_rank(group, 0), group=group)\n"
           "                object.__setattr__(self, '_sync_group', group)\n"),
     Patch("keras/src/backend/torch/trainer.py", _BEFORE_UPDATE,
           "            group = getattr(self, '_sync_group', None)  # mutant: each gradient once\n"
           "            for g in gradients if group is not None else ():\n"
           "                if g is not None:\n"
           "                    dist.all_reduce(g, group=group)\n"
           "                    g.div_(dist.get_world_size(group))\n" + _BEFORE_UPDATE)),
)

#: DataParallel synchronising every gradient a second time after DDP averaged it: the numbers are
#: identical (an average of equal values), the traffic twice.
DATAPARALLEL_DOUBLE_SYNC = Mutant(
    "dataparallel-double-sync",
    "every gradient all-reduced and averaged again after DDP's buckets averaged it",
    (Patch("keras/src/backend/torch/trainer.py", _BEFORE_UPDATE,
           "            for g in gradients if self.ddp_model is not None else ():  # mutant: again\n"
           "                if g is not None:\n"
           "                    dist.all_reduce(g, group=self.ddp_model.process_group)\n"
           "                    g.div_(dist.get_world_size(self.ddp_model.process_group))\n" + _BEFORE_UPDATE),),
)


def slow_step(fraction: float) -> Mutant:
    """Every optimizer update adds ``fraction`` of a training step's CPU time in busy host work.

    Calibrated at run time: the update measures the process CPU time between its own calls (one
    step, less the work it added itself), takes the median of the last five (a round's boundary,
    or another pool's round in between, is then an outlier) and spins until the process has spent
    that fraction more, so the step costs ``fraction`` more CPU on any machine and any model,
    loaded or not. CPU time, not wall time: a rank's step spends part of its wall time waiting in
    collectives, so a spin of 10 % of the wall step made the CPU step 13-16 % dearer here (and the
    wall step 11-15 %), a larger regression than the one it was named for.
    """
    name = f"slow-step-{round(fraction * 100)}pct"
    return Mutant(
        name=name,
        imitates=f"a {fraction:.0%} step-time regression in the optimizer update",
        patches=(
            Patch(
                "keras/src/optimizers/base_optimizer.py",
                "        if len(grads) == 0:\n            # It is possible that the grad is empty. In this case,\n",
                f"        _clock, _state = __import__(\"time\").process_time, globals().setdefault(\"_MUTANT\", {{}})  # {name}\n"
                "        _now = _clock()\n"
                "        if \"last\" in _state:\n"
                "            _state[\"steps\"] = (_state.get(\"steps\", []) + [_now - _state[\"last\"] - _state[\"spun\"]])[-5:]\n"
                f"            _end = _now + {fraction!r} * sorted(_state[\"steps\"])[len(_state[\"steps\"]) // 2]\n"
                "            while _clock() < _end:\n"
                "                pass\n"
                "        _state[\"last\"], _state[\"spun\"] = _now, _clock() - _now\n"
                "        if len(grads) == 0:\n            # It is possible that the grad is empty. In this case,\n",
            ),
        ),
    )


# ------------------------------------------------------------------ the bug-imitating mutants
TORCH = "keras/src/backend/torch/"

#: The small tier every mutant runs (exact pytest node ids); the expected changes below are
#: relative to the unmutated build, on which every one of these cells passes.
TIER = (
    "conformance/test_fit.py::test_fit[sgd-arrays-nojit-colshard]",
    "conformance/test_fit.py::test_fit[adam-arrays-nojit-colshard]",
    "conformance/test_fit.py::test_fit[adam-dataloader-nojit-rowshard]",
    "conformance/test_fit.py::test_fit[adam-arrays-nojit-replicated]",
    "conformance/test_fit.py::test_fit[adam-arrays-nojit-batchshard]",
    "conformance/test_fit.py::test_fit[adam-arrays-nojit-dataparallel]",
    "conformance/test_fit.py::test_fit[sgd-arrays-jit-dataparallel]",
    "conformance/test_ops.py::test_op[subtract-tensor-shard1-eager]",
    "conformance/test_ops.py::test_op[matmul-tensor-first-shard0-eager]",
    "conformance/test_ops.py::test_op[add-scalar-shard0-eager]",
    "conformance/test_ops.py::test_op[relu-shard0-eager]",
    "conformance/test_setup.py::test_setup[list-devices]",
)


@dataclasses.dataclass(frozen=True)
class Case:
    """A mutant, the tier it runs, and the verdict each cell of that tier must get."""

    mutant: Mutant
    expected: dict  # cell name -> verdict; every other cell of the tier must pass
    tier: tuple[str, ...] = TIER
    #: --rank-timeout for the run: short only where a hang is the expected verdict (a real
    #: inductor compile of a jit cell can take longer than that on 2 busy cores).
    rank_timeout: int = 300
    #: --nproc for the run: 4 for a bug only the 2x2 mesh shows (1 < batch shards < processes).
    nproc: int = 2
    #: --full for the run: its tier names cells only --full collects.
    full: bool = False

    def verdict(self, cell: str) -> str:
        return self.expected.get(cell, "pass")


_SHARDED = ("sgd-arrays-nojit-colshard", "adam-arrays-nojit-colshard", "adam-dataloader-nojit-rowshard",
            "adam-arrays-nojit-batchshard")
_FIT = (*_SHARDED, "adam-arrays-nojit-replicated", "adam-arrays-nojit-dataparallel", "sgd-arrays-jit-dataparallel")


#: The agreement cells the metrics mutants run: DataParallel's, and ModelParallel's that they must not reach.
AGREEMENT_TIER = tuple(f"conformance/test_agreement.py::{cell}" for cell in (
    "test_metrics[mae-dataparallel]", "test_metrics[weighted-mae-dataparallel]",
    "test_callbacks[earlystopping-dataparallel]", "test_callbacks[reducelronplateau-dataparallel]",
    "test_callbacks[modelcheckpoint-dataparallel]", "test_metrics[accuracy-colshard]",
    "test_metrics[mae-batchshard]", "test_callbacks[earlystopping-batchshard]"))


def _ids(*names: str) -> list[str]:
    return [f"test_fit[{n}]" if "-arrays-" in n or "-dataloader-" in n else n for n in names]


# [issue 19: data sharding] helpers of that block, at the end of CASES
DATA_ADAPTERS = "keras/src/trainers/data_adapters/"


def _sharded_ids(*names: str) -> tuple[str, ...]:
    return tuple(f"conformance/test_data_sharding.py::test_keras_sharded[{n}]" for n in names)


def _fit_ids(*names: str) -> tuple[str, ...]:
    return tuple(f"conformance/test_fit.py::test_fit[{n}]" for n in names)


#: get_data_adapter's multi-process guard (written for tf.data on JAX and TensorFlow) lifted, so the
#: array and DataLoader adapters shard themselves: the rewrite adapters-shard-arrays-and-dataloaders,
#: and the base of the mutants that break that sharding.
_GUARD_LIFTED = Patch(DATA_ADAPTERS + "__init__.py",
                      '        and getattr(distribution, "_is_multi_process", False)\n',
                      '        and False  # rewrite: the torch adapters shard arrays and DataLoaders themselves\n')


#: The default tier's Keras-sharded cells, and the hand-fed ones of the same sources.
_KERAS_SHARDED_DEFAULT = (
    *_sharded_ids("arrays-dataparallel", "tensors-batchshard", "dataloader-dataparallel",
                  "dataloader-sampler-batchshard", "iterable-dataparallel", "pydataset-dataparallel",
                  "pydataset-batchshard", "pydataset-colshard"),
    *_fit_ids("adam-arrays-nojit-dataparallel", "adam-dataloader-nojit-batchshard"),
)


CASES = (
    Case(
        Mutant(
            "promotion-off",
            "set_distribution never enters KerasDTensorPromotionMode: ops mixing DTensors and plain tensors",
            (Patch(TORCH + "ops/core.py",
                   "    if _get_dtensor_promotion_mode() is None:\n        KerasDTensorPromotionMode().__enter__()\n",
                   "    return  # mutant: the promotion dispatch mode is never entered\n"),),
        ),
        {**{c: "mixed-tensor" for c in _ids(*_SHARDED, "adam-arrays-nojit-replicated")},
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
        {c: "mixed-tensor" for c in _ids(*_SHARDED, "adam-arrays-nojit-replicated")},
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
        {c: "sharding-lost" for c in _ids(*_SHARDED)},
    ),
    Case(
        Mutant(
            "slots-plain",
            "optimizer slots created as plain tensors, ignoring their variable's layout",
            (Patch("keras/src/optimizers/base_optimizer.py",
                   "            layout=getattr(reference_variable, \"_layout\", None),\n",
                   "            layout=None,  # mutant: slots never sharded\n"),),
        ),
        {c: "sharding-lost" for c in _ids("adam-arrays-nojit-colshard", "adam-dataloader-nojit-rowshard",
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
        {c: "numerics" for c in _ids(*_FIT)},
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
        {c: "numerics" for c in _ids("adam-arrays-nojit-colshard", "adam-dataloader-nojit-rowshard",
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
        {c: "numerics" for c in _ids("adam-arrays-nojit-dataparallel", "sgd-arrays-jit-dataparallel")},
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
        {c: "sharding-lost" for c in _ids("adam-arrays-nojit-colshard", "adam-dataloader-nojit-rowshard",
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
        {c: "over-budget" for c in _ids("sgd-arrays-nojit-colshard", "adam-arrays-nojit-colshard",
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
        tier=(*_sharded_ids("pydataset-dataparallel", "pydataset-batchshard", "pydataset-colshard"),
              *_fit_ids("adam-pydataset-nojit-dataparallel", "adam-arrays-nojit-dataparallel")),
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
        tier=_sharded_ids("dataloader-sampler-batchshard", "dataloader-dataparallel", "arrays-dataparallel"),
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
        tier=_fit_ids("adam-sample-weights-nojit-batchshard", "adam-sample-weights-nojit-colshard",
                      "adam-sample-weights-nojit-dataparallel", "adam-dict-nojit-batchshard",
                      "adam-arrays-nojit-batchshard"),
    ),
    # ---- issue 20: maths errors of the torch backend's own optimizer updates, outside the NumPy
    # oracle's core set, that single-process and distributed torch share: the same-build reference
    # passes them (the point), the JAX reference catches them as numerics. And an accumulation that
    # forgets to divide by its steps: caught with SGD, cancelled by Adam (adam-accum passes).
    *(Case(Mutant(f"jax-ref-{name}", imitates, (Patch(TORCH + f"optimizers/torch_{module}.py", old, new),)),
           {f"test_fit[{cell}-arrays-nojit-colshard]": "numerics"},
           tier=_fit_ids(f"{cell}-arrays-nojit-colshard", "sgd-arrays-nojit-colshard", "adam-arrays-nojit-colshard"))
      for name, module, cell, imitates, old, new in (
          ("adadelta", "adadelta", "adadelta", "Adadelta accumulates |g| instead of g**2",
           "accumulated_grads, torch._foreach_mul(grads, grads), alpha=1 - rho",
           "accumulated_grads, torch._foreach_abs(grads), alpha=1 - rho  # mutant"),
          ("adagrad", "adagrad", "adagrad", "Adagrad accumulates |g| instead of g**2",
           "torch._foreach_add_(accumulators, torch._foreach_mul(grads, grads))",
           "torch._foreach_add_(accumulators, torch._foreach_abs(grads))  # mutant"),
          ("adamax", "adamax", "adamax", "Adamax's infinity norm forgets the absolute value of g",
           "torch._foreach_maximum_(u_list, torch._foreach_abs(grads))",
           "torch._foreach_maximum_(u_list, grads)  # mutant"),
          ("lion", "lion", "lion", "Lion's momentum decays with beta_1 instead of beta_2",
           "torch._foreach_add_(m_list, grads, alpha=1 - self.beta_2)",
           "torch._foreach_add_(m_list, grads, alpha=1 - self.beta_1)  # mutant"),
          ("nadam", "nadam", "nadam", "Nadam's second-moment bias correction uses beta_2, not beta_2**t",
           "torch._foreach_div(v_list, 1 - beta_2_power)",
           "torch._foreach_div(v_list, 1 - ops.cast(self.beta_2, dtype))  # mutant"),
          ("amsgrad", "adam", "adam-amsgrad", "amsgrad keeps the maximum of g**2 instead of the second moment",
           "torch._foreach_maximum_(v_hat_list, v_list)",
           "torch._foreach_maximum_(v_hat_list, torch._foreach_mul(grads, grads))  # mutant"),
          ("rmsprop-centered", "rmsprop", "rmsprop-centered",
           "centered RMSprop adds the mean gradient's square instead of subtracting it",
           "torch._foreach_mul(average_grads, average_grads),\n                alpha=-1,",
           "torch._foreach_mul(average_grads, average_grads),\n                alpha=1,  # mutant"),
      )),
    # ---- issue 25, item 4: a correct torch backend with a wrong JAX backend. The base optimizer's
    # weight decay, which the torch backend overrides (TorchOptimizer._apply_weight_decay), forgets the
    # learning rate: only the JAX reference runs it. The NumPy oracle models AdamW and sides with
    # torch, so the cell names the JAX backend instead of failing the torch backend.
    Case(
        Mutant("jax-backend-weight-decay", "the base optimizer's weight decay without the learning rate (code only "
               "the JAX backend runs)",
               (Patch("keras/src/optimizers/base_optimizer.py",
                      "variable.assign(variable - variable * wd * lr)",
                      "variable.assign(variable - variable * wd)  # mutant: lr left out"),)),
        {"test_fit[adamw-arrays-nojit-colshard]": "jax-backend-differs"},
        tier=_fit_ids("adamw-arrays-nojit-colshard", "adam-arrays-nojit-colshard"),
    ),
    # ---- issue 25, item 3: a mutant for every promise and every check that can hold. These four
    # break what no other mutant of the kit breaks: the global batch, an op's value, a setup entry
    # point and a scenario.
    Case(
        Mutant("per-process-batch-split-again", "distribute_data_input takes each process's batch for the global "
               "one and splits it again over the batch axis (the shard count counted twice)",
               (Patch(TORCH + "distribution_lib.py",
                      "    return torch_distributed_tensor.DTensor.from_local(\n        per_process_batch,\n",
                      "    if isinstance(layout.placements[0], torch_distributed_tensor.Shard):  # mutant: split again\n"
                      "        count, index = layout.device_mesh.size(0), layout.device_mesh.get_coordinate()[0]\n"
                      "        rows = per_process_batch.shape[0] // count\n"
                      "        per_process_batch = per_process_batch[index * rows:(index + 1) * rows]\n"
                      "    return torch_distributed_tensor.DTensor.from_local(\n        per_process_batch,\n"),)),
        {"test_fit[adam-arrays-nojit-batchshard]": "numerics"},
        tier=_fit_ids("adam-arrays-nojit-batchshard", "adam-arrays-nojit-colshard", "adam-arrays-nojit-dataparallel"),
    ),
    Case(
        Mutant("promote-plain-as-partial", "the promotion mode makes a plain operand a Partial DTensor, not a "
               "Replicate one: every rank's copy is summed",
               (Patch(TORCH + "ops/core.py", "    placements = [Replicate()] * len(mesh.shape)\n",
                      "    placements = [torch.distributed.tensor.Partial()] * len(mesh.shape)  # mutant\n"),)),
        # relu has no plain operand: its value holds, and its compiled cell fails to compile as on
        # the unmutated build (the op-compiled check's failure, which no mutant adds).
        {"test_op[subtract-tensor-shard1-eager]": "numerics", "test_op[relu-shard0-compiled]": "compile-fallback"},
        tier=("conformance/test_ops.py::test_op[subtract-tensor-shard1-eager]",
              "conformance/test_ops.py::test_op[relu-shard0-eager]",
              "conformance/test_ops.py::test_op[relu-shard0-compiled]"),
    ),
    Case(
        Mutant("list-devices-local", "keras.distribution.list_devices() names this process's device only",
               (Patch(TORCH + "distribution_lib.py", '    return [f"{display_type}:{i}" for i in range(count)]\n',
                      '    return [f"{display_type}:0"]  # mutant: this process\'s device only\n'),)),
        {"test_setup[list-devices]": "error"},
        tier=("conformance/test_setup.py::test_setup[list-devices]", "conformance/test_setup.py::test_setup[device-mesh]",
              *_fit_ids("adam-arrays-nojit-colshard")),
    ),
    Case(
        Mutant("clear-session-keeps-distribution", "clear_session() leaves the distribution and its promotion mode "
               "in place", (Patch("keras/src/backend/common/global_state.py",
                                  "    distribution_lib.set_distribution(None)\n",
                                  "    pass  # mutant: the distribution survives clear_session\n"),)),
        {"test_scenario[clear-session-undoes-distribution]": "error"},
        tier=("conformance/test_scenarios.py::test_scenario[clear-session-undoes-distribution]",
              *_fit_ids("adam-arrays-nojit-colshard")),
    ),
    # ---- issue 25, item 5: DataParallel's communication budget, and a correct build without DDP.
    Case(DATAPARALLEL_DOUBLE_SYNC,
         {"test_fit[adam-arrays-nojit-dataparallel]": "over-budget", "test_fit[sgd-dataloader-nojit-dataparallel]":
          "over-budget"},
         tier=_fit_ids("adam-arrays-nojit-dataparallel", "sgd-dataloader-nojit-dataparallel",
                       "adam-arrays-nojit-colshard")),
    Case(DATAPARALLEL_WITHOUT_DDP, {},
         tier=_fit_ids("adam-arrays-nojit-dataparallel", "sgd-dataloader-nojit-dataparallel",
                       "adam-arrays-eager-dataparallel", "adam-arrays-nojit-colshard")),
    Case(
        Mutant("accumulation-no-divide", "gradient accumulation applies the SUM of its steps' gradients, not their mean",
               (Patch("keras/src/optimizers/base_optimizer.py",
                      "(g + acc_g) / steps for g, acc_g in zip(grads, acc_grads)",
                      "(g + acc_g) for g, acc_g in zip(grads, acc_grads)  # mutant"),)),
        # SGD's update is lr * g: every weight moves by the factor (measured: losses 0.033 off JAX's).
        # Adam cancels it up to its epsilon (m / (sqrt(v) + eps)): adam-accum was measured 2.5e-5 off
        # on one kernel, just over the tolerance, a margin this kit does not assert on.
        {"test_fit[sgd-accum-arrays-nojit-colshard]": "numerics"},
        tier=_fit_ids("sgd-accum-arrays-nojit-colshard", "sgd-arrays-nojit-colshard", "adam-arrays-nojit-colshard"),
    ),
)


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
        tier=(*_sharded_ids("pydataset-dataparallel", "pydataset-batchshard", "pydataset-colshard"),
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
CASES = (*CASES, *ON_BATCH_CASES)


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


# [lora] issue 27, item 2: LoRA fine-tuning on a sharded model.
#: The LoRA cells the LoRA mutants run, on the layouts that split the kernels and on DataParallel,
#: and MLP cells they must not reach.
LORA_TIER = (*_fit_ids(*(f"{model}-adam-arrays-nojit-{layout}" for model in ("lora", "lora-sharded")
                         for layout in ("colshard", "rowshard", "dataparallel"))),
             *_fit_ids("adam-arrays-nojit-colshard", "adam-arrays-nojit-dataparallel"))
DENSE = "keras/src/layers/core/dense.py"
#: What both LoRA bugs give: numerics on both models wherever the layout splits the kernels.
LORA_SPLIT_NUMERICS = {f"test_fit[{model}-adam-arrays-nojit-{layout}]": "numerics" for model in ("lora", "lora-sharded")
                       for layout in ("colshard", "rowshard")}
LORA_CASES = (
    Case(
        Mutant(
            "lora-kernels-left-out",
            "under ModelParallel the train step updates only the LoRA kernels that are DTensors: one the "
            "LayoutMap does not name (a plain replicated Parameter) is left out of the update",
            (Patch(TORCH + "trainer.py",
                   "            trainable_weights = self.trainable_weights[:]\n",
                   "            trainable_weights = [  # mutant: plain LoRA kernels left out\n"
                   "                v for v in self.trainable_weights\n"
                   "                if not isinstance(distribution(), ModelParallel) or \"lora_kernel\" not in v.path\n"
                   "                or isinstance(v.value, DTensor)\n"
                   "            ]\n"),),
        ),
        # lora-sharded under colshard and rowshard shards one LoRA kernel of each layer: the other is
        # left out, and with it the update of the pair.
        LORA_SPLIT_NUMERICS,
        tier=LORA_TIER,
        full=True,  # the LoRA cells beyond axes.LORA_DEFAULT are --full's
    ),
    Case(
        Mutant(
            "frozen-flag-lost-on-dtensor",
            "setting trainable on a sharded (DTensor) variable is ignored: enable_lora cannot freeze a "
            "sharded kernel, which then trains with the LoRA kernels",
            (Patch(TORCH + "ops/core.py",
                   "    def trainable(self, value):\n        self._trainable = value\n",
                   "    def trainable(self, value):\n"
                   "        if isinstance(getattr(self._value, \"data\", self._value), DTensor):\n"
                   "            return  # mutant: a sharded variable keeps its flag\n"
                   "        self._trainable = value\n"),),
        ),
        LORA_SPLIT_NUMERICS,
        tier=LORA_TIER,
        full=True,  # the LoRA cells beyond axes.LORA_DEFAULT are --full's
    ),
    # A correct build written differently: Dense with LoRA computes x @ kernel + scale * (x @ a) @ b,
    # the low-rank path that never forms the merged kernel, where the nightly adds a @ b to the
    # kernel first. Both backends run it; every LoRA cell must still pass.
    Case(
        Mutant(
            "lora-low-rank-path",
            "a correct rewrite, not a bug: LoRA applied on the low-rank path, the merged kernel never formed",
            (Patch(DENSE,
                   "    def call(self, inputs, training=None):\n        x = ops.matmul(inputs, self.kernel)\n",
                   "    def call(self, inputs, training=None):\n"
                   "        if self.lora_enabled and self._quantized_weight() is None:  # rewrite: low-rank path\n"
                   "            x = ops.add(ops.matmul(inputs, self._kernel), (self.lora_alpha / self.lora_rank)\n"
                   "                        * ops.matmul(ops.matmul(inputs, self.lora_kernel_a), self.lora_kernel_b))\n"
                   "        else:\n"
                   "            x = ops.matmul(inputs, self.kernel)\n"),),
        ),
        {},
        tier=LORA_TIER,
        full=True,  # the LoRA cells beyond axes.LORA_DEFAULT are --full's
    ),
)
CASES = (*CASES, *LORA_CASES)


# [mixed] issue 27, item 1: mixed precision as an axis of the training cells.
#: Mixed-precision cells of both policies on the layouts that shard columns, rows and data-parallelise,
#: the loss-scale row, and float32 cells the mixed-precision mutants must not reach.
_MIXED = ("mixed_bfloat16-sgd-arrays-nojit-colshard", "mixed_bfloat16-adam-arrays-nojit-rowshard",
          "mixed_float16-adam-arrays-nojit-colshard", "mixed_float16-lossscale-arrays-nojit-colshard",
          "mixed_bfloat16-adam-arrays-nojit-dataparallel", "mixed_float16-adam-arrays-nojit-dataparallel")
MIXED_TIER = _fit_ids(*_MIXED, "adam-arrays-nojit-colshard", "lossscale-arrays-nojit-colshard")
MIXED_CASES = (
    Case(
        Mutant(
            "mixed-update-writes-lost",
            "under a distribution the train step applies the optimizer inside the model's autocast scope: "
            "the in-place updates write to the 16-bit copies a variable's value reads as there, and are lost",
            (Patch(TORCH + "trainer.py", _BEFORE_UPDATE + "                self.optimizer.apply(gradients, trainable_weights)\n",
                   "            # Update weights\n"
                   "            policy = self.dtype_policy  # mutant: the update under the compute dtype\n"
                   "            with torch.no_grad(), __import__(\n"
                   "                \"keras.src.backend.common.variables\", fromlist=[\"AutocastScope\"]\n"
                   "            ).AutocastScope(policy.compute_dtype if distribution() is not None\n"
                   "                            and policy.compute_dtype != policy.variable_dtype else None):\n"
                   "                self.optimizer.apply(gradients, trainable_weights)\n"),),
        ),
        {f"test_fit[{cell}]": "numerics" for cell in _MIXED},
        tier=MIXED_TIER,
    ),
    # A correct build written differently: a sharded variable is cast for a 16-bit computation shard
    # by shard (the local shard cast, the DTensor rebuilt with the same placements), where the nightly
    # casts the DTensor as one tensor. Every mixed cell must still pass.
    Case(
        Mutant(
            "mixed-cast-shard-by-shard",
            "a correct rewrite, not a bug: a sharded variable's autocast copy is cast shard by shard",
            (Patch("keras/src/backend/common/variables.py",
                   "        if self.dtype is not None and is_float_dtype(value.dtype):\n"
                   "            return backend.ops.cast(value, dtype=self.dtype)\n",
                   "        if self.dtype is not None and is_float_dtype(value.dtype):\n"
                   "            if type(getattr(value, \"data\", value)).__name__ == \"DTensor\":  # rewrite: per shard\n"
                   "                from torch.distributed.tensor import DTensor\n"
                   "                from keras.src.backend.torch.ops.core import to_torch_dtype\n"
                   "                local = value.to_local().to(to_torch_dtype(self.dtype))\n"
                   "                return DTensor.from_local(local, value.device_mesh, value.placements,\n"
                   "                                          run_check=False, shape=value.shape, stride=value.stride())\n"
                   "            return backend.ops.cast(value, dtype=self.dtype)\n"),),
        ),
        {},
        tier=MIXED_TIER,
    ),
)
CASES = (*CASES, *MIXED_CASES)


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
CASES = (*CASES, *STATE_CASES)


# [issue 27, item 4: the data x model mesh] Only on the 2x2 mesh (4 ranks) are there more batch shards
# than one and fewer than processes: ranks (0, 1) form one batch shard and (2, 3) the other. Both cases
# lift get_data_adapter's multi-process guard (as adapters-shard-arrays-and-dataloaders does), so the
# array and DataLoader adapters shard too and the shard count reaches three sources; DataParallel (a
# shard per process) is the cell where a shard count from the process count is still right.
_MESH_SHARDED = _sharded_ids("pydataset-batchxmodel", "arrays-batchxmodel", "dataloader-sampler-batchxmodel",
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
CASES = (*CASES, *MESH_CASES)


#: Cells of some mutant's tier that the unmutated build fails, each with its verdict: the build's own bug
#: (in its expectations file too), in a tier so that a correct rewrite shows the cell passes without it.
UNMUTATED_FAILS = {"test_metrics[max-dataparallel]": "numerics", "test_metrics[max-batchshard]": "numerics",
                   # dynamo compiles no frame under the promotion dispatch mode
                   "test_op[relu-shard0-compiled]": "compile-fallback",
                   "test_reconcile[dataparallel]": "numerics", "test_checkpoint[modelcheckpoint-dataparallel]": "error",
                   # issue 19: get_data_adapter refuses to shard anything but tf.data and PyDataset
                   **{f"test_keras_sharded[{n}]": "data-not-sharded" for n in (
                       "arrays-dataparallel", "tensors-batchshard", "dataloader-dataparallel",
                       "dataloader-sampler-batchshard", "iterable-dataparallel",
                       "arrays-batchxmodel", "dataloader-sampler-batchxmodel")}}


def unmutated_tier(nproc: int = 2) -> tuple[str, ...]:
    """Every cell some mutant's tier runs with ``nproc`` ranks: the unmutated build must pass them all."""
    return tuple(dict.fromkeys(cell for case in CASES if case.nproc == nproc for cell in case.tier))


def unmutated_needs_full(nproc: int = 2) -> bool:
    """Whether ``unmutated_tier(nproc)`` names cells only ``--full`` collects."""
    return any(case.full for case in CASES if case.nproc == nproc)


def unmutated_fails(nproc: int = 2) -> dict[str, str]:
    """``UNMUTATED_FAILS`` of the cells ``unmutated_tier(nproc)`` runs."""
    names = {cell.rsplit("::", 1)[-1] for cell in unmutated_tier(nproc)}
    return {cell: verdict for cell, verdict in UNMUTATED_FAILS.items() if cell in names}


#: The rank counts the kit runs with.
KIT_NPROCS = tuple(sorted({case.nproc for case in CASES}))


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


# [precision] issue 40, items 1 and 3: an update factor off by 1 % under a mixed policy, and a JAX
# backend that cannot run the cells its reference is asked for.
PRECISION_CASES = (
    Case(
        Mutant(
            "mixed-learning-rate-off-1pct",
            "the torch backend's optimizers step 1 % too far under a mixed dtype policy (a learning rate "
            "read through a 16-bit cast, say): single-process and distributed torch share it; only the JAX "
            "backend's update, by its scale, shows it",
            (Patch(TORCH + "optimizers/torch_parallel_optimizer.py",
                   "        self._parallel_update_step(\n            grads,\n            trainable_variables,\n"
                   "            learning_rate,\n        )\n",
                   "        import keras  # mutant: 1 % more under a mixed policy\n"
                   "        if keras.config.dtype_policy().name.startswith(\"mixed\"):\n"
                   "            learning_rate = learning_rate * 1.01\n"
                   "        self._parallel_update_step(\n            grads,\n            trainable_variables,\n"
                   "            learning_rate,\n        )\n"),),
        ),
        {f"test_fit[{cell}]": "numerics" for cell in _MIXED},
        tier=MIXED_TIER,
    ),
    # The torch backend is right; its JAX reference raises on every cell: every verdict stays a pass,
    # and the report counts jax-numbers as not judged (tests/test_mutants.py reads it).
    Case(
        Mutant(
            "jax-optimizer-raises",
            "the JAX backend's optimizer raises on every update (a bug of code only the JAX backend runs): "
            "the torch cells' JAX reference fails",
            (Patch("keras/src/backend/jax/optimizer.py",
                   "    def _backend_apply_gradients(self, grads, trainable_variables):\n",
                   "    def _backend_apply_gradients(self, grads, trainable_variables):\n"
                   "        raise RuntimeError(\"mutant: the JAX backend's optimizer cannot apply gradients\")\n"),),
        ),
        {},
        tier=_fit_ids("sgd-arrays-nojit-colshard", "adam-arrays-nojit-dataparallel"),
    ),
)
# [layouts] issue 40, item 2: the JAX backend departing from the LayoutMap, which torch follows.
PRECISION_CASES = (
    *PRECISION_CASES,
    Case(
        Mutant(
            "jax-shards-biases",
            "the JAX backend shards every bias over the model axis under ModelParallel, where the LayoutMap "
            "leaves biases whole: torch follows the LayoutMap and must not be held to JAX's layout",
            (Patch("keras/src/backend/jax/ops/core.py",
                   "        if self._layout is None and distribution is not None:\n"
                   "            self._layout = distribution.get_variable_layout(self)\n",
                   "        if self._layout is None and distribution is not None:\n"
                   "            self._layout = distribution.get_variable_layout(self)\n"
                   "            if self.path.endswith(\"bias\") and hasattr(distribution, \"_layout_map\"):  # mutant\n"
                   "                from keras.src.distribution import TensorLayout\n"
                   "                self._layout = TensorLayout([\"model\"], distribution.device_mesh)\n"),),
        ),
        {f"test_fit[{cell}]": "jax-backend-differs" for cell in ("sgd-arrays-nojit-colshard",
                                                                  "adam-arrays-nojit-replicated")},
        tier=_fit_ids("sgd-arrays-nojit-colshard", "adam-arrays-nojit-replicated", "adam-arrays-nojit-dataparallel"),
    ),
)
CASES = (*CASES, *PRECISION_CASES)


# [graph breaks] issue 40, item 4: a compiled op cell that breaks into graphs on DTensors. On the nightly
# dynamo compiles no frame under the promotion dispatch mode (UNMUTATED_FAILS), so the mutant starts from
# a rewrite that lets it: the mode says ignore_compile_internals (dynamo traces with the mode off and runs
# the compiled graphs under it). Unary ops with no plain operand then compile whole on DTensors and pass
# (abs, relu below; mixed plain-tensor ops do not: traced without the mode, they are mixed-tensor).
_MODE_LETS_DYNAMO_COMPILE = Patch(
    TORCH + "ops/core.py", '    tensor to a Replicated DTensor.\n    """\n',
    '    tensor to a Replicated DTensor.\n    """\n\n'
    "    @classmethod\n"
    "    def ignore_compile_internals(cls):  # rewrite: dynamo compiles under the mode\n"
    "        return True\n")
_GRAPH_BREAK_TIER = tuple(f"conformance/test_ops.py::test_op[{cell}]" for cell in (
    "exp-shard0-compiled", "exp-shard1-compiled", "exp-shard0-eager", "abs-shard0-compiled", "relu-shard0-compiled"))
GRAPH_BREAK_CASES = (
    Case(
        Mutant(
            "op-graph-break-on-dtensors",
            "keras.ops.exp breaks dynamo's graph when its input is a DTensor (Python the tracer cannot follow): "
            "the compiled function splits in two graphs with eager code between them, more than on plain tensors",
            (_MODE_LETS_DYNAMO_COMPILE,
             Patch(TORCH + "ops/numpy.py", "        x = cast(x, config.floatx())\n    return torch.exp(x)\n",
                   "        x = cast(x, config.floatx())\n"
                   "    if type(x).__name__ == \"DTensor\":  # mutant: a graph break on DTensors\n"
                   "        torch._dynamo.graph_break()\n"
                   "    return torch.exp(x)\n")),
        ),
        # the old rule (fewer graphs than the control) passed them: 2 graphs on DTensors, 1 on plain tensors
        {"test_op[exp-shard0-compiled]": "compile-fallback", "test_op[exp-shard1-compiled]": "compile-fallback"},
        tier=_GRAPH_BREAK_TIER,
    ),
)
CASES = (*CASES, *GRAPH_BREAK_CASES)
# Its compiled cells fall back on the nightly itself (dynamo compiles no frame under the promotion mode).
UNMUTATED_FAILS = {**UNMUTATED_FAILS, **{f"test_op[{cell}]": "compile-fallback" for cell in (
    "exp-shard0-compiled", "exp-shard1-compiled", "abs-shard0-compiled")}}


# [workflows] issue 54: the flows users run between and around fits (conformance/test_workflows.py).
def _workflow_ids(*names: str) -> tuple[str, ...]:
    return tuple(f"conformance/test_workflows.py::test_workflow[{n}]" for n in names)


#: The nightly's own DataParallel failures among the default tier's eager workflow cells: DDP wraps the model
#: once, at the first fit, over the parameters that required grad then (find_unused_parameters=False), and is
#: never rebuilt.
_DDP_BUILT_ONCE = {"test_workflow[freeze-fit-unfreeze-fit-eager-dataparallel]": "numerics",
                   "test_workflow[fit-freeze-fit-eager-dataparallel]": "error",
                   "test_workflow[fit-lora-fit-eager-dataparallel]": "error",
                   "test_workflow[model-untrainable-fit-eager-dataparallel]": "error"}
_WORKFLOW_CELLS = tuple(f"{flow}-eager-{layout}" for flow in (
    "freeze-fit-unfreeze-fit", "fit-freeze-fit", "fit-lora-fit", "model-untrainable-fit",
    "built-before-distribution", "load-keras-fit", "load-weights-fit") for layout in ("colshard", "dataparallel"))
#: The default tier's eager workflow cells of the between-fits and loading flows on the model-parallel
#: layouts and the DataParallel ones the nightly passes, and a training cell the workflow mutants must not reach.
WORKFLOW_TIER = (*_workflow_ids(*(c for c in _WORKFLOW_CELLS if f"test_workflow[{c}]" not in _DDP_BUILT_ONCE),
                                "fit-lora-fit-eager-rowshard", "load-weights-fit-eager-rowshard"),
                 *_fit_ids("adam-arrays-nojit-colshard"))
#: With the nightly's DataParallel failures, for the rewrite that shows they can pass.
DDP_TIER = (*WORKFLOW_TIER, *_workflow_ids(*(c[len("test_workflow["):-1] for c in _DDP_BUILT_ONCE)))
_TRAINABLE_COPY = "            trainable_weights = self.trainable_weights[:]\n"
WORKFLOW_CASES = (
    # A correct build, written as the nightly is not: DDP rebuilt when the set of parameters to train has
    # changed since it was built (a recompile after freezing, unfreezing or enable_lora), and no DDP over
    # a model with nothing to train. Every workflow cell of the tier passes, DataParallel's too.
    Case(
        Mutant(
            "ddp-rebuilt-when-trainable-set-changes",
            "a correct rewrite, not a bug: DataParallel's DDP wrapper rebuilt whenever the trainable set changed",
            (Patch(TORCH + "trainer.py",
                   "        if torch.distributed.is_initialized() and self.ddp_model is None:\n",
                   "        trainable = tuple(id(v) for v in self.trainable_weights)  # rewrite: rebuilt on change\n"
                   "        if self.ddp_model is not None and self.__dict__.get('_ddp_trainable') != trainable:\n"
                   "            object.__setattr__(self, 'ddp_model', None)\n"
                   "        if not trainable:\n"
                   "            return  # nothing to synchronise: DDP refuses such a module\n"
                   "        object.__setattr__(self, '_ddp_trainable', trainable)\n"
                   "        if torch.distributed.is_initialized() and self.ddp_model is None:\n"),),
        ),
        {},
        tier=DDP_TIER,
    ),
    Case(
        Mutant(
            "trainable-set-kept-from-first-fit",
            "under a distribution the train step keeps the trainable variables of the first step it ran: a layer "
            "unfrozen, or LoRA enabled, and recompiled later does not train",
            (Patch(TORCH + "trainer.py", _TRAINABLE_COPY,
                   "            trainable_weights = (  # mutant: the first step's trainable set, kept\n"
                   "                self.__dict__.setdefault('_first_trainable', self.trainable_weights[:])\n"
                   "                if distribution() is not None else self.trainable_weights[:]\n"
                   "            )\n"),),
        ),
        # a layer unfrozen later is not trained; a new optimizer built for the trainable set a layer frozen
        # later, or LoRA, left is handed the old set's variables (ValueError: Unknown variable)
        {"test_workflow[freeze-fit-unfreeze-fit-eager-colshard]": "numerics",
         "test_workflow[fit-freeze-fit-eager-colshard]": "error",
         "test_workflow[fit-lora-fit-eager-colshard]": "error",
         "test_workflow[fit-lora-fit-eager-rowshard]": "error"},
        tier=WORKFLOW_TIER,
    ),
    Case(
        Mutant(
            "loaded-value-replaces-sharded-variable",
            "assigning a plain value (a loaded weight) to a sharded variable replaces its DTensor with a plain "
            "tensor: a pretrained .keras or .weights.h5 loaded under ModelParallel is no longer laid out",
            (Patch(TORCH + "ops/core.py",
                   "    def _direct_assign(self, value):\n",
                   "    def _direct_assign(self, value):\n"
                   "        if isinstance(self._value.data, DTensor) and not isinstance(value, DTensor):  # mutant\n"
                   "            self._value = torch.nn.Parameter(value.detach().clone(), requires_grad=self.trainable)\n"
                   "            return\n"),),
        ),
        {"test_workflow[load-keras-fit-eager-colshard]": "sharding-lost",
         "test_workflow[load-weights-fit-eager-colshard]": "sharding-lost",
         "test_workflow[load-weights-fit-eager-rowshard]": "sharding-lost"},
        tier=WORKFLOW_TIER,
    ),
    # A correct build written differently: a plain value assigned to a sharded variable is copied shard by
    # shard (each rank its own slice of the global value into its local tensor), not distributed whole.
    Case(
        Mutant(
            "assign-local-shard",
            "a correct rewrite, not a bug: a plain value is assigned to a sharded variable shard by shard",
            (Patch(TORCH + "ops/core.py",
                   "    def _direct_assign(self, value):\n",
                   "    def _direct_assign(self, value):\n"
                   "        if isinstance(self._value.data, DTensor) and not isinstance(value, DTensor):  # rewrite\n"
                   "            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset\n"
                   "            target = self._value.data\n"
                   "            shape, offset = compute_local_shape_and_global_offset(\n"
                   "                target.shape, target.device_mesh, target.placements)\n"
                   "            local = target.to_local()\n"
                   "            with torch.no_grad():\n"
                   "                # builtins' slice: this module defines keras.ops.slice\n"
                   "                local.copy_(value[tuple(__import__('builtins').slice(o, o + s)\n"
                   "                                        for o, s in zip(offset, shape))]\n"
                   "                            .to(device=local.device, dtype=local.dtype))\n"
                   "            return\n"),),
        ),
        {},
        tier=WORKFLOW_TIER,
    ),
)
CASES = (*CASES, *WORKFLOW_CASES)
UNMUTATED_FAILS = {**UNMUTATED_FAILS, **_DDP_BUILT_ONCE}


# [meshes] issue 54, item 4: meshes whose axes are ordered or named otherwise (axes.MESH_NAMING_CELLS).
MESH_NAMING_TIER = (*_fit_ids(*(f"{optimizer}-{data}-{mode}-{layout}" for _, optimizer, data, mode, layout
                                in axes.MESH_NAMING_CELLS)),
                    *_fit_ids("adam-arrays-nojit-colshard", "adam-arrays-nojit-batchshard"))
_PLACEMENTS_BY_NAME = "    for mesh_dim_name in keras_mesh.axis_names:\n"
#: ModelParallel's get_data_layout (DataParallel's reads the same but for the line before it).
_MODEL_PARALLEL_DATA_LAYOUT = ("        return self.device_mesh.shape[mesh_batch_dim_index]\n\n"
                               "    def get_data_layout(self, data_shape):\n"
                               "        data_shard_spec = [None] * len(data_shape)\n")
MESH_NAMING_CASES = (
    Case(
        Mutant(
            "mesh-model-axis-last",
            "a layout's placements listed as if the model axis were the mesh's last (the batch axis first): "
            "right on a (batch, model) mesh, on the wrong mesh dimension where the model axis comes first",
            (Patch(TORCH + "distribution_lib.py", _PLACEMENTS_BY_NAME,
                   "    names = list(keras_mesh.axis_names)  # mutant: the model axis taken for the last\n"
                   "    for mesh_dim_name in [n for n in names if n != 'model'] + [n for n in names if n == 'model']:\n"),),
        ),
        {"test_fit[adam-arrays-nojit-colshard-modelfirst]": "sharding-lost",
         "test_fit[sgd-dataloader-eager-colshard-modelfirst]": "sharding-lost",
         "test_fit[adam-arrays-nojit-batchshard-modelfirst]": "sharding-lost",
         "test_fit[sgd-dataloader-eager-batchshard-modelfirst]": "sharding-lost"},
        tier=MESH_NAMING_TIER,
    ),
    Case(
        Mutant(
            "batch-axis-named-batch",
            "ModelParallel's input layout names the mesh axis 'batch' whatever the distribution's batch_dim_name",
            (Patch("keras/src/distribution/distribution_lib.py",
                   _MODEL_PARALLEL_DATA_LAYOUT + "        data_shard_spec[0] = self.batch_dim_name  # Shard on the first dim\n",
                   _MODEL_PARALLEL_DATA_LAYOUT + "        data_shard_spec[0] = \"batch\"  # mutant: the name assumed\n"),),
        ),
        {"test_fit[adam-arrays-nojit-colshard-data]": "error", "test_fit[sgd-dataloader-eager-colshard-data]": "error"},
        tier=MESH_NAMING_TIER,
    ),
    # A correct build written differently: placements listed in the order of the torch mesh's own dimension
    # names, not of the Keras mesh's axis names (the same names, in the same order).
    Case(
        Mutant(
            "placements-from-torch-mesh-names",
            "a correct rewrite, not a bug: a layout's placements listed by the torch DeviceMesh's dimension names",
            (Patch(TORCH + "distribution_lib.py", _PLACEMENTS_BY_NAME,
                   "    for mesh_dim_name in torch_mesh.mesh_dim_names:  # rewrite: torch's own names\n"),),
        ),
        {},
        tier=MESH_NAMING_TIER,
    ),
)
CASES = (*CASES, *MESH_NAMING_CASES)


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
CASES = (*CASES, *TOP_K_CASES)


# [dropout] issue 54, item 3: the transformer block with dropout (conformance/cell_data.TRANSFORMER_MODELS).
TRANSFORMER_TIER = (*_fit_ids(*(f"{model}-sgd-arrays-nojit-{layout}" for model in ("transformer", "transformer-dropout")
                                for layout in ("colshard", "dataparallel"))),
                    *_fit_ids("transformer-frozen-ln-sgd-arrays-nojit-colshard", "adam-arrays-nojit-colshard"))
_UNSEEDED_DROPOUT = "    # Fast path, unseeded (since torch doesn't support seeding dropout!!!!)\n"
#: The nightly's dropout of a Partial DTensor (in-place bernoulli_, no strategy) mended: the partial sums
#: reduced first. A correct rewrite by itself, and the base of the mutant that draws masks per rank.
_PARTIAL_REDUCED = Patch(TORCH + "random.py", _UNSEEDED_DROPOUT,
                         "    if type(inputs).__name__ == \"DTensor\" and any(p.is_partial() for p in inputs.placements):\n"
                         "        from torch.distributed.tensor import Replicate  # rewrite: partial sums reduced first\n"
                         "        inputs = inputs.redistribute(\n"
                         "            inputs.device_mesh, [Replicate() if p.is_partial() else p for p in inputs.placements])\n"
                         + _UNSEEDED_DROPOUT)
DROPOUT_CASES = (
    Case(
        Mutant("dropout-partial-reduced-first",
               "a correct rewrite, not a bug: dropout of a Partial DTensor reduces the partial sums, then draws "
               "its mask through DTensor's own random stream", (_PARTIAL_REDUCED,)),
        {},
        tier=TRANSFORMER_TIER,
    ),
    Case(
        Mutant(
            "dropout-mask-per-rank",
            "(on the rewrite above) dropout of a DTensor draws each rank's mask for its local values from a "
            "generator of the rank's own: ranks that hold the same activations drop different units",
            (_PARTIAL_REDUCED,
             Patch(TORCH + "random.py", _UNSEEDED_DROPOUT,
                   "    if type(inputs).__name__ == \"DTensor\":  # mutant: each rank's own mask\n"
                   "        from torch.distributed.tensor import DTensor\n"
                   "        generator = torch.Generator().manual_seed(\n"
                   "            torch.distributed.get_rank() + 1000 * int(torch.randint(1 << 20, ())))\n"
                   "        local = inputs.to_local()\n"
                   "        keep = torch.rand(local.shape, generator=generator) >= rate\n"
                   "        return DTensor.from_local(torch.where(keep, local / (1 - rate), torch.zeros_like(local)),\n"
                   "                                  inputs.device_mesh, inputs.placements, run_check=False)\n"
                   + _UNSEEDED_DROPOUT)),
        ),
        {"test_fit[transformer-dropout-sgd-arrays-nojit-colshard]": "numerics"},
        tier=TRANSFORMER_TIER,
    ),
)
CASES = (*CASES, *DROPOUT_CASES)
UNMUTATED_FAILS = {**UNMUTATED_FAILS, "test_fit[transformer-dropout-sgd-arrays-nojit-colshard]": "error"}


# [initialize] issue 54, item 4: keras.distribution.initialize() making the group from torchrun's variables.
INITIALIZE_TIER = (*_workflow_ids("initialize-from-torchrun-eager-dataparallel", "initialize-from-torchrun-eager-colshard",
                                  "fit-recompile-fit-eager-dataparallel"),
                   "conformance/test_setup.py::test_setup[initialize]")
_INIT_GROUP = ("        torch.distributed.init_process_group(\n"
               "            backend=backend, rank=rank, world_size=world_size\n"
               "        )\n")
INITIALIZE_CASES = (
    Case(
        Mutant(
            "initialize-leaves-no-group",
            "keras.distribution.initialize() on torch sets nothing up: the group is made later, by the first "
            "DeviceMesh (torch's env:// default), so a script that asks for its rank after initialize() fails",
            (Patch(TORCH + "distribution_lib.py", _INIT_GROUP, "        pass  # mutant: the group left to the first mesh\n"),),
        ),
        {"test_workflow[initialize-from-torchrun-eager-dataparallel]": "error",
         "test_workflow[initialize-from-torchrun-eager-colshard]": "error"},
        tier=INITIALIZE_TIER,
    ),
    # A correct build written differently: the group made from torchrun's variables by torch's env:// default.
    Case(
        Mutant("initialize-env-defaults",
               "a correct rewrite, not a bug: initialize() leaves rank and world size to torch's env:// default",
               (Patch(TORCH + "distribution_lib.py", _INIT_GROUP,
                      "        torch.distributed.init_process_group(backend=backend)  # rewrite: env://\n"),)),
        {},
        tier=INITIALIZE_TIER,
    ),
)
CASES = (*CASES, *INITIALIZE_CASES)
