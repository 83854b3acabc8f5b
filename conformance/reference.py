"""The single-process reference of training cells, cached per reference configuration.

By default the reference runs on the build under test. ``--reference-keras-path`` runs it on
another build (a release, say), so a maths bug of the build under test that its single-process
and distributed runs share shows as a difference; a cell whose API that other build lacks falls
back to the same build, and the cell's record says which reference it used.
"""

from __future__ import annotations

import dataclasses
import json
import re

from conformance.judge import fit_checks
from conformance.ranks import train as rank_train

SAME_BUILD = "same build"

#: Exceptions (type suffix, message pattern) by which a build says it lacks a cell's API: the
#: reference then falls back to the build under test. Any other failure is the reference's own.
MISSING_API = (
    ("NotInBuild", ""),
    ("AttributeError", r"has no attribute"),
    ("TypeError", r"unexpected keyword argument"),
)


@dataclasses.dataclass(frozen=True)
class Reference:
    """A reference's PoolResult and which build computed it (the cell record's ``reference``)."""

    result: object
    source: str


@dataclasses.dataclass(frozen=True)
class OtherBuild:
    """The pool of ``--reference-keras-path`` and how records name it (``keras 3.15.1 at PATH``)."""

    pool: object
    label: str


def missing_api(result) -> str | None:
    """Why the build that ran ``result`` lacks the cell's API, or None when that is not the failure."""
    for outcome in result.outcomes:
        error = outcome.error
        if error is None:
            continue
        for type_suffix, pattern in MISSING_API:
            if error.type.endswith(type_suffix) and re.search(pattern, error.message):
                return f"{error.type.rpartition('.')[2]}: {error.message}"
    return None


class References:
    """Single-process results, computed once per reference configuration in a clean process.

    The reference runs the same model, seed, data source (so the same order) and optimizer with no
    distribution and no torch.compile; cells that differ only in layout or in whether they compile
    share one reference.
    """

    def __init__(self, pool, other: OtherBuild | None = None):
        self.pool = pool
        self.other = other
        self._cache: dict[str, Reference] = {}

    @staticmethod
    def spec_for(spec: dict) -> dict:
        return fit_checks.reference_spec(spec)

    def get(self, spec: dict):
        """The reference's PoolResult for ``spec`` (cached: failures too, they do not change)."""
        return self.lookup(spec).result

    def lookup(self, spec: dict) -> Reference:
        """The reference of ``spec`` and which build computed it (cached)."""
        ref = self.spec_for(spec)
        key = json.dumps(ref, sort_keys=True)
        if key not in self._cache:
            self._cache[key] = self._compute(ref)
        return self._cache[key]

    def _compute(self, ref: dict) -> Reference:
        if self.other is None:
            return Reference(self.pool.run(rank_train.train, ref, False), SAME_BUILD)
        result = self.other.pool.run(rank_train.train, ref, False)
        reason = missing_api(result)
        if reason is None:
            return Reference(result, self.other.label)
        fallback = f"{SAME_BUILD} (fallback: {self.other.label} lacks it: {reason})"
        return Reference(self.pool.run(rank_train.train, ref, False), fallback)
