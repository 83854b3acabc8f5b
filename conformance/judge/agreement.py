"""Evidence -> verdict for the agreement cells: metrics and callbacks as a user sees them.

Plain functions returning ``(verdict, message)`` or None, like ``fit_checks.py``; raising is
``judge.cells.judge_agreement``'s part. ``values`` is what ``conformance.ranks.agreement.run`` returns on
each rank, in rank order (None for a rank that did not return); ``reference`` is what it returns in
the single-process run over the global batch.

What is required, and why it is stricter than the training cells' numerics check: every rank's
logs (``History``, each epoch's callback ``logs``, ``evaluate()``'s dict) equal the reference's
over the GLOBAL batch, and equal each other. A rank reporting its local batch's value is not
accepted even when the ranks' mean equals the global value: a callback on each rank decides on
what that rank sees, and ranks that see different values decide differently.
"""

from __future__ import annotations

import json

import numpy as np
from keras_dtensor_conformance import ERROR, NUMERICS

from conformance.judge.numerics import TOLERANCES, listed

#: How ranks' logs must agree with each other: all-reduced or replicated values are the same
#: computation on every rank (bit-equal in practice); this only forgives the last bit.
BETWEEN_RANKS = {"rtol": 1e-6, "atol": 1e-7}
#: ... and with the single-process reference (sharded reductions sum in another order).
WITH_REFERENCE = TOLERANCES["float32"]

#: The line a rank prints for each epoch's decision (``conformance.ranks.agreement.DECISION_PREFIX``).
DECISION_PREFIX = "keras-dtensor-conformance decision: "

#: Outcomes of ``agreement_failure`` that are no verdict of theirs: a rank did not return and its
#: peers' decisions do not explain it (the caller classifies the failure as any other cell's), or
#: the single-process reference did not run (the harness' error).
RANKS_FAILED = "ranks-failed"
NO_REFERENCE = "no-reference"

#: callback name -> (how messages name it, the log it decides on, the decision fields it takes).
CALLBACKS = {
    "earlystopping": ("EarlyStopping(monitor='val_loss')", "val_loss", ("stop_training",)),
    "reducelronplateau": ("ReduceLROnPlateau(monitor='val_loss')", "val_loss", ("learning_rate",)),
    "modelcheckpoint": ("ModelCheckpoint(monitor='val_loss', save_best_only=True)", "val_loss",
                        ("wrote_checkpoint",)),
}
#: Every decision a callback cell records, whatever its callback: no callback may change another's.
DECISIONS = ("stop_training", "learning_rate", "wrote_checkpoint")


def _close(a, b, tolerance: dict) -> bool:
    return bool(np.allclose(np.float64(a), np.float64(b), **tolerance))


def _logs_of(value: dict) -> list[tuple[str, str, float]]:
    """(where, key, value) for every number a user sees on a rank: History, callback logs, evaluate.

    ``where`` reads as a user would find it: ``History['mae'] epoch 1``, ``on_epoch_end logs['mae']
    epoch 1``, ``evaluate()['mae']``, ``test_on_batch() call 2['mae']`` (epochs and calls 1-based, as
    Keras prints epochs)."""
    found = []
    for key, per_epoch in value.get("history", {}).items():
        found += [(f"History[{key!r}] epoch {e + 1}", key, v) for e, v in enumerate(per_epoch)]
    for e, logs in enumerate(value.get("epoch_logs", ())):
        found += [(f"on_epoch_end logs[{key!r}] epoch {e + 1}", key, v) for key, v in logs.items()]
    for key, v in value.get("evaluate", {}).items():
        found.append((f"evaluate()[{key!r}]", key, v))
    for call, logs in enumerate(value.get("calls", ())):  # the on-batch cells' logs, one dict per call
        found += [(f"{value['api']}() call {call + 1}[{key!r}]", key, v) for key, v in logs.items()]
    return found


def logs_differ(what: str, values: list[dict], reference: dict) -> tuple[str, str] | None:
    """Every rank's logs equal every other rank's, then the single-process reference's over the
    global batch. ``what`` names the metric or the callback the logs belong to."""
    problems = []
    first = dict(((where, v) for where, _, v in _logs_of(values[0])))
    for rank, value in enumerate(values[1:], start=1):
        mine = dict(((where, v) for where, _, v in _logs_of(value)))
        for where in [*first, *(w for w in mine if w not in first)]:
            if where not in mine or where not in first:
                problems.append(f"{where}: rank 0 {'has' if where in first else 'lacks'} it, rank {rank} "
                                f"{'has' if where in mine else 'lacks'} it")
            elif not _close(mine[where], first[where], BETWEEN_RANKS):
                problems.append(f"{where}: rank 0 reports {first[where]:.6g}, rank {rank} {mine[where]:.6g}")
    if problems:
        return NUMERICS, listed(f"{what}: the ranks' logs differ from each other", problems)
    want = dict(((where, v) for where, _, v in _logs_of(reference)))
    for rank, value in enumerate(values):
        for where, _, got in _logs_of(value):
            if where not in want:
                problems.append(f"{where}: rank {rank} reports {got:.6g}, the single-process reference has no such log")
            elif not _close(got, want[where], WITH_REFERENCE):
                problems.append(f"{where}: rank {rank} reports {got:.6g}, the single-process reference over the "
                                f"global batch {want[where]:.6g}")
        missing = sorted(set(want) - {where for where, _, _ in _logs_of(value)})
        problems += [f"{where}: rank {rank} does not report it (the reference: {want[where]:.6g})" for where in missing]
    if problems:
        return NUMERICS, listed(f"{what}: the logs differ from the single-process reference over the global batch",
                                  problems)
    return None


