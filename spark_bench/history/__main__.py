"""`python -m spark_bench.history ...`: the history commands without the rest of the CLI (it skips importing torch,
so a query answers in a fraction of a second)."""

from spark_bench.history.cli import history

if __name__ == "__main__":
    history(prog_name="spark-bench history")
