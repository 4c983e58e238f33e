"""The kernels' declared config spaces: the mechanism lives in the framework (spark_bench/tune/space.py), where a
third-party kernel declares its own the same way; docs/tune.md."""

from spark_bench.tune.space import LAUNCH_OPTIONS, SPACES, ConfigSpace, config_id, declare, split

__all__ = ["LAUNCH_OPTIONS", "SPACES", "ConfigSpace", "config_id", "declare", "split"]
