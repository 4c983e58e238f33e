"""The run's and `show`'s console tables (spark_bench/console.py)."""

import io

from rich.console import Console

from spark_bench.console import results_table


def _rec(op, backend, params, median, status="ok"):
    timing = {"median": median, "rel_ci": 0.01, "timer": "cuda-event"} if median is not None else None
    return {"op": op, "backend": backend, "params": params, "dtype": "bf16", "status": status, "timing": timing,
            "labels": [], "check": {"err_ratio": 1e-3}}


def _render(records, limit=400):
    buf = io.StringIO()
    Console(file=buf, width=220, force_terminal=False).print(results_table(records, title="run x", limit=limit))
    return buf.getvalue()


def _row(text, *needles):
    rows = [line for line in text.splitlines() if all(n in line for n in needles)]
    assert len(rows) == 1, (needles, rows)
    return [cell.strip() for cell in rows[0].strip("│ ").split("│")]


def test_one_table_per_op_with_its_fixed_axes_in_the_title_and_the_ratio_to_the_fastest():
    records = []
    for tokens, (t_triton, t_torch) in {1: (10.0, 25.0), 64: (40.0, 20.0)}.items():
        params = {"tokens": tokens, "hidden": 2304, "experts": 256}
        records += [_rec("moe.experts", "triton", params, t_triton), _rec("moe.experts", "torch", params, t_torch)]
    records += [_rec("moe.experts", "peer", {"tokens": 64, "hidden": 2304, "experts": 256}, 5.0, "mismatch"),
                _rec("moe.experts", "reference", {"tokens": 64, "hidden": 2304, "experts": 256}, 4.0),
                _rec("moe.experts", "vllm", {"tokens": 1, "hidden": 2304, "experts": 256}, None, "skipped"),
                _rec("kda.gate", "torch", {"tokens": 7, "heads": 4}, 3.0),
                _rec("kda.gate", "torch", {"tokens": 9, "heads": 4}, 6.0)]
    text = _render(records)
    lines = text.splitlines()
    assert lines[0].strip() == "run x"
    title = ["moe.experts", "hidden=2304", "experts=256", "·", "timer", "cuda-event"]
    assert any(line.split() == title for line in lines)  # constant axes, and the timer every row shares
    assert any(line.split() == ["kda.gate", "heads=4", "·", "timer", "cuda-event"] for line in lines)
    assert text.index("kda.gate heads=4") < text.index("moe.experts hidden")  # ops in order, one table each
    # params shows only what varies; x fastest compares the correct backends of one point
    assert _row(text, "triton", "tokens=1")[:6] == ["triton", "tokens=1", "bf16", "ok", "10 ±1%", "1"]
    assert _row(text, "torch", "tokens=1")[5] == "2.5"
    assert _row(text, "triton", "tokens=64")[5] == "2"
    assert _row(text, "torch", "tokens=64")[5] == "1"  # the faster 'peer' failed its check: it does not count,
    assert _row(text, "reference", "tokens=64")[5] == "0.2"  # nor does the fp32 reference
    assert _row(text, "peer", "tokens=64")[5] == "0.25"
    assert "vllm" not in text  # skipped cases belong to the "Not measured" table
    assert _row(text, "torch", "tokens=9")[5] == "1"  # points are compared with themselves, not with each other


def test_an_op_with_one_point_shows_no_params_column_and_the_limit_is_said():
    records = [_rec("x.op", b, {"tokens": 4}, m) for b, m in (("a", 2.0), ("b", None))]
    records[1]["status"] = "error"
    text = _render(records)
    assert "params" not in text and "TFLOP/s" not in text and "labels" not in text  # no column without a value
    assert _row(text, "│ a ")[:4] == ["a", "bf16", "ok", "2 ±1%"] and _row(text, "│ b ")[4] == "-"
    many = [_rec("x.op", "a", {"tokens": t}, 1.0) for t in range(5)]
    assert "2 more cases not shown (see the HTML report)" in _render(many, limit=3)
    swept = [_rec("x.op", "a", {"heads": h, "tokens": t}, 1.0) for h in (4, 8) for t in (1, 2)]
    cut = _render(swept, limit=2)  # the rows shown all have heads=4; the op's other rows do not
    assert "x.op heads=4" not in cut and "heads=4 tokens=1" in cut and "2 more cases not shown" in cut
    assert "x.op heads=4" not in _render(swept) and "x.op tokens=1" in _render(swept[:1] + swept[2:3])


