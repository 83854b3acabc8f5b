"""The promises of ``keras.distribution`` the suite's cells test: the report leads with them.

One entry per promise, in the order a report shows them: adding one (issue 19's Keras-side data
sharding, reconciled variables, checkpoints) is one ``Promise`` here. ``tests(cell)`` says which
cells check it when they run; ``breaks`` which failures break it (verdicts, or a predicate of the
failed cell); ``kept_despite`` which failures come only after it was checked and held. They read a
cell of the results model: ``family``, ``axes`` (what the ``cell`` markers record), ``verdict``,
``message``, ``cause``. The plugin counts, per promise, the cells kept, broken, expected-broken,
not judged (failed for another reason before this promise was checked) and not tested
(``keras_dtensor_conformance/report/promises.py``); ``tests/test_promises.py`` holds this table to
every verdict, so a failure cannot fall outside every promise unnoticed.
"""

from __future__ import annotations

from collections.abc import Callable

from keras_dtensor_conformance import (
    COMPILE_FALLBACK,
    COMPILE_TIMEOUT,
    CRASH_VERDICT,
    DATA_NOT_SHARDED,
    ERROR,
    HANG_VERDICT,
    JAX_BACKEND_DIFFERS,
    JUDGED_VERDICTS,
    MIXED_TENSOR,
    NO_SHARDING_STRATEGY,
    NUMERICS,
    OVER_BUDGET,
    SHARDING_LOST,
    Promise,
)

from conformance import axes
from conformance.cell_data import DROPOUT_MODELS, batch_axis, mesh_axes
from conformance.judge import fit_checks
from conformance.judge import hub as hub_checks
from conformance.judge.op_checks import OP_COMPILED, OP_PLACEMENTS, OP_VALUE

#: The field of a cell that carries one train step's collectives and bytes (``test_fit`` records it
#: for every training cell that ran everywhere): a cell that has it tested the budget.
COMMUNICATION = "communication"

#: Layouts whose LayoutMap shards a variable (``replicated`` and ``dataparallel`` shard none).
SHARDING_LAYOUTS = tuple(name for name, layout in axes.LAYOUTS.items() if layout.get("map"))
#: The KerasHub cells' layouts that shard variables: the authors' maps and the user's.
HUB_SHARDING_LAYOUTS = tuple(name for name, layout in axes.HUB_LAYOUTS.items() if layout.get("map"))
#: Scenarios whose judge holds a kernel to its sharding (``judge.scenarios.SCENARIO_JUDGES``); the others
#: (``iterate-dtensor``, ``clear-session-undoes-distribution``) check values or state only.
SHARDING_SCENARIOS = {"assign-partial", "uneven-sharding", "rank0-convert-to-numpy", "rank0-callback-get-weights",
                      "rank0-checkpoint-save", "distribution-changed-between-fits", "mesh-reshaped-between-fits",
                      "integer-variable",
                      "mixed-float16", "mixed-bfloat16", "save-load-keras", "save-load-weights-h5"}
#: Where in Keras a failure is about the per-process input: the data adapters, and the torch
#: backend's ``distribute_data_input`` and the trainer's ``_distribute_data`` that calls it.
INPUT_CODE = ("keras/src/trainers/data_adapters/", " in distribute_data_input", " in _distribute_data")


def family(cell: dict) -> str:
    return cell["family"].split()[0]


def fit(cell: dict) -> bool:
    return family(cell) == "fit"


def hub(cell: dict) -> bool:
    """A KerasHub cell: a causal LM's flow under its authors' map, a user's map or DataParallel (``test_hub.py``)."""
    return family(cell) == "kerashub"


def hub_sharded(cell: dict) -> bool:
    """A KerasHub cell whose layout map shards variables (every layout of theirs but DataParallel)."""
    return hub(cell) and cell["axes"].get("layout") in HUB_SHARDING_LAYOUTS


