"""Float8 and the execution mode in the planner (NOTE [execution and float8 in the plan]): float8 weighed by the price
of the plans as built, with and without it; a compiled plan priced and stated as compiled; a partial schedule's
float8 forcing it; the float8 linears replicated over tensor axes; the plan file; a planned float8 schedule verified
on gloo; the refusals."""

from __future__ import annotations

import pytest
import torch

import treadle
from treadle.cost.cluster import parse_cluster
from treadle.errors import PlanError
from treadle.mesh import Mesh
from treadle.models.zoo import named_model
from treadle.planner import plan_model
from treadle.planner.plan import Plan

pytest.importorskip("transformers")
pytest.importorskip("torchao")


def _model(batch: int = 8, seq: int = 128, fake: bool = True):
    model, inputs = named_model("tiny-llama", batch=batch, seq=seq, fake=fake, dtype=torch.bfloat16,
                                dropout=False)
    model.config.use_cache = False
    return model, inputs


def _chosen_is_fastest(plan) -> None:
    rows = plan.solver["priced"]
    assert {r["roles"] for r in rows} >= {plan.roles}
    assert plan.price["step_s"] == pytest.approx(min(r["step_s"] for r in rows))


def test_float8_is_weighed_by_the_price_compiled_and_eager():
    """The best plans with and without float8 are both priced as built, eager and compiled, and the faster wins
    (the tiny model's products are small, so which one depends on its casts; `bench/bench_published.py --plan`
    shows float8 chosen at 8B shapes compiled and refused eager); the plan states its execution and prices itself
    so."""
    model, inputs = _model()
    cl = parse_cluster("1x2:h100")
    for execution in ("compiled", "eager"):
        plan = plan_model(model, inputs, cluster=cl, execution=execution, float8="tensorwise", pp_axis=None)
        kinds = {"float8 tensorwise" in r["roles"] for r in plan.solver["priced"]}
        assert kinds == {True, False}, plan.solver["priced"]
        _chosen_is_fastest(plan)
        assert plan.execution == execution and plan.price["execution"] == execution
        assert ("overlap modelled, blocks compiled)" in plan.explain()) == (execution == "compiled")
        lines = plan.python_lines()
        assert any("float8(" in ln for ln in lines) == ("float8" in plan.roles)


def test_float8_in_the_plan_converts_the_block_linears_replicated_over_tensor_axes():
    """A partial schedule's float8 forces it; under a tensor axis the converted linears' weights are not split (the
    solver keeps their ops replicated there), and the decision names the block list, all-gathering in float8 under
    ZeRO-3."""
    model, inputs = _model()
    part = treadle.create_schedule(model, mesh=Mesh((2, 2), ("dp", "tp")))
    part["model.layers"].float8()
    plan = plan_model(model, inputs, cluster=parse_cluster("2x2:h100"), partial_schedule=part, dp_axis="dp",
                      zero=True, pp_axis=None, price_top=0)
    assert "float8 tensorwise" in plan.roles
    f8 = [d for d in plan.decisions if d.op == "float8"]
    assert [(d.path, d.args) for d in f8] == [("model.layers", {"recipe": "tensorwise", "all_gather": True})]
    linears = {f"model.layers.{i}.{m}" for i in range(4) for m in ("self_attn.q_proj", "self_attn.k_proj",
                                                                     "self_attn.v_proj", "self_attn.o_proj",
                                                                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert not [d for d in plan.decisions if d.op == "shard" and d.path in linears]
    sch = plan.schedule
    assert set(sch.view().extras["float8"]["model.layers"].linears) == linears
    again = Plan.from_json(plan.to_json())
    assert again.execution == "eager" and [d.op for d in again.decisions if d.op == "float8"] == ["float8"]


@pytest.mark.timeout(300)
def test_a_planned_float8_schedule_verifies_on_gloo():
    model, inputs = _model(batch=4, seq=32, fake=False)
    model = model.float()
    part = treadle.create_schedule(model, mesh=Mesh((2,), ("dp",)))
    part["model.layers"].float8()
    plan = plan_model(model, inputs, cluster=parse_cluster("2x1:cpu"), partial_schedule=part, dp_axis="dp",
                      pp_axis=None, price_top=0)
    assert any(d.op == "float8" for d in plan.decisions)
    assert treadle.verify(plan.schedule, inputs).ok


def test_execution_and_float8_refusals():
    model, inputs = _model()
    cl = parse_cluster("1x2:h100")
    with pytest.raises(PlanError, match=r"execution must be one of \['eager', 'compiled'\], got 'jit'"):
        plan_model(model, inputs, cluster=cl, execution="jit")
    with pytest.raises(PlanError, match=r"float8 must be a recipe in \['rowwise', 'rowwise_with_gw_hp', "
                                        r"'tensorwise'\] or None, got 'e4m3'"):
        plan_model(model, inputs, cluster=cl, float8="e4m3")
    with pytest.raises(PlanError, match="a compiled plan cannot pipeline"):
        plan_model(model, inputs, cluster=cl, execution="compiled", pp_axis="dp")
    with pytest.raises(PlanError, match="price_top must be >= 1 with float8"):
        plan_model(model, inputs, cluster=cl, float8="tensorwise", price_top=0)
