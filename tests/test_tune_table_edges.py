"""The tuned table's edges (spark_bench/tune/store.py, report.py, cli.py): the device's file name and identity, where a
forced merge says an entry was measured, the entries `tuned show` refuses rather than crash on, what its columns say,
and `tune`'s and `run --tuned`'s one-line checks and warnings. Found by a mutation audit of the tuner."""

import json

import pytest
from conftest import run_cli
from test_tune import DEVICE, FAST, SLOW, _no_plan, _plan, _records, _store
from test_tune_store import _entry

from spark_bench.tune.store import device_identity, slug


def test_the_tables_file_name_and_identity_are_the_documented_ones():
    """'nvidia-h200-sm90-132sm-<id>' (docs/tune.md); the memory size is part of the identity, not of the name."""
    ident_id = device_identity(DEVICE)[1]
    assert slug(DEVICE) == f"nvidia-test-sm90-8sm-{ident_id}"
    assert device_identity({**DEVICE, "memory_bytes": 2})[1] != ident_id


def test_a_forced_merge_keeps_where_an_entry_was_first_measured():
    """X's entry merged (--force) into Y's table, then Y's into Z's: it was measured on X, not on Y."""
    x = _store([("test._k", {"n": 1}, {"B": 8}, "t1")], device={**DEVICE, "name": "NVIDIA X"})
    y = _store([], device={**DEVICE, "name": "NVIDIA Y"})
    z = _store([], device={**DEVICE, "name": "NVIDIA Z"})
    y.merge(x, force=True)
    z.merge(y, force=True)
    assert z.foreign_entries() == {"NVIDIA X (sm 9.0)": 1}


@pytest.mark.parametrize("entry, needle", [
    (_entry(config={"B": True}), "\"config\" parameter 'B' must be an integer, not true"),
    (_entry(drift={"max": "big", "cases": 1}), '"drift" must be null or an object with a numeric "max"'),
    (_entry(drift={"max": 0.1, "cases": "2"}), '"drift" must be null or an object with a numeric "max"'),
    (_entry(noise="wide"), '"noise" must be null or a finite number'),  # was a traceback in `tuned show`
    (_entry(noise=-0.05), '"noise" must be null or a finite number >= 0'),  # a margin, printed as "±-5%"
    (_entry(speedup=0), '"speedup" must be a finite number > 0'),
    (_entry(time_us=-1.0), '"time_us" must be a finite number > 0'),
])
def test_tuned_show_refuses_an_entry_it_could_not_use_or_print(tmp_path, entry, needle):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({**_store([]).data, "kernels": {"k": [entry]}}))
    code, _, err = run_cli("tuned", "show", path)
    assert code == 2 and err.strip().count("\n") == 0 and f"kernel 'k' entry 0: {needle}" in err, err


def _cells(**fields):
    """The `tuned show` table's cells for one entry with these fields: column header -> text."""
    from spark_bench.tune.report import entries_table

    table = entries_table([("test._k", _entry(**fields))])
    return {column.header: next(iter(column.cells)) for column in table.columns}


def test_tuned_show_columns_say_what_the_entry_holds():
    default = {"config": {"B": 2}, "time_us": 2.0}
    cells = _cells(config={"B": 2}, default=default, speedup=1.0, noise=None, cases=2, untimed=1,
                   drift={"max": 0.012, "cases": 2}, runner_up={"config": {"B": 8}, "time_us": 1.9},
                   within_noise={"id": "B=8", "speedup": 1.05, "noise": None})
    assert cells["config"] == "(default)" and cells["noise ±"] == "-"  # the default stayed: said so, not as an id
    assert cells["drift"] == "+1.2% (2)" and cells["cases"] == "2 (1 untimed)"
    assert cells["runner-up"] == "B=8 1.9 (1.050x, within an unknown noise)"
    assert _cells(within_noise={"id": "B=8", "speedup": 1.05, "noise": 0.07},
                  runner_up={"config": {"B": 8}, "time_us": 1.9})["runner-up"].endswith("within the ±7.0% noise)")


def test_the_tune_summary_counts_every_failed_case(capsys, tmp_path):
    from spark_bench.tune.report import print_table
    from spark_bench.tune.space import config_id

    plan = _plan([FAST, SLOW])
    times = [{"default": ("ok", 10.0), config_id(FAST): ("mismatch", None), config_id(SLOW): ("crash", None)}]
    store = type("Store", (), {"path": tmp_path / "tune-1", "read_results": lambda self: _records(plan, times)})()
    print_table(type("Session", (), {"store": store, "tune": {"plan": {**plan, "capture_errors": []},
                                                               "target_note": "no pruning"}})(), None)
    assert "3 cases timed or tried (2 failed: never chosen)" in " ".join(capsys.readouterr().out.split())


def test_an_unknown_target_is_one_line_before_any_planning(tmp_path, monkeypatch):
    _no_plan(monkeypatch, None)
    code, _, err = run_cli("tune", "--op", "kda.gate", "--device", "cpu", "--target", "sm_75", "--run-dir",
                           tmp_path / "tune", "--out", tmp_path / "t.json")
    assert code == 2 and err.strip().count("\n") == 0 and "unknown --target 'sm_75'" in err, err
    assert not (tmp_path / "tune").exists()


def test_run_tuned_warns_of_stale_entries(tmp_path, monkeypatch):
    from spark_bench.tune import ConfigSpace
    from spark_bench.tune.cli import load_tuned
    from spark_bench.tune.space import SPACES

    space = ConfigSpace("edge._stale", key=("n",), default={"B": 16}, candidates=[{"B": 64}])
    monkeypatch.setitem(SPACES, space.kernel, space)
    _store([("edge._stale", {"n": 1}, {"B": 128}, "t")]).save(tmp_path / "t.json", "now")
    warned = []
    assert load_tuned(str(tmp_path / "t.json"), "cpu", tmp_path, warned.append) is not None
    assert any("edge._stale: 1 tuned entry with a config the kernel no longer declares" in w for w in warned), warned