def hub_checked_before(*verdicts: str):
    """``kept_despite`` for a promise a KerasHub cell's checks hold before those ``verdicts``
    (``judge/hub.hub_failure``'s order: the map, frozen variables, the layouts and slots, the step's
    communication, the reference, every fit's numbers, generate's ids); a frozen variable that changed
    is a ``numerics`` before all of them."""
    return lambda cell: hub(cell) and cell["verdict"] in verdicts and not hub_frozen_changed(cell)


def hub_frozen_changed(cell: dict) -> bool:
    return hub(cell) and cell["verdict"] == NUMERICS and "a variable frozen during a fit changed" in (
        cell.get("message") or "")


def shards_variables(cell: dict) -> bool:
    """A training or KerasHub cell whose layout shards a variable, or a scenario that checks a kernel's sharding."""
    if fit(cell):
        return cell["axes"].get("layout") in SHARDING_LAYOUTS
    return hub_sharded(cell) or (family(cell) == "scenarios" and cell["axes"].get("scenario") in SHARDING_SCENARIOS)


#: Layouts with several batch shards (with more than one process): each process feeds its own part.
BATCH_SHARDED_LAYOUTS = tuple(name for name, layout in axes.LAYOUTS.items()
                              if layout["kind"] == "data-parallel"
                              or layout.get("mesh", (1,))[mesh_axes(layout).index(batch_axis(layout))] != 1)


def feeds_batch_shards(cell: dict) -> bool:
    """A training cell whose processes each feed their own part of the global batch."""
    return fit(cell) and cell["axes"].get("layout") in BATCH_SHARDED_LAYOUTS


def keeps_slots(cell: dict) -> bool:
    """A training cell on a sharding layout whose optimizer keeps a slot per variable, or a KerasHub cell
    on a map (whose recorded check outcomes say where no laid-out variable has a slot: SGD, LoRA's frozen
    kernels)."""
    slots = axes.SLOTS.get(cell["axes"].get("optimizer"), {})
    return hub_sharded(cell) or (fit(cell) and cell["axes"].get("layout") in SHARDING_LAYOUTS and any(slots.values()))


def about_slots(line: str) -> bool:
    """A line of a sharding-lost message about optimizer state (``fit_checks.sharding_lost``:
    ``rank 0 optimizer slot ...``, ``expected 2 optimizer slots for ...``, ``optimizer variables
    that match no model variable``, a factored slot)."""
    return "optimizer" in line or "factored" in line


def lost_lines(cell: dict) -> list[str]:
    if cell["verdict"] != SHARDING_LOST:
        return []
    return [line for line in cell["message"].splitlines() if line.strip()]


def variable_lost(cell: dict) -> bool:
    """Sharding lost by a model variable (a scenario's kernel included), not only by a slot."""
    return any(not about_slots(line) for line in lost_lines(cell)) and family(cell) != "ops"


def slot_lost(cell: dict) -> bool:
    return (fit(cell) or hub(cell)) and any(about_slots(line) for line in lost_lines(cell))


def input_failure(cell: dict) -> bool:
    """A training cell that failed in the code that hands each process its input."""
    where = (cell.get("cause") or {}).get("where", "")
    return fit(cell) and any(part in where for part in INPUT_CODE)




def keras_sharded(cell: dict) -> bool:
    """A cell that hands Keras the global dataset to shard (``test_data_sharding.py``)."""
    return family(cell) == "keras-sharded"


def keras_sharding_broken(cell: dict) -> bool:
    """Keras did not shard, or refused to (``data-not-sharded``); or a Keras-sharded cell hung or
    crashed: its processes were handed unequal numbers of steps, so one waited in a collective
    its peers never entered (the uneven cells' failure mode); or its ``evaluate`` returned another
    loss than the one over all the rows evaluated (``numerics``)."""
    return cell["verdict"] == DATA_NOT_SHARDED or (
        keras_sharded(cell) and cell["verdict"] in (HANG_VERDICT, CRASH_VERDICT, NUMERICS))


