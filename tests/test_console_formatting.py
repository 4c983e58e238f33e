"""The console table's number and text formatting at its boundaries (found by a mutation audit of console.py): each
test names the mutant it was written against."""

import io

from rich.console import Console

from spark_bench.console import ci_is_range, clip_params, fmt_num, rate_text, results_table


def test_params_clip_at_whole_items_and_fill_the_width_exactly():
    """Mutant: `> width` -> `>=` (a params text exactly as wide as the column lost its last item)."""
    params = {"tokens": 64, "heads": 32}  # "tokens=64 heads=32": 18 characters
    assert clip_params(params, width=18) == "tokens=64 heads=32"
    assert clip_params(params, width=17) == "tokens=64 …"
    assert clip_params({"routing": "uniform"}, width=8) == "routing…"


def test_numbers_keep_their_significant_digits_up_to_a_thousand_and_huge_ones_read_as_exponents():
    """Mutants: `>= 10**digits` -> `>` (1000 read '1e+03'); the exponent form above 1e9 dropped (a 20-digit count)."""
    assert [fmt_num(v) for v in (999.4, 1000.0, 12345.6, 0.00146, 0)] == ["999", "1000", "12346", "0.00146", "0"]
    assert fmt_num(2.5e12) == "2.500e+12" and fmt_num(999_999_999.0) == "999999999"


def test_rates_take_the_prefix_from_exactly_its_scale():
    """Mutant: `per_s >= scale` -> `>` (1 GB/s read '1000 MB/s')."""
    assert rate_text(1e9, "B/s") == "1 GB/s" and rate_text(999.0, "B/s") == "999 B/s"
    assert rate_text(1.46e9, "FLOP/s") == "1.46 GFLOP/s" and rate_text(1e15, "FLOP/s") == "1 PFLOP/s"


def test_five_samples_are_a_range_six_are_a_ci():
    """Mutant: the level cut 0.945 -> 0.9 (5 samples, a 93.8% range, shown as a 95% CI)."""
    assert ci_is_range({"ci_level": 0.9375}) and ci_is_range({"ci_level": 0.75})
    assert not ci_is_range({"ci_level": 0.95}) and not ci_is_range({"ci_level": None}) and not ci_is_range({})


def test_no_more_cases_line_when_exactly_the_limit_is_shown():
    """Mutant: `len(shown) > limit` -> `>=` ('0 more cases not shown' under a table that shows them all)."""
    records = [{"op": "x.op", "backend": b, "params": {"tokens": 4}, "dtype": "bf16", "status": "ok", "labels": [],
                "timing": {"median": m, "rel_ci": 0.01, "timer": "cuda-event"}, "check": {"err_ratio": 1e-3}}
               for b, m in (("a", 1.0), ("b", 2.0))]

    def render(limit):
        buf = io.StringIO()
        Console(file=buf, width=220, force_terminal=False).print(results_table(records, limit=limit))
        return buf.getvalue()

    assert "not shown" not in render(2)
    assert "1 more cases not shown" in render(1)
