"""GGUF K-quant blocks (Q2_K, Q3_K) in torch: layouts, valid random blocks, a small quantizer, two dequantizers.

A row of `cols` weights (cols a multiple of 256) is cols/256 super-blocks stored back to back (moe.md):
  block_q2_K, 84 B:  scales[16] (low nibble sc_j, high nibble m_j) | qs[64] | d fp16 | dmin fp16
                     w[e] = d * sc_j * q - dmin * m_j,   q = (qs[32*(e//128) + e%32] >> 2*((e%128)//32)) & 3, j = e//16
  block_q3_K, 110 B: hmask[32] | qs[64] | scales[12] (16 packed 6-bit l_j) | d fp16
                     w[e] = d * (l_j - 32) * (q2 - (bit e//32 of hmask[e%32] SET ? 0 : 4)),  d of either sign
Every product is exact in fp32 (fp16 d times a <=6-bit integer times a <=3-bit integer), so any correct fp32
dequantizer is bit-exact against gguf's numpy one; bf16 output is that value rounded once.

`dequantize_reference` follows the element formulas with index gathers; `dequantize_torch` is the vectorised
reshape-and-shift form a user would write. `random_blocks` draws valid blocks cheaply (random codes, sane scales,
d/dmin for a target weight std); `quantize` is a simplified port of llama.cpp's reference quantizers
(quantize_row_q2_K_ref / q3_K_ref without their RMSE search) for realistic blocks from real-valued weights.
"""

from __future__ import annotations

import dataclasses

import torch

from spark_bench.inputs import is_meta

QK_K = 256


@dataclasses.dataclass(frozen=True)
class KQuant:
    name: str
    block_bytes: int
    ggml_type: str  # gguf.GGMLQuantizationType member name


FORMATS = {"q2_k": KQuant("q2_k", 84, "Q2_K"), "q3_k": KQuant("q3_k", 110, "Q3_K")}
Q2K_BYTES, Q3K_BYTES = FORMATS["q2_k"].block_bytes, FORMATS["q3_k"].block_bytes


def kquant(fmt: str) -> KQuant:
    if fmt not in FORMATS:
        raise ValueError(f"unknown K-quant format {fmt!r}; choose from {sorted(FORMATS)}")
    return FORMATS[fmt]


def row_bytes(fmt: str, cols: int) -> int:
    if cols % QK_K:
        raise ValueError(f"K-quant rows need a multiple of {QK_K} weights, got {cols}")
    return cols // QK_K * kquant(fmt).block_bytes


def bytes_per_weight(fmt: str) -> float:
    return kquant(fmt).block_bytes / QK_K


