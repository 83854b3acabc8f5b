"""The JAX reference's part of the judge: torch's numbers and layouts against the same build's JAX
backend (``conformance/ranks/jax_reference.py``), as plain functions a reproducer can inline.

Why a second backend: the single-process torch reference shares the torch backend's code with
the ranks (its optimizer updates in ``keras/src/backend/torch/optimizers/``, its gradient
accumulation, its schedule reads), so a maths bug there passes it. Keras promises that its
backends compute the same model; the JAX backend computes it with other code, under the same
``keras.distribution`` (its most mature). Its numbers are a reference, arbitrated by the NumPy
oracle where they differ from torch's; its layouts are held, as torch's are, to the specification
(the LayoutMap and the optimizer's slots), so a JAX backend that departs from it is named as such
and never makes torch's correct layout a failure. What it cannot catch: a bug in code every backend shares
(``keras/src/optimizers/*.py``'s update rules, layers): the NumPy oracle's part.

``jax`` below is what ``jax_reference.train`` returns; ``values`` what ``rank_train.train`` returns
on each rank.
"""

from __future__ import annotations

from conformance.judge.numerics import TOLERANCES, numerics_problems
from conformance.judge.sharding import intended
from conformance.judge.slots import expected

#: float32 results of XLA's and torch's CPU kernels may differ in the last bits (fused multiply-adds,
#: another summation order in matmuls and reductions), and every optimizer step carries a
#: difference on, so the comparison has the single-process reference's float32 tolerance, for every
#: optimizer. Measured on keras-nightly 3.16.0.dev2026102704, jax 0.10.2, torch 2.13.0+cpu, 2 ranks
#: (docs/measurements.md, "JAX reference"): the largest difference of any weight, loss or evaluate, as
#: a fraction of what DEFAULT allows at that value (|d| / (atol + rtol |want|)), was 1.9 % (Nadam,
#: whose bias corrections multiply products over steps), 1 % (the Embedding model), 0.08 % for
#: Adafactor's factored moments, identical results for Lion's sign(), under 0.4 % for every other
#: optimizer and model; a maths error in an update moves weights by about one update (>= 1e-3 here),
#: hundreds of times the tolerance.
DEFAULT = {"rtol": 1e-4, "atol": 1e-5}


def tolerance(policy: str = "float32") -> dict:
    """The tolerance against JAX under a dtype policy: DEFAULT, or the policy's
    (``numerics.TOLERANCES``: 16-bit compute rounds on both backends) where wider."""
    precision = TOLERANCES[policy]
    return {key: max(DEFAULT[key], precision[key]) for key in DEFAULT}


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


def layout_departures(jax: dict, layout: dict, nproc: int, optimizer: str, frozen=()) -> list[str]:
    """Where the JAX backend departs from the specification, one line each (empty: it follows it).

    The LayoutMap is the specification of layouts, the optimizer's slots (``slots.expected``, from
    ``axes.SLOTS``) of their count: torch is held to them (``sharding.sharding_problems``,
    ``slots.slot_problems``), and so is the JAX backend, here. A variable JAX lays out otherwise than
    the LayoutMap asks (sharding one the map leaves whole, or keeping whole one it shards), a full
    optimizer slot laid out otherwise than its variable, or a laid-out, trained variable (not in
    ``frozen``) with another number of slots than its optimizer keeps, is a departure of the JAX
    backend, not a layout torch must copy. Slot counts are not judged when the JAX run kept optimizer
    state no model variable claims (``unattributed_slots``: slots named without their variable's path,
    a bug of code both backends share that the torch side shows as missing slots)."""
    axes_names, lines = jax["mesh_axes"], []

    def asked(path: str, shape) -> list[str] | None:
        want = intended(layout, path, tuple(shape), nproc)
        return None if want is None else want[0]

    def said(placement) -> str:
        return str(placement) if placement else "replicated"

    for var in jax["variables"]:
        got, want = placements(var["spec"], axes_names), asked(var["path"], var["shape"])
        if got != want:
            lines.append(f"{var['path']}: the JAX backend lays it out {said(got)}, the LayoutMap asks {said(want)}")
    for slot in jax["slots"]:
        if slot["factor"] is not None:
            continue  # factored slots: a layout of their own (slots.factored_problem)
        got, want = placements(slot["spec"], axes_names), asked(slot["reference"], slot["shape"])
        if got != want:
            lines.append(f"optimizer slot {slot['path']}: the JAX backend lays it out {said(got)}, its variable "
                         f"{slot['reference']} is laid out {said(want)}")
    if jax.get("unattributed_slots"):
        return lines
    for var in jax["variables"]:
        if var["path"] in frozen or asked(var["path"], var["shape"]) is None:
            continue
        want = expected(optimizer, var)
        mine = [s for s in jax["slots"] if s["reference"] == var["path"]]
        got = {"full": sum(s["factor"] is None for s in mine), "factored": sum(s["factor"] is not None for s in mine)}
        if got != want:
            lines.append(f"{var['path']}: the JAX backend keeps {got['full']} optimizer slot(s) and {got['factored']} "
                         f"factored, {optimizer} keeps {want['full']} and {want['factored']}")
    return lines


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


def numbers_differ_from_jax(values: list[dict], jax: dict, policy: str = "float32") -> list[str]:
    """Every rank's losses, evaluate, predict and final weights against the JAX backend's, within
    ``tolerance(policy)``, and its update's scale (``numerics.scale_problems``; empty: they agree)."""
    return numerics_problems(values, reported_steps(values, jax), tolerance(policy), policy)
