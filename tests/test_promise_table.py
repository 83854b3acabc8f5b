"""README's promise table held to the judge's behaviour, not only to ``Promise.scope``'s text.

``test_readme.py`` keeps each row equal to its promise's title and scope; this file checks what a
row says is not applicable against what the judge does. Synthetic training and op cells, one per
condition a row may name (each layout, jit, SGD without momentum, a model that freezes nothing, no
JAX run; an op whose twin compiles nothing, one whose result is no tensor), go through the judge's
own functions: ``fit_checks.fit_checks`` with its comparisons with a reference stubbed out
(``COMPARISONS``: the evidence has no numbers; the checks' scopes, the sharding, the slots and the
communication run as written), and ``op_checks.op_scope``. Each cell, with the outcomes the judge recorded, is counted as the report
counts it (``report.promises.cell_state``). For every row and every condition:

- where the row says the promise is not applicable there, the judge could fail none of its checks
  (the report counts the cell not applicable, or not at all);
- where it does not, a cell the promise tests is one the judge could fail: the report counts it kept.

So a DataParallel cell, whose step communication the judge holds to DDP's budget, must count under
``communication-budget``, and a row that called DataParallel not applicable fails here.
"""

from __future__ import annotations

import re

import pytest
from keras_dtensor_conformance.checks import FAILED, HELD
from keras_dtensor_conformance.report import promises as report_promises

from conformance import axes
from conformance.judge import fit_checks, op_checks
from conformance.judge.sharding import intended
from conformance.promises import PROMISES
from tests.test_readme import README, cells

NPROC = 2
#: The MLP's variables (path -> shape); the first kernel is the one a frozen model freezes.
MLP = {"mlp/dense_a/kernel": (8, 16), "mlp/dense_a/bias": (16,), "mlp/dense_b/kernel": (16, 4), "mlp/dense_b/bias": (4,)}
FROZEN = "mlp/dense_a/kernel"
#: One measured step that moved nothing beyond scalars: within every layout's budget.
STEP = {"measured": "one eager train_on_batch", "count": 0, "bytes": 0, "ops": {}, "calls": [],
        "redistributions": [], "gradients": []}
#: The modules of the judge's comparisons with a reference (the single process's numbers, the JAX
#: backend's numbers and layouts, dynamo's counters), which need evidence the synthetic cells do not
#: have: what ``fit_checks`` imports from them is stubbed to find no problem (an empty list).
COMPARISONS = ("conformance.judge.numerics", "conformance.judge.jax_compare", "conformance.judge.compile_evidence")


def described(layout: dict, path: str, shape: tuple, rank: int) -> dict:
    """A variable as ``rank_train.describe_variable`` gives it, laid out as the layout asks."""
    want = intended(layout, path, shape, NPROC, rank)
    if want is None:
        return {"path": path, "type": "Variable", "shape": shape, "dtensor": False}
    return {"path": path, "type": "Variable", "shape": shape, "dtensor": True, "placements": want[0],
            "local_shape": want[1]}


def rank_evidence(spec: dict, rank: int, frozen: bool) -> dict:
    """One rank's evidence of a training cell that did everything as asked."""
    layout = spec["layout"]
    variables = [described(layout, path, shape, rank) for path, shape in MLP.items()]
    frozen_paths = [FROZEN] if frozen else []
    full = axes.SLOTS[spec["optimizer_name"]]["full"]
    slots = [dict(v, path=f"{v['path'].replace('/', '_')}_slot{i}", reference=v["path"], factor=None)
             for v in variables if v["path"] not in frozen_paths for i in range(full)]
    data_parallel = layout["kind"] == "data-parallel"
    return {"stages": {stage: variables for stage in ("build", "fit", "evaluate", "predict")}, "slots": slots,
            "unmatched_optimizer_variables": [], "frozen": frozen_paths,
            "initial_weights": {FROZEN: [[0.5]]}, "weights": {FROZEN: [[0.5]]},
            "communication": dict(STEP), "device": "cpu",
            "distribution": "DataParallel" if data_parallel else "ModelParallel",
            "batch_part": (rank, NPROC) if data_parallel else (0, 1), "unsynchronized_batch_norm": [],
            "compiled_graphs": 1, "warnings": []}


def fit_condition(layout="colshard", compile_mode="nojit", optimizer="adam", frozen=True, jax=True) -> dict:
    """A training cell (its record for the report) and the outcomes the judge recorded for it. The
    base case can fail every check: a split layout, eager steps measured, slots, a frozen kernel,
    a JAX run."""
    spec = axes.cell_spec("mlp", optimizer, "arrays", compile_mode, layout)
    values = [rank_evidence(spec, rank, frozen) for rank in range(NPROC)]
    with pytest.MonkeyPatch.context() as patch:
        for name, value in vars(fit_checks).items():
            if callable(value) and getattr(value, "__module__", None) in COMPARISONS:
                patch.setattr(fit_checks, name, lambda *args, **kwargs: [])
        found, outcomes = fit_checks.fit_checks(spec, values, NPROC, {"device": "cpu"}, oracle=lambda: None,
                                                jax={"numbers": "as torch's"} if jax else None)
    assert found is None, found  # evidence of a build that did everything as asked
    axes_ = {"model": "mlp", "optimizer": optimizer, "data": "arrays", "compile": compile_mode, "layout": layout}
    return record(f"fit {layout}", axes_, outcomes, communication={"measured": STEP["measured"]})


