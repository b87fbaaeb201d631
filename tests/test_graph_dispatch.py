"""The issue's spellings of the graph-level primitives: `find(fn)`, `replace(new, match)`, `checkpoint(match)`,
`checkpoint(save=...)` dispatch to the graph forms, and each result verifies against the original."""

import pytest

import treadle
from treadle import ScheduleError
from test_graph_rewrite import BiasGeLU, _decomposed, _inputs, bias_gelu, gelu_then_linear


def test_find_with_a_function_matches_subgraphs_and_with_a_regex_matches_paths():
    sch = _decomposed()
    assert [s.path for s in sch.find(r"mlp\.fc\d")] == ["mlp.fc1", "mlp.fc2"]
    (m,) = sch["mlp"].find(bias_gelu)
    assert sorted(m.inputs) == ["bias", "x"]


def test_replace_with_a_match_then_verify():
    sch = _decomposed()
    sch["mlp"].replace(BiasGeLU(), sch["mlp"].find(bias_gelu)[0])
    assert "replace_match" in sch.to_python()
    assert treadle.verify(sch, _inputs()).ok


def test_checkpoint_of_a_match_and_selective_then_verify():
    sch = _decomposed()
    sch["mlp"].checkpoint(sch["mlp"].find(gelu_then_linear)[0])
    assert treadle.verify(sch, _inputs()).ok
    sch2 = _decomposed()
    sch2["mlp"].checkpoint(save=["aten.mm"])
    assert treadle.verify(sch2, _inputs()).ok
    with pytest.raises(ScheduleError, match="give one of match=, save= or policy="):
        _decomposed()["mlp"].checkpoint(sch["mlp"].find(bias_gelu), save=["aten.mm"])
