"""The upstream kit: the files a Keras maintainer adds to keras-team/keras to gate on this suite.

They live under ``upstream/`` at the paths they take in keras-team/keras, and this script writes them:

- ``upstream/.github/workflows/dtensor-conformance.yml``: README's caller (the CI section's YAML
  block that calls ``keras-conformance.yml``), read from README.md each time, with its
  ``expectations:`` set to the kit's file: one source, never written twice;
- ``upstream/.github/dtensor-conformance-expectations.txt``: Keras master's expected failures,
  written by the plugin's own writer (``Expectations.write_update``, what ``--update-expectations``
  calls) from a recorded run;
- ``upstream/PR.md``: the note for the pull request's description, with the run's figures;
- ``upstream/run-<commit>.json``: the record of that run (every cell's verdict and the first line of
  the text it was classified from, the versions, the command, the wall time), small enough to
  commit, so the three files above can be written again without rerunning the tier.

Usage (from the repository root)::

    python scripts/upstream_kit.py                          # write the kit from upstream/run-*.json
    python scripts/upstream_kit.py --check                  # exit 1, one line, if the kit differs
    python scripts/upstream_kit.py --keras-path ../keras    # run the default tier there, record it, write the kit
    python scripts/upstream_kit.py --from-run report.json --keras-commit SHA --wall-s 1234 --run-log run.log
                                                            # record a --conformance-json report, write the kit

``--from-run`` takes a record (``upstream/run-*.json``) or a whole ``--conformance-json`` report
(it is recorded first; ``--wall-s``, ``--command`` and ``--run-log`` add what the report lacks).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kit_record import (  # noqa: E402 - the record of a run, beside this script
    REPORT_SCHEMA,
    KitError,
    counts,
    dump_record,
    environment,
    load_record,
    record_from_report,
    record_name,
)

UPSTREAM = ROOT / "upstream"
#: Paths inside keras-team/keras (and under ``upstream/`` here).
CALLER_PATH = ".github/workflows/dtensor-conformance.yml"
EXPECTATIONS_PATH = ".github/dtensor-conformance-expectations.txt"
PR_PATH = "PR.md"
_EXPECTATIONS_LINE = re.compile(r"^(?P<lead>[ \t]*expectations:[ \t]*)(?P<value>[^\s#]+)(?P<tail>.*)$", re.MULTILINE)


# -- the caller ---------------------------------------------------------------------------------


def readme_caller_text() -> str:
    from tests.workflows import readme_caller_text as extract  # the one extraction the self-tests use

    return extract()


def caller_text(readme_block: str, expectations: str = EXPECTATIONS_PATH) -> str:
    """README's caller with its one ``expectations:`` input set to ``expectations``."""
    found = list(_EXPECTATIONS_LINE.finditer(readme_block))
    if len(found) != 1:
        raise KitError(f"README's caller block has {len(found)} 'expectations:' inputs; the kit needs exactly one")
    return _EXPECTATIONS_LINE.sub(lambda m: m["lead"] + expectations + m["tail"], readme_block)


def suite_ref(caller: str) -> str:
    """The ref the caller's ``uses: .../keras-conformance.yml@REF`` names (a SHA, or a branch)."""
    refs = set(re.findall(r"uses:\s*\S+/keras-conformance\.yml@(\S+)", caller))
    if len(refs) != 1:
        raise KitError(f"README's caller names {len(refs)} refs of keras-conformance.yml; the kit needs one")
    return refs.pop()


def caller_input(caller: str, name: str):
    """One ``with:`` input of the job that calls keras-conformance.yml (None where absent)."""
    from tests.workflows import load

    for job in load(caller)["jobs"].values():
        if str(job.get("uses", "")).split("@")[0].endswith("/keras-conformance.yml"):
            return (job.get("with") or {}).get(name)
    return None


# -- the expectations file ----------------------------------------------------------------------


def banner(record: dict) -> str:
    """What the plugin's --update-expectations writes on top, with the commit the run was against."""
    keras = record["keras"]
    return (f"Keras {keras['version']} ({keras['repository']} {keras['commit'][:12]}), torch {record['torch']}, "
            f"{record['dist_backend']}, nproc {record['nproc']}")


def writer_inputs(record: dict) -> tuple[set[str], dict[str, tuple[str, str]]]:
    """What the plugin hands the writer at the end of a session: every collected cell's name, and
    each cell that got a verdict, with the text it was classified from (here its first line)."""
    collected = set(record["cells"]) | set(record["not_run"])
    verdicts = {cell: (value[0], value[1] if len(value) > 1 else "")
                for cell, value in record["cells"].items() if value[0] not in ("skipped", "interrupted")}
    return collected, verdicts


