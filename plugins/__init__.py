"""Spark-bench op plugins: one module per op, each registered as a `spark_bench.plugins` entry point."""
