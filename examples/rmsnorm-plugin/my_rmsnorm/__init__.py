"""spark-bench example plugin (docs/plugins.md): the `mine.rmsnorm` op, and a backend added to `kda.gate`."""
