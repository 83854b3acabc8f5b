"""Synthetic cell records for the promise self-tests (tests/test_promises.py, the grouping;
tests/test_promise_views.py, every view of it): one of each thing the grouping must tell apart."""

from __future__ import annotations

from keras_dtensor_conformance.report.recorder import CellRecord
from keras_dtensor_conformance.report.results import build_report

from conformance import promises as suite

SLOT_LOST = "rank 0 optimizer slot adam/dense_kernel_momentum: a plain Tensor, expected a DTensor ['R', 'S(1)']"
VARIABLE_LOST = "rank 1 after fit: sequential/dense/kernel: a plain Tensor, expected a DTensor ['R', 'S(1)']"


def record(id, verdict, outcome, message="", family="fit colshard", **axes) -> CellRecord:
    axes = {"optimizer": "adam", "data": "arrays", "compile": "nojit", "layout": "colshard", **axes}
    return CellRecord(id, f"conformance/test_fit.py::test_fit[{id}]", family, axes.get("optimizer", id),
                      axes.get("data", "x") + "/" + axes.get("compile", "x"), axes, verdict=verdict, outcome=outcome,
                      message=message)


#: One of each thing the grouping must tell apart, on the suite's own promises.
RECORDS = [
    record("kept-jit", "pass", "passed", compile="jit"),
    record("slot-lost", "sharding-lost", "failed", SLOT_LOST),
    record("variable-lost", "sharding-lost", "xfailed", VARIABLE_LOST, optimizer="sgd"),
    record("both-lost", "sharding-lost", "failed", f"{VARIABLE_LOST}\n{SLOT_LOST}"),
    record("crashed", "crash", "failed"),
    record("numbers", "numerics", "xfailed", "rank 0: step_losses: max abs difference 0.1"),
    record("fallback", "compile-fallback", "xfailed", "jit_compile=True but torch._dynamo compiled no graph",
           compile="jit"),
    record("jit-numbers", "numerics", "failed", "rank 0: predict: max abs difference 0.1", compile="jit"),
    record("skipped-jit", None, "skipped", compile="jit"),
    record("dataparallel", "pass", "passed", layout="dataparallel"),
    record("op-lost", "sharding-lost", "failed", "rank 0: the result is Replicate", family="ops eager",
           op="max", operand="none", placement="shard1", compile="eager"),
]


def report_of(records=RECORDS, table=suite.PROMISES) -> dict:
    return build_report(records, {"keras_version": "3.16"}, 1.0, promises=list(table))


def by_name(report: dict) -> dict:
    return {p["name"]: p for p in report["promises"]}


def with_checks(rec: CellRecord, **outcomes: str) -> CellRecord:
    """``rec`` with the outcomes its judge recorded (check name with ``_`` for ``-``: outcome)."""
    rec.checks = {name.replace("_", "-"): {"outcome": outcome, "why": ""} for name, outcome in outcomes.items()}
    return rec


def measured(rec: CellRecord) -> CellRecord:
    """``rec`` with a step's communication, as ``test_fit`` records it for a training cell that ran everywhere."""
    rec.communication = {"measured": "one eager train step", "ranks": [], "full_size_copies": []}
    return rec
