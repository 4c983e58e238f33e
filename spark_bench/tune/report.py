"""The tables `tune` and `tuned show` print: per kernel and key, the chosen config against the declared default."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from spark_bench.tune.space import config_id


def _key(key: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in key.items()) or "-"


def _us(value: float | None) -> str:
    from spark_bench.console import fmt_num

    return fmt_num(value, 4)  # 46670, 12.35: as run's tables, never 4.667e+04


def _cases(entry: dict[str, Any]) -> str:
    """How many cases the choice rests on, and the timings it left out: throttled or recompiling (unranked), and
    candidates the budget left untimed somewhere at this key."""
    left = [f"{entry[k]} {k}" for k in ("unranked", "untimed") if entry.get(k)]
    return str(entry.get("cases", "")) + (f" ({', '.join(left)})" if left else "")


def _drift(entry: dict[str, Any]) -> str:
    """The default's largest change between its two timings, over how many cases ('-': not timed twice)."""
    drift = entry.get("drift")
    return f"{drift['max']:+.1%} ({drift['cases']})" if drift else "-"


def entries_table(rows: list[tuple[str, dict[str, Any]]]) -> Table:
    table = Table()
    left = ("kernel", "key", "config", "runner-up", "labels")
    for col in ("kernel", "key", "config", "µs (geomean)", "default µs (geomean)", "speedup", "noise ±", "runner-up",
                "cases", "drift", "labels"):
        table.add_column(col, justify="left" if col in left else "right")
    for kernel, e in rows:
        runner = e.get("runner_up") or {}
        chosen = "(default)" if e["config"] == e["default"]["config"] else config_id(e["config"])
        close = e.get("within_noise")
        noise = "an unknown" if close and close.get("noise") is None else f"the ±{(close or {}).get('noise', 0):.1%}"
        note = f" ({close['speedup']:.3f}x, within {noise} noise)" if close else ""
        cells = [kernel, _key(e["key"]), chosen, _us(e["time_us"]), _us(e["default"]["time_us"]),
                 f"{e['speedup']:.3f}x", f"{e['noise']:.1%}" if e.get("noise") is not None else "-",
                 f"{config_id(runner['config'])} {_us(runner['time_us'])}{note}"
                 if runner else "-", _cases(e), _drift(e), ",".join(e.get("labels") or [])]
        table.add_row(*map(escape, cells))  # a table's names are text, never rich markup (`k[/]`)
    return table


def print_store(store) -> None:
    from spark_bench.console import console
    from spark_bench.tune.store import describe_device

    out = console()
    rows = store.entries()
    # the heading on its own unwrapped line: a table title wraps with the table's width, mid-path or mid-name
    out.print(f"{store.path}: {describe_device(store.data['device'])}, updated {store.data.get('updated')}, "
              f"{len(rows)} entries", markup=False, soft_wrap=True)
    out.print(entries_table(rows))
    from spark_bench.tune.space import stale_entries, stale_text

    stale = stale_entries(store)
    if stale:
        out.print(f"stale: {stale_text(stale)}", markup=False)
    for where, n in store.foreign_entries().items():
        out.print(f"{n} entries measured on {where} (merged with --force)", markup=False)


def print_table(session, path: Path | None) -> None:
    """After a tune: what was pruned, what was chosen, where the table is."""
    from spark_bench.console import console
    from spark_bench.tune.search import select

    out = console()
    records = session.store.read_results()
    rows = select(session.tune["plan"], records)
    out.print(f"spark-bench tune {session.store.path.name}: {len(rows)} tuned entries", markup=False, soft_wrap=True)
    out.print(entries_table(rows))
    plan = session.tune["plan"]
    pruned = sum(c["status"] == "pruned" for i in plan["items"] for c in i["candidates"])
    failed = [r for r in records if r["status"] != "ok"]
    out.print(f"{len(records)} cases timed or tried ({len(failed)} failed: never chosen), {pruned} candidate "
              f"launch(es) pruned offline ({session.tune.get('target_note')})", markup=False)
    for line in plan.get("capture_errors", [])[:10]:
        out.print(f"capture error (not tuned): {line}", markup=False)
    if plan.get("untunable"):
        out.print(f"{len(plan['untunable'])} case(s) launch no declared kernel: nothing to tune", markup=False)
    out.print(f"tuned table: {path}" if path else "tuned table: not written (no case produced an entry)",
              markup=False)
