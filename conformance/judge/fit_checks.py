"""Evidence -> verdict for a trained cell, as plain functions that a standalone reproducer can inline.

``judge.judge_fit`` decides a training cell's verdict with these, and so does the script
``--conformance-repro`` writes for a training cell (it inlines this module's source after the
modules it imports: ``conformance/reproducible.py``), so a contributor's script judges sharding,
numbers against the single-process reference and compilation with the suite's own rules, not a
copy. Each check returns ``(verdict, message)`` when the evidence fails it, or None; raising
pytest's or the plugin's exceptions is the judge's part. ``fit_failure`` runs them in their
order, the one place that order is written. The NumPy oracle is not here: the judge hands its
check to ``fit_failure`` (``oracle=``), and a reproducer does not run it.

``values`` is what ``rank_train.train`` returns on each rank, in rank order; ``reference`` is what it
returns in the single-process run of ``reference_spec(spec)``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from keras_dtensor_conformance import (
    COMPILE_FALLBACK,
    ERROR,
    FAILED,
    HELD,
    JAX_BACKEND_DIFFERS,
    NOT_APPLICABLE,
    NOT_REACHED,
    NUMERICS,
    SHARDING_LOST,
)

from conformance.cell_data import policy
from conformance.judge.communication import over_budget, sharded_variables
from conformance.judge.compile_evidence import compile_problems
from conformance.judge.jax_compare import (
    BOTH_SHARE,
    JAX_IS_WRONG,
    expected_layouts,
    numbers_differ_from_jax,
    slot_counts,
)
from conformance.judge.numerics import TOLERANCES, numerics_problems, reported_problems
from conformance.judge.sharding import laid_out, sharding_problems
from conformance.judge.slots import slot_problems


def reference_spec(spec: dict) -> dict:
    """The single-process run a cell is compared with: the same model, seed, data and optimizer,
    with no layout and no torch.compile (``spe4`` kept: it changes when metrics are read)."""
    return dict(spec, compile="spe4" if spec["compile"] == "spe4" else "nojit",
                layout={"kind": "single"}, layout_name="single")


def sharding_checks(spec: dict, values: list[dict], nproc: int,
                    jax: dict | None = None) -> tuple[tuple[str, str] | None, dict[str, tuple[str, str]]]:
    """(what failed, as ``(verdict, message)`` or None; the outcomes of ``VARIABLE_LAYOUTS`` and
    ``SLOT_LAYOUTS``). One look at the variables and their slots: a cell that lost either is one
    ``sharding-lost`` verdict, and each of the two checks says whether it held, failed or could not
    fail (nothing laid out to hold to).

    Every variable the layout shards, and every optimizer slot of it, is a DTensor as asked; and
    every such variable has exactly the slots its optimizer keeps (``conformance.judge.slots``), so a
    slot the rank side could not find is a failure, not an empty list that passes.

    With ``jax`` (the JAX reference's evidence), what is asked is what the same build's JAX backend
    made of the same LayoutMap: each variable's and slot's layout, and each sharded variable's slot
    counts (``jax_compare``); without it, the layout map and the hand-written ``axes.SLOTS``."""
    variable_problems, slot_lines = [], []
    layout = spec["layout"]
    want = expected_layouts(jax, layout, nproc) if jax is not None else None
    counts = slot_counts(jax, layout, nproc) if jax is not None else None
    source = " (as the JAX backend lays it out)" if jax is not None else ""
    for rank, value in enumerate(values):
        for stage, variables in value["stages"].items():
            variable_problems += sharding_problems(layout, variables, nproc, f"rank {rank} after {stage}: ",
                                                   rank=rank, want=want)
        full = [s for s in value["slots"] if s["factor"] is None]
        slot_lines += sharding_problems(layout, full, nproc, f"rank {rank} optimizer slot ", rank=rank, want=want)
        # A frozen variable (LoRA's kernel) is not trained, so its optimizer keeps no slots for it.
        trained = [v for v in value["stages"]["fit"] if v["path"] not in value.get("frozen", ())]
        missing = slot_problems(spec["optimizer_name"], layout, trained, value["slots"], nproc,
                                f"rank {rank}: ", rank=rank, counts=counts)
        if missing and value["unmatched_optimizer_variables"]:
            missing.append(f"rank {rank}: optimizer variables that match no model variable: "
                           + ", ".join(value["unmatched_optimizer_variables"]))
        slot_lines += missing
    first = values[0] if values else {"stages": {"fit": []}, "slots": []}
    variables = laid_out(layout, first["stages"]["fit"], nproc, want)
    slots = laid_out(layout, [s for s in first["slots"] if s["factor"] is None], nproc, want)
    outcomes = {
        VARIABLE_LAYOUTS: _outcome(variable_problems, variables, "the layout asks no variable for a layout"),
        SLOT_LAYOUTS: _outcome(slot_lines, slots, "no optimizer slot of a laid-out variable to hold to its layout"
                               if variables else "the layout asks no variable for a layout"),
    }
    problems = variable_problems + slot_lines
    return ((SHARDING_LOST, "\n".join(p + source for p in problems)) if problems else None), outcomes


def _outcome(problems: list[str], judged: list, why_not: str) -> tuple[str, str]:
    """A check's outcome: failed on its problems (the first one said), held where it judged
    something (``judged``: what, counted), else not applicable (``why_not``)."""
    if problems:
        return FAILED, problems[0]
    return (HELD, f"{len(judged)} judged") if judged else (NOT_APPLICABLE, why_not)


def sharding_lost(spec: dict, values: list[dict], nproc: int, jax: dict | None = None) -> tuple[str, str] | None:
    """``sharding_checks``' finding alone."""
    return sharding_checks(spec, values, nproc, jax)[0]


def frozen_changed(values: list[dict]) -> tuple[str, str] | None:
    """A frozen variable (a kernel LoRA froze: ``frozen`` in the evidence) ends training exactly as
    it began on every rank. Its change is ``numerics``: the single-process reference would show it
    only as a difference, this check names the variable."""
    problems = []
    for rank, value in enumerate(values):
        for path in value.get("frozen", ()):
            before, after = np.asarray(value["initial_weights"][path]), np.asarray(value["weights"][path])
            if not np.array_equal(before, after):
                problems.append(f"rank {rank}: frozen {path} changed in training (max abs change "
                                f"{np.abs(after.astype('float64') - before).max():.3g}): it is not trainable")
    return (NUMERICS, "\n".join(problems)) if problems else None


def frozen_scope(values: list[dict]) -> str | None:
    """None where ``frozen_changed`` can fail: some variable is frozen."""
    return None if any(v.get("frozen") for v in values) else "the model freezes no variable"


def communication_scope(spec: dict, values: list[dict]) -> str | None:
    """None when ``communication.over_budget`` can fail on this cell, else why it cannot: it judges
    an eager step's gradient synchronisation under DataParallel and ModelParallel's split
    variables, so a ModelParallel cell whose layout splits no variable (replicated, a model axis of
    one) has nothing it could reject, and a jit cell's compiled step is not the step measured."""
    if not all(v.get("communication") for v in values):
        return "no step was measured"
    if spec["layout"]["kind"] == "model-parallel" and not any(sharded_variables(v["stages"]["fit"]) for v in values):
        return "no variable is split on any rank"
    if spec["compile"] == "jit":
        return "the measured step is eager; the compiled step's communication is not recorded"
    return None


def step_communication(spec: dict, values: list[dict], nproc: int) -> tuple[str, str] | None:
    """``communication.over_budget`` where ``communication_scope`` says it can fail (elsewhere None)."""
    return over_budget(spec, values, nproc) if communication_scope(spec, values) is None else None


def reference_elsewhere(values: list[dict], reference: dict) -> tuple[str, str] | None:
    """The reference computed on the ranks' device type: the same Keras seed gives other initial
    weights on cuda than on cpu, so a CPU reference for GPU ranks would blame Keras for the
    harness' choice (``error``, not ``numerics``)."""
    devices = sorted({v["device"] for v in values})
    if devices != [reference["device"]]:
        return ERROR, (f"the single-process reference computed on {reference['device']}, the ranks on "
                       f"{', '.join(devices)}: their numbers are not comparable (a harness error)")
    return None


def local_batch_statistics(values: list[dict]) -> str | None:
    """Why the reference does not define the right numbers, or None: a ``BatchNormalization``
    (``synchronized=False``, the only value the torch backend accepts) under ``DataParallel`` with
    more than one batch shard normalizes with each process' LOCAL batch statistics, which Keras
    documents ("each replica uses its own local batch statistics"), while the reference normalizes
    the global batch. (Under ModelParallel the batch is one global DTensor, so the statistics are
    global and the cell is compared as usual.)"""
    local = sorted({path for v in values if v["distribution"] == "DataParallel" and v["batch_part"][1] > 1
                    for path in v["unsynchronized_batch_norm"]})
    if not local:
        return None
    return (f"{', '.join(local)}: BatchNormalization under DataParallel uses each process' local batch "
            "statistics (synchronized=True is TensorFlow-only), the single-process reference the global "
            "batch's: numbers not comparable")


def global_batch_scope(spec: dict, values: list[dict]) -> str | None:
    """None when ``global_batch_differs`` can fail on this cell, else why it cannot."""
    if len({v["batch_part"][0] for v in values}) < 2:
        return "one batch shard: every process feeds the whole batch"
    if spec["compile"] == "spe4":
        return "steps_per_execution=4 reports its first loss after three updates"
    if not all(v["step_losses"] for v in values):
        return "no step loss reported"
    return None


def global_batch_differs(spec: dict, values: list[dict], reference: dict) -> tuple[str, str] | None:
    """The first step's loss, which no update has touched yet, equals the single process's on every
    rank: the processes' own parts made the global batch (a rank reporting its local loss is
    accepted as ``numerics.reported_problems`` accepts it). Judged where there are several batch
    shards (``global_batch_scope``); a wrong forward pass fails it too."""
    if global_batch_scope(spec, values) is not None:
        return None
    firsts = [{"first step loss": v["step_losses"][:1], "batch_part": v["batch_part"]} for v in values]
    problems = reported_problems("first step loss", firsts, reference["step_losses"][:1], TOLERANCES[policy(spec)])
    return (NUMERICS, "the processes' input did not make the single process's global batch (the first step's "
            "loss, before any update, differs): " + "\n".join(problems)) if problems else None


def numbers_differ(spec: dict, values: list[dict], reference: dict) -> tuple[str, str] | None:
    """Losses, evaluate, predict and final weights against the single-process reference's, and the
    ranks against each other (``conformance.judge.numerics``), within the tolerance of the cell's
    dtype policy."""
    problems = numerics_problems(values, reference, TOLERANCES[policy(spec)])
    # The verdict's kind and the first problem on the first line: the headline, and what clusters it.
    return (NUMERICS, "distributed torch differs from single-process torch (a distribution bug): "
            + "\n".join(problems)) if problems else None


def differs_from_jax(spec: dict, values: list[dict], jax: dict | None) -> tuple[str, str] | None:
    """The ranks (which the single-process torch reference has just passed) against the same build's
    JAX backend (``jax_compare``), as ``(NUMERICS, what differs)``: which backend is wrong is for
    ``arbitrate`` to say."""
    if jax is None:
        return None
    problems = numbers_differ_from_jax(spec["optimizer_name"], values, jax, policy(spec))
    return (NUMERICS, "\n".join(problems)) if problems else None


def arbitrate(jax_found: tuple[str, str], oracle_found: tuple[str, str] | None) -> tuple[str, str]:
    """The verdict of a cell whose torch runs agree with each other and not with JAX, from the
    NumPy oracle's outcome (None: it held; ``(NOT_APPLICABLE, why)``; else its failure).

    The oracle siding with torch clears the torch backend: ``jax-backend-differs``, naming the JAX
    backend. Siding with neither, or against torch, is the torch backend's bug both torch runs
    share. Without an oracle for the cell, the difference is said without claiming a side."""
    differences = jax_found[1]
    if oracle_found is None:
        return JAX_BACKEND_DIFFERS, (f"{JAX_IS_WRONG}: {differences}")
    if oracle_found[0] == NOT_APPLICABLE:
        return NUMERICS, f"{BOTH_SHARE}; no NumPy oracle says which backend is right ({oracle_found[1]}): {differences}"
    return NUMERICS, f"{BOTH_SHARE}, and the NumPy oracle disagrees with torch too: a torch-backend bug: {differences}"


def not_compiled(spec: dict, values: list[dict]) -> tuple[str, str] | None:
    """A ``jit`` cell's fit ran compiled graphs, and the whole step in them: model call, loss,
    backward and optimizer update (torch._dynamo's own instrumentation; the rule and why it
    holds are in ``conformance.judge.compile_evidence``)."""
    if spec["compile"] != "jit":
        return None
    if any(v["compiled_graphs"] == 0 for v in values):
        said = "; ".join(dict.fromkeys(w for v in values for w in v["warnings"])) or "no warning"
        return COMPILE_FALLBACK, f"jit_compile=True but torch._dynamo compiled no graph ({said})"
    problems = [f"rank {rank}: {p}" for rank, v in enumerate(values) for p in compile_problems(v)]
    if problems:
        return COMPILE_FALLBACK, ("jit_compile=True but the train step did not run whole in compiled graphs:\n"
                                  + "\n".join(problems))
    return None


#: ``fit_failure``'s outcomes that are no verdict: the reference does not define the right numbers
#: (the suite skips the cell), or the single-process reference did not run (the harness' error).
NOT_COMPARABLE = "not-comparable"
NO_REFERENCE = "no-reference"

#: A trained cell's checks, in ``fit_checks``' order: the promises (``conformance/promises.py``)
#: name them, and a cell's record carries each one's outcome.
VARIABLE_LAYOUTS = "variable-layouts"
SLOT_LAYOUTS = "slot-layouts"
FROZEN_UNCHANGED = "frozen-unchanged"
STEP_COMMUNICATION = "step-communication"
GLOBAL_BATCH = "global-batch"
SINGLE_PROCESS_NUMBERS = "single-process-numbers"
JAX_NUMBERS = "jax-numbers"
ORACLE_NUMBERS = "oracle-numbers"
COMPILED = "compiled"
CHECKS = (FROZEN_UNCHANGED, VARIABLE_LAYOUTS, SLOT_LAYOUTS, STEP_COMMUNICATION, GLOBAL_BATCH, SINGLE_PROCESS_NUMBERS,
          JAX_NUMBERS, ORACLE_NUMBERS, COMPILED)

#: The oracle a reproducer has: none (the suite's judge passes its own).
NO_ORACLE = (NOT_APPLICABLE, "the NumPy oracle is not run here")


def fit_checks(spec: dict, values: list[dict], nproc: int, reference: dict | None,
               oracle: Callable[[], tuple[str, str] | None] | None = None,
               jax: dict | None = None) -> tuple[tuple[str, str] | None, dict[str, tuple[str, str]]]:
    """(what the cell found, as ``fit_failure`` says it; each check's ``(outcome, why)``, in ``CHECKS``' order).

    The order: frozen variables left as they were (``frozen_changed``: a frozen kernel that trained
    is the cause of what follows, its optimizer slots among them); the sharding (which needs no
    reference, so a cell that lost it says so whatever became of the reference); the communication
    of a step (``communication.over_budget``: no
    full-size copy of a variable the sharding check has just held to its layout); the reference
    itself (that it ran, ``reference`` None being ``NO_REFERENCE``, and on the ranks' device);
    whether its numbers are comparable (else ``(NOT_COMPARABLE, why)``); the global batch and the
    numbers against single-process torch (a distribution bug); then against ``jax``, the same
    build's JAX backend, when one ran, with ``oracle`` (the suite's NumPy oracle: None when it
    holds, ``(NOT_APPLICABLE, why)`` outside its scope, else its failure) to arbitrate a
    difference (``arbitrate``); and compilation last, since a step that computes the wrong numbers
    or loses its sharding is that failure whether or not it compiled. A check after the first
    failure is not reached; a check that cannot fail on the cell is not applicable, with why.
    """
    outcomes: dict[str, tuple[str, str]] = {}

    def finish(found, reached: int, why: str | None = None):
        failed = [name for name in CHECKS if outcomes.get(name, ("",))[0] == FAILED]
        why = why or (("the cell stopped" if not found else f"{failed[0]} failed" if failed
                       else "an earlier check failed"))
        for name in CHECKS[reached:]:
            outcomes.setdefault(name, (NOT_REACHED, why))
        return found, {name: outcomes[name] for name in CHECKS}

    def record(name, found, scope=None):
        outcomes[name] = (FAILED, found[1].splitlines()[0]) if found else (
            (NOT_APPLICABLE, scope) if scope else (HELD, ""))
        return found

    found = record(FROZEN_UNCHANGED, frozen_changed(values), frozen_scope(values))
    if found is not None:
        return finish(found, 1)
    found, layouts = sharding_checks(spec, values, nproc, jax)
    outcomes.update(layouts)
    if found is not None:
        return finish(found, 3)
    found = record(STEP_COMMUNICATION, step_communication(spec, values, nproc), communication_scope(spec, values))
    if found is not None:
        return finish(found, 4)
    if reference is None:
        return finish((NO_REFERENCE, "the single-process reference failed"), 4,
                      "the single-process reference failed")
    why = reference_elsewhere(values, reference)
    if why is None:
        local = local_batch_statistics(values)
        why = (NOT_COMPARABLE, local) if local else None
    if why is not None:
        return finish(why, 4, f"the numbers cannot be compared with the single process's: {why[1].splitlines()[0]}")
    batch = record(GLOBAL_BATCH, global_batch_differs(spec, values, reference), global_batch_scope(spec, values))
    found = record(SINGLE_PROCESS_NUMBERS, numbers_differ(spec, values, reference)) or batch
    if found is not None:
        return finish(found, 6)
    jax_found = record(JAX_NUMBERS, differs_from_jax(spec, values, jax),
                       None if jax is not None else "the JAX backend did not run")
    oracle_found = oracle() if oracle is not None else NO_ORACLE
    oracle_applicable = oracle_found is None or oracle_found[0] != NOT_APPLICABLE
    record(ORACLE_NUMBERS, oracle_found if oracle_applicable else None,
           None if oracle_applicable else oracle_found[1])
    if jax_found is not None:
        found = arbitrate(jax_found, oracle_found)
        if found[0] != JAX_BACKEND_DIFFERS:
            return finish(found, 8)
    elif oracle_applicable and oracle_found is not None:
        return finish(oracle_found, 8)
    compiled = record(COMPILED, not_compiled(spec, values), None if spec["compile"] == "jit" else "not a jit cell")
    return finish(compiled or found, 9)


def fit_failure(spec: dict, values: list[dict], nproc: int, reference: dict | None,
                oracle: Callable[[], tuple[str, str] | None] | None = None,
                jax: dict | None = None) -> tuple[str, str] | None:
    """The first check a trained cell fails, as ``(verdict, message)``, or None: it passes
    (``fit_checks``, which says the order)."""
    return fit_checks(spec, values, nproc, reference, oracle, jax)[0]
