"""spark_bench/tune/space.py at its edges: bucket bounds on a key the launch does not pass, a bound naming no key
parameter, launch arguments outside the key, and what `summarize` records of one case's picks. Found by a mutation
audit of the tuner."""

import pytest
from test_tune import SPACE, _store

from spark_bench.tune import ConfigSpace
from spark_bench.tune.space import applied, recording, summarize


def test_a_bound_on_a_key_the_launch_does_not_pass_does_not_hold():
    space = ConfigSpace("edge._b", key=("n", "dtype"), default={"B": 16}, buckets=[({"dtype": "bf16"}, {"B": 8})])
    assert space.declared(n=4, dtype="bf16") == {"B": 8}
    assert space.declared(n=4) == {"B": 16}


def test_a_bucket_bound_that_is_not_a_key_parameter_is_refused_at_declaration():
    with pytest.raises(ValueError, match=r"bucket bounds \['N'\] are not key parameters"):
        ConfigSpace("edge._n", key=("n",), default={"B": 16}, buckets=[({"N": 64}, {"B": 8})])


def test_arguments_outside_the_key_neither_hide_the_tuned_entry_nor_enter_the_record():
    """A wrapper may pass more than the key (a stride, a flag): the key alone finds the table's entry and is logged."""
    table = _store([("test._k", {"n": 1024, "dtype": "bf16"}, {"B": 64, "num_warps": 8}, "t")])
    with applied(table=table), recording() as log:
        assert SPACE.pick(n=1024, dtype="bf16", stride=7)["B"] == 64
    assert log[0]["source"] == "tuned" and log[0]["key"] == {"n": 1024, "dtype": "bf16"}


def test_summarize_keeps_one_source_and_one_config_unwrapped():
    """One case launching a kernel twice from the same source is that source, not "mixed"; one config is stored as
    itself, several as a list."""
    with recording() as log:
        SPACE.pick(n=32, dtype="bf16")
        SPACE.pick(n=32, dtype="bf16")
        SPACE.pick(n=4096, dtype="bf16")
    assert summarize(log[:2]) == {"config": {"test._k": {"B": 8, "num_warps": 2}},
                                  "config_source": {"test._k": "default"}}
    assert summarize(log) == {"config": {"test._k": [{"B": 8, "num_warps": 2}, {"B": 16, "num_warps": 4}]},
                              "config_source": {"test._k": "default"}}
