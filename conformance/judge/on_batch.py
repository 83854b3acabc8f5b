"""Evidence -> verdict for the on-batch cells (``conformance/ranks/on_batch.py``): what each
rank's ``train_on_batch``, ``test_on_batch``, ``predict_on_batch``, ``evaluate`` or ``predict``
returned, against the single process's over the global batch.

As strict as the agreement cells (``agreement.logs_differ``): every rank's logs equal the single
process's GLOBAL values, not its local batch's, and each other, because a user's loop on every
rank acts on what its own call returned. Predictions are the rows the rank fed, every column
(``numerics.predict_problems``: Keras gathers every mesh axis but the batch axis); after
``train_on_batch`` every rank holds the single process's weights.
"""

from __future__ import annotations

import numpy as np
from keras_dtensor_conformance import ERROR, NUMERICS

from conformance.judge import agreement, numerics

#: What each evidence key is checked by: logs (``calls``, ``evaluate``) or predictions (``predict``).
LOGS, PREDICTIONS = ("calls", "evaluate"), ("predict",)


def started_elsewhere(values: list[dict], reference: dict) -> str | None:
    """The reference must start from the ranks' weights (the same seed; on another device it
    could give others): otherwise nothing after it is comparable."""
    for rank, value in enumerate(values):
        if len(value["initial_weights"]) != len(reference["initial_weights"]):
            return (f"rank {rank} built {len(value['initial_weights'])} weights, the single-process reference "
                    f"{len(reference['initial_weights'])}: the runs are not comparable")
        for i, (got, want) in enumerate(zip(value["initial_weights"], reference["initial_weights"], strict=True)):
            if not np.array_equal(got, want):
                return (f"rank {rank}'s initial weight {i} differs from the single-process reference's: "
                        "the runs are not comparable")
    return None


def on_batch_failure(spec: dict, values: list[dict], reference: dict) -> tuple[str, str] | None:
    """The first check an on-batch cell fails, as ``(verdict, message)``, or None: it passes.
    In order: the same starting weights, the logs, the predictions, the weights after training."""
    api = spec["api"]
    elsewhere = started_elsewhere(values, reference)
    if elsewhere:
        return ERROR, elsewhere
    if any(key in reference for key in LOGS):
        found = agreement.logs_differ(f"{api}()", values, reference)
        if found is not None:
            return found
    problems = []
    if "predict" in reference:
        want = np.asarray(reference["predict"])
        for rank, value in enumerate(values):
            problems += numerics.predict_problems(rank, value, want)
    if problems:
        return NUMERICS, agreement.listed(f"{api}(): the predictions differ from the single process's rows", problems)
    if api == "train_on_batch":
        for rank, value in enumerate(values):
            problems += numerics.weight_problems(rank, value, reference)
        problems += numerics.ranks_agree(values)
    if problems:
        return NUMERICS, agreement.listed(f"{api}(): the weights differ from the single process's", problems)
    return None
