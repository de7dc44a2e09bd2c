"""tools/mutate.py, the planted-bug harness: its list parses, patterns apply or are reported
stale, pytest's exit status maps to a verdict, and the scratch copy follows the tree without
touching it. Pure: no mutation is run here (that is ``python tools/mutate.py``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
)
import mutate  # noqa: E402


def _mutation(**kw):
    base = dict(
        id="m", file="a.py", pattern="x = 1", replacement="x = 2", tests=("t",), why="because"
    )
    return mutate.Mutation(**{**base, **kw})


def test_the_project_list_is_well_formed():
    mutations = mutate.load_mutations(mutate.DEFAULT_LIST)
    assert len(mutations) >= 30
    for m in mutations:
        assert m.tests and all(t.startswith("tests/") for t in m.tests), m.id
        assert not os.path.isabs(m.file), m.id
    native = [m for m in mutations if m.native]  # the C++ sources and the build's flags
    assert native and all(m.file.startswith("csrc/") or m.file == "CMakeLists.txt" for m in native)


def test_apply_replaces_exactly_count_occurrences_or_reports_the_pattern_stale():
    assert _mutation().apply("a\nx = 1\n") == "a\nx = 2\n"
    with pytest.raises(mutate.PatternNotFound, match="pattern not found in a.py"):
        _mutation().apply("x = 3\n")
    with pytest.raises(mutate.PatternNotFound, match="found 2 times in a.py, expected 1"):
        _mutation().apply("x = 1\nx = 1\n")
    assert _mutation(count=2).apply("x = 1\nx = 1\n") == "x = 2\nx = 2\n"


def test_malformed_lists_are_refused(tmp_path):
    path = tmp_path / "list.toml"
    entry = 'id = "a"\nfile = "f.py"\npattern = "p"\nreplacement = "q"\ntests = ["t"]\n'
    path.write_text(f'[[mutation]]\n{entry}why = "w"\n[[mutation]]\n{entry}why = "w"\n')
    with pytest.raises(mutate.ListError, match="duplicate id 'a'"):
        mutate.load_mutations(str(path))
    path.write_text(f"[[mutation]]\n{entry}")
    with pytest.raises(mutate.ListError, match=r"missing \['why'\]"):
        mutate.load_mutations(str(path))
    path.write_text(f'[[mutation]]\n{entry}why = "w"\nfiles = "typo"\n')
    with pytest.raises(mutate.ListError, match=r"unknown fields \['files'\]"):
        mutate.load_mutations(str(path))


def test_pytest_exit_status_is_a_verdict_only_for_pass_and_fail():
    assert mutate.classify(1) == "caught"
    assert mutate.classify(0) == "MISSED"
    for code in (2, 3, 4, 5, -9):  # interrupted, internal error, usage (a bad id), no tests
        assert mutate.classify(code) == "error"
    out = "....\nFAILED tests/test_a.py::test_b[2] - AssertionError\nERROR tests/x.py\n"
    assert mutate.first_failure(out) == "tests/test_a.py::test_b[2]"


def test_native_mutations_are_run_last_grouped_by_file():
    ms = [
        _mutation(id="c1", file="csrc/b.cc"),
        _mutation(id="p1"),
        _mutation(id="c2", file="csrc/a.h"),
        _mutation(id="p2", file="z.py"),
    ]
    assert [m.id for m in mutate.ordered(ms)] == ["p1", "p2", "c2", "c1"]


def test_scratch_copy_follows_the_tree_and_restores_every_mutation(tmp_path):
    src, work = tmp_path / "src", tmp_path / "work"
    src.mkdir()
    subprocess.run(["git", "init", "-q", str(src)], check=True)
    (src / "a.py").write_text("x = 1\n")
    (src / ".gitignore").write_text("ignored/\n")
    (src / "ignored").mkdir()
    (src / "ignored" / "big.bin").write_text("not copied")
    scratch = mutate.Scratch(str(work), log=lambda line: None)
    mutate.sync_tree(str(src), scratch.tree)
    assert (work / "tree" / "a.py").read_text() == "x = 1\n"
    assert not (work / "tree" / "ignored").exists()
    scratch.apply(_mutation())
    assert (work / "tree" / "a.py").read_text() == "x = 2\n"
    assert (src / "a.py").read_text() == "x = 1\n"  # the working tree is never touched
    scratch.restore()
    assert (work / "tree" / "a.py").read_text() == "x = 1\n"
    (src / "a.py").unlink()
    (src / "b.py").write_text("y = 1\n")
    mutate.sync_tree(str(src), scratch.tree)
    assert sorted(os.listdir(work / "tree")) == [".gitignore", "b.py"]
