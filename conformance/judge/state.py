"""Evidence -> verdict for the state cells: variables reconciled between processes, checkpoints
that resume and reshard.

Plain functions returning ``(verdict, message)`` or None, like ``fit_checks.py``; raising is the
test module's part (``judge.cells.raise_found``). ``values`` are what ``conformance.ranks.state`` returns
on each rank, in rank order.

Reconciled: after build and after training, every rank's global view of every variable
(``get_weights``) is the same, and every rank's local values are its part of that view (a
sharded variable's shard at the rank's mesh coordinate, a replicated one the whole): so ranks
with the same shard coordinates hold identical replicas, and the shards assemble into the one
tensor every rank sees. That one tensor must be one global initialisation: within the bounds
its initializer draws from for the GLOBAL shape (``INITIALIZER_BOUNDS``): a build that draws
each shard for its local shape draws from wider bounds. Which random stream drew it is free; the
single-process reference trains from the weights the ranks agreed on.

Checkpoints: the loaded model keeps the resume side's layout (its variables and its optimizer
slots), the optimizer state loaded equals the state saved (``iterations`` and every slot), and
the training resumed from it equals the same training uninterrupted, on every rank.
"""

from __future__ import annotations

import math
import re

import numpy as np
from keras_dtensor_conformance import ERROR, NUMERICS, SHARDING_LOST

from conformance.judge.numerics import compare, listed, ranks_agree, reported_problems
from conformance.judge.sharding import mesh_coordinate, mesh_shape, shard_size, sharding_problems

#: The loaded optimizer state against the saved: the same numbers written and read back.
LOADED = {"rtol": 1e-6, "atol": 1e-7}


def _glorot_limit(shape: tuple) -> float:
    """``GlorotUniform``'s limit, sqrt(6 / (fan_in + fan_out)), from the global shape (Keras'
    ``compute_fans``: a 2-D kernel's fans are its two dimensions)."""
    receptive = math.prod(shape[:-2]) if len(shape) > 2 else 1
    fan_in, fan_out = (shape[0], shape[0]) if len(shape) == 1 else (shape[-2] * receptive, shape[-1] * receptive)
    return math.sqrt(6.0 / (fan_in + fan_out))


#: initializer class -> the largest absolute value it draws for a variable of that GLOBAL shape.
INITIALIZER_BOUNDS = {
    "GlorotUniform": _glorot_limit,
    "Zeros": lambda shape: 0.0,
    "Ones": None,  # constant: checked by the ranks' agreement alone
}


