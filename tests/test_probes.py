"""Backend probes: the Triton interpreter is tried once before a CPU sweep relies on it."""

import numpy
import triton

from spark_bench import probes


def test_interpreter_runs_a_program_id_bounded_loop_here():
    # The real launch (TRITON_INTERPRET=1 in the tests): range(pid, 3 + pid) at pid 0 sums to 3.
    assert probes._run_loop_bound() == 3
    assert probes.interpreter_fault() is None
    assert probes.triton_kernel("cpu") is None


def test_a_broken_interpreter_is_one_reason_naming_versions_and_fix():
    def like_triton_36_on_numpy_24():  # what triton 3.6's interpreter raises there (docstring of interpreter_fault)
        cause = TypeError("only 0-dimensional arrays can be converted to Python scalars")
        raise RuntimeError("InterpreterError") from cause

    reason = probes.interpreter_fault(like_triton_36_on_numpy_24)
    assert reason.startswith(f"triton {triton.__version__}'s interpreter fails with numpy {numpy.__version__}")
    assert "(TypeError: only 0-dimensional arrays" in reason and "pip install 'numpy<2.4'" in reason
    assert "\n" not in reason


def test_a_wrong_interpreted_result_is_a_reason():
    assert probes.interpreter_fault(lambda: 4) == (
        f"triton {triton.__version__}'s interpreter ran a loop wrongly (sum 4, not 3)")
