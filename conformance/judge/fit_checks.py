"""Evidence -> verdict for a trained cell, as plain functions that a standalone reproducer can inline.

``judge.cells.judge_fit`` decides a training cell's verdict with these, and so does the script
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
    NOT_JUDGED,
    NOT_REACHED,
    NUMERICS,
    SHARDING_LOST,
)

from conformance.cell_data import DROPOUT_MODELS, policy
from conformance.judge.communication import over_budget, sharded_variables
from conformance.judge.compile_evidence import compile_problems
from conformance.judge.jax_compare import BOTH_SHARE, JAX_IS_WRONG, layout_departures, numbers_differ_from_jax
from conformance.judge.numerics import numerics_problems, same_rows_problems
from conformance.judge.sharding import laid_out, sharding_problems, whole_problems
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

    Every variable the LayoutMap shards, and every optimizer slot of it, is a DTensor as asked; every
    variable it names no layout for, and its slots, is whole (``sharding.whole_problems``); and every
    such sharded variable has exactly the slots its optimizer keeps (``conformance.judge.slots``), so a
    slot the rank side could not find is a failure, not an empty list that passes. The LayoutMap and
    the optimizer's slots are the specification whatever the JAX backend does; where ``jax`` (the JAX
    reference's evidence) departs from them too, the message says so (a bug of code both backends
    share), and where only JAX departs, ``jax_layouts_differ`` names it."""
    variable_problems, slot_lines = [], []
    layout = spec["layout"]
    for rank, value in enumerate(values):
        for stage, variables in value["stages"].items():
            variable_problems += sharding_problems(layout, variables, nproc, f"rank {rank} after {stage}: ", rank=rank)
            variable_problems += whole_problems(layout, variables, nproc, f"rank {rank} after {stage}: ")
        full = [s for s in value["slots"] if s["factor"] is None]
        slot_lines += sharding_problems(layout, full, nproc, f"rank {rank} optimizer slot ", rank=rank)
        slot_lines += whole_problems(layout, full, nproc, f"rank {rank} optimizer slot ")
        # A frozen variable (LoRA's kernel) is not trained, so its optimizer keeps no slots for it.
        trained = [v for v in value["stages"]["fit"] if v["path"] not in value.get("frozen", ())]
        missing = slot_problems(spec["optimizer_name"], layout, trained, value["slots"], nproc,
                                f"rank {rank}: ", rank=rank)
        if missing and value["unmatched_optimizer_variables"]:
            missing.append(f"rank {rank}: optimizer variables that match no model variable: "
                           + ", ".join(value["unmatched_optimizer_variables"]))
        slot_lines += missing
    first = values[0] if values else {"stages": {"fit": []}, "slots": []}
    variables = laid_out(layout, first["stages"]["fit"], nproc)
    slots = laid_out(layout, [s for s in first["slots"] if s["factor"] is None], nproc)
    outcomes = {
        VARIABLE_LAYOUTS: _outcome(variable_problems, variables, "the layout asks no variable for a layout"),
        SLOT_LAYOUTS: _outcome(slot_lines, slots, "no optimizer slot of a laid-out variable to hold to its layout"
                               if variables else "the layout asks no variable for a layout"),
    }
    problems = variable_problems + slot_lines
    if not problems:
        return None, outcomes
    departures = _jax_departures(spec, values, nproc, jax)
    also = ("\nthe JAX backend departs from the LayoutMap too (code both backends share?): " + "; ".join(departures)
            if departures else "")
    return (SHARDING_LOST, "\n".join(problems) + also), outcomes


def _jax_departures(spec: dict, values: list[dict], nproc: int, jax: dict | None) -> list[str]:
    if jax is None:
        return []
    frozen = set(values[0].get("frozen", ())) if values else set()
    return layout_departures(jax, spec["layout"], nproc, spec["optimizer_name"], frozen)


def jax_layouts_differ(spec: dict, values: list[dict], nproc: int, jax: dict | None) -> tuple[str, str] | None:
    """The JAX backend lays out the cell's variables and slots as the LayoutMap and the optimizer ask
    (``jax_compare.layout_departures``), which torch has just been held to: where it does not, the
    JAX backend departs, ``jax-backend-differs`` naming it (torch's own layouts held)."""
    departures = _jax_departures(spec, values, nproc, jax)
    return (JAX_BACKEND_DIFFERS, "the JAX backend departs from the LayoutMap, which torch follows: "
            + "\n".join(departures)) if departures else None


def _outcome(problems: list[str], judged: list, why_not: str) -> tuple[str, str]:
    """A check's outcome: failed on its problems (the first one said), held where it judged
    something (``judged``: what, counted), else not applicable (``why_not``)."""
    if problems:
        return FAILED, problems[0]
    return (HELD, f"{len(judged)} judged") if judged else (NOT_APPLICABLE, why_not)


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


