"""The suite's slices (tests/support/shards.py): together they run every module exactly once."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

import pytest

from tests.support.shards import deal, merge, parse_shard, recorded_durations


def test_every_module_lands_in_exactly_one_slice_and_the_slices_balance():
    durations = {"a": 100.0, "b": 60.0, "c": 50.0, "d": 10.0}
    modules = ["a", "b", "c", "d", "new"]
    slices = deal(modules, 2, durations)
    assert sorted(m for part in slices for m in part) == sorted(modules)
    loads = [sum(durations.get(m, 55.0) for m in part) for part in slices]  # "new": the median
    assert max(loads) - min(loads) <= max(durations.values())
    assert deal(modules, 1, durations) == [sorted(modules, key=lambda m: -durations.get(m, 55))]


@pytest.mark.parametrize("value", ["0/2", "3/2", "x", "1/2/3", ""])
def test_a_bad_shard_is_a_usage_error(value):
    with pytest.raises(pytest.UsageError):
        parse_shard(value)


def test_durations_of_the_slices_are_merged(tmp_path):
    first, second = tmp_path / "1.json", tmp_path / "2.json"
    first.write_text('{"tests/test_a.py": 13.0}')
    second.write_text('{"tests/test_b.py": 3.0}')
    into = tmp_path / "durations.json"
    assert merge([first, second], into) == {"tests/test_a.py": 13.0, "tests/test_b.py": 3.0}
    assert recorded_durations(into) == {"tests/test_a.py": 13.0, "tests/test_b.py": 3.0}


def test_a_slice_writes_how_long_its_modules_took(tmp_path):
    out = tmp_path / "slice.json"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "tests/test_shards.py", "-k", "bad_shard"],
        env={**os.environ, "TEST_DURATIONS_OUT": str(out)}, check=True, capture_output=True,
    )  # fmt: skip
    assert list(recorded_durations(out)) == ["tests/test_shards.py"]


def test_the_two_slices_collect_the_whole_suite():
    def collected(*args: str) -> set[str]:
        output = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", *args],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        # Some parameters are drawn at random when collected: compare without them.
        return Counter(line.split("[", 1)[0] for line in output.splitlines() if "::" in line)

    # A few modules stand for the suite: collecting all of it three times costs a minute.
    some = ["tests/test_shards.py", "tests/test_identifiers.py", "tests/test_stanzas.py"]
    whole = collected(*some)
    first, second = collected(*some, "--shard", "1/2"), collected(*some, "--shard", "2/2")
    modules = [{test.split("::", 1)[0] for test in part} for part in (first, second)]
    assert modules[0] and modules[1] and not modules[0] & modules[1]
    assert first + second == whole


def test_the_parallel_summary_names_every_failed_test_and_fails(tmp_path):
    """CI keeps only the end of the output: the summary must name what failed."""
    script = (
        "echo 'FAILED tests/test_x.py::test_y - AssertionError: boom'; "
        "echo 'ERROR tests/test_z.py::test_w - OSError'; exit 1"
    )
    jobs = ["--job", "bad", script, "--job", "good", "true"]
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.parallel", *jobs],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.getcwd()}, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 1
    summary = done.stdout.split("== summary ==", 1)[1]
    assert "bad: FAILED tests/test_x.py::test_y - AssertionError: boom" in summary
    assert "bad: ERROR tests/test_z.py::test_w - OSError" in summary
    assert "good: ok" in summary
    assert (tmp_path / "var/test-logs/bad.log").read_text().count("FAILED") == 1


def test_the_summary_shows_the_end_of_a_failed_tests_traceback(tmp_path):
    """pytest's own tracebacks scroll away among three jobs' output: tests/support/traces.py
    prints each failed test's last lines, and the summary (what CI keeps) carries them."""
    failing = tmp_path / "test_failing.py"
    failing.write_text("def test_once():\n    assert False, 'it fails: ' + 'why' * 2\n")
    command = (
        f"{sys.executable} -m pytest -q -p no:cacheprovider -p tests.support.traces "
        f"--rootdir {tmp_path} {failing}"
    )
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.parallel", "--job", "failing", command],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.getcwd()}, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout[-2000:]
    summary = done.stdout.split("== summary ==", 1)[1]
    trace = "failing: TRACE test_failing.py::test_once | E       AssertionError: it fails"
    assert f"{trace}: whywhy" in summary
    assert "failing: FAILED test_failing.py::test_once" in summary
