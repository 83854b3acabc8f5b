"""Rank side of the KerasHub cells: the causal language models users shard, under the layout map
their authors wrote, through the flows KerasHub's guides teach.

``ModelParallel`` exists for models too large for one device, and users reach it through KerasHub:
``GemmaBackbone.get_layout_map(mesh)``, a ``CausalLM`` fitted on token ids, LoRA, ``from_preset``,
``generate``. These models have what the suite's own lack: 3-D ``EinsumDense`` kernels sharded on their
heads, RMSNorm, rotary embeddings, grouped-query attention, a reverse embedding, a KV cache, and maps
that shard some variables and leave the rest replicated.

``MODELS`` is one table (a tiny random configuration of every causal LM whose backbone has
``get_layout_map``: nothing is downloaded), ``FLOWS`` another (what a user does with it), ``LAYOUTS`` a
third (``axes.HUB_LAYOUTS``: the authors' map on a ``(1, n)`` mesh and on the 2x2 one, a map as users write it, which
the suite's transformer runs too, and DataParallel).
A cell runs one flow of one model under one layout on every rank; the same function runs the one
process it is judged against (``distributed=False``: no distribution) on the global batches, from the
same weights. Each process feeds its own part of every global batch (``cell_data.batch_part``), as
KerasHub's ``CausalLMPreprocessor`` would have made it: token ids and padding mask as ``x``, the next
tokens as ``y``, the next positions' mask as sample weights.

The evidence mirrors the workflow cells' (``ranks/workflows.py``): one *phase* per fit (each step's
loss, the variables frozen in it, every weight and variable after), what ``generate`` returned, the
variables after every stage, the optimizer's slots, the map the authors' code gave, and one more train
step's communication. ``conformance/judge/hub.py`` judges it.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable

import numpy as np
from keras_dtensor_conformance import rank_context

from conformance.axes import AUTHORS, HUB_LAYOUTS
from conformance.cell_data import batch_part, mesh_axes, mesh_shape
from conformance.ranks.step_communication import measure_step_communication
from conformance.ranks.train import (
    _describe_slots,
    _device_type,
    describe_variable,
    make_distribution,
    step_losses_callback,
    weights_by_path,
)

#: Token ids in ``[1, VOCABULARY)``; 0 pads. Sequences of ``LENGTH + 1`` tokens: ``x`` holds the first
#: ``LENGTH``, ``y`` the last ``LENGTH`` (KerasHub's ``CausalLMPreprocessor`` shifts the same way).
VOCABULARY = 64
LENGTH = 8
#: The global batch and the rows: two steps, each batch divisible by 1, 2 and 4 batch shards.
GLOBAL_BATCH = 8
ROWS = 16
#: ``generate``'s prompts: the first ``GLOBAL_BATCH`` rows' first ``PROMPT`` tokens, completed to ``GENERATED``.
PROMPT = 3
GENERATED = 8
#: Per optimizer: AdamW at Adam's rate in the training cells, where its update's rounding stays within the
#: float32 tolerance (at 0.05 a few elements of a thousand came out 2x beyond it on a correct build).
LEARNING_RATES = {"sgd": 0.05, "adamw": 0.01}
#: The weights of the "pretrained" model a one-process preset holds (a fresh model is built from seed 0:
#: a load that does nothing leaves seed-0 weights, which train to other numbers than the reference's).
PRETRAINED_SEED = 1
LORA_ADAPTER_RANK = 4


@dataclasses.dataclass(frozen=True)
class Model:
    """One row of the model axis: a KerasHub causal LM, and its backbone's tiny random configuration."""

    task: str  #: the ``keras_hub.models`` CausalLM class
    backbone: str  #: its backbone class, whose ``get_layout_map`` the ``authors`` layouts use
    config: dict  #: the backbone's arguments
    #: In the default tier (the others, the mixtures of experts, are ``--full``'s).
    default: bool = True


