"""spark_bench/kernelgate: CTAs per SM round registers up to the per-warp allocation unit and count the driver's
shared-memory reservation per CTA (CUDA occupancy calculator, compute capability 9.0: 65536 registers, 256-register
warp allocation unit, 228 KB shared memory per SM, 1 KB reserved per block); a `ptxas -v` log of several entry
functions gives the most registers and the summed spills; the traffic counter leaves out reads of what the launch
itself wrote. Expected numbers are worked by hand."""

import torch
import triton
import triton.language as tl

from spark_bench.kernelgate.offline import parse_ptxas_log
from spark_bench.kernelgate.targets import TARGETS
from spark_bench.kernelgate.traffic import counting

H200 = TARGETS["sm_90a"]


def test_registers_are_allocated_per_warp_in_units_of_256():
    """100 registers x 32 threads = 3200, rounded up to 3328 per warp: 65536 // 3328 = 19 warps = 4 CTAs of 4 warps
    (unrounded, 20 warps would fit 5)."""
    assert H200.ctas_per_sm(regs=100, warps=4, shared=0) == 4
    assert H200.ctas_per_sm(regs=72, warps=8, shared=0) == 3  # 2304 = 9 x 256: 28 warps -> 3 CTAs of 8


def test_each_resident_cta_costs_its_shared_memory_plus_the_reserved_kilobyte():
    """116224 B per CTA: two take 2 x (116224 + 1024) = 234496 B > 233472 B of the SM, so only one fits."""
    assert H200.ctas_per_sm(regs=32, warps=4, shared=116224) == 1
    assert H200.ctas_per_sm(regs=32, warps=4, shared=115712) == 2  # 2 x 116736 = 233472: exactly fits


def test_a_ptxas_log_of_several_functions_gives_the_most_registers_and_the_summed_spills():
    log = ("ptxas info    : Compiling entry function 'big' for 'sm_90a'\nptxas info    : Function properties for big\n"
           "    16 bytes stack frame, 12 bytes spill stores, 8 bytes spill loads\n"
           "ptxas info    : Used 96 registers, used 1 barriers\n"
           "ptxas info    : Compiling entry function 'small' for 'sm_90a'\n"
           "ptxas info    : Function properties for small\n"
           "    0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 40 registers, used 1 barriers\n")
    assert parse_ptxas_log(log) == {"regs": 96, "stack": 16, "spill_stores": 20, "spill_loads": 12}


@triton.jit
def _write_then_read(x, y, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    m = o < n
    tl.store(y + o, tl.load(x + o, mask=m, other=0.0) + 1.0, mask=m)
    tl.store(y + o, tl.load(y + o, mask=m, other=0.0) * 2.0, mask=m)  # re-reads what this launch wrote


def test_reads_of_what_the_launch_wrote_are_issued_but_not_unique():
    """10 fp32 of x read once and 10 of y read back after this launch stored them: 80 B issued, 40 B unique (x only);
    y written twice: 80 B issued, 40 B unique."""
    x, y = torch.arange(16, dtype=torch.float32), torch.zeros(16)
    with counting() as kernels:
        _write_then_read[(1,)](x, y, 10, BLOCK=16)
    row = kernels["_write_then_read"]
    assert (row.read_issued, row.read_unique, row.written_issued, row.written_unique) == (80, 40, 80, 40)
    assert torch.equal(y[:10], (x[:10] + 1) * 2)