def test_a_timer_every_row_shares_is_said_once_in_the_title_and_labels_stay_per_row():
    records = [_rec("x.op", "torch", {"tokens": 4}, 2.0), _rec("x.op", "triton", {"tokens": 4}, 9.0)]
    records[1]["labels"] = ["interpreted"]
    records[0]["tflops"] = 0.5
    text = _render(records)
    assert "x.op tokens=4 · timer cuda-event" in text.splitlines()[1]
    assert _row(text, "│ triton ")[-1] == "interpreted" and "interpreted" not in _row(text, "│ torch ")
    assert "TFLOP/s" in text and _row(text, "│ triton ")[-4] == "-"
    records[1]["timing"]["timer"] = "cuda-graph"  # two timers: each row says its own
    text = _render(records)
    assert "· timer" not in text and _row(text, "│ triton ")[-1] == "cuda-graph, interpreted"


def test_logs_get_160_columns_whatever_columns_says(monkeypatch):
    from spark_bench.console import console

    monkeypatch.setenv("COLUMNS", "80")  # as pytest-xdist exports to its workers
    assert console().width == 160  # pytest's stdout is not a terminal


def test_a_tune_candidate_is_labelled_with_its_forced_config():
    default = _rec("x.op", "triton", {"tokens": 4}, 2.0)
    forced = {**_rec("x.op", "triton", {"tokens": 4}, 1.0), "config": {"x._k": {"BT": 32, "num_warps": 4}},
              "config_source": {"x._k": "candidate"}}
    default.update(config={"x._k": {"BT": 64, "num_warps": 4}}, config_source={"x._k": "default"})
    text = _render([default, forced])
    assert _row(text, "│ triton[BT=32,num_warps=4] ")[4] == "1" and _row(text, "│ triton ")[4] == "2"


def _progress(expected=None, total=4, monkeypatch=None, elapsed=0.0):
    """A log-mode progress whose clock says `elapsed` seconds have gone by (no wall time in these tests)."""
    from spark_bench import console as console_module
    from spark_bench.console import SweepProgress

    buf = io.StringIO()
    progress = SweepProgress(total, Console(file=buf, width=160, force_terminal=False), expected=expected)
    if monkeypatch is not None:
        monkeypatch.setattr(console_module.time, "monotonic", lambda: progress.started + elapsed)
    return progress, buf


def _case(backend, n):
    from spark_bench.sweep import Case

    return Case("x.op", backend, {"n": n}, "fp32", "cpu", 0)


def _eta(line):
    import re

    return int(re.search(r"eta (\d+)s", line).group(1))


def test_eta_weighs_the_cases_left_by_their_estimates(monkeypatch):
    cases = [_case("torch", 1), _case("torch", 2), _case("triton", 3)]
    expected = {cases[0].case_id: 1.0, cases[1].case_id: 1.0, cases[2].case_id: 100.0}
    progress, buf = _progress(expected, total=3, monkeypatch=monkeypatch, elapsed=2.0)  # a 1-s case took 2 s
    progress.result(cases[0], {"status": "ok", "timing": None})
    # 101 s of estimates left, this run twice as slow as estimated, damped by 10.2 s: 101 * 12.2 / 11.2
    assert _eta(buf.getvalue()) == 110
    unweighted, buf = _progress(None, total=3, monkeypatch=monkeypatch, elapsed=2.0)
    unweighted.result(cases[0], {"status": "ok", "timing": None})
    assert _eta(buf.getvalue()) == 4


