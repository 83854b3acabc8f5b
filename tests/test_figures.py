"""The cell counts README and the docs quote are what the suite collects: a cell added or removed
fails this until the figures are said again (docs/matrix.md's tier table, the mesh and skipped
counts, and the default build's recorded run that README quotes from).

Two collections (the default tier and ``--full``, about 20 s each for the build probe), no cell run.
"""

from __future__ import annotations

import collections
import pathlib
import re

import pytest

from tests.slice_dump import collected
from tests.test_readme import rows_below

ROOT = pathlib.Path(__file__).resolve().parents[1]
MATRIX = ROOT / "docs" / "matrix.md"
README = ROOT / "README.md"
MEASUREMENTS = ROOT / "docs" / "measurements.md"
#: The family ``slice_dump`` gives a cell marked to skip: at --nproc 2, the 2x2 mesh's.
SKIPPED = "skipped"
#: The data source whose package README's set-up does not install (a cell of its then skips when it runs):
#: tf.data's TensorFlow; grain comes with the hub extra.
OPTIONAL_SOURCES = re.compile(r"[\[-]tfdata[-\]]")


def number(text: str) -> int:
    return int(text.replace(",", ""))


@pytest.fixture(scope="module")
def tiers(tmp_path_factory) -> dict[str, list[list[str]]]:
    tmp = tmp_path_factory.mktemp("figures")
    return {"default": collected(tmp, "conformance"), "full": collected(tmp, "--full", "conformance")}


def tier_table() -> list[list[str]]:
    """docs/matrix.md's tier table: family, test functions, default tier, --full."""
    lines = MATRIX.read_text(encoding="utf-8").splitlines()
    return rows_below(lines, lines.index("| family | test functions | default tier | `--full` |"))


def test_the_tier_table_counts_what_each_tier_collects(tiers):
    by_function = {tier: collections.Counter(nodeid.split("::")[-1].split("[")[0] for nodeid, _ in cells)
                   for tier, cells in tiers.items()}
    rows = tier_table()
    families = [row for row in rows if row[1]]
    for family, functions, default, full in families:
        names = re.findall(r"`(\w+)`", functions)
        assert names, family
        for tier, quoted in (("default", default), ("full", full)):
            assert number(quoted) == sum(by_function[tier][n] for n in names), f"{family}, {tier}: {functions}"
    listed = {n for _, functions, _, _ in families for n in re.findall(r"`(\w+)`", functions)}
    assert listed == set(by_function["full"]), "every test function of the suite has its row"
    total = next(row for row in rows if row[0] == "**all**")
    assert [number(total[2].strip("*")), number(total[3].strip("*"))] == [len(tiers["default"]), len(tiers["full"])]
    mesh = next(row for row in rows if "2x2 mesh" in row[0])
    skipped = [sum(family == SKIPPED for _, family in tiers[t]) for t in ("default", "full")]
    assert [number(mesh[2]), number(mesh[3])] == skipped


def test_the_skipped_cells_matrix_md_names_are_the_collected_ones(tiers):
    """"With 2 processes the default tier skips 38 cells: the 34 on the 2x2 mesh, the 3 tf.data cells ...,
    and BatchNormalization under DataParallel ...; ... judges the other 945." The BatchNormalization cell
    skips when judged (its numbers are not comparable): one, as the sentence says."""
    text = " ".join(MATRIX.read_text(encoding="utf-8").split())
    said = re.search(r"default tier skips (\d+) cells: the (\d+) on the 2x2 mesh, the (\d+) tf\.data cells "
                     r".*?judges the other ([\d,]+)\.", text)
    assert said, "docs/matrix.md no longer says which cells the default tier skips"
    skips, mesh, optional, judged = map(number, said.groups())
    cells = tiers["default"]
    assert mesh == sum(family == SKIPPED for _, family in cells)
    assert optional == sum(bool(OPTIONAL_SOURCES.search(nodeid)) for nodeid, _ in cells)
    assert skips == mesh + optional + 1 and judged == len(cells) - skips


def test_readme_quotes_the_mesh_and_the_recorded_run(tiers):
    """README's mesh leg names the default tier's mesh cells; its promise line is the recorded run's
    (docs/measurements.md, "Results against the default build"), which ran every collected cell."""
    readme = " ".join(README.read_text(encoding="utf-8").split())
    mesh = re.search(r"the (\d+) cells on the 2x2 mesh", readme)
    assert mesh and number(mesh.group(1)) == sum(family == SKIPPED for _, family in tiers["default"])
    section = MEASUREMENTS.read_text(encoding="utf-8").split("\n## Results against the default build\n", 1)[1]
    section = section.split("\n## ", 1)[0]
    recorded = re.search(r"\*\*([\d,]+) cells at \w+:", section)
    assert recorded and number(recorded.group(1)) == len(tiers["default"]), \
        "the default tier changed since its run was recorded: record it again (docs/measurements.md)"
    quoted = re.search(r"`KEPT communication-budget +(.+?)` \(the default build", readme)
    assert quoted and re.search(r"KEPT +communication-budget +" + re.escape(quoted.group(1)), section)
