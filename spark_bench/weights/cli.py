"""The command-line options of a weight source, shared by `run`, `profile` and (as --spark-*) the pytest plugin."""

from __future__ import annotations

from pathlib import Path

import click

__all__ = ["make_spec", "weight_options"]


def make_spec(*args, **kwargs):
    """spark_bench.weights.make_spec, imported when called (it needs torch; declaring the options does not)."""
    from spark_bench.weights.layer import make_spec as make

    return make(*args, **kwargs)


def weight_options(fn):
    """--weights PATH, --layer N, --routing FILE, --activations FILE (docs/weights.md)."""
    fn = click.option("--activations", "activations", type=click.Path(path_type=Path), default=None, metavar="FILE",
                      help="Captured activations (.npy [tokens, hidden]) fed to the layer's ops as x.")(fn)
    fn = click.option("--routing", "routing", type=click.Path(path_type=Path), default=None, metavar="FILE",
                      help="Expert ids per token to replay (.npy [T, K] or .jsonl): routing axis value `file`.")(fn)
    fn = click.option("--layer", type=int, default=None, metavar="N",
                      help="The layer of --weights to benchmark (needed when the file holds several).")(fn)
    fn = click.option("--weights", "weights", type=click.Path(path_type=Path), default=None, metavar="PATH",
                      help="A model's safetensors (file, index or directory) or GGUF file: the KDA and MoE ops take "
                           "this layer's weights and shapes (docs/weights.md).")(fn)
    return fn
