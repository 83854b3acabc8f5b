"""The JAX reference's part of the judge: torch's numbers and layouts against the same build's JAX
backend (``conformance/ranks/jax_reference.py``), as plain functions a reproducer can inline.

Why a second backend: the single-process torch reference shares the torch backend's code with
the ranks (its optimizer updates in ``keras/src/backend/torch/optimizers/``, its gradient
accumulation, its schedule reads), so a maths bug there passes it. Keras promises that its
backends compute the same model; the JAX backend computes it with other code, under the same
``keras.distribution`` (its most mature), so it defines both the numbers and the layout of every
variable and optimizer slot for the cell. What it cannot catch: a bug in code every backend shares
(``keras/src/optimizers/*.py``'s update rules, layers): the NumPy oracle's part.

``jax`` below is what ``jax_reference.train`` returns; ``values`` what ``rank_train.train`` returns
on each rank.
"""

from __future__ import annotations

from conformance.judge.numerics import TOLERANCES, numerics_problems
from conformance.judge.sharding import intended, mesh_coordinate, shard_size

#: float32 results of XLA's and torch's CPU kernels may differ in the last bits (fused multiply-adds,
#: another summation order in matmuls and reductions), and every optimizer step carries a
#: difference on, so the comparison has the single-process reference's float32 tolerance. Measured
#: on keras-nightly 3.16.0.dev2026102704, jax 0.10.2, torch 2.13.0+cpu, 2 ranks (docs/measurements.md,
#: "JAX reference"): the largest difference of any weight, loss or evaluate, as a fraction of what
#: DEFAULT allows at that value (|d| / (atol + rtol |want|)), was 1.9 % (Nadam), 1 % (the Embedding
#: model), under 0.4 % for every other optimizer and model; a maths error in an update moves weights
#: by about one update (>= 1e-3 here), hundreds of times the tolerance.
DEFAULT = {"rtol": 1e-4, "atol": 1e-5}

#: optimizer name (an ``axes.OPTIMIZERS`` key) -> its tolerance against JAX, with why; a row not
#: named here gets DEFAULT. The three below were suspected of needing more and measured not to.
JAX_TOLERANCES = {
    # sign(beta_1*m + (1-beta_1)*g): an entry within rounding of 0 could take opposite signs on the
    # two backends, a whole step (lr = 1e-3) apart. Measured: identical results (difference 0.0), so
    # DEFAULT; a sign flip is a 2e-3 difference that fails, and an entry that close to 0 is not
    # expected in 4 steps from these weights (the failure would say which weight).
    "lion": DEFAULT,
    # Factored second moments: row and column means of g**2, quotients of small sums, where the
    # reduction order shows most. Measured: 0.08 % of DEFAULT.
    "adafactor": DEFAULT,
    # Nadam's bias corrections multiply u_t products over steps (host floats on torch, arrays on
    # JAX): the largest difference of all, 1.9 % of DEFAULT, still 50 times inside it.
    "nadam": DEFAULT,
}


def tolerance(optimizer: str, policy: str = "float32") -> dict:
    """The tolerance against JAX of an ``axes.OPTIMIZERS`` row's cells under a dtype policy: the
    row's, or the policy's (``numerics.TOLERANCES``: 16-bit compute rounds on both backends) where wider."""
    row, precision = JAX_TOLERANCES.get(optimizer, DEFAULT), TOLERANCES[policy]
    return {key: max(row[key], precision[key]) for key in row}


# ---------------------------------------------------------------- layouts
def placements(spec: list | None, mesh_axes: list[str]) -> list[str] | None:
    """A JAX ``PartitionSpec`` (per dimension None, an axis name or a list of them) as torch
    placements, one per mesh axis: ``P(None, 'model')`` on ("batch", "model") is ``["R", "S(1)"]``.
    None when JAX keeps the variable whole on every device (replicated: no DTensor is required)."""
    if spec is None:
        return None
    result = ["R"] * len(mesh_axes)
    for dim, axes in enumerate(spec):
        for axis in [axes] if isinstance(axes, str) else (axes or []):
            result[mesh_axes.index(axis)] = f"S({dim})"
    return None if all(p == "R" for p in result) else result


