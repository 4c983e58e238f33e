"""spark_bench/kernelgate memcheck edges: an element whose last bytes leave its view, where a bad address points
(the nearest region by either end, bytes before an argument), views of one storage that only touch, what comes
back from an input's copy, the progress line, the candidates' count, and `spark-bench memcheck` exiting 1 on a case
that errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from conftest import run_cli
from test_memcheck import _copy, _copy_op, _shifted_sum, fused_qkv

from spark_bench.kernelgate import memcheck as mc
from spark_bench.kernelgate import memcheck_cli
from spark_bench.kernelgate.guarded import Region, where
from spark_bench.kernelgate.memcheck import OutOfBounds, memcheck, out_of_bounds_in


@triton.jit
def _double_into(out, x, stride, n, BLOCK: tl.constexpr):
    """out[r, c] = 2 x[r, c] for c < n: the output comes first."""
    row, c = tl.program_id(0), tl.arange(0, BLOCK)
    tl.store(out + row * stride + c, 2 * tl.load(x + row * stride + c, mask=c < n), mask=c < n)


def _region(lo, hi, name, allowed=None, total=None):
    return Region(lo, hi, name, allowed, [((hi - lo,), (1,), 0)], 0, hi - lo if total is None else total)


def test_an_element_that_starts_in_its_view_and_ends_outside_it_is_caught():
    """Every other fp32 of a storage viewed (stride 2): an 8-byte load at a viewed element reads the unviewed one."""
    allowed = np.array([True] * 4 + [False] * 4 + [True] * 4 + [False] * 4)
    mc._state.launch = ("k", [_region(4096, 4112, "x", allowed)], np.array([4096]), np.array([4112]),
                        lambda: (0, 0, 0))
    try:
        mc.check("load", np.array([4096, 4104], dtype=np.uint64), None, 4)  # the two viewed fp32 elements
        with pytest.raises(OutOfBounds, match="load of 1 of 1 elements out of bounds; the first at byte 8 of `x`"):
            mc.check("load", np.array([4104], dtype=np.uint64), None, 8)
    finally:
        mc._state.launch = None


def test_a_bad_address_is_described_from_the_nearest_end_of_the_nearest_region():
    """100 bytes past a 1000-byte `a` is not 500 bytes before the small `b` further on."""
    regions = [_region(1000, 2000, "a"), _region(2600, 2700, "b")]
    assert where(2100, regions) == "100 bytes past the end of `a` (1000 bytes)"
    assert where(2590, regions) == "10 bytes before `b` (100 bytes)"


def test_a_read_before_the_first_element_says_how_many_bytes_before():
    a, b, out = torch.randn(1, 8), torch.randn(1, 8), torch.empty(1, 8)
    with memcheck(), pytest.raises(Exception) as info:
        _shifted_sum[(1,)](a, b, out, 8, 8, SHIFT=-1, BLOCK=8)
    assert "load of 1 of 8 elements out of bounds; the first 4 bytes before `b` (32 bytes)" \
        in str(out_of_bounds_in(info.value))


def test_a_read_past_a_view_into_the_next_view_of_its_storage_is_caught():
    """x and y are the two halves of one tensor: they touch but share no byte, so each is checked on its own."""
    base = torch.arange(200.0)
    x, y = base[:100], base[100:]
    with memcheck():
        _copy[(2,)](x, y, 100, EXTRA=0, BLOCK=64)
        assert torch.equal(y, x)
        with pytest.raises(Exception) as info:
            _copy[(2,)](x, y, 100, EXTRA=28, BLOCK=64)
    assert "load of 28 of 64 elements out of bounds; the first at byte 400 of `x`'s storage (800 bytes), outside " \
        "its view (shape [100], strides [1], offset 0)" in str(out_of_bounds_in(info.value))


def test_slow_launches_print_a_progress_line(capsys):
    memcheck_cli._progress("_k", 4, (9, 1, 1), 5.0)
    memcheck_cli._progress("_k", None, (3,), 12.4)
    memcheck_cli._progress("_k", 9, (9, 1, 1), 4.9)
    assert capsys.readouterr().err == "  _k: 4 of 9x1x1 programs, 5 s\n  _k: grid (3,), 12 s\n"


def test_a_case_that_errors_fails_the_command(monkeypatch):
    """Not only an access out of bounds: a case that raised is a case nothing was checked in."""
    monkeypatch.setattr(memcheck_cli, "check_case", lambda *a, **k: ("error", "ValueError: boom"))
    code, out, err = run_cli("memcheck", "--op", "kda.gate", "--backend", "triton", "--set", "tokens=1",
                             "--set", "head_dim=60")
    assert code == 1 and "error         kda.gate triton" in out and "1 with an access out of bounds or an error" in out


def test_a_whole_launch_is_reported_with_every_program_run():
    x, y = torch.randn(40), torch.empty(40)
    heard = []
    with memcheck(on_launch=lambda *a: heard.append(a[:3])):
        _copy[(2,)](x, y, 40, EXTRA=0, BLOCK=32)
    assert heard == [("_copy", 2, (2,))] and torch.equal(x, y)


def test_clean_candidates_are_counted_in_the_detail(monkeypatch):
    from spark_bench.kernelgate.targets import TARGETS

    op, case, space = _copy_op(monkeypatch)
    space.candidates.pop()  # the one that reads past the end
    assert memcheck_cli.check_case(op, op.backends["triton"], case, TARGETS["sm_90a"], False, candidates=True) \
        == ("ok", "1 launches; 2 candidate configs of 1 kernel(s)")


def test_an_input_whose_span_covers_the_output_s_columns_does_not_undo_the_write():
    """k = 2 q with k passed first: q's copy spans k's columns of every row but the last; writing q's copy back
    after k's must leave them alone (only the bytes q views come back)."""
    qkv, q, k, v = fused_qkv(4, 5, seed=4)
    with memcheck():
        _double_into[(4,)](k, q, 15, 5, BLOCK=8)
    assert torch.equal(k, 2 * q)
