"""ModelParallel's memory promise inside a train step: no full-size copy of a sharded variable, its
gradient or an optimizer slot of it.

The evidence is ``values[rank]["communication"]`` (``step_communication.measure_step_communication``): one
extra eager train step, measured after the cell's other evidence, with every collective it
issued (torch's ``CommDebugMode``), every ``DTensor.redistribute`` the build called itself
(``full_tensor()`` is one), and what the optimizer received as each variable's gradient.

**The rule.** A variable is *sharded* on a rank when the layout splits it there: a DTensor whose
local part holds fewer elements than the whole (``stages["fit"]``, which the sharding check has
already held to the layout, so this check goes after it). A tensor of a sharded variable's global
shape (the variable itself, its gradient, an optimizer slot: they share the shape) must not be
made whole on a rank during the step:

1. the build redistributes it to all-``Replicate`` (every rank then holds every element) and the
   redistribution issues a collective: the verdict names that collective (op, input and output
   shapes, bytes) and the tensor (shape, placements before and after) and the variables of that
   shape;
2. its gradient reaches ``optimizer.apply`` as a plain tensor of the variable's global shape (made
   whole by any means, e.g. ``to_local()`` and a hand-written all-gather).

**What a correct build needs is allowed.** Measured on the default build (keras-nightly
3.16.0.dev2026102704, torch 2.13, 2 ranks), a step makes no explicit redistribution and hands the
optimizer DTensor gradients, on every layout; its collectives all come from DTensor's own
sharding strategies inside ops: all-gathers of activations and a reduce-scatter of their
gradient (column-sharded MLP, SGD: 9 collectives, 3896 bytes per rank), reduce-scatters of
partial sums (row-sharded), scalar all-reduces of the loss and metrics. Those are what running the
layout's ops takes, and this rule does not judge them, even where DTensor's strategy moves a
full-size tensor: measured, the default build all-gathers ``dense_b/kernel``'s gradient (it
arrives ``Shard(0)`` for a ``Shard(1)`` kernel) in the column-sharded update, all-gathers that
kernel itself in the row-sharded forward, and all-reduces Adam's full ``g * g`` of the row-sharded
kernels' ``Partial`` gradients. Those are figures in the report (counts and bytes), not verdicts:
a build cannot be blamed for the strategy DTensor picked for an op on the layout it asked for.
What the rule rejects is the build *asking* for a whole copy: no layout needs one, since the
update of a sharded variable is elementwise on its shards, and what needs the whole tensor
(clipping norms, Lamb's trust ratio) needs a reduced scalar, not a copy.

**What it cannot see**: a full-size copy made by a DTensor op the build chose to make one (e.g.
an elementwise op against a Replicate operand of the variable's shape), or by plain-tensor
collectives on local parts that never reach the optimizer as a gradient; a jit cell's compiled
step (the measured step is eager: dynamo compiles nothing under a dispatch mode).

**DataParallel's budget** is DDP's contract: one step synchronises each gradient once (DDP's
buckets all-reduce every gradient's bytes; a build that synchronises by other means moves the same
bytes), plus scalars (collectives of at most ``SCALAR_BYTES``: the loss, metrics). More is
``over-budget``, with the collectives and the bytes over; the report gives each cell's bytes moved
and its gradients' bytes (``figures``).
"""

from __future__ import annotations

import math

from keras_dtensor_conformance import OVER_BUDGET


def sharded_variables(variables: list[dict]) -> dict[str, dict]:
    """path -> description of each variable the layout splits on this rank (``describe_variable``
    dicts): a DTensor whose local part holds fewer elements than the whole."""
    return {v["path"]: v for v in variables
            if v.get("dtensor") and math.prod(v["local_shape"]) < math.prod(v["shape"])}


def _matches(sharded: dict[str, dict], shape) -> list[str]:
    return [path for path, v in sharded.items() if list(v["shape"]) == list(shape)]


def _variable(v: dict) -> str:
    return (f"{v['path']} (sharded {v['placements']}, {math.prod(v['local_shape'])} of "
            f"{math.prod(v['shape'])} elements on this rank)")


def _shapes(shapes: list) -> str:
    return ", ".join(str(list(s)) for s in shapes)


def _call(call: dict) -> str:
    return f"{call['op']} {_shapes(call['inputs'])} -> {_shapes(call['outputs'])} ({call['bytes']} bytes)"


