"""Float8 linears under tensor parallelism (NOTE [float8 under tensor parallelism] in
`treadle.forms.float8.tensor_parallel`): verified against the single-process float8 model on gloo (TP, TP with
sequence parallelism, DP x TP), each cast's amax reduced over the split axis and priced as the c10d all-reduce it is,
and the refusals (rowwise recipes, float8 all-gather of a split weight, a slice the float8 kernels cannot take)."""

from __future__ import annotations

import math

import pytest
import torch

import treadle
from treadle.cost.cluster import parse_cluster
from treadle.errors import BuildError, ScheduleError, VerifyError
from treadle.mesh import Mesh
from treadle.models.megatron import schedule_llama

transformers = pytest.importorskip("transformers")
pytest.importorskip("torchao")

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _llama(dtype=torch.float32):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg).to(dtype)
    ids = torch.randint(0, 128, (4, 32))
    return model, {"input_ids": ids, "labels": ids}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shape,names,sp,first,gather", [((2,), ("tp",), False, False, False),
                                                         ((2,), ("tp",), True, True, False),
                                                         ((2, 2), ("dp", "tp"), True, False, False),
                                                         ((2, 2), ("dp", "tp"), True, False, True)],
                         ids=["tp2", "tp2-sp-float8-first", "dp2xtp2-sp", "zero3-dp2xtp2-sp-float8-gather"])
