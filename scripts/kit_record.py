"""The upstream kit's record of a run (``upstream/run-<commit>.json``): every cell's verdict and the
first line of the text it was classified from, with the versions, the command and the wall time;
made from a ``--conformance-json`` report, written one cell a line, read back
(``scripts/upstream_kit.py`` writes the kit's files from it)."""

from __future__ import annotations

import collections
import importlib.metadata
import json
import os
import pathlib
import platform
import re

KERAS_REPOSITORY = "keras-team/keras"
RECORD_SCHEMA = "keras-dtensor-conformance/kit-run"
RECORD_VERSION = 1
REPORT_SCHEMA = "keras-dtensor-conformance/report"


class KitError(Exception):
    """A problem the script says in one line (exit code 2)."""


def first_line(text: str) -> str:
    """The text's first non-blank line, whole and as it was (pids kept): all the writer reads of a
    failing cell's text (its cause, its pattern, its reason) comes from that line, and a pattern made
    from it must match the text a session sees."""
    from keras_dtensor_conformance.report.expectations import nonblank_line

    return nonblank_line(text)


def cell_text(cell: dict) -> str:
    """What a report's cell was classified from: its ``text`` (reports since the field was added),
    else its message and its ranks' stories."""
    if cell.get("text") is not None:
        return cell["text"]
    stories = "\n".join(rank.get("story", "") for rank in cell.get("ranks") or [])
    return cell.get("message", "") + ("\n" + stories if stories else "")


def log_facts(log: str) -> dict:
    """What a run's terminal output says that its JSON report does not: the header's capabilities
    line (with the probe's notes) and the closing counts."""
    facts = {}
    capabilities = re.search(r"^keras torch-distribution capabilities: (.*)$", log, re.MULTILINE)
    if capabilities:
        facts["capabilities_line"] = capabilities.group(1).strip()
    counts = re.findall(r"^(\d+ cells: .*)$", log, re.MULTILINE)
    if counts:
        facts["counts_line"] = counts[-1].strip()
    return facts


def environment(machine: str | None = None) -> dict:
    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"python": platform.python_version(), "jax": version("jax"),
            "machine": machine or f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores"}


def record_from_report(report: dict, *, commit: str | None, command: str | None, wall_s: float | None,
                       log: str = "", env: dict | None = None, suite_commit: str | None = None) -> dict:
    """The compact record of a ``--conformance-json`` report: per cell its verdict (or ``skipped``,
    ``interrupted``) and the first line of its text, with the versions, the suite's commit the run
    was made with (the one the kit's caller pins) and the run's cost."""
    if not suite_commit:
        raise KitError("no suite commit: record with the suite at a commit (commit its changes first)")
    if report.get("schema") != REPORT_SCHEMA:
        raise KitError(f"not a {REPORT_SCHEMA} report (schema {report.get('schema')!r})")
    build = report["build"]
    commit = commit or build.get("git_commit")
    if not commit:
        raise KitError("the report names no git commit (an archive, not a checkout): pass --keras-commit SHA")
    env = env if env is not None else environment()
    cells, seconds = {}, {cell["id"]: cell.get("duration", 0.0) for cell in report["cells"]}
    for cell in report["cells"]:
        state = cell["verdict"] or ("interrupted" if cell["outcome"] == "interrupted" else "skipped")
        text = cell_text(cell) if cell["verdict"] else cell.get("message", "")
        line = first_line(text) if state != "pass" else ""
        cells[cell["id"]] = [state, line] if line else [state]
    ran = set(cells)
    return {
        "schema": RECORD_SCHEMA,
        "version": RECORD_VERSION,
        "keras": {"repository": KERAS_REPOSITORY, "commit": commit, "version": build["keras_version"]},
        "suite_commit": suite_commit,
        "torch": build["torch_version"],
        "jax": env.get("jax"),
        "python": env.get("python"),
        "dist_backend": build["backend"],
        "nproc": build["nproc"],
        "capabilities": build.get("capabilities", {}),
        **log_facts(log),
        "command": command,
        "wall_s": None if wall_s is None else round(wall_s, 1),
        "session_s": round(report["duration"], 1),
        "machine": env.get("machine"),
        "created": report.get("created"),
        "clusters": [{"cells": c["cells"], "seconds": round(sum(seconds.get(i, 0.0) for i in c.get("ids", ())), 1),
                      "verdict": c["verdict"], "exception": c["exception"][:300], "where": c["where"],
                      "example": c["example"]} for c in report.get("clusters", [])],
        "not_run": sorted(set(report.get("collected", [])) - ran),  # collected, deselected (outside the tier)
        "cells": dict(sorted(cells.items())),
    }


def counts(record: dict) -> dict[str, int]:
    return dict(sorted(collections.Counter(v[0] for v in record["cells"].values()).items()))


def dump_record(record: dict) -> str:
    """The record as JSON, one cell and one cluster a line (small diffs, easy to read)."""
    record = {**record, "counts": counts(record)}
    head = {k: v for k, v in record.items() if k not in ("clusters", "not_run", "cells")}
    lines = ["{"]
    for key, value in head.items():
        lines.append(f" {json.dumps(key)}: {json.dumps(value, ensure_ascii=False)},")
    for key in ("clusters", "not_run"):
        items = [json.dumps(v, ensure_ascii=False) for v in record[key]]
        lines.append(f" {json.dumps(key)}: [" + ("" if items else "],"))
        if items:
            lines += ["  " + item + "," for item in items[:-1]] + ["  " + items[-1], " ],"]
    cells = [f"  {json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}"
             for k, v in record["cells"].items()]
    lines += [' "cells": {', ",\n".join(cells), " }", "}"]
    return "\n".join(lines) + "\n"


def load_record_text(text: str, where: str = "the record") -> dict:
    data = json.loads(text)
    if data.get("schema") != RECORD_SCHEMA:
        raise KitError(f"{where}: not a {RECORD_SCHEMA} record (schema {data.get('schema')!r})")
    data.pop("counts", None)  # derived: written from the cells
    return data


def load_record(path: pathlib.Path) -> dict:
    return load_record_text(path.read_text(encoding="utf-8"), str(path))


def record_name(record: dict) -> str:
    return f"run-{record['keras']['commit'][:7]}.json"
