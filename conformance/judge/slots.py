"""Optimizer slots: the check that every sharded variable has as many as its optimizer keeps,
each with the layout it must have.

Why counts: the rank side finds a variable's slots by Keras' slot naming (``rank_train``:
``<variable path, "/" -> "_">_<slot>``, e.g. ``mlp_dense_a_kernel_momentum``). A build that
renames its slots, or keeps its state in another shape, leaves nothing to match, and a check
that looks only at the slots it found passes on an empty list. So every sharded variable's slots
are counted, found against expected, and a shortfall (or a surplus) is ``sharding-lost``.

The counts are each optimizer's ``slots`` in ``axes.OPTIMIZERS`` (read here as ``axes.SLOTS``,
plain data that a reproducer inlines by value). They come from each optimizer's ``build()`` in
``keras/src/optimizers/`` of the default build, and were measured there (2 ranks, column-sharded
MLP and Embedding): SGD keeps a momentum only when ``momentum > 0``; Adam keeps momentum and
velocity, plus ``velocity_hat`` with amsgrad; ``use_ema`` adds an ``average`` copy and
``gradient_accumulation_steps`` a ``gradient_accumulator`` (``BaseOptimizer.build``); RMSprop
keeps a velocity, plus a momentum when ``momentum > 0`` and an ``average_gradient`` when
centered; LossScaleOptimizer only adds scalars of its own to its inner optimizer's slots.

Adafactor and Muon keep per-variable state that is not one copy per variable; see
``factored_problem`` and ``muon_uses_adamw``.
"""

from __future__ import annotations

import re

from conformance.axes import SLOTS
from conformance.cell_data import mesh_axes
from conformance.judge.sharding import intended


def muon_uses_adamw(variable: dict) -> bool:
    """Muon's ``_should_use_adamw`` with its defaults: every variable that is not a matrix, and
    embeddings (``exclude_embeddings=True``), are updated by AdamW and get a velocity."""
    return len(variable["shape"]) != 2 or "embedding" in variable["path"].lower()


def expected(optimizer: str, variable: dict) -> dict[str, int]:
    """{"full": n, "factored": m}: the slots ``optimizer`` must keep for ``variable``."""
    slots = SLOTS[optimizer]
    full = slots["full"] + (slots["adamw_velocity"] if muon_uses_adamw(variable) else 0)
    return {"full": full, "factored": slots["factored"] if len(variable["shape"]) >= 2 else 0}


# ---------------------------------------------------------------- factored slots
def factored_shapes(shape: tuple) -> list[tuple]:
    """Adafactor's factored second moments of a rank >= 2 variable, in the order it creates them:
    ``r`` keeps every dimension but the last, ``c`` every dimension but the second to last."""
    return [tuple(shape[:-1]), tuple(shape[:-2]) + tuple(shape[-1:])]


def kept_dims(rank: int, which: int) -> list[int]:
    """The variable dimensions factored slot ``which`` (0: r, 1: c) keeps, in order."""
    dropped = rank - 1 if which == 0 else rank - 2
    return [d for d in range(rank) if d != dropped]


def factored_layout(layout: dict, variable: dict, which: int, nproc: int,
                    rank: int = 0) -> tuple[list[str], tuple] | None:
    """(placements, local shape) of a factored slot kept sharded like its variable, or None when
    the variable is not sharded."""
    for key, axes in layout.get("map", {}).items():
        if re.fullmatch(key, variable["path"]):
            kept = kept_dims(len(variable["shape"]), which)
            shape = tuple(variable["shape"][d] for d in kept)
            restricted = {"map": {".*": [axes[d] for d in kept]}, "mesh": layout.get("mesh", (1, "nproc")),
                          "axes": mesh_axes(layout)}
            return intended(restricted, "slot", shape, nproc, rank)
    return None


def factored_problem(layout: dict, variable: dict, slot: dict, nproc: int, rank: int = 0) -> str | None:
    """Why a factored slot of ``variable`` is not laid out as accepted, or None when it is.

    Keras' Adafactor creates its factored slots with ``add_variable(shape, name=var.name)`` and
    no layout (measured on keras-nightly 3.16.0.dev2026102704: plain torch tensors holding the
    whole vector on every rank). What DTensor gives the same reduction of a sharded gradient is
    the variable's layout kept on the dimensions the slot keeps (``c``, the mean over the rows of
    a column-sharded kernel, is Shard(0); ``r``, the mean over its sharded columns, Replicate).
    Accepted: that layout, or a full replicated copy (Keras' choice: O(rows + cols) memory, and
    the update stays right, which the numerics check proves). Any other shape or placement is
    sharding-lost.
    """
    which = slot["factor"]
    want_shape = factored_shapes(tuple(variable["shape"]))[which]
    name = f"{slot['path']} (factored {'rc'[which]} of {variable['path']})"
    if tuple(slot["shape"]) != want_shape:
        return f"{name}: shape {tuple(slot['shape'])}, expected {want_shape}"
    if not slot["dtensor"]:
        return None  # a plain full copy on every rank: replicated
    sharded = factored_layout(layout, variable, which, nproc, rank)
    replicated = (["R"] * len(mesh_axes(layout)), want_shape)
    got = (slot["placements"], tuple(slot["local_shape"]))
    if got in (sharded, replicated):
        return None
    return f"{name}: DTensor {got[0]} local {got[1]}, expected {sharded[0]} local {sharded[1]} or replicated"


# ---------------------------------------------------------------- the check
def slot_problems(optimizer: str, layout: dict, variables: list[dict], slots: list[dict], nproc: int,
                  what: str = "", rank: int = 0) -> list[str]:
    """Every variable the layout shards has exactly its expected slots, found by the rank side, and
    its factored slots are laid out as ``factored_problem`` accepts. (Full slots' layouts are held to their
    variable's by ``sharding.sharding_problems``.)

    ``variables``: ``describe_variable`` dicts of the model after fit; ``slots``: the rank side's
    slots, each with ``reference`` (its variable's path) and ``factor`` (None for a full slot).
    The counts are the optimizer's (``axes.SLOTS``), whatever the JAX backend keeps
    (``jax_compare.layout_departures`` holds it to the same).
    """
    problems = []
    for variable in variables:
        if intended(layout, variable["path"], tuple(variable["shape"]), nproc) is None:
            continue
        want = expected(optimizer, variable)
        mine = [s for s in slots if s["reference"] == variable["path"]]
        for kind, found in (("full", [s for s in mine if s["factor"] is None]),
                            ("factored", [s for s in mine if s["factor"] is not None])):
            if len(found) != want[kind]:
                label = "optimizer slots" if kind == "full" else "factored optimizer slots"
                names = ", ".join(s["path"] for s in found) or "none"
                problems.append(f"{what}expected {want[kind]} {label} for {variable['path']}, "
                                f"found {len(found)}: {names}")
        for slot in mine:
            if slot["factor"] is not None:
                problem = factored_problem(layout, variable, slot, nproc, rank)
            elif tuple(slot["shape"]) != tuple(variable["shape"]):
                problem = f"{slot['path']}: shape {tuple(slot['shape'])}, expected {tuple(variable['shape'])}"
            else:
                continue  # a full slot's layout: sharding.sharding_problems holds it to its variable's
            if problem:
                problems.append(f"{what}{problem}")
    return problems
