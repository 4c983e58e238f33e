"""The active weight source of a case (the package's API; see spark_bench/weights/__init__.py)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from spark_bench.weights import config
from spark_bench.weights.formats import WeightError, open_weights
from spark_bench.weights.names import detect_family, layers_in
from spark_bench.weights.routing import load_routing
from spark_bench.weights.validate import (
    F32_ROLES,
    KdaPlan,
    MoePlan,
    layer_tensor_names,
    load_kda,
    load_moe_part,
    plan_kda,
    plan_moe,
)

__all__ = ["FromWeights", "LayerSource", "WeightError", "active", "describe", "make_spec", "source", "using"]


@dataclasses.dataclass(frozen=True)
class FromWeights:
    """An op's binding to a weight source (Op.from_weights).

    family: "kda" or "moe", the part of the layer the op runs.
    fixed(shapes) -> {axis: value} the file fixes for this op, or a string: why this layer cannot feed the op.
        `shapes` is LayerSource.shapes(family) (heads, head_dim_k, head_dim_v, hidden / hidden, experts, inter,
        shared_inter, format, topk, ...).
    make_inputs(params, src, *, device, dtype, seed, factory) -> the op's inputs from the source; `factory` is the
        op's own random factory (for the inputs the file does not give, or when the source is a routing file only).
    redraw(params, src, *, device, dtype, seed, factory) -> just the rotated inputs of another timed set.
    uses: see the field.
    """

    family: str
    fixed: Callable[[dict[str, Any]], dict[str, Any] | str]
    make_inputs: Callable[..., dict[str, Any]]
    redraw: Callable[..., dict[str, Any]] | None = None
    uses: tuple[str, ...] = ()  # what a case's label names besides the file and layer (weights/label.py):
    # "shared" (the op runs the shared expert), "scaling" (its routing weights carry the routed scaling factor)


def make_spec(path: str | None, layer: int | None, routing: str | None,
              activations: str | None = None) -> dict[str, Any] | None:
    """The weight spec of the command-line options (absolute paths), or None when none is given."""
    if path is None and layer is not None:
        raise WeightError("--layer needs --weights PATH")
    if path is None and activations is not None:
        raise WeightError("--activations needs --weights PATH (captured activations are fed to a layer)")
    if path is None and routing is None:
        return None
    spec = {"path": str(Path(path).resolve()) if path else None, "layer": layer,
            "routing": str(Path(routing).resolve()) if routing else None}
    if activations is not None:
        spec["activations"] = str(Path(activations).resolve())
    return spec


class LayerSource:
    """One layer of one weight file (validated from its headers on creation), plus an optional routing trace."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = dict(spec)
        self.routing = load_routing(spec["routing"]) if spec.get("routing") else None
        self.activations = load_activations(spec["activations"]) if spec.get("activations") else None
        self.reader = None
        self.kda: KdaPlan | None = None
        self.moe: MoePlan | None = None
        self.layer = spec.get("layer")
        self.router_mismatch: str | None = None
        # the routed scaling factor the ops use with this source, and its origin (config.routed_scaling)
        self.scaling: tuple[float, str] = (config.DRAWN_SCALING, "ops' default")
        if not spec.get("path"):
            return
        self.reader = open_weights(spec["path"])
        layers = layers_in(self.reader)
        if not layers:
            raise WeightError(f"{spec['path']}: no layer tensors (model.layers.N.* or blk.N.*) found"
                              f"{self._holds('', 'the file')}")
        if self.layer is None:
            if len(layers) > 1:
                raise WeightError(f"{spec['path']} holds layers {_ranges(layers)}: pick one with --layer N")
            self.layer = layers[0]
        elif self.layer not in layers:
            raise WeightError(f"{spec['path']}: no layer {self.layer} (the file holds layers {_ranges(layers)})")
        self.where = f"{spec['path']} layer {self.layer}"
        self.family = detect_family(self.reader, self.layer)
        prefix = f"model.layers.{self.layer}."
        if self.family is None:
            raise WeightError(f"{self.where}: no tensor under a known family's names: looked for {prefix}self_attn."
                              f"A_log (KDA), {prefix}block_sparse_moe.* or {prefix}mlp.* (MoE){self._holds(prefix)}")
        router = config.stated(self.reader, self.family)
        self.kda = plan_kda(self.reader, self.family, self.layer, self.where)
        self.moe = plan_moe(self.reader, self.family, self.layer, self.where, router.values)
        if self.kda is None and self.moe is None:
            prefix = self.family.layer_prefix(self.layer)
            wanted = [prefix + n for n in self.family.kda.get("a_log", ()) + self.family.moe["gate_w"]]
            raise WeightError(f"{self.where}: the layer has neither a KDA block nor an MoE layer (family "
                              f"{self.family.name}): looked for {' or '.join(wanted)}{self._holds(prefix)}")
        if self.moe is not None:
            config.check_router(router, self.moe.dims["E"], self.where)
        self.router_mismatch = router.mismatch  # the file's router is not the ops' (routing=model refuses it)
        self.router_stated = router.values  # what the ops read from the file besides tensors (in the hash)
        self.scaling = config.routed_scaling(router, self.family)  # (value, where it comes from): config.py
        self._loaded: dict[Any, Any] = {}

    def _holds(self, prefix: str, what: str = "the layer") -> str:
        """'; <what> holds <a few of its tensor names>' (for the messages naming what was looked for)."""
        names = sorted(n for n in self.reader.names() if prefix in n)  # also under another prefix (language_model.)
        return f"; {what} holds {', '.join(names[:4])}{', ...' if len(names) > 4 else ''}" if names else ""

    @property
    def has_layer(self) -> bool:
        return self.reader is not None

    def shapes(self, family: str) -> dict[str, Any] | None:
        plan = self.kda if family == "kda" else self.moe
        return None if plan is None else plan.shapes()

    # --- loading (in the worker) --------------------------------------------------------------------------------
    def kda_weights(self, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
        key = ("kda", dtype, str(device))
        if key not in self._loaded:
            cpu = load_kda(self.reader, self.kda, dtype)
            self._loaded[key] = {k: v.to(device) for k, v in cpu.items()}
        return self._loaded[key]

    def moe_part(self, part: str, device) -> dict[str, torch.Tensor]:
        key = ("moe", part, str(device))
        if key not in self._loaded:
            cpu = load_moe_part(self.reader, self.moe, part)
            self._loaded[key] = {k: (v.to(device) if v is not None else None) for k, v in cpu.items()}
        return self._loaded[key]

    def activation_rows(self, T: int, gen: torch.Generator, dtype, device) -> torch.Tensor:
        """T rows of the captured activations, from an offset drawn from `gen` (wrapping around the file)."""
        from spark_bench.dtypes import torch_dtype

        n = self.activations.shape[0]
        offset = int(torch.randint(0, n, (1,), generator=gen, device=gen.device).item())
        rows = (torch.arange(T) + offset) % n
        x = torch.from_numpy(np.ascontiguousarray(self.activations[rows.numpy()]))
        return x.to(device=device, dtype=torch_dtype(dtype))

    def _f32_names(self) -> set[str]:
        """The layer's f32 tensors the ops read as stored (validate.F32_ROLES: checked to be f32 on load)."""
        plans = [p for p in (self.kda, self.moe) if p is not None]
        return {p.names[r] for p in plans for r in F32_ROLES if isinstance(p.names.get(r), str)}

    # --- the fingerprint ------------------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """What the run's fingerprint records: the file(s), sizes, the layer, its tensors and their content hash."""
        out: dict[str, Any] = {}
        if self.reader is not None:
            names = layer_tensor_names(self.kda, self.moe)
            h = hashlib.sha256()
            h.update(json.dumps([self.router_stated, self.router_mismatch], sort_keys=True).encode())
            layer_bytes = 0
            exact = self._f32_names()
            for name in names:
                info = self.reader.info(name)
                h.update(json.dumps([name, info.dtype, list(info.shape)]).encode())
                raw = self.reader.raw(name)
                if name in exact:
                    _check_finite(name, raw, self.where)
                h.update(raw)
                layer_bytes += raw.nbytes
            files = [{"path": str(f), "size_bytes": f.stat().st_size} for f in self.reader.files() if f.exists()]
            out.update({
                "path": self.spec["path"], "format": self.reader.format, "family": self.family.name,
                "layer": self.layer, "files": files, "size_bytes": sum(f["size_bytes"] for f in files),
                "tensors": len(names), "layer_bytes": layer_bytes, "sha256": h.hexdigest(),
                "router": self.router_stated,
                "routed_scaling": {"value": self.scaling[0], "from": self.scaling[1]} if self.moe else None,
                "kda": self.kda.shapes() if self.kda else None, "moe": self.moe.shapes() if self.moe else None,
            })
        if self.routing is not None:
            out["routing"] = self.routing.describe()
        if self.activations is not None:
            from spark_bench.weights.routing import file_sha256

            path = Path(self.spec["activations"])
            out["activations"] = {"path": str(path), "size_bytes": path.stat().st_size, "sha256": file_sha256(path),
                                  "shape": list(self.activations.shape)}
        return out


def _check_finite(name: str, raw: memoryview, where: str) -> None:
    """A NaN or inf in a small f32 tensor the ops take as stored (A_log, dt_bias, the router's correction bias) would
    show up only as a mismatch of every case: refuse the file instead (checked on the bytes the hash reads anyway)."""
    values = np.frombuffer(raw, dtype=np.float32)
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        raise WeightError(f"{where}: {name} holds {bad.size} non-finite value(s) (first {values[bad[0]]} at index "
                          f"{bad[0]}): the file is damaged")


def load_activations(path: str) -> np.ndarray:
    """A captured activation file: a float .npy [tokens, hidden], memory-mapped."""
    p = Path(path)
    if not p.is_file():
        raise WeightError(f"activation file {p}: no such file")
    try:
        x = np.load(p, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise WeightError(f"activation file {p}: not a readable .npy array ({' '.join(str(exc).split())})") from None
    if x.ndim != 2 or x.shape[0] == 0 or not np.issubdtype(x.dtype, np.floating):
        raise WeightError(f"activation file {p}: expected a float array [tokens, hidden], got {x.dtype} "
                          f"{list(x.shape)}")
    return x


def _ranges(layers: list[int]) -> str:
    return f"{layers[0]}..{layers[-1]}" if layers == list(range(layers[0], layers[-1] + 1)) else \
        ", ".join(map(str, layers))


def _key(spec: dict[str, Any]) -> str:
    return json.dumps({k: spec.get(k) for k in ("path", "layer", "routing", "activations")}, sort_keys=True)


@functools.lru_cache(maxsize=4)
def _source(key: str) -> LayerSource:
    return LayerSource(json.loads(key))


def source(spec: dict[str, Any]) -> LayerSource:
    """The (cached) source of a spec: headers read and validated once per process, tensors loaded on request."""
    return _source(_key(spec))


def describe(spec: dict[str, Any]) -> dict[str, Any]:
    return source(spec).describe()


_ACTIVE: contextvars.ContextVar[LayerSource | None] = contextvars.ContextVar("spark_bench_weights", default=None)


@contextlib.contextmanager
def using(spec: dict[str, Any] | None) -> Iterator[LayerSource | None]:
    """Make `spec` the active source while the block runs (a no-op for None)."""
    if not spec:
        yield None
        return
    token = _ACTIVE.set(source(spec))
    try:
        yield _ACTIVE.get()
    finally:
        _ACTIVE.reset(token)


def active() -> LayerSource | None:
    return _ACTIVE.get()