def test_a_budget_caps_the_eta_and_says_so(monkeypatch):
    """Under `run --budget` no point starts after the deadline: the ETA is the time left to it, labelled."""
    cases = [_case("torch", 1), _case("torch", 2), _case("triton", 3)]
    expected = {cases[0].case_id: 1.0, cases[1].case_id: 1.0, cases[2].case_id: 100.0}
    progress, buf = _progress(expected, total=3, monkeypatch=monkeypatch, elapsed=2.0)
    progress.deadline = progress.started + 30.0  # 28 s of budget left at 2 s, against a 110 s estimate
    progress.result(cases[0], {"status": "ok", "timing": None})
    assert "eta 28s budget]" in buf.getvalue()
    progress.deadline = progress.started + 500.0  # the estimate ends first: the plain ETA
    progress.result(cases[1], {"status": "ok", "timing": None})
    last = buf.getvalue().splitlines()[-1]
    assert "budget" not in last and _eta(last) > 28


def test_estimates_of_zero_seconds_fall_back_to_counting_cases(monkeypatch):
    cases = [_case("vllm", 1), _case("torch", 2)]
    progress, buf = _progress({c.case_id: 0.0 for c in cases}, total=2, monkeypatch=monkeypatch, elapsed=4.0)
    assert progress.eta(5.0) == 0.0
    progress.result(cases[1], {"status": "ok", "timing": None})
    assert _eta(buf.getvalue()) == 4
    from spark_bench.console import SweepProgress

    live = SweepProgress(2, Console(file=io.StringIO(), force_terminal=True), expected={cases[0].case_id: 0.0})
    with live:  # the terminal's bar: a skipped case (0 s estimated) updates its ETA without dividing by zero
        live.result(cases[0], {"status": "skipped", "error": "vllm not installed", "timing": None})
    assert live.progress.tasks[0].fields["eta"] == "0s"


def test_one_slow_first_case_does_not_multiply_the_whole_eta(monkeypatch):
    cases = [_case("torch_compile", n) for n in range(100)]
    # the first graph compiled: 30 s for a case estimated at 1 s
    progress, buf = _progress({c.case_id: 1.0 for c in cases}, total=100, monkeypatch=monkeypatch, elapsed=30.0)
    progress.result(cases[0], {"status": "ok", "timing": None})
    assert _eta(buf.getvalue()) == 360  # 99 * (30 + 10) / (1 + 10): slower than estimated, not 99 more compiles


def test_skipped_cases_are_one_line_per_backend_and_reason_before_the_first_case_that_ran():
    skipped = [_case("vllm", n) for n in range(3)] + [_case("fla", 9)]
    ran = _case("torch", 1)
    progress, buf = _progress(None, total=5)
    with progress:
        for case in skipped:
            reason = "vllm not installed" if case.backend == "vllm" else "fla not installed"
            progress.result(case, {"status": "skipped", "error": reason, "timing": None})
        assert buf.getvalue() == ""
        progress.result(ran, {"status": "ok", "timing": None})
    lines = buf.getvalue().splitlines()
    assert lines[0] == "[4/5] skipped  3 cases of backend vllm: vllm not installed"
    assert lines[1] == "[4/5] skipped  1 case of backend fla: fla not installed"
    assert lines[2].startswith("[5/5 ") and " ok " in lines[2] and len(lines) == 3


def test_skipped_cases_at_the_end_are_printed_when_the_sweep_ends():
    progress, buf = _progress(None, total=2)
    with progress:
        progress.result(_case("torch", 1), {"status": "ok", "timing": None})
        progress.result(_case("vllm", 2), {"status": "skipped", "error": "vllm not installed", "timing": None})
    assert buf.getvalue().splitlines()[-1] == "[2/2] skipped  1 case of backend vllm: vllm not installed"


