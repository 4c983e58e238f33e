"""Initialisers for KDA parameters, the way the model initialises them (kda.md pitfall 7: an uninitialised
dt_bias gives NaNs): dt ~ logU(1e-3, 0.1), dt_bias = dt + log(-expm1(-dt)), A ~ U(1, 16), a_log = log A."""

import torch

from spark_bench.inputs import log_uniform, uniform


def a_log(heads: int, gen: torch.Generator, device: str) -> torch.Tensor:
    """[H] fp32, per head."""
    return uniform((heads,), gen, 1.0, 16.0, device=device).log()


def dt_bias(channels: int, gen: torch.Generator, device: str) -> torch.Tensor:
    """[H*K] fp32, per channel: the inverse softplus of dt."""
    dt = log_uniform((channels,), gen, 1e-3, 0.1, device=device)
    return dt + torch.log(-torch.expm1(-dt))
