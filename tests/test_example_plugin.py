"""docs/plugins.md's worked example is the real package examples/rmsnorm-plugin: installed, discovered by its entry
points, swept, and quoted verbatim by the doc."""

import json
import os
import shutil
import subprocess
import sys

import tomllib
from conftest import REPO, spark_bench_cmd

EXAMPLE = REPO / "examples" / "rmsnorm-plugin"
FILES = ["pyproject.toml", "my_rmsnorm/rmsnorm.py", "my_rmsnorm/kernels.py", "my_rmsnorm/gate_ext.py"]


def test_the_doc_quotes_the_example_files_verbatim():
    doc = (REPO / "docs" / "plugins.md").read_text()
    for rel in FILES:
        assert f"# examples/rmsnorm-plugin/{rel}\n" + (EXAMPLE / rel).read_text().rstrip("\n") + "\n```" in doc, rel


def test_the_example_pyproject_is_complete():
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    assert project["name"] and project["version"]
    for target in project["entry-points"]["spark_bench.plugins"].values():
        assert (EXAMPLE / (target.replace(".", "/") + ".py")).is_file(), target


def test_the_example_installs_and_sweeps(tmp_path):
    site, source = tmp_path / "site", tmp_path / "source"
    shutil.copytree(EXAMPLE, source)  # pip builds in the source tree: keep the repository clean
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--no-index", "--target", str(site), str(source)], capture_output=True, text=True,
                         timeout=600)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    env = {k: v for k, v in os.environ.items() if k != "SPARK_BENCH_PLUGINS"}  # found by its entry points only
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH", "")]))
    out = tmp_path / "run"
    proc = subprocess.run(spark_bench_cmd("run", "--op", "mine.*", "--op", "kda.gate", "--backend", "torch",
                                          "--backend", "triton", "--backend", "my_gate", "--quick", "--set",
                                          "tokens=1,67", "--set", "head_dim=60", "--dtype", "bf16,fp32", "--out", out,
                                          "--no-report"), env=env, capture_output=True, text=True, timeout=900,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    got = {(r["op"], r["backend"], r["dtype"]) for r in records}
    assert {("mine.rmsnorm", b, d) for b in ("torch", "triton") for d in ("bf16", "fp32")} <= got
    assert ("kda.gate", "my_gate", "bf16") in got
    assert all(r["status"] == "ok" for r in records), [(r["op"], r["backend"], r["error"]) for r in records
                                                       if r["status"] != "ok"]
