"""Packaging: every package directory ships, under the spark_bench namespace (plugins/ and kernels/ included)."""

import importlib
import sys
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parent.parent
ROOTS = {"spark_bench": REPO / "spark_bench", "spark_bench.plugins": REPO / "plugins",
         "spark_bench.kernels": REPO / "kernels"}


def test_every_package_directory_is_listed_in_pyproject():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    assert config["package-dir"] == {"spark_bench": "spark_bench", "spark_bench.plugins": "plugins",
                                     "spark_bench.kernels": "kernels"}
    found = set()
    for name, root in ROOTS.items():
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root).parts
            found.add(".".join([name, *rel]))
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"


def test_plugins_and_kernels_import_under_the_namespace():
    assert importlib.import_module("spark_bench.plugins.kda.gate").op.name == "kda.gate"
    kernels = importlib.import_module("spark_bench.kernels")
    assert Path(kernels.__file__).resolve().parent == REPO / "kernels"
    assert "kernels" not in sys.modules or Path(sys.modules["kernels"].__file__ or "").parent != REPO / "kernels"


def test_dev_extra_installs_what_the_tests_import():
    """`pip install -e ".[dev]"` then pytest: no test skips for a missing package (scipy: tests/test_compare.py)."""
    dev = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    names = {d.split(">")[0].split("=")[0].split("[")[0].strip() for d in dev}
    assert {"pytest", "ruff", "scipy"} <= names


def test_no_unit_test_asserts_a_wall_time_speed_up():
    """Unit tests assert behaviour, never speed: a loaded CI machine fails any clock comparison (issue 15, item 9)."""
    text = (REPO / "tests" / "test_executors.py").read_text()
    assert "_span(" not in text