def numbers_differ(spec: dict, values: list[dict], reference: dict) -> tuple[str, str] | None:
    """Losses, evaluate, predict and final weights against the single-process reference's, and the
    ranks against each other (``conformance.judge.numerics``), within the tolerance of the cell's
    dtype policy."""
    problems = numerics_problems(values, reference, policy=policy(spec))
    # The verdict's kind and the first problem on the first line: the headline, and what clusters it.
    return (NUMERICS, "distributed torch differs from single-process torch (a distribution bug): "
            + "\n".join(problems)) if problems else None


def dropout_scope(spec: dict) -> str | None:
    """Why the ranks' numbers are held to a single process's (None), or why not: a model with dropout
    draws its masks from a random stream no single process shares (``masks_differ`` judges it)."""
    if spec["model"] in DROPOUT_MODELS:
        return ("the model draws dropout masks a single process does not share: judged by the ranks' agreement "
                "(dropout-masks-agree), its dropout-free twin by numbers")
    return None


def masks_differ(values: list[dict]) -> tuple[str, str] | None:
    """A model with dropout: ranks that fed the same rows report the same numbers and every rank holds
    the same weights (``numerics.same_rows_problems``): a mask one rank draws alone for a tensor the
    others hold too makes its numbers its own."""
    problems = same_rows_problems(values)
    return (NUMERICS, "the ranks' dropout masks differ (ranks that hold the same rows disagree): "
            + "\n".join(problems)) if problems else None


def differs_from_jax(spec: dict, values: list[dict], jax: dict | None) -> tuple[str, str] | None:
    """The ranks (which the single-process torch reference has just passed) against the same build's
    JAX backend (``jax_compare``), as ``(NUMERICS, what differs)``: which backend is wrong is for
    ``arbitrate`` to say."""
    if jax is None:
        return None
    problems = numbers_differ_from_jax(values, jax, policy(spec))
    return (NUMERICS, "\n".join(problems)) if problems else None


def arbitrate(jax_found: tuple[str, str], oracle_found: tuple[str, str] | None) -> tuple[str, str]:
    """The verdict of a cell whose torch runs agree with each other and not with JAX, from the
    NumPy oracle's outcome (None: it held; ``(NOT_APPLICABLE, why)`` or ``(NOT_JUDGED, why)``; else its failure).

    The oracle siding with torch clears the torch backend: ``jax-backend-differs``, naming the JAX
    backend. Siding with neither, or against torch, is the torch backend's bug both torch runs
    share. Without an oracle for the cell, the difference is said without claiming a side."""
    differences = jax_found[1]
    if oracle_found is None:
        return JAX_BACKEND_DIFFERS, (f"{JAX_IS_WRONG}: {differences}")
    if oracle_found[0] in (NOT_APPLICABLE, NOT_JUDGED):
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
SINGLE_PROCESS_NUMBERS = "single-process-numbers"
DROPOUT_MASKS = "dropout-masks-agree"
JAX_NUMBERS = "jax-numbers"
JAX_LAYOUTS = "jax-layouts"
ORACLE_NUMBERS = "oracle-numbers"
COMPILED = "compiled"
CHECKS = (FROZEN_UNCHANGED, VARIABLE_LAYOUTS, SLOT_LAYOUTS, STEP_COMMUNICATION, SINGLE_PROCESS_NUMBERS,
          DROPOUT_MASKS, JAX_NUMBERS, JAX_LAYOUTS, ORACLE_NUMBERS, COMPILED)

#: The oracle a reproducer has: none (the suite's judge passes its own).
NO_ORACLE = (NOT_APPLICABLE, "the NumPy oracle is not run here")