def expectations_text(record: dict) -> str:
    """The expectations file the plugin writes for this run, from no earlier file, by its own writer."""
    from keras_dtensor_conformance.report.expectations import Expectations

    collected, verdicts = writer_inputs(record)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "expectations.txt")
        book = Expectations(None, path, strict=False, torch_version=record["torch"])
        book.check_collected(collected)
        book.write_update(verdicts, banner(record))
        lines = pathlib.Path(path).read_text(encoding="utf-8").splitlines(keepends=True)
    # Above the entries (the reader skips comments; a re-record by the plugin keeps those of an entry).
    at = next(i for i, line in enumerate(lines) if not line.startswith("#"))
    return "".join([*lines[:at], *(line + "\n" for line in rerecord_lines(record)), *lines[at:]])


def rerecord_lines(record: dict) -> list[str]:
    """How the expectations were recorded, and how to record them again on a newer master: one command."""
    return [f"# Recorded with keras-dtensor-conformance {record['suite_commit'][:12]}, the commit the workflow pins. "
            "On a newer master, from that",
            f"# suite checkout: pytest --keras-path ../keras --update-expectations ../keras/{EXPECTATIONS_PATH}"]


def expectation_entries(text: str):
    from keras_dtensor_conformance.report.expectations_file import read

    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "expectations.txt"
        path.write_text(text, encoding="utf-8")
        return read(str(path))


# -- the PR note --------------------------------------------------------------------------------


def _minutes(seconds: float | None) -> str:
    return "not measured" if seconds is None else f"{seconds / 60:.0f} min"


def _cause_line(cluster: dict) -> str:
    said = cluster["exception"] if len(cluster["exception"]) <= 200 else cluster["exception"][:197] + "..."
    where = f" (in `{cluster['where']}`)" if cluster["where"] else ""
    took = f", {_minutes(cluster['seconds'])}" if cluster.get("seconds", 0) >= 60 else ""
    return f"- {cluster['cells']} cells{took}, `{cluster['verdict']}`: {said}{where}; e.g. `{cluster['example']}`"


def gating_check(caller: str) -> str:
    """The check GitHub names the gating job of the caller: the calling job's id, then the called job's
    name (``keras-conformance.yml``: ``merge`` with slices, ``conformance`` without)."""
    from tests.workflows import load

    job = next(name for name, spec in load(caller)["jobs"].items()
               if str(spec.get("uses", "")).split("@")[0].endswith("/keras-conformance.yml"))
    return f"{job} / {'merge' if int(caller_input(caller, 'slices') or 1) > 1 else 'conformance'}"