def local_shape(spec: list, shape: tuple, mesh_axes: list[str], mesh: list[int], rank: int) -> tuple:
    """The local shape torch's chunking gives ``rank`` for a variable laid out as ``spec``."""
    where = mesh_coordinate(rank, tuple(mesh))
    local = list(shape)
    for dim, axes in enumerate(spec):
        for axis in [axes] if isinstance(axes, str) else (axes or []):
            i = mesh_axes.index(axis)
            local[dim] = shard_size(local[dim], mesh[i], where[i])
    return tuple(local)


def expected_layouts(jax: dict, layout: dict, nproc: int):
    """``want(var, path, rank)`` for ``sharding.sharding_problems``: the placements and local shape
    JAX's layout of ``path`` gives on ``rank``; ``path`` is the variable's, and an optimizer slot's
    is its variable's, since a slot must be sharded like its variable (Keras' promise), whatever a
    build's shared optimizer code made of it on JAX too. Where JAX keeps whole what the LayoutMap
    shards, the LayoutMap's layout (``sharding.intended``): a build that ignores the map in code
    both backends share must not lower what is asked."""
    specs = {entry["path"]: entry["spec"] for entry in jax["variables"]}

    def want(var: dict, path: str, rank: int):
        spec = specs.get(path)
        where = placements(spec, jax["mesh_axes"])
        if where is None:
            return intended(layout, path, tuple(var["shape"]), nproc, rank)
        return where, local_shape(spec, tuple(var["shape"]), jax["mesh_axes"], jax["mesh_shape"], rank)

    return want


def slot_counts(jax: dict, layout: dict, nproc: int):
    """``counts(variable)`` for ``slots.slot_problems``: for each variable JAX or the LayoutMap
    shards, the full and factored optimizer slots JAX keeps for it (None for any other variable).

    None (the hand-written ``axes.SLOTS`` decide) when the JAX run kept optimizer state that no
    model variable claims (``unattributed_slots``): slots named without their variable's path are
    the build's bug in code both backends share, and counting JAX's attributed slots would then
    expect none where the table expects the optimizer's."""
    if jax.get("unattributed_slots"):
        return None
    sharded = {e["path"] for e in jax["variables"] if placements(e["spec"], jax["mesh_axes"]) is not None}

    def counts(variable: dict):
        if variable["path"] not in sharded and intended(layout, variable["path"], tuple(variable["shape"]),
                                                        nproc) is None:
            return None
        mine = [s for s in jax["slots"] if s["reference"] == variable["path"]]
        return {"full": sum(s["factor"] is None for s in mine), "factored": sum(s["factor"] is not None for s in mine)}

    return counts


# ---------------------------------------------------------------- numbers
#: The headline of a difference from JAX, which claims no side (``fit_checks.arbitrate`` says which, where it can).
BOTH_SHARE = "torch differs from JAX while single-process and distributed torch agree"
#: The headline of a difference the NumPy oracle arbitrates for torch.
JAX_IS_WRONG = ("the JAX backend differs from torch, and the NumPy oracle sides with torch: a bug of Keras' JAX "
                "backend (or of code only it runs), not of the torch backend")


def reported_steps(values: list[dict], jax: dict) -> dict:
    """``jax`` with its step losses read where the cell reports them: a ``steps_per_execution=k``
    fit calls ``on_train_batch_end`` once every k steps, with the epoch's running loss so far, which
    is the JAX run's running loss at steps k, 2k, ... (one JAX run serves every compile mode)."""
    ran, reported = len(jax["step_losses"]), len(values[0]["step_losses"])
    if reported == ran or reported == 0 or ran % reported:
        return jax
    every = ran // reported
    return dict(jax, step_losses=jax["step_losses"][every - 1::every])


def numbers_differ_from_jax(optimizer: str, values: list[dict], jax: dict, policy: str = "float32") -> list[str]:
    """Every rank's losses, evaluate, predict and final weights against the JAX backend's, within
    ``tolerance(optimizer, policy)`` (empty: they agree)."""
    return numerics_problems(values, reported_steps(values, jax), tolerance(optimizer, policy))
