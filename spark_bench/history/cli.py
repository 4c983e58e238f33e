"""`spark-bench history ...`: ingest runs into the history database, list and show them, print one case's trend,
gate on new regressions (`check`), write the trend report, prune old runs. docs/history.md."""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path

import click
from rich.markup import escape

from spark_bench.history import detect, gitinfo, query
from spark_bench.history.cli_options import (
    Table,
    branch_option,
    console,
    db_option,
    fingerprint_option,
    one_line_errors,
    opened,
    repo_option,
    step_threshold,
    threshold_option,
)
from spark_bench.history.gate import parse_age, regressions
from spark_bench.history.ingest import add_runs
from spark_bench.history.store import HistoryError
from spark_bench.options import OutputPath, SparkGroup


@click.group("history", cls=SparkGroup)  # one-line errors standalone too
def history() -> None:
    """Performance history across runs and commits: ingest runs, trends, step detection, the nightly gate."""


@history.command("add")
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(path_type=Path))
@db_option
@click.option("--branch", default=None, help="Record the runs under this branch (default: the repository's current "
                                              "branch when it contains the run's commit).")
@repo_option
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=None,
              help="Processes parsing runs while this one writes (default: one per core, at most 4).")
@click.option("-q", "--quiet", is_flag=True, help="Only the totals.")
@click.option("--allow-fewer-cases", is_flag=True,
              help="Let a changed run replace its stored copy even when it now holds fewer cases.")
@one_line_errors
def add_cmd(run_dirs: tuple[Path, ...], db: Path, branch: str | None, repo: Path | None, jobs: int | None,
            quiet: bool, allow_fewer_cases: bool) -> None:
    """Ingest RUN_DIR... (run directories, or directories of runs such as results/) into the database. Adding a run
    again changes nothing; a run whose files changed since (resumed) replaces its earlier copy. Another run with an
    id already stored (the same --out name, e.g. a nightly directory) is kept beside it as ID@<created>.

    A damaged run (an unreadable or malformed file) found in a directory of runs is skipped with a warning and the
    others are added: exit 1. A damaged run named on the command line stops the ingest: exit 2. A changed run that
    holds fewer cases than its stored copy (a truncated results.jsonl) counts as damaged unless --allow-fewer-cases."""
    def each(path: Path, run_id: str, outcome: str) -> None:
        if not quiet:
            click.echo(f"{outcome:9s} {run_id}  ({path})")

    def damaged(path: Path, why: str) -> None:
        click.echo(f"warning: skipped the damaged run {path}: {why}", err=True)

    counts = add_runs(db, run_dirs, repo=repo, branch=branch, on_run=each, jobs=jobs, on_damaged=damaged,
                      allow_fewer_cases=allow_fewer_cases)
    click.echo(f"history {db}: " + ", ".join(f"{n} {k}" for k, n in counts.items()))
    if counts.get("damaged"):
        sys.exit(1)


