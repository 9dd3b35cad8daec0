"""Benchmark records (`dspark.tools.records`): the schema round trip, the loader's search from a subfolder, the
error that names the paths tried, and the records the book and tests read being present in that schema."""
import json
import re
import subprocess
from pathlib import Path

import pytest

from dspark.tools.records import FIELDS, RECORDS, load_record, split_raw, write_record

ROOT = Path(__file__).resolve().parents[1]


def test_round_trip_from_a_subfolder(tmp_path, monkeypatch):
    (tmp_path / RECORDS).mkdir(parents=True); (tmp_path / "nbs").mkdir()
    monkeypatch.chdir(tmp_path / "nbs")
    p = write_record("x", [{"c": 1, "tok_s": 2.5}], "python x.py", {"repeats": 3}, machine={"gpu": "none"}, commit="abc")
    assert p == (tmp_path / RECORDS / "x.json").resolve()
    rec = load_record("x")
    assert list(rec) == list(FIELDS)
    assert rec["commit"] == "abc" and rec["rows"] == [{"c": 1, "tok_s": 2.5}] and rec["config"] == {"repeats": 3}
    assert rec["date"].endswith("+00:00")


def test_missing_record_names_the_paths_tried(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="tried") as e: load_record("no_such_record_anywhere")
    assert str(tmp_path / RECORDS / "no_such_record_anywhere.json") in str(e.value)


def test_commit_comes_from_the_checkout(tmp_path):
    p = write_record(tmp_path / "y.json", {"a": 1}, None, None, machine={})
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert json.loads(p.read_text())["commit"] == head


def test_a_tree_that_is_not_its_commit_is_flagged(tmp_path, monkeypatch):
    import dspark.tools.records as records
    run = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)
    run("init", "-q"); (tmp_path / "f").write_text("a")
    run("add", "f"); run("-c", "user.email=x@y", "-c", "user.name=x", "commit", "-qm", "c")
    assert records.tree_differs(tmp_path) is False
    (tmp_path / "f").write_text("b")                  # what a device machine's stale .git sees
    assert records.tree_differs(tmp_path) is True
    monkeypatch.setattr(records, "tree_differs", lambda cwd=None: True)
    rec = json.loads(write_record(tmp_path / "z.json", {}, None, None, machine={"gpu": "x"}).read_text())
    assert rec["machine"] == {"gpu": "x", "tree_differs_from_commit": True}
    rec = json.loads(write_record(tmp_path / "w.json", {}, None, None, machine={"gpu": "x"}, commit="a" * 40).read_text())
    assert rec["machine"] == {"gpu": "x"}             # a commit given is the caller's word for what ran


def test_split_raw():
    assert split_raw({"gpu": "H200", "torch": "2.11", "C": 64, "runs": [1]}) == \
        {"rows": [1], "config": {"C": 64}, "machine": {"gpu": "H200", "torch": "2.11"}}
    assert split_raw([1, 2]) == {"rows": [1, 2], "config": None, "machine": None}


def test_every_record_has_the_schema():
    recs = sorted((ROOT / RECORDS).glob("*.json"))
    assert recs
    for p in recs:
        rec = json.loads(p.read_text())
        assert set(FIELDS) <= set(rec), p.name
        assert rec["commit"] and len(rec["commit"]) == 40, p.name


def test_records_the_tests_cite_exist():
    rec = load_record("graphs_gpu")
    assert rec["rows"]["llm_graph_vs_eager_tiny_fp32"]["dspark"]["identical"]


def test_records_the_book_names_exist():
    "Every `benchmarks/records/<name>.json` a notebook or the README names, and every literal `load_record(\"<name>\")`, is there."
    named = set()
    for p in [*sorted((ROOT / "nbs").glob("*.ipynb")), ROOT / "README.md"]:
        t = p.read_text().replace('\\"', '"')
        named |= set(re.findall(r"benchmarks/records/(\w+)\.json", t)) | set(re.findall(r'load_record\("(\w+)"\)', t))
    named -= {"demo", "no_such_record"}   # chapter 35a's own examples, written to and missed in a temporary folder
    assert named
    assert not [n for n in sorted(named) if not (ROOT / RECORDS / f"{n}.json").is_file()]
