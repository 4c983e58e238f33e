"""Which weights a case ran on, per case (known-issues, Weights): each result record of a run with --weights or
--routing carries a compact `weights` label (the file and layer, what was dequantized or defaulted), its console
line shows it, and the run-file schema takes it; records of synthetic cases and older run files have none."""

import json

import numpy as np
import pytest
from conftest import run_cli
from weight_files import gguf_file, kimi_checkpoint, routing_npy

from spark_bench import results
from spark_bench.console import console, results_table


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return gguf_file(tmp_path_factory.mktemp("label") / "deepseek.gguf")


def _records(run):
    return [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines()]


def test_records_and_console_lines_name_the_weights(gguf, tmp_path):
    code, out, err = run_cli("run", "--weights", gguf, "--layer", 1, "--op", "moe.router", "--op", "moe.align",
                             "--backend", "torch", "--set", "tokens=3", "--set", "routing=uniform", "--out",
                             tmp_path / "run", "--no-report", "--executor", "inprocess")
    assert code == 0, out + err
    labels = {r["op"]: r.get("weights") for r in _records(tmp_path / "run")}
    assert labels == {"moe.router": "deepseek.gguf L1, routed scaling 2.5 (file)", "moe.align": "deepseek.gguf L1"}
    case_lines = [line for line in out.splitlines() if line.startswith("[")]
    assert case_lines and all("· weights deepseek.gguf L1" in line for line in case_lines), out
    assert "moe.router " in out and "weights deepseek.gguf L1, routed scaling 2.5 (file)" in " ".join(out.split())
    results.load_run(tmp_path / "run")  # the schema takes the field


def test_a_checkpoint_is_named_by_its_folder_and_a_trace_by_its_file(tmp_path):
    index = kimi_checkpoint(tmp_path / "Kimi-Tiny", layers=1)
    trace = routing_npy(tmp_path / "ids.npy", np.array([[e % 8, (e + 3) % 8] for e in range(9)]))
    code, out, err = run_cli("run", "--weights", index, "--routing", trace, "--op", "moe.experts", "--op",
                             "kda.gate", "--backend", "torch", "--set", "tokens=3", "--out", tmp_path / "run",
                             "--no-report", "--executor", "inprocess")
    assert code == 0, out + err
    labels = {r["op"]: r.get("weights") for r in _records(tmp_path / "run")}
    assert labels["kda.gate"] == "Kimi-Tiny L0"
    assert labels["moe.experts"] == "Kimi-Tiny L0, routing ids.npy, routed scaling 2.5 (file)"


def test_synthetic_cases_have_no_label(tmp_path):
    trace = routing_npy(tmp_path / "ids.npy", np.array([[0, 1], [2, 3]]))
    code, out, err = run_cli("run", "--routing", trace, "--op", "moe.experts", "--op", "moe.router", "--backend",
                             "torch", "--set", "tokens=2", "--set", "experts=8", "--out",
                             tmp_path / "run", "--no-report", "--executor", "inprocess")
    assert code == 0, out + err
    labels = {r["op"]: r.get("weights") for r in _records(tmp_path / "run")}
    assert labels == {"moe.experts": "routing ids.npy, routed scaling 2.5 (ops' default)", "moe.router": None}
    code, out, err = run_cli("run", "--op", "moe.router", "--backend", "torch", "--set", "tokens=2", "--out",
                             tmp_path / "plain", "--no-report", "--executor", "inprocess")
    assert code == 0 and all("weights" not in r for r in _records(tmp_path / "plain")) and "· weights" not in out


def test_old_records_load_and_a_bad_label_is_refused(tmp_path):
    store = results.RunStore(tmp_path / "run")
    store.create({"run_id": "r", "fingerprint": {}})
    base = {"case_id": "c", "op": "moe.router", "backend": "torch", "params": {"tokens": 1}, "dtype": "bf16",
            "device": "cpu", "status": "ok"}
    store.append(base)  # a record written before the field existed
    assert results.load_run(tmp_path / "run")[1][0].get("weights") is None
    assert results.record_problem({**base, "weights": "x.gguf L1"}) is None
    assert "field 'weights' must be a string or null" in results.record_problem({**base, "weights": 3})


def test_the_results_table_names_the_weights():
    rows = [{"case_id": str(i), "op": "moe.router", "backend": b, "params": {"tokens": 1}, "dtype": "bf16",
             "status": "ok", "timing": {"median": 1.0 + i}, "weights": w}
            for i, (b, w) in enumerate([("torch", "a.gguf L1"), ("host", "a.gguf L1")])]
    out = console()
    with out.capture() as cap:
        out.print(results_table(rows))
    assert "weights a.gguf L1" in cap.get()
    rows[1]["weights"] = "b.gguf L1"
    with out.capture() as cap:
        out.print(results_table(rows))
    text = cap.get()
    assert "a.gguf L1" in text and "b.gguf L1" in text and "· weights" not in text
