"""Run files that pass the top-level schema check but hold a malformed nested field (or an amendment that makes one):
`show`, `report` and `compare` end with one line and exit 2, never a traceback; statuses never parse as markup."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
import report_fixtures as fx  # noqa: E402

from spark_bench.cli import main  # noqa: E402
from spark_bench.results import load_run  # noqa: E402

PARAMS = ({"tokens": 16, "heads": 4, "head_dim": 128}, {"tokens": 64, "heads": 4, "head_dim": 128})


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A small CPU run: two timed torch cases and a failed triton one."""
    rng = np.random.default_rng(0)
    cases = [fx.case("kda.gate", "torch", p, samples=fx.draw(rng, 50.0), nbytes=4e4, device="cpu") for p in PARAMS]
    cases.append(fx.case("kda.gate", "triton", PARAMS[0], status="error", error="boom", device="cpu"))
    return fx.write_run(tmp_path_factory.mktemp("runs") / "base", cases, device={"type": "cpu", "name": "EPYC"})


def _run_json(change):
    def apply(path: Path) -> None:
        run = json.loads((path / "run.json").read_text())
        change(run)
        (path / "run.json").write_text(json.dumps(run))
    return apply


def _first_record(change):
    def apply(path: Path) -> None:
        lines = (path / "results.jsonl").read_text().splitlines()
        rec = json.loads(lines[0])
        change(rec)
        (path / "results.jsonl").write_text("\n".join([json.dumps(rec), *lines[1:]]) + "\n")
    return apply


def _amendment(fields, label=None):
    def apply(path: Path) -> None:
        target = json.loads((path / "results.jsonl").read_text().splitlines()[0])["case_id"]
        with open(path / "results.jsonl", "a") as f:
            f.write(json.dumps({"schema_version": 1, "amends": target, "label": label, "fields": fields}) + "\n")
    return apply


def _timing(key, value):
    return _first_record(lambda r: r["timing"].__setitem__(key, value))


# damage -> (how to make it, what the one-line error names)
DAMAGES = {
    "fingerprint-null": (_run_json(lambda r: r.__setitem__("fingerprint", None)),
                         "run.json: field 'fingerprint' must be an object, not null"),
    "device-string": (_run_json(lambda r: r["fingerprint"].__setitem__("device", "cpu")),
                      "run.json: field 'fingerprint.device' must be an object, not a string"),
    "git-string": (_run_json(lambda r: r["fingerprint"].__setitem__("git", "3f2a")), "field 'fingerprint.git'"),
    "power-limit-string": (_run_json(lambda r: r["fingerprint"].__setitem__("power", {"limit_w": "700 W"})),
                           "field 'fingerprint.power.limit_w' must be a number"),
    "labels-not-strings": (_first_record(lambda r: r.__setitem__("labels", [1, {"a": 2}])),
                           "results.jsonl:1: field 'labels[0]' must be a string, not a number"),
    "p10-string": (_timing("p10", "fast"), "results.jsonl:1: field 'timing.p10' must be a number or null"),
    "samples-string": (_timing("samples", "abc"), "field 'timing.samples' must be a list or null, not a string"),
    "samples-of-strings": (_timing("samples", ["a", "b"]), "field 'timing.samples[0]' must be a number"),
    "list-param": (_first_record(lambda r: r["params"].__setitem__("tokens", [16])),
                   "field 'params.tokens' must be a string or a number or true/false or null, not a list"),
    "amended-markup-status": (_amendment({"status": "[bold red]x[/]"}),
                              "results.jsonl:4: amendment: unknown status '[bold red]x[/]'"),
    "amended-params-null": (_amendment({"params": None}), "amendment: field 'params' must be an object, not null"),
    "amended-labels-string": (_amendment({"labels": "abc"}, label="suspect"),
                              "amendment: field 'labels' must be a list, not a string"),
    "amended-bad-timing": (_amendment({"timing": {"median": "slow"}}), "amendment: field 'timing.median'"),
}


@pytest.fixture(scope="module")
def damaged(base, tmp_path_factory):
    """damage name -> a copy of the base run with that damage."""
    root = tmp_path_factory.mktemp("damaged")
    out = {}
    for name, (apply, _) in DAMAGES.items():
        out[name] = Path(shutil.copytree(base, root / name))
        apply(out[name])
    return out


def _cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


COMMANDS = {
    "show": lambda run, base, tmp: ("show", run),
    "show --set": lambda run, base, tmp: ("show", run, "--set", "tokens=16"),
    "report": lambda run, base, tmp: ("report", run, "-o", tmp / "r.html"),
    "compare base new": lambda run, base, tmp: ("compare", base, run),
    "compare new base": lambda run, base, tmp: ("compare", run, base),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_run_is_one_line_exit_2(damaged, base, tmp_path, damage, command):
    code, out, err = _cli(*COMMANDS[command](damaged[damage], base, tmp_path))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("spark-bench: error:"), (code, out, err)
    assert DAMAGES[damage][1] in lines[0], lines[0]
    assert "Traceback" not in out + err and not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("command", ["show", "show --set", "report", "compare base new"])
def test_the_undamaged_run_still_loads(base, tmp_path, command):
    code, out, err = _cli(*COMMANDS[command](base, base, tmp_path))
    assert code == 0 and not err.strip(), (code, out, err)


def test_an_amendment_merges_fields_and_its_label(base, tmp_path):
    run = Path(shutil.copytree(base, tmp_path / "run"))
    _amendment({"suspect": "ran before a crash"}, label="suspect")(run)
    _, records = load_run(run)
    assert records[0]["suspect"] == "ran before a crash" and records[0]["labels"] == ["suspect"]


def test_statuses_and_dtypes_never_parse_as_markup():
    """An unknown status (only a record built in memory has one: loading refuses it) prints as its text."""
    from rich.console import Console

    from spark_bench.console import failures_table, results_table

    recs = [fx.case("kda.gate", "torch", PARAMS[0], dtype="[/]bf16", device="cpu"),
            fx.case("kda.gate", "torch", PARAMS[1], status="error", error="[/]boom", device="cpu")]
    recs[0]["status"] = "[bold red]weird[/]"
    out = Console(width=200, record=True)
    out.print(results_table(recs, title="t"))
    out.print(failures_table(recs))
    text = out.export_text()
    assert "[bold red]weird[/]" in text and "[/]bf16" in text and "[/]boom" in text
