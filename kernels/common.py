"""Helpers shared by our Triton kernels.

INTERPRET: True under TRITON_INTERPRET=1 (CPU tensors). Pass it as the `UPCAST_DOT` constexpr of any kernel that
calls tl.dot: triton 3.9's interpreter multiplies the raw bit patterns of bf16 operands (triton issue #11584), so
kernels upcast dot operands to fp32 when interpreting, and keep bf16 operands on the GPU. Wrappers decide their
block sizes, splits and paths by `widen()`, never by INTERPRET: memcheck, traffic and
tests/test_gpu_configs_interpreted.py turn widening off to run a GPU's launches in the interpreter.
The interpreter also casts fp32 to bf16 by truncation (even with fp_downcast_rounding="rtne"); kernels that store bf16
pass ROUND=rounds_bf16(out.dtype) and store round_bf16(x, ROUND), which rounds to nearest there and is a no-op on GPUs.
"""

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# Wrappers widen their declared block sizes under the interpreter (it runs one Python program at a time, so few
# large programs are faster). Tests of the declared candidates set this to False: the configs then run as on a GPU.
WIDEN_WHEN_INTERPRETING = True


def widen() -> bool:
    """Whether a wrapper should replace its declared block sizes by whole rows (interpreting, not told otherwise)."""
    return INTERPRET and WIDEN_WHEN_INTERPRETING


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(int(n))


def row_block(n_cols: int, budget: int = 4096) -> int:
    """Rows per program for a row-wise kernel: fill `budget` elements. The interpreter runs one program at a
    time in Python, so there fewer, larger programs are faster."""
    budget = 1 << 16 if widen() else budget
    return max(1, min(1024, budget // max(1, next_pow2(n_cols))))


@triton.jit
def softplus(x):
    """log(1 + exp(x)) = max(x, 0) + log1p(exp(-|x|)); equals x beyond 20 like torch's threshold.

    log1p(t), t = exp(-|x|) in (0, 1]: log(1 + t) where t >= 1/32 (relative error <= 2^-19), else its series to t^5
    (truncation below fp32's rounding). log(1 + t) alone lost the digits of t below 1 ulp of 1: softplus(-9) was off
    by 3e-4 relative and softplus(x < -16.6) was 0 (kda.gate's check failed from dt_bias ~ -6; a real checkpoint's
    gate gets there). The series, not Goldberg's log(u) t / (u - 1): the division made `_recurrent_decode` spill."""
    t = tl.exp(-tl.abs(x))
    series = t * (1.0 + t * (-0.5 + t * (1.0 / 3.0 + t * (-0.25 + t * 0.2))))
    log1p = tl.where(t < 0.03125, series, tl.log(1.0 + t))
    return tl.where(x > 20.0, x, tl.maximum(x, 0.0) + log1p)


@triton.jit
def round_bf16(x, ROUND: tl.constexpr):
    """x (fp32) rounded to the nearest bf16 (ties to even) when ROUND: triton 3.9's interpreter casts fp32 to bf16
    by truncation (error ratio ~4e-3), the GPU rounds. Pass ROUND=rounds_bf16(out_dtype); a no-op on the GPU."""
    if ROUND:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
        x = bits.to(tl.float32, bitcast=True)
    return x


@triton.jit
def live_rows(mask, slot):
    """`mask` where the pool slot is live (slot >= 0) and nowhere for a padding row (slot < 0: vLLM's PAD_SLOT_ID).
    The scalar test goes through an integer tile of mask's shape: triton 3.9's interpreter refuses a load mask made
    by `&` with a scalar bool ("mask has unsupported dtype")."""
    return mask & ((mask.to(tl.int64) * 0 + slot) >= 0)


MAX_GRID_YZ = 65535  # CUDA's cap on grid dimensions 1 and 2 (dimension 0 takes 2^31 - 1)


def ordered_grid(fast: int, slow: int, middle: tuple[int, ...] = (), prefer: bool = True) -> tuple[tuple, bool]:
    """(fast, *middle, slow) when `prefer` and `slow` fits its grid dimension's cap, else (slow, *middle, fast); and
    whether `fast` came first (the kernel's constexpr that reads its program ids in that order). For kernels whose
    programs in flight should cover whole rows of memory: `fast` indexes the tiles of one row."""
    first = bool(prefer) and slow <= MAX_GRID_YZ
    return ((fast, *middle, slow) if first else (slow, *middle, fast)), first


@triton.jit
def ordered_ids(FAST_FIRST: tl.constexpr, SLOW_AXIS: tl.constexpr):
    """(fast, slow) program ids of a grid laid out by ordered_grid: (axis 0, SLOW_AXIS) when FAST_FIRST, else
    (SLOW_AXIS, axis 0)."""
    if FAST_FIRST:
        fast, slow = tl.program_id(0), tl.program_id(SLOW_AXIS)
    else:
        fast, slow = tl.program_id(SLOW_AXIS), tl.program_id(0)
    return fast, slow


def rounds_bf16(dtype: torch.dtype) -> bool:
    return INTERPRET and dtype == torch.bfloat16


def per_tensor(cache: dict, tensor: torch.Tensor, build, *extra, limit: int = 8):
    """build(), computed once while the same tensor object comes back unmodified (same `_version`) with the same
    `extra` key parts; `cache` (the caller's dict) keeps the `limit` most recent entries, each with a weak reference
    to its tensor, so a new tensor that reuses a dead one's id is not mistaken for it."""
    import weakref

    key = (id(tensor), tensor._version, *extra)
    hit = cache.get(key)
    if hit is not None and hit[0]() is tensor:
        return hit[1]
    value = build()
    if len(cache) >= limit:
        cache.pop(next(iter(cache)))
    cache[key] = (weakref.ref(tensor), value)
    return value


_TICKETS: dict = {}


def tickets(owner: str, device, n: int) -> torch.Tensor:
    """Zeroed int32 tickets of `owner` (a kernel that elects the last of a tile's programs), one per tile, kept per
    device. Each launch's electing program resets its tile's ticket to 0, so the buffer is zero between launches on
    one stream; two launches of the same owner must not run concurrently on different streams."""
    key = (owner, str(device))
    buf = _TICKETS.get(key)
    if buf is None or buf.numel() < n:
        if str(device).startswith("cuda") and torch.cuda.is_current_stream_capturing():
            # a capture only records the zero fill: calls outside the graph would elect on garbage tickets
            raise RuntimeError(f"{owner}: its ticket buffer is first allocated inside a CUDA graph capture; "
                               "call it once outside the capture first (a warm-up)")
        buf = _TICKETS[key] = torch.zeros(max(n, 256), dtype=torch.int32, device=device)
    return buf


@triton.jit
def last_to_arrive(tickets, tile, n_programs):
    """True in the last of the n_programs programs of `tile` to get here. Every thread's earlier stores precede
    the ticket (barrier, then an acq_rel atomic at GPU scope); the winner reads the others' stores with .cg loads
    (L2: they were written on other SMs). The winner resets the ticket at once (no program of this launch takes it
    again): resetting after its work made ptxas keep the store's predicate in local memory (a 4 B "spill")."""
    tl.debug_barrier()
    won = tl.atomic_add(tickets + tile, 1, sem="acq_rel") == n_programs - 1
    if won:
        tl.store(tickets + tile, 0)
    return won

