"""Evidence -> verdict for the KerasHub cells: a causal LM's flow on the ranks against one process.

Plain functions returning ``(verdict, message)`` or None, like ``workflows.py`` (whose fit-by-fit
checks serve here too); raising is the judge's part (``judge.cells.judge_hub``). ``values`` are what
``conformance.ranks.hub.run_hub`` returns on each rank, in rank order; ``reference`` what it returns in
one process on the global batches. ``hub_failure`` runs the checks in their order:

0. every rank was given the same layout map by the backend's ``get_layout_map`` (else ``error``: the
   ranks would train different models);
1. every variable frozen during a fit (LoRA froze the whole backbone but its LoRA kernels) is
   bit-equal after it (``numerics``);
2. the layouts, after every stage (built, loaded, generated) and every fit, on every rank: each
   variable the map names is a DTensor with the placements and local shape the map gives it, each
   optimizer slot of it has its layout too (and it has as many as its optimizer keeps), and each variable the map leaves alone is whole on every
   rank, a plain tensor or a replicated DTensor (``sharding-lost``);
3. one more eager train step within the layout's budget (``over-budget``, the training cells' rule:
   ``communication.over_budget``);
4. the reference started where the ranks did (the same initial weights, on the same device type:
   else the harness' ``error``);
5. after every fit, each step's loss, every weight, and the ranks' agreement, against the one
   process after the same fit (``numerics``);
6. ``generate``'s token ids against the one process's for the same prompts (``numerics``), up to the
   first token the one process chose by a margin under ``TIE``, where rounding may pick otherwise.
"""

from __future__ import annotations

import numpy as np

from keras_dtensor_conformance import FAILED, HELD, NOT_APPLICABLE, NOT_JUDGED, NOT_REACHED

from conformance.judge.communication import over_budget
from conformance.judge.fit_checks import (
    ERROR,
    FROZEN_UNCHANGED,
    NUMERICS,
    SHARDING_LOST,
    SLOT_LAYOUTS,
    STEP_COMMUNICATION,
    VARIABLE_LAYOUTS,
    reference_elsewhere,
)
from conformance.judge.numerics import listed
from conformance.judge.sharding import laid_out, sharding_problems, whole_problems
from conformance.judge.slots import slot_problems
from conformance.judge.workflows import frozen_problems, phase_problems, start_problems

#: A greedy choice whose logit led the next best by less than this (in the one process) can go either way
#: under another summation order: the ids after it are not judged. float32 sums of this model's size
#: differ by about 1e-6; a lost or misplaced cache entry changes the logits by far more than this.
TIE = 1e-3


def map_problems(values: list[dict]) -> list[str]:
    """Every rank ran under the layout rank 0 did (the authors' map is made on each rank)."""
    return [f"rank {rank} was given another layout map than rank 0: {value['layout'].get('map')} against "
            f"{values[0]['layout'].get('map')}" for rank, value in enumerate(values[1:], start=1)
            if value["layout"] != values[0]["layout"]]


def map_layout_problems(spec: dict, values: list[dict]) -> list[str]:
    """After every stage and every fit, on every rank: named variables and their slots as the map
    says (as many slots as ``spec['optimizer_name']`` keeps), the others whole (module docstring, 2)."""
    nproc = len(values)
    problems = []
    for rank, value in enumerate(values):
        layout = value["layout"]
        if layout.get("kind") != "model-parallel":
            continue
        # ``fit``: the last fit's variables again (the communication check's), judged with its phase below.
        seen = [(f"after {stage}", variables) for stage, variables in value["stages"].items() if stage != "fit"]
        seen += [(f"after the fit '{phase['name']}'", phase["variables"]) for phase in value["phases"]]
        for when, variables in seen:
            where = f"rank {rank} {when}: "
            problems += sharding_problems(layout, variables, nproc, where, rank=rank)
            problems += whole_problems(layout, variables, nproc, where)
        problems += sharding_problems(layout, value["slots"], nproc, f"rank {rank} optimizer slot ", rank=rank)
        problems += whole_problems(layout, value["slots"], nproc, f"rank {rank} optimizer slot ")
        if value["phases"]:  # every trained variable the map lays out has its optimizer's slots
            frozen = set(value["phases"][-1]["frozen"])
            trained = [v for v in value["phases"][-1]["variables"] if v["path"] not in frozen]
            problems += slot_problems(spec["optimizer_name"], layout, trained, value["slots"], nproc,
                                      f"rank {rank}: ", rank=rank)
    return problems


def communication_failure(spec: dict, values: list[dict]) -> tuple[str, str] | None:
    """The measured step against the layout's budget, with the variables as the last fit left them."""
    if not all(v.get("communication") for v in values):
        return None
    return over_budget({"layout": values[0]["layout"]}, values, len(values))


def generated_problems(values: list[dict], reference: dict) -> list[str]:
    """Each rank's generated ids against the one process's for the prompts it fed, row by row, up to
    the first position the one process chose within ``TIE`` of another token."""
    want = reference["generated"]
    if want is None:
        return [] if all(v["generated"] is None for v in values) else ["the one process generated nothing"]
    problems = []
    for rank, value in enumerate(values):
        got = value["generated"]
        rows = np.asarray(got["rows"])
        ids, expected = np.asarray(got["token_ids"]), np.asarray(want["token_ids"])[rows]
        if ids.shape != expected.shape:
            problems.append(f"rank {rank}: generated ids of shape {ids.shape}, the one process {expected.shape} "
                            "for the same prompts")
            continue
        margins = np.asarray(want["margins"])[rows]
        first = margins.shape[1] and ids.shape[1] - margins.shape[1]  # the first generated position
        for i, row in enumerate(rows):
            differ = np.flatnonzero(ids[i] != expected[i])
            if not differ.size:
                continue
            at = int(differ[0])
            ties = np.flatnonzero(margins[i, :max(0, at - first + 1)] < TIE)
            if ties.size:
                continue  # a choice at or before it was a near-tie in the one process
            problems.append(f"rank {rank}: prompt {int(row)}: token {at} generated {int(ids[i, at])}, one process "
                            f"{int(expected[i, at])} (which it chose by a logit margin of {margins[i, at - first]:.3g})"
                            if at >= first else f"rank {rank}: prompt {int(row)}: the prompt came back changed at {at}")
    return problems


