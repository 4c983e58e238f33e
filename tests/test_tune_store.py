"""The tuned-config table: its round trip and merge, the one-line errors of a malformed table, `tuned show` and
`merge`, and the report's section on the tuned configs a run used."""

import json

import pytest
from conftest import run_cli
from test_tune import DEVICE, _store

from spark_bench.tune.store import StoreError, TunedStore


def _config(table, kernel, key):
    """The config of the entry nearest to `key`."""
    return table.nearest(kernel, key)[0]["config"]


def test_store_round_trip_merge_and_device_check(tmp_path):
    a = _store([("test._k", {"n": 1}, {"B": 8}, "2026-01-01"), ("test._k", {"n": 2}, {"B": 8}, "2026-01-01")])
    b = _store([("test._k", {"n": 2}, {"B": 16}, "2026-02-01"), ("other._k", {"n": 1}, {"B": 4}, "2026-02-01")])
    a.save(tmp_path / "a.json", "now")
    loaded = TunedStore.load(tmp_path / "a.json")
    assert _config(loaded, "test._k", {"n": 2}) == {"B": 8}
    assert loaded.merge(b) == 2
    assert _config(loaded, "test._k", {"n": 2}) == {"B": 16} and _config(loaded, "other._k", {"n": 1}) == {"B": 4}
    assert loaded.merge(a) == 0  # older measurements do not replace newer ones
    other = _store([], device={**DEVICE, "name": "NVIDIA Other"})
    with pytest.raises(StoreError, match="measured on NVIDIA Other"):
        loaded.merge(other)


@pytest.mark.parametrize("text, needle", [
    ("{", "not valid JSON"),
    ("[]", "not a spark-bench tuned-config table"),
    ('{"schema": "spark-bench.tuned", "schema_version": 7}', "schema version 7"),
    ('{"schema": "spark-bench.tuned", "schema_version": 1, "device": {}, "device_id": "x", "kernels": []}',
     '"kernels" must be an object'),
    ('{"schema": "spark-bench.tuned", "schema_version": 1, "device": {}, "device_id": "x", "kernels": {"k": '
     '[{"key": {}, "config": {"B": "big"}, "time_us": 1}]}}', "parameter 'B' must be an integer"),
    ('{"schema": "spark-bench.tuned", "schema_version": 1, "device": {}, "device_id": "x", "kernels": {"k": '
     '[{"key": {}, "config": {"B": 1}, "time_us": null}]}}', '"time_us" must be a finite number'),
])
def test_a_malformed_store_is_one_line_naming_the_problem(tmp_path, text, needle):
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.raises(StoreError) as err:
        TunedStore.load(path)
    assert needle in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value)


def test_run_with_a_malformed_store_exits_2_with_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "spark-bench.tuned", "schema_version": 1}))
    code, _, err = run_cli("run", "--op", "kda.gate", "--tuned", bad, "--out", tmp_path / "r")
    assert code == 2 and err.strip().count("\n") == 0 and "missing its \"device\"" in err
    assert not (tmp_path / "r").exists()


def test_the_report_names_each_tuned_config_an_op_ran(tmp_path):
    from spark_bench.report.html import _table, esc
    from spark_bench.report.model import RunData
    from spark_bench.report.tuned import tuned_section

    table = _store([("test._k", {"n": 1}, {"B": 64, "num_warps": 8}, "2026-12-01")])
    run = {"spec": {"tuned": {"path": "t.json", "data": table.data}}}
    recs = [{"op": "x.op", "config": {"test._k": {"B": 64, "num_warps": 8}}, "config_source": {"test._k": "tuned"}},
            {"op": "x.op", "config": {"test._k": {"B": 16, "num_warps": 4}}, "config_source": {"test._k": "default"}}]
    html = tuned_section([RunData(tmp_path, run, recs, label="r1")], _table, esc)
    assert "B=64,num_warps=8" in html and "1 of 2" in html and "2.000x" in html and "NVIDIA Test" in html
    assert "tuned µs (geomean)" in html and "not this run" in html and "medians" in html
    entry = table.data["kernels"]["test._k"][0]
    entry.update(cases=7, labels=["interpreted"])  # how the tune timed it: said beside its times
    html = tuned_section([RunData(tmp_path, run, recs, label="r1")], _table, esc)
    assert '<td class="num">7</td>' in html and "<td>interpreted</td>" in html
    recs.append({"op": "x.op", "config": {"test._k": {"B": 64, "num_warps": 8}},
                 "config_source": {"test._k": "tuned-nearest"}})  # at a key the tune never timed
    html = tuned_section([RunData(tmp_path, run, recs, label="r1")], _table, esc)
    assert "2 of 3 (1 at a key never tuned: the nearest one&#x27;s)" in html
    assert tuned_section([RunData(tmp_path, {"spec": {}}, recs, label="r1")], _table, esc) == ""
    # two keys tuned to one config: the section names the entry the case took (its tuned_key), not both
    two = _store([("test._k", {"n": 1}, {"B": 64, "num_warps": 8}, "2026-12-01"),
                  ("test._k", {"n": 4096}, {"B": 64, "num_warps": 8}, "2026-12-02")])
    run = {"spec": {"tuned": {"path": "t.json", "data": two.data}}}
    took = [{**recs[0], "tuned_key": {"test._k": [{"n": 4096}]}}]
    html = tuned_section([RunData(tmp_path, run, took, label="r1")], _table, esc)
    assert "n=4096" in html and "n=1<" not in html and "2026-12-02" in html and "2026-12-01" not in html
    html = tuned_section([RunData(tmp_path, run, recs[:1], label="r1")], _table, esc)  # a result without tuned_key
    assert "n=4096" in html and "n=1<" in html