@history.command("list")
@db_option
@click.option("--runs", "show_runs", is_flag=True, help="List the runs themselves, newest first.")
@fingerprint_option
@branch_option
@click.option("--limit", type=click.IntRange(min=1, max=2**63 - 1), default=None,  # SQLite's LIMIT is 64-bit
              help="At most N runs (with --runs).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@one_line_errors
def list_cmd(db: Path, show_runs: bool, fingerprint: str | None, branch: str | None, limit: int | None,
             as_json: bool) -> None:
    """Runs per device fingerprint and branch (with --runs: the runs)."""
    with opened(db) as con:
        rows = query.runs(con, fingerprint, branch, limit) if show_runs or fingerprint else query.fingerprints(
            con, branch)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    out = console()
    if show_runs or fingerprint:
        table = Table(title=f"{len(rows)} runs in {escape(str(db))}")
        for col in ("run", "device", "branch", "commit", "run at", "cases", "failed"):
            table.add_column(col)
        for r in rows:
            table.add_row(escape(r["run_id"]), escape(str(r["device"])), escape(r["branch"] or "-"),
                          escape(_commit(r["commit"], r["dirty"])), escape(r["created"] or "?"),
                          str(r["cases"]), str(r["failed"]))
    else:
        table = Table(title=f"history {escape(str(db))}")
        for col in ("fingerprint", "device", "branch", "runs", "first", "last", "latest commit"):
            table.add_column(col)
        for r in rows:
            table.add_row(escape(r["fingerprint_id"]), escape(str(r["device"])), escape(r["branch"] or "-"),
                          str(r["runs"]), escape(r["first"] or "?"), escape(r["last"] or "?"),
                          escape(_commit(r["latest_commit"], False)))
    out.print(table)


def _commit(commit: str | None, dirty: bool | None) -> str:
    return (commit[:10] + (" (dirty)" if dirty else "")) if commit else "no commit"


@history.command("show")
@click.argument("run_id")
@db_option
@click.option("--failed", is_flag=True, help="Only the cases that did not pass.")
@click.option("--json", "as_json", is_flag=True, help="The stored run.json and records (samples included).")
@one_line_errors
def show_cmd(run_id: str, db: Path, failed: bool, as_json: bool) -> None:
    """One stored run (RUN_ID or a unique prefix of it), as `spark-bench show` prints a run directory."""
    from spark_bench.console import failures_table, results_table, summary_line
    from spark_bench.results import summarize_statuses

    with opened(db) as con:
        stored = query.run(con, run_id)
    records = [r for r in stored["results"] if not failed or r.get("status") != "ok"]
    if as_json:  # stored_id: the id in this database (ID@<created> when another run held the run's own id)
        click.echo(json.dumps({"stored_id": stored["stored_id"], "run": stored["run"], "results": records},
                              default=str))
        return
    run, out = stored["run"], console()
    dev = (run.get("fingerprint") or {}).get("device") or {}
    git = (run.get("fingerprint") or {}).get("git") or {}
    out.print(results_table(records, title=f"{stored['stored_id']} on {dev.get('name', '?')} ({dev.get('type', '?')}) "
                                           f"at {_commit(git.get('commit'), git.get('dirty'))}"))
    fails = failures_table(records)
    if fails is not None:
        out.print(fails)
    out.print(summary_line(summarize_statuses(stored["results"])))


def _series(con: sqlite3.Connection, ops, backends, sets, dtypes, fingerprint, branch,
            threshold: float) -> list[detect.Series]:
    cases = query.select_cases(con, ops, backends, sets, dtypes)
    rows = query.series_rows(con, [c.id for c in cases], fingerprint, branch)
    return detect.all_series(cases, rows, threshold=threshold)


@history.command("trend")
@click.option("--op", "ops", multiple=True, required=True, help="Op name or glob.")
@click.option("--backend", "backends", multiple=True, help="Backend (repeatable).")
@click.option("--set", "sets", multiple=True, metavar="AXIS=V",
              help="Parameter value(s) of the case (by value: fused=true).")
@click.option("--dtype", "dtypes", multiple=True, help="dtype.")
@db_option
@fingerprint_option
@branch_option
@threshold_option
@click.option("--last", type=click.IntRange(min=0), default=30, show_default=True,
              help="Print the newest N points (0: all; --json has all). Detection always uses the whole series.")
@repo_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@one_line_errors
def trend_cmd(ops, backends, sets, dtypes, db, fingerprint, branch, threshold, last, repo, as_json) -> None:
    """One case's series per device fingerprint, in commit order, with its detected steps."""
    thr = step_threshold(threshold)
    with opened(db) as con:
        cases = query.select_cases(con, ops, backends, sets, dtypes)
        if not cases:
            raise HistoryError("no stored case matches the selection (see `spark-bench history list`)")
        if len(cases) > 1:
            raise HistoryError(f"the selection matches {len(cases)} cases (e.g. {cases[0].label}; {cases[1].label}); "
                               "narrow it with --backend, --set AXIS=V and --dtype")
        series = detect.all_series(cases, query.series_rows(con, [cases[0].id], fingerprint, branch), threshold=thr)
    repo_path = gitinfo.find_repo(repo) if any(s.steps for s in series) else None
    for s in series:
        for step in s.steps:
            step.suspects = gitinfo.log_range(repo_path, step.last_good.commit, step.first_bad.commit)
    if as_json:
        click.echo(json.dumps([s.to_dict() for s in series], indent=1))
        return
    out = console()
    if not series:
        out.print(f"{escape(cases[0].label)}: no stored results")
    for s in series:
        steps = {st.index: st for st in s.steps}
        table = Table(title=f"{escape(s.case.label)} on {escape(s.device)} ({escape(s.fingerprint_id)}): "
                            f"{len(s.points)} points, " + (f"noise ±{s.sigma * 100:.2f}%" if s.sigma is not None else
                                           "too few timed points to estimate noise or find steps (3 needed)"))
        for col in ("#", "commit", "when", "runs", "status", f"median {s.unit}", "95% CI", "n", "timer", "step"):
            table.add_column(col, justify="right" if col in ("#", "n") or col.startswith("median") else "left")
        first = max(0, len(s.points) - last) if last else 0
        if first:
            table.caption = f"the newest {last} of {len(s.points)} points (--last 0 prints all)"
        for i, p in enumerate(s.points):
            if i < first:
                continue
            st = steps.get(i)
            mark = (f"[{'red' if st.direction == 'slower' else 'green'}]{st.direction} "
                    f"{(st.ratio - 1) * 100:+.1f}% (conf {st.confidence:.3f})[/]") if st else ""
            table.add_row(str(i), escape(p.label), escape(p.time or "?"), str(len(p.run_ids)), escape(p.status),
                          _num(p.median), f"{_num(p.ci_low)}–{_num(p.ci_high)}" if p.median else "", str(p.n),
                          escape("/".join(p.timers) or "-"), mark)
        out.print(table)
        for st in s.steps:
            _print_step(out, s, st)


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def _print_step(out, s: detect.Series, st: detect.Step) -> None:
    out.print(f"  step {st.direction} {(st.ratio - 1) * 100:+.1f}% ({_num(st.before)} → {_num(st.after)} {s.unit} "
              f"median per call, geometric means of {st.n_before} and {st.n_after} commits; confidence "
              f"{st.confidence:.4f}) between {escape(st.last_good.label)} and {escape(st.first_bad.label)} (first "
              f"run after: {escape(st.first_bad.run_ids[0])})", markup=True)
    for line in [*st.cautions(), *st.suspects_shown(20)]:
        out.print(f"    {escape(line)}")


@history.command("check")
@click.option("--since", required=True, metavar="COMMIT|DATE",
              help="Gate on steps after this commit (exclusive) or first measured on/after this date (UTC).")
@click.option("--op", "ops", multiple=True, help="Op name or glob (repeatable). Default: every op.")
@click.option("--backend", "backends", multiple=True, help="Backend (repeatable).")
@db_option
@fingerprint_option
@branch_option
@threshold_option
@repo_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@one_line_errors
def check_cmd(since, ops, backends, db, fingerprint, branch, threshold, repo, as_json) -> None:
    """Exit 1 when a case stepped slower beyond the threshold (or stopped passing) after SINCE; the nightly gate.
    Exit 0: nothing regressed; 2: usage error."""
    thr = step_threshold(threshold)
    repo_path = gitinfo.find_repo(repo)
    with opened(db) as con:
        all_s = _series(con, ops, backends, (), (), fingerprint, branch, thr)
    if not all_s:
        raise HistoryError("no stored case matches the selection (see `spark-bench history list`)")
    gate = regressions(all_s, since, repo_path)
    found = gate.found

    def newest(s):  # (status, error) of the newest run of the newest commit: what a 'broken' verdict is about
        return (s.points[-1].newest or (s.points[-1].status, s.points[-1].error, None))[:2]

    if as_json:
        click.echo(json.dumps([{"op": s.case.op, "backend": s.case.backend, "dtype": s.case.dtype,
                                "params": s.case.params, "fingerprint_id": s.fingerprint_id, "device": s.device,
                                "unit": s.unit, "verdict": v,
                                **(st.to_dict() if st else dict(zip(("status", "error"), newest(s), strict=True)))}
                               for s, v, st in found], indent=1))
    else:
        out = console(stderr=bool(found))
        unplaced = sorted({f"{s.device} [{s.fingerprint_id}]" for s in gate.unplaced})
        if unplaced:  # never silently passed: said on stderr, whatever the verdict
            console(stderr=True).print(
                f"note: {len(gate.unplaced)} series not checked: {escape(', '.join(unplaced))} never ran "
                f"{escape(since)} and the repository does not place it (give a date, or --fingerprint)")
        if not found:
            from spark_bench.console import fmt_pct

            checked = len(all_s) - len(gate.unplaced)
            short = sum(s.sigma is None for s in all_s if s not in gate.unplaced)  # find_steps needs 3 timed points
            unchecked = (f"; {short} of them with fewer than 3 timed points, which cannot show a step"
                         if short else "")
            out.print(f"history check: no case stepped slower than {fmt_pct(100 * thr)} since {escape(since)} "
                      f"({checked} series, {gate.in_window} with runs after it{unchecked})", soft_wrap=True)
        else:
            out.print(f"[bold red]REGRESSED[/]: {len(found)} case(s) since {escape(since)}")
            for s, v, st in found:
                out.print(f"  {escape(s.case.label)} on {escape(s.device)} [{escape(s.fingerprint_id)}]: {v}"
                          + ("" if st else " ({}: {})".format(*(escape(x or "") for x in newest(s)))))
                if st is not None:
                    _print_step(out, s, st)
    if found:
        sys.exit(1)


@history.command("report")
@click.option("-o", "--output", type=OutputPath(file=True), default=Path("trends.html"), show_default=True,
              help="HTML file to write.")
@click.option("--op", "ops", multiple=True, help="Op name or glob (repeatable). Default: every op.")
@click.option("--backend", "backends", multiple=True, help="Backend (repeatable).")
@db_option
@fingerprint_option
@branch_option
@threshold_option
@repo_option
@click.option("--last", type=click.IntRange(min=0), default=None,
              help="Chart only the newest N points per series (0: all).")
@one_line_errors
def report_cmd(output, ops, backends, db, fingerprint, branch, threshold, repo, last) -> None:
    """One offline HTML page: detected regressions and improvements first, then a trend chart per op."""
    from spark_bench.history.report import write_trends

    thr = step_threshold(threshold)
    with opened(db) as con:
        series = _series(con, ops, backends, (), (), fingerprint, branch, thr)
    if not series:
        raise HistoryError("no stored case matches the selection (see `spark-bench history list`)")
    repo_path = gitinfo.find_repo(repo)
    for s in series:
        for st in s.steps:
            st.suspects = gitinfo.log_range(repo_path, st.last_good.commit, st.first_bad.commit)
    try:
        click.echo(str(write_trends(series, output, db=db, threshold=thr, last=last)))
    except OSError as exc:  # -o a directory, a read-only place
        raise HistoryError(f"-o {output}: {exc.strerror or exc}") from None


@history.command("prune")
@db_option
@click.option("--older-than", default=None, metavar="AGE|DATE", help="Drop runs created before this (90d, 2026-06-01).")
@click.option("--keep", type=int, default=None, help="Keep only the newest N runs per fingerprint and branch.")
@fingerprint_option
@branch_option
@click.option("--dry-run", is_flag=True, help="Print what would go; change nothing.")
@one_line_errors
def prune_cmd(db, older_than, keep, fingerprint, branch, dry_run) -> None:
    """Drop old runs (by age, or beyond a count per fingerprint and branch) and the cases no run uses any more."""
    from spark_bench.history.store import prune

    if older_than is None and keep is None:
        raise HistoryError("prune needs --older-than AGE and/or --keep N")
    if keep is not None and keep < 1:
        raise HistoryError("--keep must be at least 1")
    cutoff = parse_age(older_than) if older_than else None
    with opened(db) as con:
        fp = query.resolve_fingerprint(con, fingerprint) if fingerprint else None
        gone = prune(con, cutoff=cutoff, keep=keep, fingerprint_id=fp, branch=branch, dry_run=dry_run)
    for run_id in gone:
        click.echo(f"{'would drop' if dry_run else 'dropped'} {run_id}")
    click.echo(f"history {db}: {len(gone)} run(s) {'would be ' if dry_run else ''}pruned")