def frozen_changed(cell: dict) -> bool:
    """A training cell whose first check failed: a frozen variable changed in training."""
    return fit(cell) and cell["verdict"] == NUMERICS and " changed in training" in (cell.get("message") or "")


def fit_checked_before(*verdicts: str):
    """``kept_despite`` for a promise that a training cell's checks hold before those ``verdicts``
    (``fit_checks.fit_failure``'s order: frozen variables first, then the sharding of variables and
    slots together, then the communication of a step, then the numbers, then compilation); a frozen
    variable that changed is a ``numerics`` before all of them. For a cell without recorded check
    outcomes (an older report): one with them is counted from them."""
    return lambda cell: fit(cell) and cell["verdict"] in verdicts and not frozen_changed(cell)


def sharding_kept_despite(lost: Callable[[dict], bool]):
    """A training cell that failed later than the sharding check, or lost only the other kind's
    sharding (one check looks at the variables and their slots together), kept this kind's."""
    later, hub_later = fit_checked_before(OVER_BUDGET, NUMERICS, COMPILE_FALLBACK), hub_checked_before(OVER_BUDGET, NUMERICS)
    return lambda cell: later(cell) or hub_later(cell) or (
        (fit(cell) or hub(cell)) and cell["verdict"] == SHARDING_LOST and not lost(cell))


def agreement(cell: dict) -> bool:
    """Cells that compile metrics or run callbacks every rank must agree on (``test_agreement.py``:
    they record a ``metric`` or a ``callback`` axis)."""
    return "metric" in cell["axes"] or "callback" in cell["axes"]


def on_batch(cell: dict) -> bool:
    """A cell that calls an on-batch or inference API as a user's loop does (``test_on_batch.py``)."""
    return family(cell) == "on-batch"


def state(cell: dict, kind: str) -> bool:
    """A state cell (``test_state.py``) of ``kind``: ``reconcile`` or ``checkpoint``."""
    return family(cell) == "state" and cell["axes"].get("state") == kind


def draws_dropout(cell: dict) -> bool:
    """A training cell whose model draws dropout masks (``cell_data.DROPOUT_MODELS``)."""
    return fit(cell) and cell["axes"].get("model") in DROPOUT_MODELS


def workflow(cell: dict) -> bool:
    """A cell that runs a flow of several fits as users do (``test_workflows.py``)."""
    return family(cell) == "workflows"


def ranks_stopped(cell: dict) -> bool:
    """A rank did not run to the end: it crashed, hung or raised (``ranks``: every rank's outcome
    where the cell recorded them; a raised verdict without them, e.g. ranks that could not start)."""
    if cell["verdict"] in (CRASH_VERDICT, HANG_VERDICT):
        return True
    if cell["verdict"] not in (ERROR, MIXED_TENSOR, NO_SHARDING_STRATEGY):
        return False
    ranks = cell.get("ranks") or []
    return not ranks or any(r["status"] != "ok" for r in ranks)


def flow_broken(family_of: Callable[[dict], bool]):
    """``breaks`` of a promise that a flow trains as one process running it: a cell of the family whose numbers
    or layouts differ, whose rank hung or stopped, or whose evidence the judge found in error."""
    return lambda cell: family_of(cell) and (cell["verdict"] in (NUMERICS, SHARDING_LOST, HANG_VERDICT)
                                             or ranks_stopped(cell) or judged_error(cell))


def judged_error(cell: dict) -> bool:
    """An ``error`` the judge gave from evidence every rank returned (not a rank's exception)."""
    return cell["verdict"] == ERROR and not ranks_stopped(cell)


