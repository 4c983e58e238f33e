"""spark_bench.kernelgate.memcheck: out-of-bounds accesses of interpreted Triton kernels, and `spark-bench memcheck`.

A toy kernel shows what is caught (an unmasked read one element past a tensor, one landing in the next argument's
storage, an atomic past its end, a bad candidate config), what is not (addresses a mask turns off), and that a
sampled launch runs only its picked programs, with their real ids. Every Triton backend of every op runs under
memcheck as on sm_90a in tests/test_gpu_configs_interpreted.py.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from conftest import run_cli

from spark_bench.kernelgate.memcheck import OutOfBounds, edge_programs, memcheck, out_of_bounds_in


@triton.jit
def _copy(x, y, n, EXTRA: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + o, tl.load(x + o, mask=o < n + EXTRA), mask=o < n)


@triton.jit
def _count(counter, slot):
    tl.atomic_add(counter + slot, 1)


@pytest.mark.parametrize("n", [100, 37])
def test_a_read_one_past_the_end_is_caught_and_masked_addresses_are_not(n):
    x, y = torch.randn(n), torch.empty(n)
    with memcheck():
        _copy[(triton.cdiv(n, 32),)](x, y, n, EXTRA=0, BLOCK=32)  # the last block's lanes past n: masked off
        assert torch.equal(x, y)
        with pytest.raises(Exception) as info:
            _copy[(triton.cdiv(n, 32),)](x, y, n, EXTRA=1, BLOCK=32)
    cause = out_of_bounds_in(info.value)
    assert isinstance(cause, OutOfBounds), info.value
    last = triton.cdiv(n, 32) - 1
    assert f"_copy program ({last}, 0, 0): load of 1 of" in str(cause)
    assert f"0 bytes past the end of `x` ({4 * n} bytes)" in str(cause)


def adjacent(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two fp32 tensors of n elements whose storages touch: the second starts where the first ends."""
    buffer = torch.empty(8 * n, dtype=torch.uint8).untyped_storage()
    return tuple(torch.empty(0).set_(buffer[i * 4 * n:(i + 1) * 4 * n], 0, (n,), (1,)) for i in (0, 1))


def test_a_read_that_lands_in_the_next_arguments_storage_is_caught():
    """The CPU allocator can place one argument right after another: a read past the end of `x` then lands in `y`.
    Each storage is copied between guard zones for the launch, so it is still out of bounds; what the kernel wrote
    comes back to the caller's tensors."""
    x, y = adjacent(100)
    x.copy_(torch.arange(100.0))
    assert x.untyped_storage().data_ptr() + 400 == y.untyped_storage().data_ptr()
    with memcheck():
        _copy[(2,)](x, y, 100, EXTRA=0, BLOCK=64)
        assert torch.equal(x, y)
        with pytest.raises(Exception) as info:
            _copy[(2,)](x, y, 100, EXTRA=28, BLOCK=64)  # lanes 100..127 of x: y's first 112 bytes
    assert "_copy program (1, 0, 0): load of 28 of 64 elements out of bounds; the first 0 bytes past the end of `x`" \
        in str(out_of_bounds_in(info.value))


