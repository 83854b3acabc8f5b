"""The single-process reference of training cells, cached per reference configuration."""

from __future__ import annotations

import json

from conformance import rank_train


class References:
    """Single-process results, computed once per reference configuration in a clean process.

    The reference runs the same model, seed, data source (so the same order) and optimizer with no
    distribution and no torch.compile; cells that differ only in layout or in whether they compile
    share one reference.
    """

    def __init__(self, pool):
        self.pool = pool
        self._cache: dict[str, object] = {}

    @staticmethod
    def spec_for(spec: dict) -> dict:
        return dict(spec, compile="spe4" if spec["compile"] == "spe4" else "nojit",
                    layout={"kind": "single"}, layout_name="single")

    def get(self, spec: dict):
        """The reference's PoolResult for ``spec`` (cached: failures too, they do not change)."""
        ref = self.spec_for(spec)
        key = json.dumps(ref, sort_keys=True)
        if key not in self._cache:
            self._cache[key] = self.pool.run(rank_train.train, ref, False)
        return self._cache[key]