def full_size_copies(value: dict) -> list[str]:
    """One line per full-size copy of a sharded variable's tensor the build made in one rank's
    measured step (empty: none), each naming the op and the tensor (rule: module docstring)."""
    comm = value.get("communication")
    if not comm:
        return []
    sharded = sharded_variables(value["stages"]["fit"])
    if not sharded:
        return []
    found = []
    for index, r in enumerate(comm["redistributions"]):
        paths = _matches(sharded, r["shape"])
        whole = r.get("to") is not None and all(p == "R" for p in r["to"])
        calls = [c for c in comm["calls"] if c["made_by"] == index]
        if paths and whole and calls:
            found.append(f"{' then '.join(_call(c) for c in calls)}: DTensor.redistribute (full_tensor) made a "
                         f"{tuple(r['shape'])} tensor whole, {r['from']} -> {r['to']}: a full-size copy of "
                         + " or ".join(_variable(sharded[p]) for p in paths)
                         + " (the variable, its gradient or an optimizer slot)")
    for grad in comm["gradients"]:
        variable = sharded.get(grad["path"])
        if variable is not None and grad["type"] != "DTensor" and list(grad["shape"]) == list(variable["shape"]):
            found.append(f"optimizer.apply received {grad['path']}'s gradient as a plain {grad['type']} "
                         f"{tuple(grad['shape'])}, the whole of {_variable(variable)}: made whole before the update")
    return found


def by_ranks(values: list[dict]) -> list[str]:
    """``full_size_copies`` of every rank, each line once, prefixed with the ranks it holds on
    (``rank 0: ...``, ``ranks 0, 1, 2, 3: ...``), in the order first found."""
    ranks: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        for line in full_size_copies(value):
            ranks.setdefault(line, []).append(rank)
    return [f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {line}" for line, r in ranks.items()]


#: A collective of at most this many bytes on a rank carries scalars (the loss, a metric's total and
#: count), not gradients: DataParallel's budget does not count it.
SCALAR_BYTES = 64


def gradient_bytes(value: dict) -> int:
    """The bytes of the gradients this rank handed the optimizer in the measured step."""
    return sum(g.get("bytes", 0) for g in value["communication"]["gradients"])


def synchronised_bytes(value: dict) -> tuple[int, list[dict]]:
    """(bytes, calls): the collectives of the measured step larger than ``SCALAR_BYTES``."""
    calls = [c for c in value["communication"]["calls"] if c["bytes"] > SCALAR_BYTES]
    return sum(c["bytes"] for c in calls), calls


def data_parallel_excess(values: list[dict]) -> list[str]:
    """DataParallel's budget, per rank: the step's gradient synchronisation moves each gradient's
    bytes once (DDP's buckets, or any other way), plus scalars. One line per rank over it, naming
    the collectives and the bytes over."""
    problems = []
    for rank, value in enumerate(values):
        if not value.get("communication"):
            continue
        needed = gradient_bytes(value)
        moved, calls = synchronised_bytes(value)
        if moved > needed:
            problems.append(f"rank {rank}: {len(calls)} collectives moved {moved} bytes for {needed} bytes of "
                            f"gradients ({moved - needed} bytes over): " + ", ".join(_call(c) for c in calls))
    return problems


def over_budget(spec: dict, values: list[dict], nproc: int) -> tuple[str, str] | None:
    """A ModelParallel cell's step made no full-size copy of a sharded variable, its gradient or
    an optimizer slot on any rank (``full_size_copies``); a DataParallel cell's step moved each
    gradient's bytes once, plus scalars (``data_parallel_excess``)."""
    if spec["layout"]["kind"] == "data-parallel":
        problems = data_parallel_excess(values)
        return (OVER_BUDGET, "one DataParallel train step synchronised more than each gradient once:\n"
                + "\n".join(problems)) if problems else None
    if spec["layout"]["kind"] != "model-parallel":
        return None
    problems = by_ranks(values)
    if not problems:
        return None
    return OVER_BUDGET, ("one train step materialised full-size copies of sharded tensors (ModelParallel keeps a "
                         "sharded variable, its gradient and its optimizer slots in shards):\n" + "\n".join(problems))


def figures(values: list[dict]) -> dict | None:
    """The cell's communication per train step, for the report: per rank, collectives counted and
    bytes by op, and the full-size copies found (None: not measured)."""
    ranks = [v.get("communication") for v in values]
    if not ranks or any(c is None for c in ranks):
        return None
    return {
        "measured": ranks[0]["measured"],
        "ranks": [{"rank": rank, "count": v["communication"]["count"], "bytes": v["communication"]["bytes"],
                   "ops": v["communication"]["ops"], "redistributions": len(v["communication"]["redistributions"]),
                   "gradient_bytes": gradient_bytes(v)} for rank, v in enumerate(values)],
        "full_size_copies": by_ranks(values),
    }
