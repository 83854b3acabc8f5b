"""The backends beside torch's: precision and layouts of the JAX backend, and compiled op cells that
break into graphs on DTensors."""

from __future__ import annotations

from tests.mutants import Case, Mutant, Patch, TORCH, fit_ids
from tests.mutants.models import MIXED_TIER, MIXED_CELLS

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
        {f"test_fit[{cell}]": "numerics" for cell in MIXED_CELLS},
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
        tier=fit_ids("sgd-arrays-nojit-colshard", "adam-arrays-nojit-dataparallel"),
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
        tier=fit_ids("sgd-arrays-nojit-colshard", "adam-arrays-nojit-replicated", "adam-arrays-nojit-dataparallel"),
    ),
)


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
# Its compiled cells fall back on the nightly itself (dynamo compiles no frame under the promotion mode).
UNMUTATED_FAILS = {**{f"test_op[{cell}]": "compile-fallback" for cell in (
    "exp-shard0-compiled", "exp-shard1-compiled", "abs-shard0-compiled")}}

CASES = (*PRECISION_CASES, *GRAPH_BREAK_CASES)