def _blocks(raw: torch.Tensor, fmt: str) -> torch.Tensor:
    """[..., nb*block_bytes] uint8 -> [..., nb, block_bytes]."""
    bb = kquant(fmt).block_bytes
    if raw.dtype != torch.uint8 or raw.shape[-1] % bb:
        raise ValueError(f"{fmt} expects uint8 rows of a multiple of {bb} bytes, got {raw.dtype} {tuple(raw.shape)}")
    return raw.reshape(*raw.shape[:-1], raw.shape[-1] // bb, bb)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] little-endian bytes -> [...] fp32 (the value of the stored fp16)."""
    return b.contiguous().view(torch.float16)[..., 0].float()


def _to_f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """[...] fp32 -> [..., 2] uint8 (fp16 bytes)."""
    return x.to(torch.float16).unsqueeze(-1).contiguous().view(torch.uint8)


# ---- dequantizers ---------------------------------------------------------------------------------------------
_E = torch.arange(QK_K)
_Q_BYTE = 32 * (_E // 128) + _E % 32  # qs byte of element e
_Q_SHIFT = 2 * ((_E % 128) // 32)  # its bit position
_SUB = _E // 16  # 16-weight sub-block j of element e


def dequantize_reference(raw: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32, element by element from the layout formulas (index gathers). [..., nb*bb] uint8 -> [..., nb*256]."""
    bu = _blocks(raw, fmt)
    b, dev = bu.long(), raw.device
    qbyte, qshift, sub, e = _Q_BYTE.to(dev), _Q_SHIFT.to(dev), _SUB.to(dev), _E.to(dev)
    if fmt == "q2_k":
        qs = b[..., 16:80]
        q = ((qs[..., qbyte] >> qshift) & 3).float()
        sc = b[..., sub]  # scale byte of each element
        d, dmin = _f16(bu[..., 80:82]), _f16(bu[..., 82:84])
        w = d[..., None] * (sc & 15).float() * q - dmin[..., None] * (sc >> 4).float()
    else:
        qs, hmask, scales = b[..., 32:96], b[..., 0:32], b[..., 96:108]
        q2 = (qs[..., qbyte] >> qshift) & 3
        high_set = (hmask[..., e % 32] >> (e // 32)) & 1
        q = (q2 - 4 * (1 - high_set)).float()
        low = torch.where(sub < 8, scales[..., sub % 8] & 15, scales[..., sub % 8] >> 4)
        high = (scales[..., 8 + sub % 4] >> (2 * (sub // 4))) & 3
        l6 = (low | (high << 4)).float()
        d = _f16(bu[..., 108:110])
        w = d[..., None] * (l6 - 32.0) * q
    return w.reshape(*raw.shape[:-1], -1)


_SHIFT4 = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
_SHIFT8 = torch.arange(8, dtype=torch.uint8).view(8, 1)


def dequantize_torch(raw: torch.Tensor, fmt: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Vectorised bit ops (reshape and broadcast shifts). [..., nb*bb] uint8 -> [..., nb*256] in `dtype`."""
    b = _blocks(raw, fmt)
    lead, nb = b.shape[:-2], b.shape[-2]
    s4 = _SHIFT4.to(raw.device)
    if fmt == "q2_k":
        q = (b[..., 16:80].reshape(*lead, nb, 2, 1, 32) >> s4) & 3  # [..., nb, half, shift, 32]
        q = q.reshape(*lead, nb, 16, 16).float()
        sc = b[..., 0:16]
        dl = _f16(b[..., 80:82])[..., None] * (sc & 15).float()
        ml = _f16(b[..., 82:84])[..., None] * (sc >> 4).float()
        w = dl[..., None] * q - ml[..., None]
    else:
        q2 = (b[..., 32:96].reshape(*lead, nb, 2, 1, 32) >> s4) & 3
        hi = (b[..., 0:32].reshape(*lead, nb, 1, 32) >> _SHIFT8.to(raw.device)) & 1
        q = q2.reshape(*lead, nb, 8, 32).to(torch.int8) - 4 * (1 - hi.to(torch.int8))
        sc = b[..., 96:108]
        low = torch.cat([sc[..., :8] & 15, sc[..., :8] >> 4], dim=-1)  # l_j, j < 8 then j >= 8
        high = (sc[..., 8:12].unsqueeze(-2) >> s4.view(4, 1)) & 3  # [..., nb, j//4, j%4]
        l6 = (low | (high.reshape(*lead, nb, 16) << 4)).float() - 32.0
        dl = _f16(b[..., 108:110])[..., None] * l6
        w = dl[..., None] * q.reshape(*lead, nb, 16, 16).float()
    return w.reshape(*lead, nb * QK_K).to(dtype)


def dequantize_gguf(raw: torch.Tensor, fmt: str):
    """The `gguf` package's numpy dequantizer (host only): uint8 CPU tensor -> fp32 numpy array."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(raw.numpy(), GGMLQuantizationType[kquant(fmt).ggml_type])


# ---- writers --------------------------------------------------------------------------------------------------
def _pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """2-bit codes [..., nb, 256] -> qs bytes [..., nb, 64]: byte 32h+l holds codes 128h+32s+l at bits 2s."""
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], 2, 4, 32)
    packed = c[..., 0, :] | (c[..., 1, :] << 2) | (c[..., 2, :] << 4) | (c[..., 3, :] << 6)
    return packed.reshape(*codes.shape[:-1], 64)


def _pack_q3_scales(l6: torch.Tensor) -> torch.Tensor:
    """16 six-bit scales [..., nb, 16] -> 12 bytes [..., nb, 12]."""
    l6 = l6.to(torch.uint8)
    low = (l6[..., :8] & 15) | ((l6[..., 8:] & 15) << 4)
    hi = (l6 >> 4).reshape(*l6.shape[:-1], 4, 4)  # [..., j//4, j%4]
    high = hi[..., 0, :] | (hi[..., 1, :] << 2) | (hi[..., 2, :] << 4) | (hi[..., 3, :] << 6)
    return torch.cat([low, high], dim=-1)


def _pack_q3(codes: torch.Tensor, l6: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """codes in 0..7 (= q + 4) [..., nb, 256], l6 [..., nb, 16], d [..., nb] -> [..., nb, 110]."""
    c = codes.to(torch.uint8)
    bits = (c >> 2).reshape(*c.shape[:-1], 8, 32)  # hmask bit e//32 of byte e%32
    hmask = (bits << torch.arange(8, dtype=torch.uint8, device=c.device).view(8, 1)).sum(-2, dtype=torch.uint8)
    return torch.cat([hmask, _pack_codes(c & 3), _pack_q3_scales(l6), _to_f16_bytes(d)], dim=-1)


def _flat(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.reshape(*blocks.shape[:-2], -1).contiguous()


def random_blocks(fmt: str, rows: tuple[int, ...] | int, cols: int, gen: torch.Generator, *, std: float = 0.02,
                  device: str | torch.device = "cpu") -> torch.Tensor:
    """Valid random blocks [*rows, cols/256*bb] uint8 whose weights have roughly `std`: uniform codes, scales
    drawn from the upper part of their range, d (and dmin) jittered +-30% per block; Q3_K's d has a random sign."""
    rows = (rows,) if isinstance(rows, int) else tuple(rows)
    nb = row_bytes(fmt, cols) // kquant(fmt).block_bytes
    shape = (*rows, nb)
    if is_meta(device):
        return torch.empty((*rows, row_bytes(fmt, cols)), dtype=torch.uint8, device=device)

    def ints(low, high, *extra):
        return torch.randint(low, high, (*shape, *extra), generator=gen, device=device, dtype=torch.uint8)

    jitter = torch.rand(shape, generator=gen, device=device) * 0.6 + 0.7
    if fmt == "q2_k":
        sc, m = ints(6, 16, 16), ints(6, 16, 16)  # mean 10.5 each
        d = std / (10.5 * 1.118) * jitter  # codes 0..3: std 1.118, mean 1.5
        dmin = d * 1.5  # E[dmin * m] = E[d * sc * q]: sub-blocks centred on average
        blocks = torch.cat([sc | (m << 4), ints(0, 256, 64), _to_f16_bytes(d), _to_f16_bytes(dmin)], dim=-1)
    else:
        sign = torch.where(torch.rand(shape, generator=gen, device=device) < 0.5, -1.0, 1.0)
        d = sign * std / (18.5 * 2.29) * jitter  # |l - 32| ~ 18.5 rms, q in -4..3 rms 2.29
        blocks = torch.cat([ints(0, 256, 32), ints(0, 256, 64), _pack_q3_scales(ints(0, 64, 16)), _to_f16_bytes(d)],
                           dim=-1)
    return _flat(blocks)


def _round(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp's nearest_int: round half away from zero."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def quantize(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """Real weights [..., cols] -> blocks [..., cols/256*bb] uint8 (llama.cpp's reference scheme, no RMSE search)."""
    row_bytes(fmt, w.shape[-1])
    x = w.float().reshape(*w.shape[:-1], -1, 16, 16)  # [..., nb, sub-block, 16]
    if fmt == "q2_k":
        lo, hi = x.amin(-1).clamp(max=0.0), x.amax(-1)
        scale, mins = (hi - lo) / 3.0, -lo
        d = (scale.amax(-1) / 15.0).half().float()
        dmin = (mins.amax(-1) / 15.0).half().float()
        sc = torch.where(d[..., None] > 0, _round(scale / d[..., None].clamp(min=1e-30)), 0).clamp(0, 15)
        m = torch.where(dmin[..., None] > 0, _round(mins / dmin[..., None].clamp(min=1e-30)), 0).clamp(0, 15)
        step, offset = (d[..., None] * sc)[..., None], (dmin[..., None] * m)[..., None]
        codes = torch.where(step > 0, _round((x + offset) / step.clamp(min=1e-30)), 0).clamp(0, 3)
        blocks = torch.cat([(sc.to(torch.uint8) | (m.to(torch.uint8) << 4)), _pack_codes(codes.flatten(-2)),
                            _to_f16_bytes(d), _to_f16_bytes(dmin)], dim=-1)
    else:
        idx = x.abs().argmax(-1, keepdim=True)
        sub_scale = -x.gather(-1, idx)[..., 0] / 4.0  # make_q3_quants: iscale = -nmax / max
        bidx = sub_scale.abs().argmax(-1, keepdim=True)
        amax = sub_scale.gather(-1, bidx)[..., 0]
        safe = torch.where(amax == 0, 1.0, amax)
        d = torch.where(amax == 0, 0.0, -safe / 32.0).half().float()
        l6 = torch.where(amax[..., None] == 0, 32.0, (_round(-32.0 / safe[..., None] * sub_scale)).clamp(-32, 31) + 32)
        step = (d[..., None] * (l6 - 32.0))[..., None]
        nz = step != 0
        q = torch.where(nz, _round(x / torch.where(nz, step, 1.0)), 0).clamp(-4, 3)
        blocks = _pack_q3((q + 4).flatten(-2), l6, d)
    return _flat(blocks)