def test_tuned_show_and_merge(tmp_path):
    _store([("test._k", {"n": 1}, {"B": 8}, "2026-01-01")]).save(tmp_path / "a.json", "now")
    _store([("test._k", {"n": 2}, {"B": 16}, "2026-02-01")]).save(tmp_path / "b.json", "now")
    code, out, _ = run_cli("tuned", "merge", tmp_path / "a.json", tmp_path / "b.json", "--out", tmp_path / "m.json")
    assert code == 0 and "2 entries from 2 table(s)" in out
    table = TunedStore.load(tmp_path / "m.json")
    assert _config(table, "test._k", {"n": 1}) == {"B": 8} and _config(table, "test._k", {"n": 2}) == {"B": 16}
    code, out, _ = run_cli("tuned", "show", tmp_path / "m.json")
    assert code == 0 and "test._k" in out and "B=16" in out
    _store([], device={**DEVICE, "name": "NVIDIA Other"}).save(tmp_path / "c.json", "now")
    code, _, err = run_cli("tuned", "merge", tmp_path / "a.json", tmp_path / "c.json", "--out", tmp_path / "x.json")
    assert code == 2 and "measured on NVIDIA Other" in err
    _store([("test._k", {"n": 4}, {"B": 32}, "2026-03-01")], device={**DEVICE, "name": "NVIDIA Other"}).save(
        tmp_path / "d.json", "now")
    code, _, err = run_cli("tuned", "merge", tmp_path / "a.json", tmp_path / "d.json", "--out", tmp_path / "f.json",
                           "--force")
    assert code == 0, err
    forced = TunedStore.load(tmp_path / "f.json")  # each entry keeps where it was measured
    ((where, n),) = forced.foreign_entries().items()
    assert n == 1 and where.startswith("NVIDIA Other")
    code, out, _ = run_cli("tuned", "show", tmp_path / "f.json")
    assert code == 0 and "1 entries measured on NVIDIA Other" in out and "(merged with --force)" in out
    from spark_bench.tune.cli import load_tuned

    warned = []
    forced.data["device_id"] = "here"  # used on a third device: both warnings
    forced.save(tmp_path / "f.json", "now")
    load_tuned(str(tmp_path / "f.json"), "cpu", tmp_path, warned.append)
    assert any("1 entries were measured on NVIDIA Other" in w for w in warned), warned
    code, _, err = run_cli("tuned", "merge", tmp_path / "a.json", "--out", tmp_path)  # a directory
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--out" in err and "Traceback" not in err, err


def _entry(**fields):
    entry = {"key": {"n": 1}, "config": {"B": 8}, "time_us": 1.0, "default": {"config": {"B": 2}, "time_us": 2.0},
             "speedup": 2.0, **fields}
    return {k: v for k, v in entry.items() if v is not None}


@pytest.mark.parametrize("entry, needle", [
    (_entry(default=None), '"default" must be an object'),
    (_entry(default={"config": {"B": 2}}), '"default.time_us" must be a finite number'),
    (_entry(speedup=None), '"speedup" must be a finite number'),
    (_entry(speedup="fast"), '"speedup" must be a finite number'),
    (_entry(runner_up={"config": [], "time_us": 1.0}), '"runner_up.config" must be a non-empty object'),
    (_entry(within_noise={"speedup": 1.0}), '"within_noise" must be null or an object'),
    (_entry(labels="gpu"), '"labels" must be a list of strings'),
])
def test_tuned_show_refuses_an_entry_it_could_not_print(tmp_path, entry, needle):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({**_store([]).data, "kernels": {"k": [entry]}}))
    code, _, err = run_cli("tuned", "show", path)
    assert code == 2 and err.strip().count("\n") == 0 and f"kernel 'k' entry 0: {needle}" in err, err


def test_tuned_show_prints_rich_markup_in_names_as_text(tmp_path):
    path = tmp_path / "t.json"
    table = _store([], device={**DEVICE, "name": "NVIDIA [bold]X"})
    table.put("k[/]", _entry(key={"n": "[red]"}, labels=["[/]"]))
    table.save(path, "now")
    code, out, _ = run_cli("tuned", "show", path)
    assert code == 0 and "k[/]" in out and "n=[red]" in out and "NVIDIA [bold]X" in out, out