PROMISES = (
    Promise("sharded-variables", "variables keep the layout asked for", tests=shards_variables,
            breaks=variable_lost, kept_despite=sharding_kept_despite(variable_lost),
            checks=(fit_checks.VARIABLE_LAYOUTS,),
            scope="every variable the LayoutMap lays out is a DTensor with those placements "
                  "and local shapes after build, fit, evaluate and predict; not applicable where the layout asks "
                  "none (replicated, DataParallel)"),
    Promise("sharded-optimizer-state", "optimizer slots are sharded like their variable", tests=keeps_slots,
            breaks=slot_lost, kept_despite=sharding_kept_despite(slot_lost), checks=(fit_checks.SLOT_LAYOUTS,),
            scope="every full slot of a laid-out variable has its variable's layout, and each such variable "
                  "its optimizer's slot count; not applicable where no laid-out variable has a full slot "
                  "(SGD without momentum; Adafactor's factored slots may be kept whole)"),
    Promise("communication-budget", "a train step communicates within the layout's budget",
            tests=lambda cell: cell.get(COMMUNICATION) is not None, breaks=(OVER_BUDGET,),
            kept_despite=lambda cell: fit_checked_before(NUMERICS, COMPILE_FALLBACK)(cell)
            or hub_checked_before(NUMERICS)(cell), checks=(fit_checks.STEP_COMMUNICATION,),
            scope="an eager ModelParallel step makes no full-size copy of a split variable, its gradient or a "
                  "slot; an eager DataParallel step synchronises each gradient once, plus scalars; not applicable "
                  "where ModelParallel splits no variable (replicated, a model axis of one) and on jit cells "
                  "(the compiled step is not measured)"),
    Promise("per-process-input", "each process's own input (hand-fed) becomes the global batch",
            tests=feeds_batch_shards, breaks=input_failure, kept_despite=fit_checked_before(COMPILE_FALLBACK),
            checks=(fit_checks.SINGLE_PROCESS_NUMBERS,),
            scope="judged by single-process-numbers on the training cells whose layout has several batch "
                  "shards (every step's loss, evaluate, predict and weights are the single process's on the "
                  "global batch): an input that does not make the global batch fails it there, and so does "
                  "any other numbers bug of those cells; an exception in Keras' input code breaks it too"),
    # issue 19, item 1: Keras' own data sharding (test_data_sharding.py, family "keras-sharded LAYOUT")
    Promise("keras-shards-input", "given the global dataset, Keras gives each process a distinct part, together "
            "the whole, and evaluate returns the loss over all of it", tests=keras_sharded, breaks=keras_sharding_broken,
            scope="the rows each process's steps received, recorded on the ranks; evaluate's loss on every "
                  "rank against the loss over every row evaluated, in NumPy from the trained weights"),
    Promise("metrics-and-callbacks-agree", "every rank reports the metrics and takes the callback decisions "
            "of a single process", tests=agreement, breaks=lambda cell: agreement(cell) and (cell["verdict"] in (
                NUMERICS, HANG_VERDICT) or judged_error(cell)),
            scope="metrics' logs and callbacks' decisions on every rank against a single process's"),
    # issue 27, item 3: the on-batch and inference APIs (test_on_batch.py, family "on-batch")
    Promise("on-batch-apis-agree", "train_on_batch, test_on_batch, predict_on_batch, evaluate and predict give "
            "every rank what a single process gives", tests=on_batch, breaks=lambda cell: on_batch(cell) and (
                cell["verdict"] in (NUMERICS, HANG_VERDICT) or judged_error(cell)),
            scope="each call's logs on every rank against a single process's over the global batch, the "
                  "predictions of the rows each rank fed (every column), the weights after train_on_batch; "
                  "hand-fed (each process its own batch): Keras' own sharding of evaluate and predict is "
                  "keras-shards-input's"),
    Promise("numbers-match-single-process", "numbers match a single process (reference and NumPy oracle)",
            tests=fit, breaks=lambda cell: fit(cell) and cell["verdict"] == NUMERICS,
            kept_despite=fit_checked_before(COMPILE_FALLBACK),
            checks=(fit_checks.SINGLE_PROCESS_NUMBERS, fit_checks.ORACLE_NUMBERS),
            scope="losses, evaluate, predict and final weights of every rank against single-process torch, and "
                  "against the NumPy oracle in its scope, element-wise and by the scale of each rank's update "
                  "(a factor 1 % off fails under every dtype policy); not judged where the reference does not "
                  "define the numbers (BatchNormalization's local statistics under DataParallel: skipped) or "
                  "failed to run (counted); not applicable on a model with dropout (dropout-masks-agree)"),
    # issue 54, item 3: a model with dropout (the transformer block's), which no single process can judge.
    Promise("dropout-masks-agree", "ranks that hold the same rows draw the same dropout masks",
            tests=draws_dropout, breaks=lambda cell: draws_dropout(cell) and cell["verdict"] == NUMERICS,
            kept_despite=fit_checked_before(COMPILE_FALLBACK), checks=(fit_checks.DROPOUT_MASKS,),
            scope="on a model with dropout, the losses, evaluate and predictions of ranks that fed the same rows "
                  "against each other, and every rank's weights against rank 0's; its dropout-free twin is held "
                  "to single-process-numbers"),
    # issue 27, item 2: what fine-tuning with LoRA relies on (the lora models of test_fit.py).
    Promise("frozen-stays-frozen", "variables a model freezes (LoRA's base kernels) stay exactly as they were",
            tests=fit, breaks=frozen_changed, checks=(fit_checks.FROZEN_UNCHANGED,),
            scope="each kernel LoRA froze bit-equal before and after training on every rank, checked first; "
                  "not applicable where the model freezes nothing"),
    Promise("agrees-with-jax-backend", "torch computes what the same build's JAX backend computes",
            tests=fit, breaks=(JAX_BACKEND_DIFFERS,), checks=(fit_checks.JAX_NUMBERS, fit_checks.JAX_LAYOUTS),
            scope="the ranks' numbers against the same build's JAX backend from the same weights, element-wise "
                  "and by the scale of each rank's update, and its layouts and slot counts against the LayoutMap "
                  "and the optimizer's; where the NumPy oracle sides with torch, or JAX alone departs from the "
                  "LayoutMap, the verdict is jax-backend-differs, not a torch failure; not applicable without "
                  "JAX; not judged where the JAX run raised, crashed or hung (counted)"),
    # issue 19: what Keras must do itself with variables between processes (test_state.py).
    Promise("variables-reconciled", "ranks seeded differently agree on one global initialisation, then train "
            "as one process from it", tests=lambda cell: state(cell, "reconcile"),
            breaks=lambda cell: state(cell, "reconcile") and cell["verdict"] in (NUMERICS, SHARDING_LOST),
            scope="every rank's variables against rank 0's and a single process's"),
    Promise("checkpoints-resume-and-reshard", "a checkpoint written from every rank loads (optimizer slots "
            "included) under any layout and process count and resumes as uninterrupted training",
            tests=lambda cell: state(cell, "checkpoint"),
            breaks=lambda cell: state(cell, "checkpoint") and cell["verdict"] in (NUMERICS, SHARDING_LOST, ERROR),
            scope="the resumed run against an uninterrupted single process, and the loaded layouts"),
    # issue 54: the flows users run between and around fits (test_workflows.py, family "workflows").
    Promise("workflows-train-as-one-process", "the flows users run between and around fits (fine-tuning, LoRA "
            "after a fit, a recompile, another batch size, a model built or loaded before the distribution, a "
            "second distribution) train as one process running them does", tests=workflow,
            breaks=flow_broken(workflow),
            kept_despite=lambda cell: workflow(cell) and cell["verdict"] == COMPILE_FALLBACK,
            scope="after every fit of the flow: each step's loss, every weight and the ranks' agreement against "
                  "one process running the same flow on the global batches, frozen variables bit-equal, and the "
                  "layouts where the flow makes its variables under the distribution; a flow that raises on a "
                  "rank breaks it"),
    # issue 64: the models users shard (test_hub.py, family "kerashub MODEL").
    Promise("kerashub-models-train-as-one-process", "KerasHub's causal LMs under their authors' layout maps (and "
            "a user's, and DataParallel) fit, fine-tune with LoRA, load a preset, generate and reload as one "
            "process does", tests=hub,
            breaks=flow_broken(hub),
            kept_despite=lambda cell: hub(cell) and cell["verdict"] == OVER_BUDGET,
            checks=(fit_checks.FROZEN_UNCHANGED, fit_checks.VARIABLE_LAYOUTS, fit_checks.SLOT_LAYOUTS,
                    hub_checks.FLOW_NUMBERS, hub_checks.GENERATED_IDS),
            scope="every variable the map names laid out as it says after every stage and fit, its slots too, "
                  "the others whole; after every fit each step's loss, every weight and the ranks' agreement "
                  "against one process running the flow from the same weights, frozen variables bit-equal; "
                  "generate's token ids against the one process's, up to a near-tie; a flow that raises on a "
                  "rank breaks it"),
    Promise("compile", "torch.compile compiles the whole step", tests=lambda cell: cell["axes"].get("compile") in (
        "jit", "compiled"), breaks=(COMPILE_FALLBACK, COMPILE_TIMEOUT), checks=(fit_checks.COMPILED, OP_COMPILED),
            scope="dynamo's counters: a jit cell's whole train step in compiled graphs; a compiled op in the graphs "
                  "its plain-tensor twin compiles, no fewer, no more, and no graph break the twin has not (not "
                  "applicable where the twin compiles none)"),
    Promise("ops-give-plain-values", "keras.ops on DTensors give the values they give on plain tensors",
            tests=lambda cell: family(cell) == "ops",
            breaks=lambda cell: family(cell) == "ops" and cell["verdict"] == NUMERICS, checks=(OP_VALUE,),
            # op_checks.op_outcomes' order: the value, the placements, then compilation.
            kept_despite=lambda cell: family(cell) == "ops" and cell["verdict"] in (SHARDING_LOST, COMPILE_FALLBACK),
            scope="each op's value on every rank against the same op on plain tensors"),
    Promise("ops-keep-placements", "keras.ops on DTensors keep the placements DTensor's propagation gives",
            tests=lambda cell: family(cell) == "ops",
            breaks=lambda cell: family(cell) == "ops" and cell["verdict"] == SHARDING_LOST, checks=(OP_PLACEMENTS,),
            kept_despite=lambda cell: family(cell) == "ops" and cell["verdict"] == COMPILE_FALLBACK,
            scope="a tensor result's placements against plain torch on the same DTensor; not applicable where "
                  "the result is no tensor (shape, is_tensor, convert_to_numpy)"),
    Promise("setup", "setup entry points work (initialize, DeviceMesh, LayoutMap, ModelParallel, DataParallel)",
            tests=lambda cell: family(cell) == "setup", breaks=lambda cell: family(cell) == "setup",
            scope="each entry point runs on every rank"),
    Promise("known-failure-modes", "failure modes real builds hit stay fixed (scenarios)",
            tests=lambda cell: family(cell) == "scenarios", breaks=lambda cell: family(cell) == "scenarios",
            scope="each scenario's own evidence (a kernel's layout, a value, a dtype, a clear error)"),
    Promise("dtensor-dispatch", "no mixed Tensor/DTensor, no missing sharding strategy", tests=lambda cell: True,
            # A judged verdict comes from a call that succeeded on every rank: it ran to the end, unmixed.
            breaks=(MIXED_TENSOR, NO_SHARDING_STRATEGY), kept_despite=JUDGED_VERDICTS,
            scope="what every rank raised, classified; a crash or hang proves nothing either way"),
    Promise("runs-to-the-end", "every rank runs to the end: no error, crash or hang", tests=lambda cell: True,
            breaks=ranks_stopped, kept_despite=lambda cell: not ranks_stopped(cell),
            scope="the ranks' outcomes alone: an error the judge gave from returned evidence does not break it"),
)
