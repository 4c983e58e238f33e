"""What the `spark-bench history` commands share: their options (--db, --fingerprint, --branch, --threshold,
--repo), the rich console and tables imported on first use, and the one-line errors for a database SQLite or our
decoding refuses."""

from __future__ import annotations

import contextlib
import functools
import json
import sqlite3
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from spark_bench.history import gitinfo
from spark_bench.history.store import DEFAULT_DB, HistoryError, connect, mistyped

db_option = click.option("--db", type=click.Path(path_type=Path), default=DEFAULT_DB, show_default=True,
                         help="The history database (SQLite).")
fingerprint_option = click.option("--fingerprint", default=None,
                                  help="Only this device fingerprint (id, id prefix, or device-name substring).")
branch_option = click.option("--branch", default=None, help="Only runs of this branch.")
threshold_option = click.option("--threshold", default="5%", show_default=True,
                                help="Smallest step that counts (5%, 0.05).")


def _work_tree(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """A --repo given must be a git work tree: else commit times and suspects would be silently left out."""
    if value is not None and gitinfo.find_repo(value) is None:
        raise click.BadParameter(f"{str(value)!r} is not in a git work tree")
    return value


repo_option = click.option("--repo", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
                           callback=_work_tree,
                           help="Git repository for commit times and suspect commits (default: around the cwd).")


def console(stderr: bool = False) -> Any:
    """The project's rich console, imported only when something is printed as a table (queries stay quick)."""
    from spark_bench.console import console as make

    return make(stderr=stderr)


def Table(*args: Any, **kwargs: Any) -> Any:  # noqa: N802  (rich's class, imported on first use)
    from rich.table import Table as RichTable

    return RichTable(*args, **kwargs)


def step_threshold(text: str) -> float:
    """--threshold as a fraction (5% -> 0.05); a malformed one is a HistoryError."""
    from spark_bench.report.compare import CompareError, parse_threshold

    try:
        return parse_threshold(text)
    except CompareError as exc:
        raise HistoryError(str(exc)) from None


def one_line_errors(f: Callable[..., Any]) -> Callable[..., Any]:
    """SQLite failures (a corrupt page, a lock held past the busy timeout) and stored values a damaged file no longer
    decodes (text that is not UTF-8, a compressed run or JSON that does not decompress or parse) become a one-line
    HistoryError naming the database."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        db = kwargs.get("db") or "history database"
        try:
            return f(*args, **kwargs)
        except sqlite3.Error as exc:
            raise HistoryError(f"{db}: {' '.join(str(exc).split())}") from None
        except (zlib.error, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise HistoryError(f"{db}: damaged history database (a stored value does not decode: "
                               f"{' '.join(str(exc).split())[:200]})") from None
        except (TypeError, ValueError, AttributeError):
            found = _mistyped(kwargs.get("db"))  # a value of the wrong type, written by another program?
            if found:
                raise HistoryError(f"{db}: damaged history database ({found})") from None
            raise  # not the file's fault: a bug of ours, with its traceback

    return wrapper


def _mistyped(db: Path | None) -> str | None:
    if db is None or not Path(db).is_file():
        return None
    try:
        con = sqlite3.connect(db)
    except sqlite3.Error:
        return None
    try:
        return mistyped(con)
    except sqlite3.Error:
        return None
    finally:
        con.close()


@contextlib.contextmanager
def opened(db: Path) -> Iterator[sqlite3.Connection]:
    con = connect(db)
    try:
        yield con
    finally:
        con.close()
