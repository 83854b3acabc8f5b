"""Evidence -> verdict for the workflow cells: a flow of several fits against one process running it.

Plain functions returning ``(verdict, message)`` or None, like ``fit_checks.py``; raising is the
judge's part (``judge.cells.judge_workflow``). ``values`` are what ``conformance.ranks.workflows.run_flow``
returns on each rank, in rank order; ``reference`` what it returns in one process on the global
batches. ``workflow_failure`` runs the checks in their order:

0. where the flow called ``keras.distribution.initialize()`` in processes started as torchrun starts a
   script (no group), that it made the group torchrun's variables describe (``error``);
1. every variable frozen during a fit is bit-equal after it to its value before, on every rank
   (``numerics``: it trained though frozen, which the numbers below would only show as a difference);
2. the layouts: after every fit whose flow lays its variables out (``FLOWS[...].layout_phases``), every
   variable the phase's LayoutMap names is a DTensor with those placements (``sharding-lost``);
3. the reference started where the ranks did (the same initial weights, on the same device type:
   else the harness' ``error``);
4. after every fit, each step's reported loss, every weight, and the ranks' agreement with each
   other, against the single process after the same fit (``numerics``), phase by phase, so the
   message names the first fit of the flow that went wrong;
5. a ``jit`` cell compiled its steps (``compile-fallback``, the training cells' rule).
"""

from __future__ import annotations

import numpy as np

# The verdicts through fit_checks: a reproducer inlines that module, and a name is defined once there.
from conformance.judge.fit_checks import ERROR, NUMERICS, SHARDING_LOST, not_compiled, reference_elsewhere
from conformance.judge.numerics import listed, ranks_agree, reported_problems, weight_problems
from conformance.judge.sharding import sharding_problems


def group_problems(values: list[dict]) -> list[str]:
    """Where a flow called ``keras.distribution.initialize()`` in processes started with no group
    (``group`` in the evidence): it made the group torchrun's variables describe, and
    ``list_devices()`` then names a device per process."""
    problems = []
    for rank, value in enumerate(values):
        group = value.get("group")
        if not group:
            continue
        env = group["environment"]
        if group["before"]:
            problems.append(f"rank {rank}: a process group existed before initialize() (the harness' error)")
        elif not group["after"]:
            problems.append(f"rank {rank}: no process group after initialize() (RANK={env['RANK']}, "
                            f"WORLD_SIZE={env['WORLD_SIZE']})")
        elif (str(group["rank"]), str(group["world_size"])) != (env["RANK"], env["WORLD_SIZE"]):
            problems.append(f"rank {rank}: initialize() made a group of rank {group['rank']} of "
                            f"{group['world_size']}, torchrun's variables say {env['RANK']} of {env['WORLD_SIZE']}")
        if group["after"] and len(group["devices"]) != group["world_size"]:
            problems.append(f"rank {rank}: list_devices() names {group['devices']} for {group['world_size']} processes")
    return problems


def frozen_problems(values: list[dict]) -> list[str]:
    """Every variable frozen during a fit (not trainable when it began) is bit-equal after it."""
    problems = []
    for rank, value in enumerate(values):
        for phase in value["phases"]:
            for path, before in phase["frozen"].items():
                after = phase["weights"].get(path)
                if after is None or not np.array_equal(np.asarray(after), np.asarray(before)):
                    change = ("it is gone" if after is None else
                              f"max abs change {np.abs(np.asarray(after, 'float64') - before).max():.3g}")
                    problems.append(f"rank {rank}: frozen {path} changed in the fit '{phase['name']}' ({change}): "
                                    "it was not trainable")
    return problems


def layout_problems(values: list[dict], judged_phases: tuple | None) -> list[str]:
    """After each judged fit, the variables have the layout of the distribution it ran under."""
    nproc = len(values)
    problems = []
    for rank, value in enumerate(values):
        for index, phase in enumerate(value["phases"]):
            if judged_phases is not None and index not in judged_phases:
                continue
            if phase["layout"]["kind"] != "model-parallel":
                continue
            problems += sharding_problems(phase["layout"], phase["variables"], nproc,
                                          f"rank {rank} after the fit '{phase['name']}': ", rank=rank)
    return problems


def start_problems(values: list[dict], reference: dict) -> list[str]:
    """The reference's first fit starts from the ranks' weights (the same seed, on the same device type)."""
    problems = []
    for rank, value in enumerate(values):
        for path, weight in value["initial_weights"].items():
            want = reference["initial_weights"].get(path)
            if want is None or np.shape(want) != np.shape(weight) or not np.array_equal(want, weight):
                problems.append(f"rank {rank}: initial {path} differs from the single-process reference's")
    return problems


def phase_problems(values: list[dict], reference: dict) -> list[str]:
    """Fit by fit: each step's loss, every weight, and the ranks' agreement against the single process."""
    want_phases = reference["phases"]
    for value in values:
        if [p["name"] for p in value["phases"]] != [p["name"] for p in want_phases]:
            return [f"the ranks ran the fits {[p['name'] for p in value['phases']]}, the single process "
                    f"{[p['name'] for p in want_phases]}"]
    for index, want in enumerate(want_phases):
        phases = [value["phases"][index] for value in values]
        problems = reported_problems("step_losses", phases, want["step_losses"])
        problems += [p for rank, phase in enumerate(phases) for p in weight_problems(rank, phase, want)]
        problems += ranks_agree(phases)
        if problems:
            where = f"after fit {index + 1} of {len(want_phases)} ('{want['name']}')"
            return [f"{where}: {p}" for p in problems]
    return []


def workflow_failure(spec: dict, values: list[dict], reference: dict,
                     layout_phases: tuple | None = None) -> tuple[str, str] | None:
    """The first check a workflow cell fails, as ``(verdict, message)``, or None (the order is the
    module's docstring). ``layout_phases``: the flow's (``ranks/workflows.Flow``)."""
    problems = group_problems(values)
    if problems:
        return ERROR, listed("keras.distribution.initialize() did not set up the group torchrun's variables describe",
                             problems)
    problems = frozen_problems(values)
    if problems:
        return NUMERICS, listed("a variable frozen during a fit changed", problems)
    problems = layout_problems(values, layout_phases)
    if problems:
        return SHARDING_LOST, listed("variables lost the layout asked for", problems)
    found = reference_elsewhere(values, reference)
    if found is not None:
        return found
    problems = start_problems(values, reference)
    if problems:
        return ERROR, listed("the single-process reference did not start from the ranks' weights (a harness error)",
                             problems)
    problems = phase_problems(values, reference)
    if problems:
        # The first problem on the first line: the headline, and what clusters it.
        return NUMERICS, listed(f"the flow '{spec['flow']}' on the ranks differs from one process running it",
                                problems).replace(":\n", ": ", 1)
    return not_compiled(spec, values)