#: Grouped-query attention everywhere (8 query heads share 4 key/value heads), so the authors' maps split
#: every attention kernel's heads evenly over 1, 2 and 4 ranks.
_ATTENTION = {"vocabulary_size": VOCABULARY, "num_layers": 2, "num_query_heads": 8, "num_key_value_heads": 4,
              "hidden_dim": 32}
#: The mixtures of experts: 4 experts, 2 per token. Their load-balancing loss is off: a statistic of the whole
#: batch's routing, which under DataParallel each process computes on its own rows, so no single process on the
#: global batch computes the ranks' gradient (BatchNormalization's case in the training cells); each token's
#: routing is its own, and is judged.
_EXPERTS = {"moe_intermediate_dim": 16, "num_experts": 4, "top_k": 2, "router_aux_loss_coefficient": 0.0}
#: name -> its model: the one place to add a KerasHub model (``conformance/test_hub.py`` crosses it
#: with ``FLOWS`` and ``LAYOUTS``). ``tests/test_hub_cells.py`` holds it to KerasHub's own list of
#: causal LMs whose backbone has ``get_layout_map``.
MODELS = {
    "gemma": Model("GemmaCausalLM", "GemmaBackbone", {**_ATTENTION, "intermediate_dim": 64, "head_dim": 4}),
    "llama": Model("LlamaCausalLM", "LlamaBackbone", {**_ATTENTION, "intermediate_dim": 64}),
    "llama3": Model("Llama3CausalLM", "Llama3Backbone", {**_ATTENTION, "intermediate_dim": 64}, default=False),
    "qwen": Model("QwenCausalLM", "QwenBackbone", {**_ATTENTION, "intermediate_dim": 64}),
    "qwen-moe": Model("QwenMoeCausalLM", "QwenMoeBackbone",
                      {**_ATTENTION, **_EXPERTS, "intermediate_dim": 64, "shared_expert_intermediate_dim": 32},
                      default=False),
    "qwen3-moe": Model("Qwen3MoeCausalLM", "Qwen3MoeBackbone",
                       {**_ATTENTION, **_EXPERTS, "intermediate_dim": 64, "head_dim": 4}, default=False),
}

#: name -> distribution: ``axes.HUB_LAYOUTS`` (the judge and the promises read them too).
LAYOUTS = HUB_LAYOUTS