@triton.jit
def _shifted_sum(a, b, out, stride, n, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    """out[r, c] = a[r, c] + b[r, c + SHIFT] for c < n (rows `stride` elements apart in all three)."""
    row, c = tl.program_id(0), tl.arange(0, BLOCK)
    x = tl.load(a + row * stride + c, mask=c < n) + tl.load(b + row * stride + c + SHIFT, mask=c < n)
    tl.store(out + row * stride + c, x, mask=c < n)


def fused_qkv(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, ...]:
    """[rows, 3 cols] and its q, k, v column views (as a fused projection is split)."""
    qkv = torch.randn(rows, 3 * cols, generator=torch.Generator().manual_seed(seed))
    return (qkv, *qkv.split(cols, dim=1))


@pytest.mark.parametrize("rows,cols,seed", [(3, 7, 0), (5, 16, 1)])
def test_a_view_reading_its_neighbours_columns_in_one_storage_is_caught(rows, cols, seed):
    """k and v split from one fused qkv tensor share a storage: a read of k one column to the left lands in q's last
    column, a byte of the launch's storages all the same. Each view is checked against its own elements."""
    qkv, q, k, v = fused_qkv(rows, cols, seed)
    out = torch.empty(rows, 3 * cols)[:, :cols]
    with memcheck():
        _shifted_sum[(rows,)](v, k, out, 3 * cols, cols, SHIFT=0, BLOCK=32)
        assert torch.equal(out, v + k)
        with pytest.raises(Exception) as info:
            _shifted_sum[(rows,)](v, k, out, 3 * cols, cols, SHIFT=-1, BLOCK=32)
    cause = str(out_of_bounds_in(info.value))
    assert "_shifted_sum program (0, 0, 0): load of 1 of" in cause, cause
    assert f"at byte {4 * (cols - 1)} of `b`'s storage ({12 * rows * cols} bytes), outside its view " \
           f"(shape [{rows}, {cols}], strides [{3 * cols}, 1], offset {cols})" in cause


@pytest.mark.parametrize("rows,cols,seed", [(3, 7, 2), (4, 33, 3)])
def test_writes_through_disjoint_views_of_one_storage_all_come_back(rows, cols, seed):
    """Disjoint views get a copy each for the launch; what the kernel wrote through each reaches the caller's
    storage, and the columns no argument views keep their values. Overlapping views share one copy: the kernel sees
    its own writes through the other view (in place)."""
    qkv, q, k, v = fused_qkv(rows, cols, seed)
    before = qkv.clone()
    with memcheck():
        _shifted_sum[(rows,)](q, q, k, 3 * cols, cols, SHIFT=0, BLOCK=64)  # k = 2 q
        _shifted_sum[(rows,)](q, k, v, 3 * cols, cols, SHIFT=0, BLOCK=64)  # v = q + k = 3 q, reading k's new values
    assert torch.equal(q, before[:, :cols])
    assert torch.equal(k, 2 * q) and torch.equal(v, q + 2 * q)
    wide = qkv[:, :2 * cols]  # overlaps q and k: one copy, so the launch reads what it writes through `wide`
    with memcheck():
        _shifted_sum[(rows,)](q, wide, q, 3 * cols, cols, SHIFT=cols, BLOCK=64)  # q += k
    assert torch.equal(q, before[:, :cols] + 2 * before[:, :cols])


def test_an_atomic_past_the_end_is_caught():
    counter = torch.zeros(4, dtype=torch.int32)
    with memcheck():
        _count[(1,)](counter, 3)
        with pytest.raises(Exception) as info:
            _count[(1,)](counter, 4)
    assert "atomic of 1 of 1 elements out of bounds" in str(out_of_bounds_in(info.value))
    assert counter.tolist() == [0, 0, 0, 1]


def test_outside_the_block_nothing_is_checked():
    x, y = torch.randn(40), torch.empty(40)
    _copy[(2,)](x, y, 40, EXTRA=0, BLOCK=32)  # unchecked here (an out-of-bounds read would go unnoticed)
    assert torch.equal(x, y)


def test_a_sampled_launch_runs_only_its_edge_programs_with_their_real_ids():
    n = 32 * 9
    x, y = torch.randn(n), torch.zeros(n)
    heard = []
    with memcheck(programs=edge_programs, on_launch=lambda *a: heard.append(a[:3])) as counts:
        _copy[(9,)](x, y, n, EXTRA=0, BLOCK=32)
    assert heard == [("_copy", 4, (9, 1, 1))] and counts == {"launches": 1}
    ran = [bool(y[32 * p:32 * (p + 1)].ne(0).all()) for p in range(9)]
    assert ran == [True, True, False, False, False, False, False, True, True]
    assert torch.equal(y[-64:], x[-64:])


@pytest.mark.parametrize("sms", ["132", "2"])
def test_the_command_checks_the_selected_backends_at_the_quick_points(sms):
    """The CLI over a few ops (every Triton backend of every op runs under memcheck, as on sm_90a at 132 and 2 SMs,
    in tests/test_gpu_configs_interpreted.py, which checks their values too)."""
    code, out, err = run_cli("memcheck", "--target", "sm_90a", "--sms", sms, "--op", "kda.gate", "--op", "moe.router")
    assert code == 0, out[-3000:] + err
    assert " 0 with an access out of bounds or an error" in out and "out-of-bounds" not in out
    assert f"memcheck on sm_90a ({sms} SMs)" in out


def test_a_backend_without_triton_kernels_is_not_called_checked():
    code, out, err = run_cli("memcheck", "--op", "kda.gate", "--backend", "torch", "--set", "tokens=1",
                             "--set", "head_dim=60")
    assert code == 1 and "no-kernel" in out and "1 launched no interpreted kernel (nothing checked)" in out


def test_memcheck_usage_errors_are_one_line():
    code, out, err = run_cli("memcheck", "--op", "nope.*")
    assert code == 2 and len(err.strip().splitlines()) == 1, err


def test_a_launch_without_tensor_arguments_has_nothing_in_bounds():
    import numpy as np

    from spark_bench.kernelgate import memcheck as mc

    mc._state.launch = ("scalar_only", [], np.zeros(0, np.int64), np.zeros(0, np.int64), lambda: (0, 0, 0))
    try:
        with pytest.raises(OutOfBounds, match="the launch has no tensor arguments"):
            mc.check("load", np.array([4096], dtype=np.uint64), None, 4)
    finally:
        mc._state.launch = None


@triton.jit
def _pair_sum(xs, y, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(y + o, tl.load(xs[0] + o, mask=o < n) + tl.load(xs[1] + o, mask=o < n), mask=o < n)


def test_a_tuple_of_tensors_is_in_bounds():
    a, b, y = torch.randn(20), torch.randn(20), torch.empty(20)
    with memcheck():
        _pair_sum[(1,)]((a, b), y, 20, BLOCK=32)
    assert torch.allclose(y, a + b)


def test_a_callable_grid_is_sampled_too():
    n = 32 * 9
    x, y = torch.randn(n), torch.zeros(n)
    heard = []
    with memcheck(programs=edge_programs, on_launch=lambda *a: heard.append(a[:3])):
        _copy[lambda meta: (n // meta["BLOCK"],)](x, y, n, EXTRA=0, BLOCK=32)  # constexprs only, as interpreted
    assert heard == [("_copy", 4, (9, 1, 1))] and int(y.ne(0).sum()) == 4 * 32


def test_an_edge_sampled_router_leaves_its_tickets_clean_for_later_calls():
    """moe.router's programs elect the last of each tile, which resets the tile's ticket; with only the corner
    programs run, no program was last, and the next (whole) call of the kernel went wrong."""
    from spark_bench import get_op
    from spark_bench.kernelgate.targets import TARGETS

    op = get_op("moe.router")
    params = {"tokens": 33, "hidden": 2048, "experts": 16, "topk": 3, "groups": 1, "topk_groups": 1,
              "routed_scaling_factor": 2.5}

    def triton_matches_torch() -> bool:
        out = op.backends["triton"].fn(**op.make_inputs(params, device="cpu", dtype="bf16", seed=0))
        ref = op.backends["torch"].fn(**op.make_inputs(params, device="cpu", dtype="bf16", seed=0))
        return all(torch.equal(a, b) if not a.is_floating_point() else torch.allclose(a.float(), b.float(), atol=1e-2)
                   for a, b in zip(out, ref, strict=True))

    assert triton_matches_torch()
    with memcheck(TARGETS["sm_90a"], programs=edge_programs):
        op.backends["triton"].fn(**op.make_inputs(params, device="cpu", dtype="bf16", seed=0))
    assert triton_matches_torch()


def _copy_op(monkeypatch):
    """An op whose backend launches `_copy` through a declared space: the default and one candidate are clean, the
    other candidate (EXTRA=64) reads past the end. (op, its case at n = 100, the space)"""
    from spark_bench import Axis, Cost, Op, Tolerance
    from spark_bench.sweep import Case
    from spark_bench.tune import ConfigSpace, split
    from spark_bench.tune.space import SPACES

    space = ConfigSpace("test_memcheck._copy", key=("n",), default={"EXTRA": 0, "BLOCK": 64},
                        candidates=[{"EXTRA": 0, "BLOCK": 32}, {"EXTRA": 64, "BLOCK": 64}])
    monkeypatch.setitem(SPACES, space.kernel, space)  # declared for this test only

    def copy(x):
        y = torch.empty_like(x)
        meta, options = split(space.pick(n=x.numel()))
        _copy[(triton.cdiv(x.numel(), meta["BLOCK"]),)](x, y, x.numel(), **meta, **options)
        return y

    op = Op(name="test.copy", make_inputs_fn=lambda p, *, device, dtype, seed: {"x": adjacent(p["n"])[0]},
            reference=lambda x: x, cost=lambda p, dtype: Cost(bytes=8 * p["n"]), axes=[Axis("n", [128])],
            dtypes=["fp32"], tolerance={"fp32": Tolerance(1e-6)})
    op.backend("triton")(copy)
    return op, Case("test.copy", "triton", {"n": 100}, "fp32", "cpu", 0), space


def test_candidates_are_checked_one_kernel_at_a_time_and_a_bad_one_is_named(monkeypatch):
    """`memcheck --candidates`: the call again with each declared candidate of each kernel it launched; a candidate
    that reads past the end (EXTRA=64 here) is reported with its kernel and config, though the default is clean."""
    from spark_bench.kernelgate.memcheck_cli import check_case
    from spark_bench.kernelgate.targets import TARGETS

    op, case, _ = _copy_op(monkeypatch)
    assert check_case(op, op.backends["triton"], case, TARGETS["sm_90a"], False) == ("ok", "1 launches")
    status, detail = check_case(op, op.backends["triton"], case, TARGETS["sm_90a"], False, candidates=True)
    assert status == "out-of-bounds", detail
    assert detail.startswith("test_memcheck._copy candidate BLOCK=64,EXTRA=64: _copy program (1, 0, 0): load"), detail


@pytest.mark.parametrize(("tuned_n", "bad"), [(100, True), (5000, True), (100, False)])
def test_a_tuned_table_s_configs_are_the_ones_checked(monkeypatch, tmp_path, tuned_n, bad):
    """`memcheck --tuned FILE` launches what `run --tuned FILE` would: the table's entry at the case's key, or its
    nearest (n = 5000 for a case at 100), so a tuned config that reads past the end is caught; a clean one is not."""
    from spark_bench.kernelgate.memcheck_cli import _tuned_table, check_case
    from spark_bench.kernelgate.targets import TARGETS
    from spark_bench.tune.store import TunedStore

    op, case, space = _copy_op(monkeypatch)
    store = TunedStore.new({"type": "cuda", "name": "NVIDIA Test", "capability": "9.0"}, {"triton": "x"})
    config = {"EXTRA": 64, "BLOCK": 64} if bad else {"EXTRA": 0, "BLOCK": 32}
    store.put(space.kernel, {"key": {"n": tuned_n}, "config": config, "time_us": 1.0,
                             "default": {"config": space.default, "time_us": 2.0}, "speedup": 2.0, "measured": "t"})
    store.save(tmp_path / "tuned.json", "2026-12-06T00:00:00")
    table = _tuned_table(str(tmp_path / "tuned.json"))
    status, detail = check_case(op, op.backends["triton"], case, TARGETS["sm_90a"], False, table=table)
    if bad:
        assert status == "out-of-bounds" and detail.startswith("_copy program (1, 0, 0): load"), detail
    else:
        assert (status, detail) == ("ok", "1 launches, 1 of 1 configs from the tuned table")


def test_memcheck_tuned_file_errors_are_one_line(tmp_path):
    (tmp_path / "bad.json").write_text("{")
    for path in (tmp_path / "missing.json", tmp_path / "bad.json"):
        code, out, err = run_cli("memcheck", "--op", "kda.gate", "--tuned", str(path))
        assert code == 2 and len(err.strip().splitlines()) == 1 and "tuned-config file" in err, err


def test_a_reinterpreted_tensor_moves_with_its_base():
    """triton.reinterpret hands the kernel a TensorWrapper: it points into the guarded copy of its base's storage
    (it was left in the caller's storage, outside every region: each access out of bounds)."""
    x, y = torch.arange(37, dtype=torch.int32), torch.zeros(37, dtype=torch.int32)
    with memcheck():
        _copy[(2,)](triton.reinterpret(x, tl.float32), triton.reinterpret(y, tl.float32), 37, EXTRA=0, BLOCK=32)
    assert torch.equal(x, y)


@triton.jit
def _strided_sum(a, b, b_stride, out, n, BLOCK: tl.constexpr):
    c = tl.arange(0, BLOCK)
    tl.store(out + c, tl.load(a + c, mask=c < n) + tl.load(b + c * b_stride, mask=c < n), mask=c < n)


def test_a_broadcast_view_beside_a_disjoint_view_of_its_storage_comes_back():
    """A stride-0 (expanded) view and a disjoint row of one storage get a copy each; writing them back must not go
    through the expanded view (torch refuses to write into a self-overlapping view)."""
    base = torch.arange(16.0).reshape(2, 8)
    out = torch.empty(8)
    with memcheck():
        _strided_sum[(1,)](base[0], base[1, :1].expand(8), 0, out, 8, BLOCK=8)
    assert torch.equal(out, base[0] + base[1, 0])


def test_disjoint_views_of_a_large_storage_copy_only_their_own_bytes():
    """Each copy holds the bytes its views span, not the whole storage: 8 row views of a 64 MB tensor cost 64 MB of
    copies in all (it was 8 x 64 MB of copies and as much again of byte masks)."""
    from spark_bench.kernelgate.guarded import guarded

    big = torch.zeros(8, 2 << 20)
    keep = []
    moved, regions = guarded([f"row{i}" for i in range(8)], list(big.unbind(0)), keep)
    assert len(regions) == 8 and all(r.allowed is None for r in regions)
    assert sum(r.hi - r.lo for r in regions) == big.numel() * 4
    assert [r.start for r in sorted(regions, key=lambda r: r.name)] == [i * (8 << 20) for i in range(8)]
    assert all(torch.equal(m, b) for m, b in zip(moved, big.unbind(0), strict=True))