def decisions_from_stdout(text: str) -> list[dict]:
    """The decisions a rank printed, one per epoch, in order (``DECISION_PREFIX`` lines)."""
    found = []
    for line in text.splitlines():
        at = line.find(DECISION_PREFIX)
        if at != -1:
            try:
                found.append(json.loads(line[at + len(DECISION_PREFIX):]))
            except json.JSONDecodeError:
                continue  # a line cut by the rank's death: the epochs before it still count
    return found


def _describe(field: str, decision: dict | None) -> str:
    if decision is None:
        return "did not reach it"
    if field == "stop_training":
        return "stopped training" if decision["stop_training"] else "went on training"
    if field == "learning_rate":
        return f"ended the epoch with learning rate {decision['learning_rate']:.6g}"
    return "wrote the checkpoint" if decision.get("wrote_checkpoint") else "wrote no checkpoint"


def _monitored(decision: dict | None, monitor: str):
    return None if decision is None else decision["logs"].get(monitor)


def decisions_differ(callback: str, decisions: list[list[dict]], finished: list[bool]) -> tuple[str, str] | None:
    """Every rank took the same decisions at the same epochs.

    ``decisions[r]``: rank r's decisions, one per epoch it finished; ``finished[r]``: whether it
    returned (a rank that did not stopped recording where it hung or died). The first epoch where
    ranks part is the verdict: ``numerics`` when the log the callback decides on differed between
    them there (each rank decided on its own value: the metrics were not reduced), else ``error``.
    """
    name, monitor, _ = CALLBACKS[callback]
    epochs = max((len(d) for d in decisions), default=0)
    for epoch in range(epochs):
        at = [d[epoch] if epoch < len(d) else None for d in decisions]
        # A rank that did not return and recorded nothing for this epoch tells nothing about it.
        known = [(rank, a) for rank, a in enumerate(at) if a is not None or finished[rank]]
        for field in DECISIONS:
            seen = {json.dumps(None if a is None else a.get(field)) for _, a in known}
            if len(seen) <= 1:
                continue
            ranks = "; ".join(f"rank {rank} {_describe(field, a)}"
                              + (f" (it saw {monitor}={_monitored(a, monitor):.6g})" if a is not None else "")
                              for rank, a in known)
            values = {_monitored(a, monitor) for _, a in known if a is not None}
            hang = ("; a rank that stops alone leaves the others waiting in the next epoch's collectives"
                    if field == "stop_training" or not all(finished) else "")
            head = f"{name}: the ranks decided differently at epoch {epoch + 1}: {ranks}{hang}"
            if len(values) > 1:
                return NUMERICS, head + (f" (each rank decided on its own {monitor}: the logs were not reduced "
                                         "across ranks)")
            return ERROR, head + f" (on the same {monitor})"
        if any(a is None for _, a in known):  # a rank that returned without this epoch: it stopped
            ran = "; ".join(f"rank {rank} {'ran' if a is not None else 'did not run'} it" for rank, a in known)
            return ERROR, f"{name}: the ranks ran different epochs: epoch {epoch + 1}: {ran}"
    return None


def decisions_unlike_reference(callback: str, values: list[dict], reference: dict) -> tuple[str, str] | None:
    """The ranks' (agreed) decisions are the single-process run's, epoch by epoch."""
    name, _, _ = CALLBACKS[callback]
    want = reference["decisions"]
    got = values[0]["decisions"]
    if len(got) != len(want):
        return NUMERICS, (f"{name}: the ranks ran {len(got)} epoch(s), the single-process reference over the global "
                          f"batch {len(want)}")
    for epoch, (g, w) in enumerate(zip(got, want, strict=True)):
        for field in DECISIONS:
            a, b = g.get(field), w.get(field)
            same = _close(a, b, WITH_REFERENCE) if field == "learning_rate" else a == b
            if not same:
                return NUMERICS, (f"{name}: at epoch {epoch + 1} every rank {_describe(field, g)}, the single-process "
                                  f"reference over the global batch {_describe(field, w)}")
    return None


def agreement_failure(spec: dict, values: list[dict | None], stdouts: list[str],
                      reference: dict | None) -> tuple[str, str] | None:
    """The first check an agreement cell fails, as ``(verdict, message)``, or None: it passes.

    A callback cell: the ranks' decisions first, read from what each rank printed where it did
    not return (so a rank that stopped alone and the peers it left hanging give that verdict, not
    a bare hang), then the logs the callback decided on, then the decisions against the
    reference's. A metrics cell: the logs. A failure the decisions do not explain is
    ``RANKS_FAILED``; a reference that did not run, ``NO_REFERENCE``.
    """
    callback = spec.get("callback")
    finished = [v is not None for v in values]
    if callback is not None:
        decisions = [v["decisions"] if v is not None else decisions_from_stdout(out)
                     for v, out in zip(values, stdouts, strict=True)]
        found = decisions_differ(callback, decisions, finished)
        if found is not None:
            return found
    if not all(finished):
        return RANKS_FAILED, "a rank did not return"
    if reference is None:
        return NO_REFERENCE, "the single-process reference failed"
    what = f"metric {spec['metric']}" if callback is None else f"{CALLBACKS[callback][0]}'s logs"
    found = logs_differ(what, values, reference)
    if found is not None or callback is None:
        return found
    return decisions_unlike_reference(callback, values, reference)