def make_data() -> tuple[dict, np.ndarray, np.ndarray]:
    """(x, y, sample_weight) of ``ROWS`` rows as KerasHub's preprocessor gives them: sequences of
    random lengths (``PROMPT + 1`` to ``LENGTH + 1`` tokens) padded with 0, ``x`` their first
    ``LENGTH`` tokens and mask, ``y`` the tokens after, the mask after as sample weights."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(PROMPT + 1, LENGTH + 2, ROWS)
    mask = np.arange(LENGTH + 1)[None, :] < lengths[:, None]
    tokens = np.where(mask, rng.integers(1, VOCABULARY, (ROWS, LENGTH + 1)), 0).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": mask[:, :-1]}
    return x, tokens[:, 1:], mask[:, 1:].astype("float32")


def prompts() -> dict:
    """``generate``'s inputs: the first ``GLOBAL_BATCH`` rows' first ``PROMPT`` tokens, the rest to fill."""
    x, _, _ = make_data()
    tokens = np.zeros((GLOBAL_BATCH, GENERATED), "int32")
    tokens[:, :PROMPT] = x["token_ids"][:GLOBAL_BATCH, :PROMPT]
    mask = np.zeros((GLOBAL_BATCH, GENERATED), bool)
    mask[:, :PROMPT] = True
    return {"token_ids": tokens, "padding_mask": mask}


def _rows(x, rows: np.ndarray):
    return {k: v[rows] for k, v in x.items()} if isinstance(x, dict) else x[rows]


@dataclasses.dataclass
class Run:
    """One flow on this process: what it builds, compiles, fits and generates, and the evidence."""

    spec: dict
    distributed: bool
    phases: list = dataclasses.field(default_factory=list)
    stages: dict = dataclasses.field(default_factory=dict)
    initial: dict = dataclasses.field(default_factory=dict)
    device: str = ""
    #: The layout the cell ran under, as data: the authors' map as ``get_layout_map`` gave it.
    layout: dict = dataclasses.field(default_factory=dict)
    generated: dict | None = None
    slots: list = dataclasses.field(default_factory=list)
    communication: dict | None = None

    @property
    def model(self) -> Model:
        return MODELS[self.spec["model"]]

    def _rank_and_world(self) -> tuple[int, int]:
        ctx = rank_context.current()
        return ctx.rank, ctx.world_size

    def part(self) -> tuple[int, int]:
        """This process's (index, count) along the batch axis; the one process feeds everything."""
        return batch_part(self.spec["layout"], *self._rank_and_world()) if self.distributed else (0, 1)

    def local_rows(self, rows: int) -> np.ndarray:
        """This process's rows of every global batch of ``GLOBAL_BATCH`` among ``rows`` rows, in order."""
        index, count = self.part()
        local = GLOBAL_BATCH // count
        return np.concatenate([np.arange(s + index * local, s + (index + 1) * local) for s in range(0, rows, GLOBAL_BATCH)])

    # ---------------------------------------------------------------- set-up
    def distribute(self) -> None:
        """The cell's distribution (none in the one process); the authors' map from the backbone's
        ``get_layout_map`` on the layout's mesh, recorded as data."""
        import keras
        import keras_hub

        layout = self.spec["layout"]
        if not self.distributed:
            keras.distribution.set_distribution(None)
            self.layout = {"kind": "single"}
            return
        if layout.get("map") != AUTHORS:
            keras.distribution.set_distribution(make_distribution(layout))
            self.layout = dict(layout)
            return
        ctx = rank_context.current()
        shape = mesh_shape(layout, ctx.world_size)
        mesh = keras.distribution.DeviceMesh(shape, list(mesh_axes(layout)), ctx.device_names())
        backbone = getattr(keras_hub.models, self.model.backbone)
        layout_map = backbone.get_layout_map(mesh, model_parallel_dim_name="model", data_parallel_dim_name="batch")
        distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
        distribution.auto_shard_dataset = False  # each process feeds its own part (``part``)
        keras.distribution.set_distribution(distribution)
        self.layout = {**layout, "map": {key: list(layout_map[key].axes) for key in layout_map},
                       "source": f"{self.model.backbone}.get_layout_map(mesh)"}

    def build(self, seed: int = 0):
        """The causal LM from ``seed``: its backbone's tiny configuration, no preprocessor."""
        import keras
        import keras_hub

        keras.utils.set_random_seed(seed)
        backbone = getattr(keras_hub.models, self.model.backbone)(**self.model.config)
        return getattr(keras_hub.models, self.model.task)(backbone=backbone, preprocessor=None)

    def compile(self, lm) -> None:
        """Compile with the flow's optimizer (``Flow.optimizer``), the next-token loss KerasHub's causal LMs
        train with, and the greedy sampler."""
        import keras

        classes = {"sgd": keras.optimizers.SGD, "adamw": keras.optimizers.AdamW}
        optimizer = FLOWS[self.spec["flow"]].optimizer
        lm.compile(optimizer=classes[optimizer](LEARNING_RATES[optimizer]), sampler="greedy", jit_compile=False,
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), weighted_metrics=[])

    def stage(self, lm, name: str) -> None:
        """The variables' layouts after ``name`` (``built``, ``loaded``, ``generated``)."""
        self.stages[name] = [describe_variable(v) for v in lm.weights]
        if not self.initial:
            self.initial = weights_by_path(lm)
            self.device = _device_type(lm.weights[0])

    # ---------------------------------------------------------------- a fit, a generate
    def fit(self, lm, name: str) -> None:
        """``lm.fit`` on this process's rows of the global batches: one phase of evidence (each
        step's loss, the variables frozen in it with their values before, every weight and variable
        after), and the optimizer's slots after it."""
        if not self.initial:
            self.stage(lm, "built")
        x, y, w = make_data()
        rows = self.local_rows(ROWS)
        index, count = self.part()
        trainable = {v.path for v in lm.trainable_weights}
        frozen = {path: value for path, value in weights_by_path(lm).items() if path not in trainable}
        losses: list[float] = []
        lm.fit(_rows(x, rows), y[rows], sample_weight=w[rows], batch_size=GLOBAL_BATCH // count, shuffle=False, epochs=1,
               verbose=0, callbacks=[step_losses_callback(losses)])
        variables = [describe_variable(v) for v in lm.weights]
        self.phases.append({"name": name, "layout": self.layout, "batch_part": [index, count],
                            "step_losses": losses, "frozen": frozen, "weights": weights_by_path(lm),
                            "variables": variables})
        self.stages["fit"] = variables  # after the last fit: what the step measured next is held to
        self.slots = _describe_slots(lm)[0]
        self._last = lm

    def generate(self, lm) -> None:
        """``lm.generate`` with the greedy sampler and its KV cache on every prompt; and the margin of
        each chosen token over the next best, from the logits of the whole generated sequence run again
        without the cache (the one process's margins say where a tie could pick otherwise).

        Every process passes the same prompts, the global batch: ``CausalLM.generate`` distributes its
        inputs itself (``distribute_tensor`` with the distribution's data layout), as no fit does, so a
        process's own part would be taken for the whole. Each process gets every prompt's completion."""
        import keras

        if not self.initial:
            self.stage(lm, "built")
        rows = np.arange(GLOBAL_BATCH)
        out = lm.generate(_rows(prompts(), rows), stop_token_ids=None)
        ids, mask = np.asarray(out["token_ids"]), np.asarray(out["padding_mask"])
        logits = keras.ops.convert_to_numpy(lm({"token_ids": ids, "padding_mask": np.ones_like(mask)}))
        top = np.sort(logits.astype("float64"), axis=-1)
        self.generated = {"rows": rows, "token_ids": ids, "padding_mask": mask,
                          "margins": (top[..., -1] - top[..., -2])[:, PROMPT - 1:-1]}
        self.stage(lm, "generated")

    def measure_step(self) -> None:
        """One more eager train step after every figure above, under the recorder of its collectives
        (``ranks/step_communication.py``): not in the one process, which has nothing to communicate."""
        if not self.distributed or not self.phases:
            return
        x, y, _ = make_data()
        first = self.local_rows(ROWS)[:GLOBAL_BATCH // self.part()[1]]
        self.communication = measure_step_communication(self._last, _rows(x, first), y[first])

    def own_folder(self, name: str) -> str:
        """A folder of this process's own in the cell's folder (no two processes write one file)."""
        who = f"rank{self._rank_and_world()[0]}" if self.distributed else "single"
        return os.path.join(self.spec["folder"], f"{who}-{name}")


# ---------------------------------------------------------------- the flows
def fit(run: Run) -> None:
    """Build under the distribution, compile with the flow's optimizer (AdamW's two slots per variable must be
    laid out as their variable), fit."""
    run.distribute()
    lm = run.build()
    run.compile(lm)
    run.fit(lm, "fit")


def lora(run: Run) -> None:
    """KerasHub's fine-tuning guide: ``backbone.enable_lora(rank)`` (every weight frozen, LoRA on the
    attention's query and value kernels), compile, fit."""
    run.distribute()
    lm = run.build()
    lm.backbone.enable_lora(rank=LORA_ADAPTER_RANK)
    run.compile(lm)
    run.fit(lm, "LoRA")


def _preset(run: Run) -> str:
    """A "pretrained" model's preset, written by this process with no distribution (weights from
    ``PRETRAINED_SEED``): the folder ``from_preset`` reads."""
    import keras

    keras.distribution.set_distribution(None)
    lm = run.build(seed=PRETRAINED_SEED)
    folder = run.own_folder("preset")
    lm.save_to_preset(folder)
    return folder


def preset(run: Run) -> None:
    """The pretrained path: a local preset one process wrote, ``CausalLM.from_preset`` under the
    distribution (its variables made there), compile, fit."""
    import keras_hub

    folder = _preset(run)
    run.distribute()
    lm = getattr(keras_hub.models, run.model.task).from_preset(folder, preprocessor=None)
    run.stage(lm, "loaded")
    run.compile(lm)
    run.fit(lm, "loaded, fit")


def generate(run: Run) -> None:
    """Build under the distribution, ``generate`` greedily with the KV cache."""
    run.distribute()
    lm = run.build()
    run.compile(lm)
    run.generate(lm)


def save_load(run: Run) -> None:
    """Fit under the distribution, ``save_to_preset`` from every process (each its own folder), load it
    back with ``from_preset`` under the same distribution, fit again."""
    import keras_hub

    run.distribute()
    lm = run.build()
    run.compile(lm)
    run.fit(lm, "before saving")
    folder = run.own_folder("saved")
    lm.save_to_preset(folder)
    loaded = getattr(keras_hub.models, run.model.task).from_preset(folder, preprocessor=None)
    run.stage(loaded, "loaded")
    run.compile(loaded)
    run.fit(loaded, "loaded, fit")


@dataclasses.dataclass(frozen=True)
class Flow:
    """One row of the flow axis."""

    run: Callable[[Run], None]
    #: What its fits train with: ``sgd`` (no slots) or ``adamw`` (two slots per trained variable).
    optimizer: str = "sgd"
    #: It writes into ``spec['folder']`` (a preset): its one process is not shared between cells.
    writes_files: bool = False
    #: In the default tier on these layouts (``--full``: every layout).
    default_layouts: tuple[str, ...] = ("authors",)
    #: It freezes the backbone (LoRA: only the LoRA kernels, which no map names, train).
    freezes_backbone: bool = False


#: flow -> its entry: the one place to add a flow.
FLOWS = {
    "fit-sgd": Flow(fit, default_layouts=("authors", "ffn-only", "dataparallel")),
    "fit-adamw": Flow(fit, optimizer="adamw"),
    "lora": Flow(lora, optimizer="adamw", freezes_backbone=True),
    "preset": Flow(preset, writes_files=True),
    "generate": Flow(generate, default_layouts=("authors", "dataparallel")),
    "save-load": Flow(save_load, writes_files=True),
}

def run_hub(spec: dict, distributed: bool = True) -> dict:
    """Run ``spec['flow']`` of ``spec['model']`` on this process; its evidence (the module's docstring)."""
    run = Run(spec, distributed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # grain's and Keras' advice on every fit: not evidence
        FLOWS[spec["flow"]].run(run)
        run.measure_step()
    return {"model": spec["model"], "flow": spec["flow"], "layout": run.layout, "initial_weights": run.initial,
            "device": run.device, "phases": run.phases, "stages": run.stages, "slots": run.slots,
            "generated": run.generated, "communication": run.communication}


def causal_lms() -> dict:
    """KerasHub's causal LMs whose backbone has ``get_layout_map``, as this KerasHub has them: task
    class name -> its backbone class name (``tests/test_hub_cells.py`` holds ``MODELS`` to it)."""
    import keras_hub

    found = {}
    for name in dir(keras_hub.models):
        task = getattr(keras_hub.models, name)
        backbone = getattr(task, "backbone_cls", None)
        if (isinstance(task, type) and issubclass(task, keras_hub.models.CausalLM) and backbone is not None
                and hasattr(backbone, "get_layout_map") and task.__name__ == name):
            found[name] = backbone.__name__
    return found