#: The checks of a KerasHub cell, in ``hub_checks``' order; a cell's record carries each one's outcome, which
#: the promises count (``conformance/promises.py``). The layouts', the frozen variables' and the step's are the
#: training cells' checks (``fit_checks``), judged here on a flow's evidence.
FLOW_NUMBERS = "flow-numbers"
GENERATED_IDS = "generated-ids"
CHECKS = (FROZEN_UNCHANGED, VARIABLE_LAYOUTS, SLOT_LAYOUTS, STEP_COMMUNICATION, FLOW_NUMBERS, GENERATED_IDS)


def _laid_out(values: list[dict], key: str) -> int:
    """How many of the first rank's variables (``key``: their last fit's, or the slots) the map lays out."""
    value = values[0] if values else {}
    layout = value.get("layout", {})
    if layout.get("kind") != "model-parallel":
        return 0
    if key == "slots":
        variables = [s for s in value.get("slots", []) if s.get("factor") is None]
    else:
        variables = [v for stage in value.get("stages", {}).values() for v in stage]
    return len(laid_out(layout, variables, len(values)))


def hub_checks(spec: dict, values: list[dict], reference: dict) -> tuple[tuple[str, str] | None, dict]:
    """(the first check a KerasHub cell fails, as ``(verdict, message)``, or None; each check's ``(outcome,
    why)``, in ``CHECKS``' order: the module's docstring says the order and what each holds). A check after the
    first failure is not reached; one that cannot fail on the cell is not applicable, with why."""
    outcomes: dict[str, tuple[str, str]] = {}

    def finish(found):
        failed = [n for n in CHECKS if outcomes.get(n, ("",))[0] in (FAILED, NOT_JUDGED)]
        for name in CHECKS:
            if name not in outcomes:
                outcomes[name] = (NOT_REACHED, f"{failed[0]} failed" if failed else "the ranks ran different maps")
        return found, {name: outcomes[name] for name in CHECKS}

    def check(name, problems, head, verdict=NUMERICS, why_not=None, judged=0):
        if problems:
            outcomes[name] = (FAILED, problems[0])
            return verdict, listed(head, problems)
        outcomes[name] = (NOT_APPLICABLE, why_not) if why_not else (HELD, f"{judged} judged" if judged else "")
        return None

    problems = map_problems(values)  # the harness' premise, no check of the build's: the ranks ran one model
    if problems:
        return finish((ERROR, listed("the ranks were given different layout maps", problems)))
    frozen = any(phase["frozen"] for value in values for phase in value["phases"])
    found = check(FROZEN_UNCHANGED, frozen_problems(values), "a variable frozen during a fit changed",
                  why_not=None if frozen else "the flow freezes no variable")
    if found:
        return finish(found)
    problems = map_layout_problems(spec, values)
    variables, slots = _laid_out(values, "variables"), _laid_out(values, "slots")
    no_map = "the layout has no map" if values and values[0]["layout"].get("kind") != "model-parallel" else None
    slot_lines = [p for p in problems if "optimizer slot" in p or " slots for " in p]
    check(VARIABLE_LAYOUTS, [p for p in problems if p not in slot_lines], "", why_not=no_map, judged=variables)
    check(SLOT_LAYOUTS, slot_lines, "", judged=slots, why_not=no_map or (
        None if slots else "no optimizer slot of a laid-out variable (SGD keeps none; LoRA trains no laid-out one)"))
    if problems:
        return finish((SHARDING_LOST, listed("variables lost the layout the map gives them", problems)))
    measured = values and all(v.get("communication") for v in values)
    found = communication_failure(spec, values)
    outcomes[STEP_COMMUNICATION] = ((FAILED, found[1].splitlines()[0]) if found else
                                    (HELD, "") if measured else (NOT_APPLICABLE, "the flow fits nothing: no step measured"))
    if found:
        return finish(found)
    found = reference_elsewhere(values, reference)
    problems = start_problems(values, reference)
    if found is None and problems:
        found = ERROR, listed("the one process did not start from the ranks' weights (a harness error)", problems)
    if found is not None:
        outcomes[FLOW_NUMBERS] = outcomes[GENERATED_IDS] = (NOT_JUDGED, found[1].splitlines()[0])
        return finish(found)
    head = f"{spec['model']}'s flow '{spec['flow']}' on the ranks differs from one process running it"
    found = check(FLOW_NUMBERS, phase_problems(values, reference), head,
                  why_not=None if reference["phases"] else "the flow fits nothing")
    if found:
        return finish((found[0], found[1].replace(":\n", ": ", 1)))
    found = check(GENERATED_IDS, generated_problems(values, reference),
                  f"{spec['model']}'s generate on the ranks differs from one process's",
                  why_not=None if reference["generated"] is not None else "the flow generates nothing")
    return finish((found[0], found[1].replace(":\n", ": ", 1)) if found else None)


def hub_failure(spec: dict, values: list[dict], reference: dict) -> tuple[str, str] | None:
    """The first check a KerasHub cell fails, as ``(verdict, message)``, or None (``hub_checks``)."""
    return hub_checks(spec, values, reference)[0]