def test_show_selects_ops_backends_and_axis_values_and_keeps_the_ratio_to_the_whole_run(tmp_path):
    import numpy as np
    from click.testing import CliRunner
    from report_fixtures import case, write_run

    from spark_bench.cli import main

    rng = np.random.default_rng(3)
    recs = [case("kda.gate", b, {"tokens": t, "heads": 4}, samples=rng.normal(m * t, 0.01, 40))
            for t in (1, 8) for b, m in (("torch", 2.0), ("triton", 1.0))]
    recs.append(case("moe.experts", "triton", {"tokens": 8}, samples=rng.normal(5.0, 0.01, 40)))
    run = write_run(tmp_path / "run", recs)

    def show(*args):
        res = CliRunner().invoke(main, ["show", str(run), *args], terminal_width=200)
        return res.exit_code, res.output

    code, out = show("--op", "kda.*", "--backend", "tor*", "--set", "tokens=8")
    assert code == 0 and "moe.experts" not in out and "triton" not in out and "1 case, 1 ok" in out
    row = _row(out, "│ torch ")
    assert row[:3] == ["torch", "bf16", "ok"] and row[3].startswith("16 ±") and row[4] == "2"  # triton's 8, unshown
    code, out = show("--set", "tokens=99")
    assert code == 2 and "no case has tokens in {99}; the run has tokens = 1, 8" in out
    code, out = show("--op", "quant.*")
    assert code == 2 and "the run has: kda.gate, moe.experts" in out
    code, out = show("--limit", "2")
    assert code == 0 and "3 more cases not shown" in out


def test_roofline_column_names_the_nearest_roof_and_says_datasheet():
    bw = {**_rec("x.op", "triton", {"tokens": 4}, 2.0),
          "roofline": {"pct_bw_measured": 45.67, "pct_flops_measured": 3.1}}
    flop = {**_rec("x.op", "torch", {"tokens": 4}, 3.0), "roofline": {"pct_bw_datasheet": 2.0,
                                                                     "pct_flops_datasheet": 12.1}}
    tiny = {**_rec("x.op", "interp", {"tokens": 4}, 9e5), "roofline": {"pct_bw_measured": 1.14e-4}}
    text = _render([bw, flop, tiny])
    assert "45.7% BW" in _row(text, "│ triton ") and "12.1% FLOP ds" in _row(text, "│ torch ")
    assert "0.000114% BW" in _row(text, "│ interp ")  # never '0%' for a real small value
    assert "roofline" not in _render([_rec("x.op", "torch", {"tokens": 4}, 3.0)])  # no peaks stored: no column


def test_every_number_in_the_table_says_what_it_is():
    """The legend under the tables: the CI behind ±, the cost model behind GB/s, what peak MB measured; a CI of under
    6 samples is marked; a graph median lost in the flush's noise is below resolution and claims no ratio."""
    few = _rec("x.op", "a", {"tokens": 4}, 20.0)
    few["timing"].update(ci_level=0.75, rel_ci=0.3, n=3)
    lost = _rec("x.op", "b", {"tokens": 4}, 0.0)
    lost["timing"].update(clamped_samples=12, rel_ci=None)
    slow = _rec("x.op", "c", {"tokens": 4}, 50.0)
    for r in (few, lost, slow):
        r.update(gbps=1.5, memory={"rss_peak_bytes": 433e6, "device_peak_bytes": None})  # as a CPU run stores it
    text = _render([few, lost, slow])
    assert _row(text, "│ a ")[3] == "20 ±30%†" and _row(text, "│ b ")[3] == "< resolution"
    assert _row(text, "│ a ")[4] == "-" and _row(text, "│ c ")[4] == "-"  # nobody is "1": b may be the fastest
    legend = text.strip().splitlines()[-1]
    assert legend.startswith("median ±: its 95% CI († under 6 samples: their range)")
    assert "GB/s, TFLOP/s: cost model's bytes, FLOPs / median, not measured traffic" in legend
    assert "peak MB: worker's peak RSS" in legend
    gpu = _rec("x.op", "a", {"tokens": 4}, 20.0)
    gpu["memory"] = {"device_peak_bytes": 5e6}
    legend = _render([gpu]).strip().splitlines()[-1]
    assert legend == "median ±: its 95% CI · peak MB: GPU's peak allocation"
