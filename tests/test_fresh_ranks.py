"""When the controller asks ranks whether a cell left state in them, and when it replaces them
without asking (``controller/fresh_ranks.py``): a pool whose cells keep leaving state gets fresh
ranks before each cell, asked again every few cells, and goes back to asking before every cell once
an asked cell left nothing. Driven here by a pool that only records what it was told, so each rule
is seen cell by cell; ``tests/test_fresh_verdicts.py`` holds the verdicts to fresh ones on real builds."""

from __future__ import annotations

from keras_dtensor_conformance.controller import fresh_ranks
from keras_dtensor_conformance.controller.fresh_ranks import FreshRanks
from keras_dtensor_conformance.rank import leftovers
from keras_dtensor_conformance.rank.outcomes import OK, PoolResult, RankOutcome


class RecordingPool(FreshRanks):
    """Ranks whose every cell leaves what ``left`` says (a cause, or None for nothing)."""

    def __init__(self, left):
        self._init_fresh_ranks()
        self.left = left
        self.started = True
        self.asked = 0
        self.kills: list[tuple[str, ...]] = []
        self.cell = 0

    def _run(self, name, call, timeout):
        self.asked += 1
        changes = {} if self.left(self.cell) is None else {self.left(self.cell): ["something"]}
        return PoolResult(name, [RankOutcome(rank=0, status=OK, value={"changes": changes, "new_modules": []})])

    health_timeout = 1.0

    def kill(self, *causes, wait=True):
        self.kills.append(causes)

    def run_cells(self, n: int) -> list[str]:
        """Before each of ``n`` cells: 'asked' (and kept or replaced) or 'replaced unasked'."""
        seen = []
        for self.cell in range(n):
            asked, kills = self.asked, len(self.kills)
            self._prepare()
            replaced = len(self.kills) > kills
            seen.append(("asked" if self.asked > asked else "unasked") + (", replaced" if replaced else ""))
        return seen


def test_a_build_that_keeps_state_gets_fresh_ranks_without_asking_and_is_asked_again():
    pool = RecordingPool(lambda cell: leftovers.DISPATCH_MODE)
    seen = pool.run_cells(3 + 2 * fresh_ranks.ASK_EVERY)
    assert seen[:fresh_ranks.PREDICT_AFTER] == ["asked, replaced"] * fresh_ranks.PREDICT_AFTER
    rest = seen[fresh_ranks.PREDICT_AFTER:]
    assert all(s.endswith("replaced") for s in rest)  # never reused
    assert [i for i, s in enumerate(rest) if s.startswith("asked")] == [
        fresh_ranks.ASK_EVERY - 1, 2 * fresh_ranks.ASK_EVERY - 1]
    assert pool.fresh_starts == {}  # counted at the next start, which this pool never makes
    assert pool.kills.count((fresh_ranks.PREDICTED,)) == len(rest) - 2


def test_an_asked_cell_that_left_nothing_ends_the_replacements_without_asking():
    clean_from = fresh_ranks.PREDICT_AFTER + fresh_ranks.ASK_EVERY
    pool = RecordingPool(lambda cell: leftovers.KERAS_STATE if cell < clean_from else None)
    seen = pool.run_cells(clean_from + 3 * fresh_ranks.ASK_EVERY)
    first_clean_ask = next(i for i, s in enumerate(seen) if i >= clean_from and s.startswith("asked"))
    assert seen[first_clean_ask] == "asked"  # kept: the ranks are as fresh ones would be
    assert all(s == "asked" for s in seen[first_clean_ask:])


def test_modules_imported_for_the_first_time_start_no_replacements_without_asking():
    """On the default build a run of cells may each import a module of the build for the first time:
    learned once, not state kept, so every cell is still asked."""
    pool = RecordingPool(lambda cell: leftovers.KERAS_MODULES)
    assert pool.run_cells(3 * fresh_ranks.ASK_EVERY) == ["asked, replaced"] * (3 * fresh_ranks.ASK_EVERY)
