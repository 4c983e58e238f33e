"""Routing replay: expert ids per token from a file (e.g. dumped by an engine), as the `file` value of the routing axis.

Formats (docs/weights.md):
  .npy    an integer array [T, K] (or [T] for K = 1): row t holds token t's K expert ids
  .jsonl  one line per token: a JSON list of K expert ids, or an object {"ids": [...], "weights": [...]}
          (weights optional; when given on every line they are replayed too, else drawn like a sigmoid router's)
Ids are distinct within a token and in [0, experts). A sweep point of T tokens takes rows [0, T) (wrapping around
when the file is shorter); rotated timing sets take windows at seeded offsets, so a decode benchmark still re-reads
its experts from HBM.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
from pathlib import Path

import numpy as np
import torch

from spark_bench.weights.formats import WeightError

MAX_ID = int(np.iinfo(np.int32).max)  # ids are replayed as int32: a larger one would wrap around to another expert


class RoutingTrace:
    def __init__(self, path: Path, ids: np.ndarray, weights: np.ndarray | None) -> None:
        self.path, self.ids, self.weights = path, ids, weights

    @property
    def tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def topk(self) -> int:
        return int(self.ids.shape[1])

    @property
    def max_id(self) -> int:
        return int(self.ids.max())

    def check_experts(self, experts: int, what: str = "") -> None:
        """Every id in [0, experts), else a WeightError naming the first offending token."""
        bad = np.argwhere(self.ids >= experts)
        if bad.size:
            t, k = (int(v) for v in bad[0])
            raise WeightError(f"routing file {self.path}: token {t} has expert id {int(self.ids[t, k])}, out of range "
                              f"for {experts} experts (ids 0..{experts - 1}){what}")

    def window(self, T: int, offset: int = 0) -> tuple[np.ndarray, np.ndarray | None]:
        rows = (np.arange(T) + offset) % self.tokens
        return self.ids[rows], (self.weights[rows] if self.weights is not None else None)

    def offset_for(self, seed: int | None) -> int:
        return 0 if seed is None else random.Random(seed).randrange(self.tokens)

    def describe(self) -> dict:
        return {"path": str(self.path), "size_bytes": self.path.stat().st_size, "sha256": file_sha256(self.path),
                "tokens": self.tokens, "topk": self.topk, "max_id": self.max_id,
                "weights": self.weights is not None}


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@functools.lru_cache(maxsize=4)
def load_routing(path: str) -> RoutingTrace:
    p = Path(path)
    if not p.is_file():
        raise WeightError(f"routing file {p}: no such file")
    if p.suffix == ".npy":
        try:
            ids = np.load(p, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise WeightError(f"routing file {p}: not a readable .npy array ({' '.join(str(exc).split())})") from None
        weights = None
    elif p.suffix in (".jsonl", ".json"):
        ids, weights = _read_jsonl(p)
    else:
        raise WeightError(f"routing file {p}: unknown format {p.suffix!r}; use .npy ([T, K] ids) or .jsonl")
    if ids.ndim == 1:
        ids = ids[:, None]
    if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
        raise WeightError(f"routing file {p}: expected expert ids [tokens, topk], got shape {list(ids.shape)}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise WeightError(f"routing file {p}: expert ids must be integers, not {ids.dtype}")
    for bad, why in ((ids < 0, "ids are >= 0"), (ids > MAX_ID, f"ids are <= {MAX_ID}")):
        if bad.any():
            t, k = (int(v) for v in np.argwhere(bad)[0])
            raise WeightError(f"routing file {p}: token {t} has expert id {int(ids[t, k])}, out of range ({why})")
    srt = np.sort(ids, axis=1)
    dup = np.argwhere((srt[:, 1:] == srt[:, :-1]).any(axis=1)) if ids.shape[1] > 1 else np.empty((0, 1))
    if dup.size:
        t = int(dup[0][0])
        raise WeightError(f"routing file {p}: token {t} names an expert twice ({ids[t].tolist()})")
    return RoutingTrace(p, ids.astype(np.int32), weights)


def _read_jsonl(p: Path) -> tuple[np.ndarray, np.ndarray | None]:
    rows, weights = [], []
    with open(p) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except ValueError:
                raise WeightError(f"routing file {p}: line {n} is not JSON") from None
            ids = item.get("ids") if isinstance(item, dict) else item
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise WeightError(f"routing file {p}: line {n}: expected a list of integer expert ids")
            if any(abs(i) > MAX_ID for i in ids):
                raise WeightError(f"routing file {p}: line {n}: expert id out of range ({ids})")
            if rows and len(ids) != len(rows[0]):
                raise WeightError(f"routing file {p}: line {n} has {len(ids)} ids, the first line {len(rows[0])}")
            rows.append(ids)
            w = item.get("weights") if isinstance(item, dict) else None
            if w is not None and (not isinstance(w, list) or len(w) != len(ids) or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) for v in w)):
                raise WeightError(f"routing file {p}: line {n}: weights must be a list of {len(ids)} numbers")
            weights.append(w)
    if not rows:
        raise WeightError(f"routing file {p}: no tokens")
    have = [w is not None for w in weights]
    if any(have) and not all(have):
        raise WeightError(f"routing file {p}: weights on some lines only (give them on every line or none)")
    w = np.asarray(weights, dtype=np.float32) if all(have) else None
    if w is not None and (~np.isfinite(w) | (w <= 0)).any():
        raise WeightError(f"routing file {p}: routing weights must be positive and finite")
    return np.asarray(rows, dtype=np.int64), w


def torch_window(trace: RoutingTrace, T: int, offset: int, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    ids, w = trace.window(T, offset)
    return (torch.from_numpy(np.ascontiguousarray(ids)).to(device),
            None if w is None else torch.from_numpy(np.ascontiguousarray(w)).to(device))