def fit_checks(spec: dict, values: list[dict], nproc: int, reference: dict | None,
               oracle: Callable[[], tuple[str, str] | None] | None = None,
               jax: dict | None = None, jax_failure: str | None = None,
               reference_failure: str = "the single-process reference failed",
               ) -> tuple[tuple[str, str] | None, dict[str, tuple[str, str]]]:
    """(what the cell found, as ``fit_failure`` says it; each check's ``(outcome, why)``, in ``CHECKS``' order).

    The order: frozen variables left as they were (``frozen_changed``: a frozen kernel that trained
    is the cause of what follows, its optimizer slots among them); the sharding (which needs no
    reference, so a cell that lost it says so whatever became of the reference); the communication
    of a step (``communication.over_budget``: no full-size copy of a variable the sharding check has
    just held to its layout); the reference itself (that it ran, ``reference`` None being
    ``NO_REFERENCE``, and on the ranks' device); whether its numbers are comparable (else
    ``(NOT_COMPARABLE, why)``); the numbers against single-process torch, or for a model with dropout the
    ranks' agreement with each other (``masks_differ``; a distribution bug either way: with
    several batch shards, a process's input that does not make the global batch fails here too);
    then against ``jax``, the same build's JAX backend, when one ran (its numbers, and its layouts
    against the LayoutMap: ``jax_layouts_differ``), with ``oracle`` (the suite's
    NumPy oracle: None when it holds, ``(NOT_APPLICABLE, why)`` outside its scope, ``(NOT_JUDGED,
    why)`` when it could not run, else its failure) to arbitrate a difference (``arbitrate``); and
    compilation last, since a step that computes the wrong numbers or loses its sharding is that
    failure whether or not it compiled. A check after the first failure is not reached; a check that
    cannot fail on the cell is not applicable, with why; a check whose reference failed
    (``reference`` None: ``reference_failure``; ``jax_failure``: why the JAX run raised, crashed or
    hung) is not judged, with why.
    """
    outcomes: dict[str, tuple[str, str]] = {}

    def finish(found, last: str, why: str | None = None):
        """The checks after ``last`` (a name of ``CHECKS``) were not reached."""
        failed = [name for name in CHECKS if outcomes.get(name, ("",))[0] == FAILED]
        why = why or ("the cell stopped" if not found else f"{failed[0]} failed" if failed
                      else "an earlier check failed")
        for name in CHECKS[CHECKS.index(last) + 1:]:
            outcomes.setdefault(name, (NOT_REACHED, why))
        return found, {name: outcomes[name] for name in CHECKS}

    def record(name, found, scope=None):
        outcomes[name] = (FAILED, found[1].splitlines()[0]) if found else (
            (NOT_APPLICABLE, scope) if scope else (HELD, ""))
        return found

    found = record(FROZEN_UNCHANGED, frozen_changed(values), frozen_scope(values))
    if found is not None:
        return finish(found, FROZEN_UNCHANGED)
    found, layouts = sharding_checks(spec, values, nproc, jax)
    outcomes.update(layouts)
    if found is not None:
        return finish(found, SLOT_LAYOUTS)
    found = record(STEP_COMMUNICATION, step_communication(spec, values, nproc), communication_scope(spec, values))
    if found is not None:
        return finish(found, STEP_COMMUNICATION)
    if reference is None:
        outcomes[SINGLE_PROCESS_NUMBERS] = (NOT_JUDGED, reference_failure)
        return finish((NO_REFERENCE, reference_failure), SINGLE_PROCESS_NUMBERS, reference_failure)
    why = reference_elsewhere(values, reference)
    if why is None:
        local = local_batch_statistics(values)
        why = (NOT_COMPARABLE, local) if local else None
    if why is not None:
        return finish(why, STEP_COMMUNICATION,
                      f"the numbers cannot be compared with the single process's: {why[1].splitlines()[0]}")
    dropout = dropout_scope(spec)
    if dropout is None:
        outcomes[DROPOUT_MASKS] = (NOT_APPLICABLE, "the model draws no dropout mask")
        found = record(SINGLE_PROCESS_NUMBERS, numbers_differ(spec, values, reference))
        if found is not None:
            return finish(found, SINGLE_PROCESS_NUMBERS)
    else:
        outcomes[SINGLE_PROCESS_NUMBERS] = (NOT_APPLICABLE, dropout)
        found = record(DROPOUT_MASKS, masks_differ(values))
        if found is not None:
            return finish(found, DROPOUT_MASKS)
    jax_found = record(JAX_NUMBERS, differs_from_jax(spec, values, jax),
                       None if jax is not None else "the JAX backend did not run")
    layouts_found = record(JAX_LAYOUTS, jax_layouts_differ(spec, values, nproc, jax),
                           None if jax is not None else "the JAX backend did not run")
    if jax is None and jax_failure:
        outcomes[JAX_NUMBERS] = outcomes[JAX_LAYOUTS] = (NOT_JUDGED, jax_failure)
    oracle_found = oracle() if oracle is not None else NO_ORACLE
    if oracle_found is not None and oracle_found[0] in (NOT_APPLICABLE, NOT_JUDGED):
        outcomes[ORACLE_NUMBERS] = oracle_found
    else:
        record(ORACLE_NUMBERS, oracle_found)
    oracle_judged = oracle_found is None or oracle_found[0] not in (NOT_APPLICABLE, NOT_JUDGED)
    if jax_found is not None:
        found = arbitrate(jax_found, oracle_found)
        if found[0] != JAX_BACKEND_DIFFERS:
            return finish(found, ORACLE_NUMBERS)
    elif oracle_judged and oracle_found is not None:
        return finish(oracle_found, ORACLE_NUMBERS)
    if layouts_found is not None:  # torch held to the LayoutMap: a departure is the JAX backend's
        found = (JAX_BACKEND_DIFFERS, layouts_found[1] + (f"\n{found[1]}" if found else ""))
    compiled = record(COMPILED, not_compiled(spec, values), None if spec["compile"] == "jit" else "not a jit cell")
    return finish(compiled or found, COMPILED)


def fit_failure(spec: dict, values: list[dict], nproc: int, reference: dict | None,
                oracle: Callable[[], tuple[str, str] | None] | None = None,
                jax: dict | None = None) -> tuple[str, str] | None:
    """The first check a trained cell fails, as ``(verdict, message)``, or None: it passes
    (``fit_checks``, which says the order)."""
    return fit_checks(spec, values, nproc, reference, oracle, jax)[0]
