"""A report format is one ``report/formats.FORMATS`` entry: the session writes it under its option and
the merge of slices under its flag, both through ``formats.write``."""

from __future__ import annotations

import json

from keras_dtensor_conformance import options
from keras_dtensor_conformance.report import formats, merge

from tests.test_merge import sliced


def test_every_format_has_the_sessions_option():
    dests = {o.dest for o in options.OPTIONS}
    assert [fmt.option for fmt in formats.FORMATS if fmt.option not in dests] == []


def test_a_new_format_is_written_by_the_merge_from_its_entry_alone(tmp_path, monkeypatch):
    shout = formats.Format("shout", "conformance_shout", "write it loudly", lambda r: json.dumps(r["summary"]).upper())
    monkeypatch.setattr(formats, "FORMATS", (*formats.FORMATS, shout))
    slices = []
    for name, report in sliced(tmp_path):
        (tmp_path / name).write_text(json.dumps(report))
        slices.append(str(tmp_path / name))
    out = tmp_path / "merged.txt"
    merge.main([*slices, "--shout", str(out), "--json", str(tmp_path / "merged.json")])
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert out.read_text() == json.dumps(merged["summary"]).upper()


def test_the_merges_flags_are_the_formats(capsys):
    try:
        merge.main(["--help"])
    except SystemExit as exit_:
        assert exit_.code == 0
    said = capsys.readouterr().out
    assert all(f"--{fmt.name}" in said for fmt in formats.FORMATS)
