"""Tuning: declared config spaces (space.py), the tuned-config store (store.py), the offline-pruned candidate plan
(plan.py), the timed rounds (session.py), the selection (search.py) and the `tune` / `tuned` commands (cli.py).
docs/tune.md."""

from spark_bench.tune.space import SPACES, ConfigSpace, config_id, declare, split

__all__ = ["SPACES", "ConfigSpace", "config_id", "declare", "split"]
