"""What history learns from the git repository at hand (spark_bench/history/gitinfo.py), found by mutation testing:
one unknown commit costs no other commit its time, a detached HEAD names no branch, suspects are good..bad in that
order and None (not []) when the repository cannot tell, and a timestamp without a zone is UTC wherever it is read."""

from __future__ import annotations

import subprocess
import time

import pytest

from spark_bench.history import gitinfo, synthetic

UNKNOWN = "f" * 40


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """A work tree of three commits a day apart: (path, their shas in order)."""
    path = tmp_path_factory.mktemp("git") / "repo"
    return path, synthetic.git_repo(path, 3)


def test_an_unknown_commit_costs_the_known_ones_nothing(repo):
    path, shas = repo
    times = gitinfo.commit_times(path, [shas[0], UNKNOWN, shas[2][:10]])
    assert set(times) == {shas[0], shas[2][:10]}  # keyed as given, abbreviated or full
    assert times[shas[0]] < times[shas[2][:10]] and times[shas[0]].endswith("+00:00")


def test_two_spellings_of_one_commit_take_no_other_commit_s_time(repo):
    """`git show` prints a commit named twice once: the times must not shift onto the next commit's name."""
    path, shas = repo
    times = gitinfo.commit_times(path, [shas[0][:10], shas[0], shas[1]])
    first, second = gitinfo.commit_time_of(path, shas[0]), gitinfo.commit_time_of(path, shas[1])
    assert times == {shas[0][:10]: first, shas[0]: first, shas[1]: second} and first < second


def test_the_branch_is_named_for_ancestors_of_head_only_and_never_as_head(repo, tmp_path):
    path, shas = repo
    assert gitinfo.branch_of(path, [shas[1][:8], UNKNOWN]) == {shas[1][:8]: "main"}
    detached = tmp_path / "detached"
    subprocess.run(["git", "clone", "-q", str(path), str(detached)], check=True)
    subprocess.run(["git", "-C", str(detached), "checkout", "-q", "--detach"], check=True)
    assert gitinfo.branch_of(detached, [shas[1]]) == {}  # 'HEAD' is no branch


def test_suspects_are_the_commits_after_the_last_good_up_to_the_first_bad(repo):
    path, shas = repo
    assert gitinfo.log_range(path, shas[0], shas[2]) == [f"{shas[2][:7]} dev: change 2", f"{shas[1][:7]} dev: change 1"]
    assert gitinfo.log_range(path, shas[2], shas[2]) == []  # nothing between: no suspect
    assert gitinfo.log_range(path, UNKNOWN, shas[2]) is None  # the repository cannot tell, which is not 'none'
    assert gitinfo.log_range(None, shas[0], shas[2]) is None


@pytest.fixture
def new_york(monkeypatch):
    """This process's local time zone is New York's for the test (restored after it)."""
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_a_timestamp_without_a_zone_is_utc_whatever_the_local_zone(new_york):
    assert gitinfo.utc("2026-01-05T10:00:00") == "2026-01-05T10:00:00+00:00"
    assert gitinfo.utc("2026-01-05T10:00:00Z") == "2026-01-05T10:00:00+00:00"
    assert gitinfo.utc("2026-01-05T10:00:00-05:00") == "2026-01-05T15:00:00+00:00"
    assert gitinfo.utc("yesterday") is None and gitinfo.utc(None) is None