def own_part(variable: dict, rank: int, nproc: int, layout: dict) -> np.ndarray:
    """The part of ``variable``'s global view that ``rank`` must hold locally: for a DTensor, the
    shard at the rank's mesh coordinate along every sharded mesh dimension (torch.chunk rule)."""
    whole = np.asarray(variable["global"])
    if not variable["dtensor"]:
        return whole
    placements = variable["placements"]
    mesh = (nproc,) if len(placements) == 1 else mesh_shape(layout, nproc)
    where = mesh_coordinate(rank, mesh)
    index = [slice(None)] * whole.ndim
    for mesh_dim, placement in enumerate(placements):
        found = re.fullmatch(r"S\((\d+)\)", placement)
        if found:
            dim = int(found.group(1))
            chunk = -(-whole.shape[dim] // mesh[mesh_dim])
            start = where[mesh_dim] * chunk
            index[dim] = slice(start, start + shard_size(whole.shape[dim], mesh[mesh_dim], where[mesh_dim]))
    return whole[tuple(index)]


def reconcile_problems(stage: str, values: list[dict], layout: dict) -> list[str]:
    """The ranks' variables at ``stage`` are one set of global tensors, each rank holding its part."""
    nproc = len(values)
    problems = []
    first = {v["path"]: v for v in values[0]["stages"][stage]}
    for rank, value in enumerate(values):
        for variable in value["stages"][stage]:
            path = variable["path"]
            if rank and not np.array_equal(variable["global"], first[path]["global"]):
                worst = np.abs(np.asarray(variable["global"], "float64") - first[path]["global"]).max()
                problems.append(f"after {stage}: ranks 0 and {rank} see different values of {path} (max abs "
                                f"difference {worst:.3g}): each rank kept its own initialisation")
            part = own_part(variable, rank, nproc, layout)
            local = np.asarray(variable["local"])
            if local.shape != part.shape or not np.array_equal(local, part):
                where = f"DTensor {variable['placements']}" if variable["dtensor"] else "a plain tensor"
                problems.append(f"after {stage}: rank {rank}'s local values of {path} ({where}, local shape "
                                f"{local.shape}) are not its part of the global view (shape {part.shape})")
    return problems


def initialisation_problems(values: list[dict]) -> list[str]:
    """Rank 0's global view after build lies within each initializer's bounds for the global shape."""
    problems = []
    for variable in values[0]["stages"]["built"]:
        bound = INITIALIZER_BOUNDS.get(variable["initializer"])
        if bound is None:
            continue
        shape = tuple(variable["shape"])
        limit = bound(shape)
        worst = float(np.abs(np.asarray(variable["global"], "float64")).max(initial=0.0))
        if worst > limit * (1 + 1e-6):
            problems.append(f"{variable['path']}: {variable['initializer']} for global shape {shape} draws within "
                            f"+-{limit:.4g}, the built value reaches {worst:.4g} (initialised for another shape: "
                            "a shard's local one?)")
    return problems


def agreed_weights(values: list[dict]) -> dict:
    """path -> the global weights after build that the ranks agreed on (rank 0's view): what the
    single-process reference starts from."""
    return {v["path"]: np.asarray(v["global"]) for v in values[0]["stages"]["built"]}


def reconcile_failure(spec: dict, values: list[dict], reference: dict) -> tuple[str, str] | None:
    """The first check a reconcile cell fails, as ``(verdict, message)``, or None: sharding as asked
    after build and after training; one reconciled set of variables after each; built within one
    global initialisation; then trained like the single-process reference from the agreed weights."""
    layout, nproc = spec["layout"], len(values)
    problems = [p for rank, value in enumerate(values) for stage, variables in value["stages"].items()
                for p in sharding_problems(layout, variables, nproc, f"rank {rank} after {stage}: ", rank=rank)]
    if problems:
        return SHARDING_LOST, listed("variables lost the layout asked for", problems)
    for stage in ("built", "fit"):
        problems = reconcile_problems(stage, values, layout)
        if problems:
            return NUMERICS, listed(f"variables not reconciled between processes after {stage} (each rank "
                                      "seeded differently)", problems)
    problems = initialisation_problems(values)
    if problems:
        return NUMERICS, listed("the agreed variables are not one global initialisation", problems)
    problems = reported_problems("step_losses", values, reference["step_losses"])
    want = {v["path"]: v["global"] for v in reference["stages"]["fit"]}
    for rank, value in enumerate(values):
        problems += [f"rank {rank}: {p}" for v in value["stages"]["fit"]
                     if (p := compare(f"weight {v['path']} after training", v["global"], want[v["path"]]))]
    if problems:
        return NUMERICS, listed("trained from the agreed weights, the ranks differ from the single-process "
                                  "reference", problems)
    return None


# ---------------------------------------------------------------- checkpoints
def loaded_layout_problems(layout: dict, resumes: list[dict]) -> list[str]:
    """The loaded model's variables and optimizer slots have the resume side's layout, after load and
    after training on."""
    nproc = len(resumes)
    problems = []
    for rank, value in enumerate(resumes):
        problems += sharding_problems(layout, value["loaded"]["variables"], nproc, f"rank {rank} after load: ",
                                      rank=rank)
        problems += sharding_problems(layout, value["loaded"]["slots"], nproc,
                                      f"rank {rank} after load: optimizer slot ", rank=rank)
        problems += sharding_problems(layout, value["variables"], nproc, f"rank {rank} after training on: ",
                                      rank=rank)
    return problems


def optimizer_state_problems(saved: dict, resumes: list[dict]) -> list[str]:
    """Every rank loaded exactly the optimizer state saved: ``iterations`` and every slot."""
    problems = []
    for rank, value in enumerate(resumes):
        loaded = value["loaded"]["optimizer"]
        for path, want in saved.items():
            if path not in loaded:
                problems.append(f"rank {rank}: optimizer variable {path} saved, not in the loaded optimizer")
                continue
            got = np.asarray(loaded[path], "float64")
            if got.shape != np.shape(want) or not np.allclose(got, np.asarray(want, "float64"), **LOADED):
                problems.append(f"rank {rank}: optimizer variable {path} loaded as {_brief(got)}, saved "
                                f"{_brief(np.asarray(want))}")
        problems += [f"rank {rank}: optimizer variable {p} loaded, never saved" for p in loaded if p not in saved]
    return problems


def _brief(array: np.ndarray) -> str:
    flat = np.asarray(array, "float64").ravel()
    shown = ", ".join(f"{x:.4g}" for x in flat[:3])
    return f"[{shown}{', ...' if flat.size > 3 else ''}] (shape {array.shape})"


def resumed_problems(saves: list[dict], resumes: list[dict]) -> list[str]:
    """The training resumed equals the same training uninterrupted: final weights on every rank;
    step losses where both sides ran on as many processes (a rank's report against the same rank's)."""
    want = saves[0]["uninterrupted"]
    problems = []
    for rank, value in enumerate(resumes):
        for path, weight in want["weights"].items():
            if path not in value["weights"]:
                problems.append(f"rank {rank}: weight {path} missing after resuming")
            elif problem := compare(f"weight {path}", value["weights"][path], weight):
                problems.append(f"rank {rank}: {problem} (uninterrupted training)")
    if len(saves) == len(resumes):
        for rank, value in enumerate(resumes):
            tail = saves[rank]["uninterrupted"]["step_losses"][-len(value["step_losses"]):]
            if problem := compare("step losses after the checkpoint", value["step_losses"], tail):
                problems.append(f"rank {rank}: {problem} (uninterrupted training)")
    elif len(saves) == 1:
        tail = want["step_losses"][-len(resumes[0]["step_losses"]):]
        problems += reported_problems("step_losses", resumes, tail)
    return problems


def writer_problems(saves: list[dict]) -> list[str]:
    """No file of the checkpoint was opened for writing by more than one process.

    Every rank must call ``model.save`` (saving a sharded model gathers it: a rank alone hangs),
    and a user, and ``ModelCheckpoint`` and ``BackupAndRestore``, give every rank the same path.
    So the build decides who writes: one process (rank 0), or each writing a file of its own that
    it renames into place. Processes writing into the same file at once interleave their bytes
    (measured on the nightly: ``BadZipFile: Bad CRC-32`` at load, on some runs only), so two
    writers of one path fail the cell every time, not only when the race is lost."""
    writers: dict[str, list[int]] = {}
    for rank, value in enumerate(saves):
        for path in value["wrote"]:
            writers.setdefault(path, []).append(rank)
    return [f"{path}: opened for writing by ranks {', '.join(map(str, ranks))} at once (every rank given the same "
            "path; one process must write it, or each its own file renamed into place)"
            for path, ranks in writers.items() if len(ranks) > 1]


def checkpoint_failure(resume_layout: dict, saves: list[dict], resumes: list[dict | None]) -> tuple[str, str] | None:
    """The first check a checkpoint cell fails, as ``(verdict, message)``, or None: who wrote the
    checkpoint; the loaded model's layout; the optimizer state loaded; the resumed numbers and the
    ranks' agreement. ``resumes`` holds None where a rank did not resume (its file had writers
    enough to fail the first check)."""
    problems = writer_problems(saves)
    if problems:
        return ERROR, listed("every rank wrote the same checkpoint file", problems)
    if any(r is None for r in resumes):
        return ERROR, "a rank did not resume from the checkpoint, though no file had two writers"
    problems = loaded_layout_problems(resume_layout, resumes)
    if problems:
        return SHARDING_LOST, listed("the loaded model lost the layout it was loaded under", problems)
    problems = optimizer_state_problems(saves[0]["saved_optimizer"], resumes)
    if problems:
        return NUMERICS, listed("the optimizer state loaded differs from the state saved", problems)
    problems = resumed_problems(saves, resumes)
    problems += ranks_agree(resumes)
    if problems:
        return NUMERICS, listed("training resumed from the checkpoint differs from the same training "
                                  "uninterrupted", problems)
    return None