def pr_text(record: dict, caller: str, expectations: str) -> str:
    """The pull request's description. GitHub shows a newline in a description as a line break, so a
    paragraph is one line."""
    keras = record["keras"]
    ref = suite_ref(caller)
    tally = counts(record)
    total = sum(tally.values())
    entries = len(expectation_entries(expectations))
    failing = total - tally.get("pass", 0) - tally.get("skipped", 0) - tally.get("interrupted", 0)
    by_verdict = ", ".join(f"{n} {v}" for v, n in sorted(tally.items(), key=lambda item: (-item[1], item[0])))
    slices = int(caller_input(caller, "slices") or 1)
    jobs = "one job" if slices == 1 else (
        f"{slices} jobs, each a slice of the tier balanced by recorded durations, and one that merges their "
        "reports into one run's, writes the summary and gates,")
    torch_input = caller_input(caller, "torch-version")
    torch_said = "the reusable workflow's default torch" if torch_input is None else (
        f"torch {torch_input}" if torch_input else "the newest torch")
    slowest = max(record["clusters"], key=lambda c: c.get("seconds", 0), default=None)
    slow_said = "" if not slowest or not record.get("wall_s") or slowest.get("seconds", 0) < record["wall_s"] / 4 else (
        f" Of that, {_minutes(slowest['seconds'])} went to the {slowest['cells']} cells of one cause "
        f"(`{slowest['verdict']}`, e.g. `{slowest['example']}`), {slowest['seconds'] / slowest['cells']:.0f} s a cell: "
        "the cost follows the build.")
    paragraphs = [
        "# Gate `keras.distribution` on torch DTensor: keras-dtensor-conformance",
        (f"This adds `{CALLER_PATH}` and `{EXPECTATIONS_PATH}`, generated by keras-team/keras-dtensor-conformance's "
        "`scripts/upstream_kit.py` (the caller is its README's; the expectations file is a recorded run's)."),
        (f"**What the gate runs.** On every pull request and every push to master, {jobs} (the suite's reusable "
        f"workflow `keras-conformance.yml@{ref}`) checks out this repository at the triggering commit, installs "
        f"{torch_said} (PyTorch's CPU wheels) and the suite, and runs the suite's default tier against the checkout "
        f"with `KERAS_BACKEND=torch` on {record['nproc']} processes ({record['dist_backend']}): training cells under "
        "`ModelParallel` and `DataParallel` judged against one process, the JAX backend and a NumPy oracle, "
        "`keras.ops` on DTensors, metrics, callbacks, on-batch APIs, checkpoints. The Markdown report goes to the "
        "step summary; JSON, HTML and Markdown are uploaded as an artifact."),
        (f"**The required check.** To gate merges, branch protection requires `{gating_check(caller)}`: the job "
        "that gates (with slices, the merge of their reports; a slice's job only runs cells)."),
        ("**What a red means.** A cell got a verdict the expectations file does not record: a cell that passed "
        "fails, or a recorded failure fails another way (`expected X (reason), got Y: ...`); or the session "
        "stopped (a usage error, such as an expectations file recorded on another torch). A recorded failure "
        "that now passes is reported, not red; its line should go. Verdicts are per build, nproc and torch: "
        "the file's `# torch:` line names the torch it was recorded on."),
        ("**When a fix lands** (or a change moves a verdict on purpose), record the file again in the same PR, "
        "with the suite at the commit the workflow pins, and review its diff like code: it keeps the file's "
        "globs, patterns and comments, drops the entries of cells that now pass and adds entries for new failures."),
        ("```bash\n"
        "git clone https://github.com/keras-team/keras-dtensor-conformance ../keras-dtensor-conformance\n"
        f"git -C ../keras-dtensor-conformance checkout {ref}\n"
        "# torch's CPU build, as the workflow installs it (else pip takes the CUDA wheels, GBs):\n"
        "export PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu\n"
        "pip install -c ../keras-dtensor-conformance/constraints-cpu.txt "
        "-e \"../keras-dtensor-conformance[default-build,jax]\"\n"
        "cd ../keras-dtensor-conformance && pytest --keras-path ../keras "
        f"--update-expectations ../keras/{EXPECTATIONS_PATH}\n"
        "```"),
        ("**Report-only.** `report-only: true` under `with:` makes the job report without gating (green whatever "
        "the verdicts): for a first landing before the file is trusted, or for a leg no file covers (another "
        "torch, `nproc: 4`, `--full`)."),
        (f"**Cost, measured.** Against master {keras['commit'][:7]} the default tier ({total} cells) took "
        f"{_minutes(record['wall_s'])} of wall time on {record['machine']}; torch {record['torch']}, "
        f"Python {record['python']}, JAX {record['jax']}.{slow_said}"),
        (f"**What master gets today** ({keras['commit'][:12]}): {by_verdict}; {failing} failing cells, recorded in "
        f"{entries} entries. The build probe says: `{record.get('capabilities_line', record['capabilities'])}`. "
        "The largest causes:"),
        "\n".join(_cause_line(c) for c in record["clusters"][:6]),
    ]
    return "\n\n".join(paragraphs) + "\n"


# -- the kit ------------------------------------------------------------------------------------


def kit_files(record: dict) -> dict[str, str]:
    """Every file of the kit, by its path under ``upstream/``, as this script writes it."""
    caller = caller_text(readme_caller_text())
    expectations = expectations_text(record)
    return {
        CALLER_PATH: caller,
        EXPECTATIONS_PATH: expectations,
        PR_PATH: pr_text(record, caller, expectations),
        record_name(record): dump_record(record),
    }


def write_kit(files: dict[str, str], upstream: pathlib.Path) -> list[str]:
    """Write ``files``; a record of another run (``run-*.json``) is removed: the kit is one run's."""
    for old in upstream.glob("run-*.json"):
        if old.name not in files:
            old.unlink()
    changed = []
    for rel, text in files.items():
        path = upstream / rel
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            changed.append(rel)
    return changed