def op_condition(compile_mode="compiled", control_graphs=1, tensor=True) -> dict:
    """An op cell and the outcomes ``op_checks.op_scope`` allows it (held where a check can fail)."""
    values = [{"expected_placements": ["S(0)"] if tensor else None, "control_graphs": control_graphs,
               "compiled_graphs": control_graphs} for _ in range(NPROC)]
    outcomes = {}
    for check in op_checks.OP_CHECKS:
        why = op_checks.op_scope(check, "add", compile_mode, values)
        outcomes[check] = ("not applicable", why) if why else (HELD, "")
    axes_ = {"op": "add", "operand": "tensor", "placement": "shard0", "compile": compile_mode}
    return record(f"ops {compile_mode}", axes_, outcomes)


def record(family: str, axes_: dict, outcomes: dict, **extra) -> dict:
    """A passing cell of the results model, with each check's outcome."""
    return {"id": family, "family": family, "axes": axes_, "verdict": "pass", "outcome": "passed", "message": "",
            "cause": None, "ranks": [], "checks": {name: {"outcome": o, "why": w} for name, (o, w) in outcomes.items()},
            **extra}


#: name -> (how README's promise table names the condition in a "not applicable" clause, the cell).
CONDITIONS = {
    "a column-split layout": (r"colshard|column", lambda: fit_condition()),
    "a row-split layout": (r"rowshard|row-split", lambda: fit_condition(layout="rowshard")),
    "the 2x2 mesh": (r"batchxmodel|2x2", lambda: fit_condition(layout="batchxmodel")),
    "the replicated layout": (r"replicated|no variable is split|asks none",
                              lambda: fit_condition(layout="replicated")),
    "a model axis of one": (r"model axis of one|no variable is split", lambda: fit_condition(layout="batchshard")),
    "DataParallel": (r"DataParallel", lambda: fit_condition(layout="dataparallel")),
    "a jit cell": (r"\bjit\b", lambda: fit_condition(compile_mode="jit")),
    "SGD without momentum": (r"SGD without momentum", lambda: fit_condition(optimizer="sgd")),
    "a model that freezes nothing": (r"freezes nothing", lambda: fit_condition(frozen=False)),
    "no JAX run": (r"without JAX", lambda: fit_condition(jax=False)),
    "a compiled op": (r"(?!)", lambda: op_condition()),
    "an op whose twin compiles nothing": (r"twin compiles none", lambda: op_condition(control_graphs=0)),
    "an op whose result is no tensor": (r"no tensor", lambda: op_condition(compile_mode="eager", tensor=False)),
}


def readme_rows() -> dict[str, str]:
    """promise name -> its row's text in README's promise table."""
    lines = README.read_text(encoding="utf-8").splitlines()
    start = lines.index("| promise | what its checks prove, and where they cannot |")
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        name, text = cells(line)
        rows[name.strip("`")] = text
    return rows


def not_applicable_clauses(text: str) -> str:
    """What a row says is not applicable: each ``not applicable ...`` up to the next ``;``."""
    return " | ".join(re.findall(r"not applicable[^;]*", text))


def judged(promise, cell: dict) -> bool | None:
    """Whether the judge could fail one of the promise's checks on ``cell`` (None: it records none)."""
    outcomes = [cell["checks"][name]["outcome"] for name in promise.checks if name in cell["checks"]]
    return any(o in (HELD, FAILED) for o in outcomes) if outcomes else None


@pytest.fixture(scope="module")
def conditions() -> dict[str, dict]:
    return {name: make() for name, (_, make) in CONDITIONS.items()}


@pytest.mark.parametrize("promise", PROMISES, ids=[p.name for p in PROMISES])
def test_the_promise_tables_applicability_is_the_judges(promise, conditions):
    text = readme_rows()[promise.name]
    clauses = not_applicable_clauses(text)
    problems = []
    for name, (words, _) in CONDITIONS.items():
        cell = conditions[name]
        said = re.search(words, clauses) is not None
        state = report_promises.cell_state(promise, cell)
        could_fail = judged(promise, cell)
        if said and (could_fail or state == report_promises.KEPT):
            problems.append(f"README says not applicable on {name}, but the judge could fail it there "
                            f"(counted {state})")
        elif not said and state == report_promises.NOT_APPLICABLE:
            problems.append(f"on {name} the judge could fail none of its checks {promise.checks} (counted not "
                            f"applicable), which README's row does not say: {clauses or text}")
        elif not said and promise.tests(cell) and state != report_promises.KEPT:
            problems.append(f"{name}: a passing cell it tests counted {state}, not kept")
    assert problems == []


def test_a_dataparallel_cell_counts_under_the_communication_budget(conditions):
    """The issue's case: the judge holds a DataParallel step to DDP's budget, so README may not call
    the promise not applicable there, and the report counts the cell kept."""
    cell = conditions["DataParallel"]
    assert cell["checks"][fit_checks.STEP_COMMUNICATION]["outcome"] == HELD
    budget = next(p for p in PROMISES if p.name == "communication-budget")
    assert report_promises.cell_state(budget, cell) == report_promises.KEPT
    assert "DataParallel" not in not_applicable_clauses(readme_rows()["communication-budget"])


def test_a_row_that_contradicts_the_judge_fails(conditions, monkeypatch):
    """The check can fail: the row as it was before issue 40 (DataParallel not applicable) fails."""
    old = ("a train step communicates within the layout's budget: an eager ModelParallel step makes no full-size "
           "copy of a split variable, its gradient or a slot; not applicable where no variable is split, under "
           "DataParallel, and on jit cells (the compiled step is not measured)")
    rows = {**readme_rows(), "communication-budget": old}
    monkeypatch.setattr(f"{__name__}.readme_rows", lambda: rows)
    budget = next(p for p in PROMISES if p.name == "communication-budget")
    with pytest.raises(AssertionError, match="README says not applicable on DataParallel"):
        test_the_promise_tables_applicability_is_the_judges(budget, conditions)
