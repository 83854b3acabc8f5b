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

from keras_dtensor_conformance import COMPILE_FALLBACK, ERROR, NUMERICS, SHARDING_LOST

from conformance.judge.communication import over_budget
from conformance.judge.compile_evidence import compile_problems
from conformance.judge.jax_compare import BOTH_SHARE, expected_layouts, numbers_differ_from_jax, slot_counts
from conformance.judge.numerics import numerics_problems
from conformance.judge.sharding import sharding_problems
from conformance.judge.slots import slot_problems


def reference_spec(spec: dict) -> dict:
    """The single-process run a cell is compared with: the same model, seed, data and optimizer,
    with no layout and no torch.compile (``spe4`` kept: it changes when metrics are read)."""
    return dict(spec, compile="spe4" if spec["compile"] == "spe4" else "nojit",
                layout={"kind": "single"}, layout_name="single")


def sharding_lost(spec: dict, values: list[dict], nproc: int, jax: dict | None = None) -> tuple[str, str] | None:
    """Every variable the layout shards, and every optimizer slot of it, is a DTensor as asked; and
    every such variable has exactly the slots its optimizer keeps (``conformance.judge.slots``), so a
    slot the rank side could not find is a failure, not an empty list that passes.

    With ``jax`` (the JAX reference's evidence), what is asked is what the same build's JAX backend
    made of the same LayoutMap: each variable's and slot's layout, and each sharded variable's slot
    counts (``jax_compare``); without it, the layout map and the hand-written ``axes.SLOTS``."""
    problems = []
    layout = spec["layout"]
    want = expected_layouts(jax, layout, nproc) if jax is not None else None
    counts = slot_counts(jax, layout, nproc) if jax is not None else None
    source = " (as the JAX backend lays it out)" if jax is not None else ""
    for rank, value in enumerate(values):
        for stage, variables in value["stages"].items():
            problems += sharding_problems(layout, variables, nproc, f"rank {rank} after {stage}: ", rank=rank,
                                          want=want)
        full = [s for s in value["slots"] if s["factor"] is None]
        problems += sharding_problems(layout, full, nproc, f"rank {rank} optimizer slot ", rank=rank, want=want)
        missing = slot_problems(spec["optimizer_name"], layout, value["stages"]["fit"], value["slots"], nproc,
                                f"rank {rank}: ", rank=rank, counts=counts)
        if missing and value["unmatched_optimizer_variables"]:
            missing.append(f"rank {rank}: optimizer variables that match no model variable: "
                           + ", ".join(value["unmatched_optimizer_variables"]))
        problems += missing
    return (SHARDING_LOST, "\n".join(p + source for p in problems)) if problems else None


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


def numbers_differ(values: list[dict], reference: dict) -> tuple[str, str] | None:
    """Losses, evaluate, predict and final weights against the single-process reference's, and the
    ranks against each other (``conformance.judge.numerics``)."""
    problems = numerics_problems(values, reference)
    # The verdict's kind and the first problem on the first line: the headline, and what clusters it.
    return (NUMERICS, "distributed torch differs from single-process torch (a distribution bug): "
            + "\n".join(problems)) if problems else None


def differs_from_jax(spec: dict, values: list[dict], jax: dict | None) -> tuple[str, str] | None:
    """The ranks (which the single-process torch reference has just passed) against the same build's
    JAX backend (``jax_compare``): a difference here is a bug of the torch backend's own code that
    the single-process and distributed torch runs share."""
    if jax is None:
        return None
    problems = numbers_differ_from_jax(spec["optimizer_name"], values, jax)
    return (NUMERICS, BOTH_SHARE + ": " + "\n".join(problems)) if problems else None


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


def fit_failure(spec: dict, values: list[dict], nproc: int, reference: dict | None,
                oracle: Callable[[], tuple[str, str] | None] | None = None,
                jax: dict | None = None) -> tuple[str, str] | None:
    """The first check a trained cell fails, as ``(verdict, message)``, or None: it passes.

    The order: the sharding (which needs no reference, so a cell that lost it says so whatever
    became of the reference); the communication of a step (``communication.over_budget``: no
    full-size copy of a variable the sharding check has just held to its layout); the reference
    itself (that it ran, ``reference`` None being ``NO_REFERENCE``, and on the ranks' device);
    whether its numbers are comparable (else
    ``(NOT_COMPARABLE, why)``); the numbers against single-process torch (a distribution bug),
    then against ``jax``, the same build's JAX backend, when one ran (a torch-backend bug both torch
    runs share; ``jax`` also defines the layouts the sharding check expects); ``oracle``, a further
    check of the numbers that the caller may add (the suite's NumPy oracle); and compilation
    last, since a step that computes the wrong numbers or loses its sharding is that failure
    whether or not it compiled.
    """
    found = sharding_lost(spec, values, nproc, jax) or over_budget(spec, values, nproc)
    if found is not None:
        return found
    if reference is None:
        return NO_REFERENCE, "the single-process reference failed"
    found = reference_elsewhere(values, reference)
    if found is not None:
        return found
    why = local_batch_statistics(values)
    if why:
        return NOT_COMPARABLE, why
    return (numbers_differ(values, reference) or differs_from_jax(spec, values, jax)
            or (oracle() if oracle is not None else None) or not_compiled(spec, values))