def check_kit(files: dict[str, str], upstream: pathlib.Path) -> str | None:
    """One line saying how the committed kit differs from ``files``; None if it does not."""
    problems = []
    for rel, text in files.items():
        path = upstream / rel
        if not path.exists():
            problems.append(f"{rel} missing")
            continue
        old = path.read_text(encoding="utf-8").splitlines()
        new = text.splitlines()
        diff = [d for d in difflib.unified_diff(old, new, lineterm="", n=0)
                if d[:1] in "+-" and not d.startswith(("+++", "---"))]
        if diff:
            added = sum(d.startswith("+") for d in diff)
            first = next(d for d in diff)
            problems.append(f"{rel} differs (+{added} -{len(diff) - added} lines, first {first[:80]!r})")
    extra = sorted(p.name for p in upstream.glob("run-*.json") if p.name not in files)
    problems += [f"{name} is not the kit's record" for name in extra]
    if not problems:
        return None
    return ("upstream kit out of date: " + "; ".join(problems)
            + " (write it: python scripts/upstream_kit.py)")


def recorded_run(upstream: pathlib.Path) -> pathlib.Path:
    runs = sorted(upstream.glob("run-*.json"))
    if len(runs) != 1:
        raise KitError(f"{upstream}: expected one run-*.json record, found {len(runs)}; pass --from-run")
    return runs[0]


def run_tier(keras_path: str, pytest_args: list[str]) -> tuple[dict, str, float, str]:
    """The default tier against ``keras_path``: its report, the command, the wall time and the output."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        args = ["pytest", "-p", "no:cacheprovider", f"--keras-path={keras_path}", "--conformance-json", report,
                *pytest_args]
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        wall = time.monotonic() - start
        sys.stdout.write(proc.stdout[-3000:])
        if not os.path.exists(report):
            raise KitError(f"the run wrote no report (exit {proc.returncode}): {proc.stderr.strip()[-400:]}")
        with open(report, encoding="utf-8") as f:
            return json.load(f), shlex.join(args[:5] + ["report.json", *pytest_args]), wall, proc.stdout


def git_commit(path: str) -> str | None:
    proc = subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    return proc.stdout.strip() if proc.returncode == 0 else None


def suite_commit() -> str | None:
    """This checkout's commit, if its tracked files are that commit's: else the run would not be the
    pinned suite's (None)."""
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=ROOT, check=False)
    return git_commit(str(ROOT)) if dirty.returncode == 0 and not dirty.stdout.strip() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--keras-path", help="run the default tier against this Keras tree and record it")
    source.add_argument("--from-run", type=pathlib.Path,
                        help="a record (upstream/run-*.json) or a --conformance-json report; "
                             "default: upstream/run-*.json")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the kit differs")
    parser.add_argument("--upstream", type=pathlib.Path, default=UPSTREAM, help="the kit's folder (default: upstream/)")
    parser.add_argument("--keras-commit", help="the Keras commit run against (a tree without .git)")
    parser.add_argument("--wall-s", type=float, help="with a report: the run's wall time in seconds")
    parser.add_argument("--command", help="with a report: the command that made it")
    parser.add_argument("--run-log", type=pathlib.Path, help="with a report: the run's terminal output")
    parser.add_argument("--machine", help="what the run ran on (default: this machine's system, CPU and core count)")
    parser.add_argument("--pytest-args", default="", help="with --keras-path: more pytest arguments")
    parser.add_argument("--suite-commit", help="with a report: the suite's commit it was made with "
                                               "(default: this checkout's, if it has no changes)")
    args = parser.parse_args(argv)
    try:
        if args.keras_path:
            report, command, wall, log = run_tier(args.keras_path, shlex.split(args.pytest_args))
            commit = args.keras_commit or git_commit(args.keras_path)
            record = record_from_report(report, commit=commit, command=command, wall_s=wall, log=log,
                                        env=environment(args.machine), suite_commit=suite_commit())
        else:
            path = args.from_run or recorded_run(args.upstream)
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("schema") == REPORT_SCHEMA:
                log = args.run_log.read_text(encoding="utf-8") if args.run_log else ""
                record = record_from_report(data, commit=args.keras_commit, command=args.command,
                                            wall_s=args.wall_s, log=log, env=environment(args.machine),
                                            suite_commit=args.suite_commit or suite_commit())
            else:
                record = load_record(path)
        files = kit_files(record)
    except KitError as exc:
        print(f"upstream_kit: {exc}", file=sys.stderr)
        return 2
    if args.check:
        problem = check_kit(files, args.upstream)
        print(problem or f"upstream kit up to date ({len(files)} files)")
        return 1 if problem else 0
    changed = write_kit(files, args.upstream)
    print(f"upstream kit: {len(changed)} of {len(files)} files written ({', '.join(changed) or 'none changed'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