def test_verify_float8_under_tensor_parallelism_against_the_float8_reference(shape, names, sp, first, gather):
    """Every output, output gradient, parameter gradient and two optimizer steps of the TP-split float8 model
    against the single-process float8 model, and the float8 model's fidelity to the original; float8 stated before
    or after the split; under ZeRO-3 with the split weights gathered in float8, their scales set over both axes.
    The column-parallel leaves' outputs are bit-exact (each element the same float8 product)."""
    from treadle.forms.float8 import FLOAT8_MIN_SQNR_DB

    model, inputs = _llama()
    sch = treadle.create_schedule(model, mesh=Mesh(shape, names))
    if first:
        sch["model.layers"].float8()
    schedule_llama(sch, tp="tp", dp="dp" if "dp" in names else None, sequence_parallel=sp, zero3=gather)
    if not first:
        sch["model.layers"].float8(all_gather=gather)
    rep = treadle.verify(sch, inputs)
    assert rep.first_divergence is None and rep.error is None
    assert all(c.diff.ok for c in rep.checks)
    assert {c.kind for c in rep.checks} >= {"loss", "output", "output_grad", "param_grad", "param_step", "float8"}
    fidelity = [c for c in rep.checks if c.kind == "float8"]
    assert len(fidelity) == 1 + len(list(model.parameters()))
    assert all(FLOAT8_MIN_SQNR_DB <= float(c.diff.note.split()[1]) < math.inf for c in fidelity)
    # verify holds a TP float8 model to one float8 rounding step (a reordered sum can flip a later cast); where no
    # reordered sum reaches a cast, each cast must be exact: the first block's products (the column-parallel ones
    # bit-exact, the row-parallel one up to its fp32 sum), the last block's weight gradients
    exact = {("output", f"model.layers.0.self_attn.{p}") for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    exact |= {("param_grad", f"model.layers.1.mlp.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")}
    got = {(c.kind, c.name): c.diff for c in rep.checks if (c.kind, c.name) in exact}
    assert set(got) == exact and all(d.max_rel < 1e-5 for d in got.values()), got
    assert all(got[("output", f"model.layers.0.self_attn.{p}")].max_abs == 0.0 for p in ("q_proj", "k_proj"))


def test_price_records_each_cast_amax_all_reduce_on_the_split_axis():
    """Per float8 leaf: two all-reduces of an amax (one element of the operand's dtype, bf16 here) in forward
    (input, weight), three in backward (output gradient, weight, input), on the tp axis; none without float8."""
    prices = {}
    for f8 in (False, True):
        model, inputs = _llama(torch.bfloat16)
        sch = treadle.create_schedule(model, mesh=Mesh((2,), ("tp",)))
        schedule_llama(sch, tp="tp")
        if f8:
            sch["model.layers"].float8()
        prices[f8] = treadle.price(sch, inputs, parse_cluster("2:h100"))
    amax = {f8: [c for c in p.collectives if c["kind"] == "all_reduce" and c["nbytes"] == 2
                 and c["module"].startswith("model.layers.0.")] for f8, p in prices.items()}
    assert amax[False] == []
    per_linear = {}
    for c in amax[True]:
        per_linear.setdefault(c["module"].rpartition(".")[2], []).append((c["phase"], c["axis"]))
    assert per_linear == {lin: [("fwd", "tp")] * 2 + [("bwd", "tp")] * 3 for lin in LINEARS}
    assert prices[True].comm_s > prices[False].comm_s


def test_price_sets_the_scales_of_split_float8_gathered_weights_before_the_forward():
    """Under ZeRO-3 with the split weights gathered in float8: the amaxes of all 14 gathered weights all-reduced over
    dp after the optimizer step (as without TP) and again before the forward, then their scales' minimum over tp
    (NOTE [float8 under tensor parallelism]), one float32 a weight each, blocking; the weights gathered at a byte."""
    model, inputs = _llama(torch.bfloat16)
    sch = treadle.create_schedule(model, mesh=Mesh((2, 2), ("dp", "tp")))
    schedule_llama(sch, tp="tp", dp="dp", zero3=True)
    sch["model.layers"].float8(all_gather=True)
    p = treadle.price(sch, inputs, parse_cluster("2x2:h100"))
    scales = [(c["axis"], c["phase"], c["nbytes"], c["blocking"]) for c in p.collectives
              if c["kind"] == "all_reduce" and c["source"] == "fsdp"]
    assert sorted(scales) == sorted([("dp", "bwd", 4 * 14, True), ("dp", "fwd", 4 * 14, True),
                                     ("tp", "fwd", 4 * 14, True)])
    gathers = {c["module"]: c["nbytes"] for c in p.collectives if c["kind"] == "all_gather" and c["axis"] == "dp"}
    q_local = 64 * 64 // 2  # q_proj's weight, split over tp: its slice gathered over dp at one byte an element
    assert gathers["model.layers.0"] < 2 * (7 * q_local)  # (every linear's slice in float8, the norms in bf16)


def test_float8_under_tensor_parallelism_refusals_name_the_linear_axis_and_sizes():
    model, inputs = _llama()
    sch = treadle.create_schedule(model, mesh=Mesh((2,), ("tp",)))
    schedule_llama(sch, tp="tp")
    with pytest.raises(ScheduleError, match=r"linear 'model.layers.0.self_attn.q_proj'.s weight is split on mesh "
                                            r"axis 'tp' \(dim 0\): recipe 'rowwise' scales per row.*needs recipe "
                                            r"'tensorwise'; or skip it"):
        sch["model.layers"].float8(recipe="rowwise")
    # a split weight gathered in float8 must sit in a block's FSDP2 unit, where build sets its scale before the gather
    rooted = treadle.create_schedule(_llama()[0], mesh=Mesh((2, 2), ("dp", "tp")))
    schedule_llama(rooted, tp="tp", dp="dp", zero3=True)
    rooted["lm_head"].float8(all_gather=True)
    with pytest.raises(VerifyError, match=r"float8\(all_gather=True\) linear 'lm_head' is split over a tensor axis "
                                          r"and sits in FSDP2's root unit"):
        treadle.verify(rooted, inputs)
    # stated before the split, refused by build
    first = treadle.create_schedule(_llama()[0], mesh=Mesh((2,), ("tp",)))
    first["model.layers"].float8(recipe="rowwise")
    schedule_llama(first, tp="tp")
    with pytest.raises(VerifyError, match=r"linear 'model.layers.0.self_attn.q_proj' is float8 and its weight is "
                                          r"split over mesh axis 'tp': recipe 'rowwise'"):
        treadle.verify(first, inputs)
    # a slice the float8 kernels cannot take: 64 features over 8 ranks hold 8
    small = treadle.create_schedule(_llama(torch.bfloat16)[0], mesh=Mesh((8,), ("tp",)))
    small["model.layers.0.self_attn.q_proj"].shard("weight", axis="tp", dim=0)
    small["model.layers.0.self_attn.q_proj"].sync("fwd_post", to=torch.distributed.tensor.Replicate(), axis="tp")
    small["model.layers"].float8()
    with pytest.raises(BuildError, match=r"float8 linear 'model.layers.0.self_attn.q_proj' \(64 -> 64\) split over "
                                         r"\[\('tp', 8\)\] holds a \(64 -> 8\) slice, a dim not divisible by 16"):
        treadle.price(small, inputs, parse_cluster("8:h100"))
