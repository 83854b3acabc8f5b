"""README is a user's manual that stays true: short, its options table the option table's, its links alive.

No ranks, no Keras: it reads README.md and ``keras_dtensor_conformance.options.OPTIONS``.
"""

from __future__ import annotations

import pathlib
import re

from keras_dtensor_conformance.options import OPTIONS

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 400
#: The options table's header row: README's one table with these columns.
HEADER = ["flag", "ini", "env", "default", "meaning"]
NONE = ("–", "-", "")  # an empty ini or env cell


def cells(line: str) -> list[str]:
    """A Markdown table row's cells, split on unescaped pipes."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def code(cell: str) -> str | None:
    """The text of a cell's first code span, or None."""
    found = re.search(r"`([^`]+)`", cell)
    return found.group(1) if found else None


def rows_below(lines: list[str], header: int) -> list[list[str]]:
    """The cells of a Markdown table's rows: those below its header (line ``header``) and separator."""
    rows = []
    for line in lines[header + 2:]:
        if not line.lstrip().startswith("|"):
            break
        rows.append(cells(line))
    return rows


def options_table(text: str) -> list[list[str]]:
    """The rows of the table whose header is ``HEADER``, below its separator row."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.lstrip().startswith("|") and cells(line) == HEADER]
    assert len(starts) == 1, f"README needs one options table with the columns {HEADER}, found {len(starts)}"
    return rows_below(lines, starts[0])


def shown(default) -> str | None:
    """How README's default column must spell a default (None: any text, e.g. "the installed Keras")."""
    if default is None:
        return None
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, float):
        return f"{default:g}"
    return str(default)


def test_readme_is_at_most_400_lines():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/"


def test_options_table_lists_every_option_once_with_its_ini_twin_and_env():
    rows = options_table(README.read_text(encoding="utf-8"))
    flags = [(code(row[0]) or row[0]).split()[0] for row in rows]  # `--nproc N` -> --nproc
    duplicates = sorted({f for f in flags if flags.count(f) > 1})
    assert duplicates == [], f"listed more than once: {duplicates}"
    by_flag = {o.flag: o for o in OPTIONS}
    assert sorted(set(by_flag) - set(flags)) == [], "options missing from README's table"
    assert sorted(set(flags) - set(by_flag)) == [], "README's table lists options that do not exist"
    problems = []
    for flag, row in zip(flags, rows):
        o = by_flag[flag]
        assert len(row) == len(HEADER), f"{flag}: {len(row)} cells, expected {len(HEADER)}: {row}"
        _, ini, env, default, _ = row
        want_ini = o.dest if o.ini else None
        if code(ini) != want_ini or (want_ini is None and ini not in NONE):
            problems.append(f"{flag}: ini {ini!r}, expected {want_ini or 'none'}")
        if code(env) != o.env or (o.env is None and env not in NONE):
            problems.append(f"{flag}: env {env!r}, expected {o.env or 'none'}")
        want_default = shown(o.default)
        if want_default is not None and default.strip("`") != want_default:
            problems.append(f"{flag}: default {default!r}, expected {want_default!r}")
    assert problems == []


def test_relative_links_point_to_files_that_exist():
    text = README.read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)
    relative = [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]
    assert relative, "README links to no file of the repository: the parser missed them"
    missing = [t for t in relative if not (README.parent / t.split("#", 1)[0]).exists()]
    assert missing == []


def test_the_promise_table_is_the_suites_promises():
    """One row per promise, in the report's order: its title and what its checks prove (``Promise.scope``)."""
    from conformance.promises import PROMISES

    lines = README.read_text(encoding="utf-8").splitlines()
    rows = rows_below(lines, lines.index("| promise | what its checks prove, and where they cannot |"))
    assert rows == [[f"`{p.name}`", f"{p.title}: {p.scope}"] for p in PROMISES]
    assert all(p.scope for p in PROMISES), "every promise says what its checks prove"


def test_the_layout_table_names_every_script():
    """README's ``scripts/`` row says what each script is for: a script added there is named, or this fails."""
    row = next(line for line in README.read_text(encoding="utf-8").splitlines() if line.startswith("| `expectations/`, `scripts/`"))
    scripts = sorted(p.name for p in (ROOT / "scripts").glob("*.py"))
    assert scripts and [name for name in scripts if f"`{name}`" not in row] == []
