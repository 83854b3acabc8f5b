"""The models' own axes: LoRA fine-tuning, mixed precision, the transformer block with dropout."""

from __future__ import annotations

from tests.mutants import Case, Mutant, Patch, TORCH, fit_ids
from tests.mutants.performance import BEFORE_UPDATE

# [lora] issue 27, item 2: LoRA fine-tuning on a sharded model.
#: The LoRA cells the LoRA mutants run, on the layouts that split the kernels and on DataParallel,
#: and MLP cells they must not reach.
LORA_TIER = (*fit_ids(*(f"{model}-adam-arrays-nojit-{layout}" for model in ("lora", "lora-sharded")
                         for layout in ("colshard", "rowshard", "dataparallel"))),
             *fit_ids("adam-arrays-nojit-colshard", "adam-arrays-nojit-dataparallel"))
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


# [mixed] issue 27, item 1: mixed precision as an axis of the training cells.
#: Mixed-precision cells of both policies on the layouts that shard columns, rows and data-parallelise,
#: the loss-scale row, and float32 cells the mixed-precision mutants must not reach.
MIXED_CELLS = ("mixed_bfloat16-sgd-arrays-nojit-colshard", "mixed_bfloat16-adam-arrays-nojit-rowshard",
          "mixed_float16-adam-arrays-nojit-colshard", "mixed_float16-lossscale-arrays-nojit-colshard",
          "mixed_bfloat16-adam-arrays-nojit-dataparallel", "mixed_float16-adam-arrays-nojit-dataparallel")
MIXED_TIER = fit_ids(*MIXED_CELLS, "adam-arrays-nojit-colshard", "lossscale-arrays-nojit-colshard")
MIXED_CASES = (
    Case(
        Mutant(
            "mixed-update-writes-lost",
            "under a distribution the train step applies the optimizer inside the model's autocast scope: "
            "the in-place updates write to the 16-bit copies a variable's value reads as there, and are lost",
            (Patch(TORCH + "trainer.py", BEFORE_UPDATE + "                self.optimizer.apply(gradients, trainable_weights)\n",
                   "            # Update weights\n"
                   "            policy = self.dtype_policy  # mutant: the update under the compute dtype\n"
                   "            with torch.no_grad(), __import__(\n"
                   "                \"keras.src.backend.common.variables\", fromlist=[\"AutocastScope\"]\n"
                   "            ).AutocastScope(policy.compute_dtype if distribution() is not None\n"
                   "                            and policy.compute_dtype != policy.variable_dtype else None):\n"
                   "                self.optimizer.apply(gradients, trainable_weights)\n"),),
        ),
        {f"test_fit[{cell}]": "numerics" for cell in MIXED_CELLS},
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


# [dropout] issue 54, item 3: the transformer block with dropout (conformance/cell_data.TRANSFORMER_MODELS).
TRANSFORMER_TIER = (*fit_ids(*(f"{model}-sgd-arrays-nojit-{layout}" for model in ("transformer", "transformer-dropout")
                                for layout in ("colshard", "dataparallel"))),
                    *fit_ids("transformer-frozen-ln-sgd-arrays-nojit-colshard", "adam-arrays-nojit-colshard"))
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

CASES = (*LORA_CASES, *MIXED_CASES, *DROPOUT_CASES)
#: Its tier's cell the nightly fails: dropout of a Partial DTensor.
UNMUTATED_FAILS = {"test_fit[transformer-dropout-sgd-arrays-nojit-colshard]": "error"}
