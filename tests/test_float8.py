"""Float8 linears (`Schedule.float8`, `treadle.forms.float8`): the primitive and its refusals, the file round trip,
build under DDP and FSDP2 (float8 all-gather on gloo, NOTE [float8 all-gather on gloo]), verify against the float8
reference and the fidelity bound (NOTE [what verified means for float8]), and the price (NOTE [float8 in the
price]): float8 products at the float8 peak on float8 bytes, FSDP2's gathers at one byte an element."""

from __future__ import annotations

import json
import math

import pytest
import torch

import treadle
from treadle.cost.cluster import parse_cluster
from treadle.errors import ProfileError, ScheduleError, VerifyError
from treadle.mesh import Mesh
from treadle.pricing import rehearse
from treadle.schedule.replay import load_schedule
from treadle.testing import spawn

from run_job import losses, run_treadle

transformers = pytest.importorskip("transformers")
pytest.importorskip("torchao")

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _llama(layers: int = 2, dtype=torch.float32):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg).to(dtype)
    ids = torch.randint(0, 128, (4, 32))
    return model, {"input_ids": ids, "labels": ids}


def _sch(model, n: int = 1):
    return treadle.create_schedule(model, mesh=Mesh((n,), ("dp",)))


def test_float8_records_every_block_linear_and_replays_from_a_file():
    model, _ = _llama()
    sch = _sch(model)
    sch["model.layers"].float8(recipe="rowwise", skip=["*.mlp.down_proj"])
    spec = sch.view().extras["float8"]["model.layers"]
    assert spec.recipe == "rowwise" and not spec.all_gather
    assert spec.linears == tuple(f"model.layers.{i}.{s}.{n}" for i in range(2)
                                 for s, n in [("self_attn", x) for x in LINEARS[:4]] + [("mlp", "gate_proj"),
                                                                                         ("mlp", "up_proj")])
    text = sch.to_json()
    assert json.loads(text)["records"] == [{"op": "float8", "path": "model.layers",
                                            "args": {"recipe": "rowwise", "all_gather": False,
                                                     "skip": ["*.mlp.down_proj"]}}]
    again = load_schedule(_llama()[0], text, Mesh((1,), ("dp",)))
    assert again.view().extras["float8"] == sch.view().extras["float8"]
    bad = json.loads(text)
    bad["records"][0]["args"]["recipe"] = "os.system"
    with pytest.raises(ScheduleError, match=r"unknown recipe 'os.system'; known: \['rowwise', 'rowwise_with_gw_hp', "
                                            r"'tensorwise'\]"):
        load_schedule(_llama()[0], json.dumps(bad), Mesh((1,), ("dp",)))


def test_float8_refusals_name_the_module_and_the_sizes():
    model, _ = _llama()
    sch = _sch(model)
    with pytest.raises(ScheduleError, match="all_gather=True needs recipe 'tensorwise'"):
        sch["model.layers"].float8(recipe="rowwise", all_gather=True)
    with pytest.raises(ScheduleError, match=r"no nn.Linear in this module's subtree outside skip=\['\*'\]"):
        sch["model.layers"].float8(skip=["*"])
    with pytest.raises(ScheduleError, match=r"linear 'lm_head' shares its weight with \['lm_head.weight', "
                                            r"'model.embed_tokens.weight'\]"):
        tied, _ = _llama()
        tied.lm_head.weight = tied.model.embed_tokens.weight
        _sch(tied).float8(skip=["model.*"])
    sch["model.layers.0"].float8()
    with pytest.raises(ScheduleError, match="linear 'model.layers.0.self_attn.q_proj' is float8 already "
                                            r"\(by float8 at 'model.layers.0'\)"):
        sch["model.layers"].float8()
    # under tensor parallelism: tests/test_float8_tensor_parallel.py


def test_float8_refuses_a_linear_whose_dims_the_kernel_cannot_take():
    """A classifier head (64 -> 10 classes) has a dim not divisible by 16: refused with its shape, and left out
    by skip."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    sch = _sch(model)
    with pytest.raises(ScheduleError, match=r"linear '2' \(64 -> 10\) has a dim not divisible by 16.*"
                                            r"skip=\[...\] \(e.g. '2'\)"):
        sch.float8()
    sch.float8(skip=["2"])
    assert sch.view().extras["float8"][""].linears == ("0",)
    # a subclass of nn.Linear has a forward of its own: refused, not silently replaced (the planner's rule too)
    mha = torch.nn.Sequential(torch.nn.MultiheadAttention(64, 4))
    with pytest.raises(ScheduleError, match=r"linear '0.out_proj' a NonDynamicallyQuantizableLinear, a subclass of "
                                            r"nn.Linear"):
        _sch(mha).float8()


def test_gpt2_has_no_linear_to_convert():
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=128))
    with pytest.raises(ScheduleError, match="no nn.Linear in this module's subtree; float8 converts linear layers "
                                            r"\(a GPT-2 Conv1D is not one\)"):
        _sch(model)["transformer.h"].float8()


def test_verify_ddp_and_fsdp2_float8_gather_against_the_float8_reference():
    """Each rank's float8 model against the single-process float8 model (forward, every gradient, two optimizer
    steps) and the float8 model's fidelity to the original (SQNR of the loss and every gradient >= the bound):
    DDP, FSDP2 with float8 gathers, HSDP (2 x 2) with float8 gathers, FSDP2 under torchtitan's op-level SAC,
    and the rowwise recipe."""
    from treadle.forms.float8 import FLOAT8_MIN_SQNR_DB

    cases = [((2,), ("dp",), {"shard": False}, {}, None), ((2,), ("dp",), {"shard": True}, {"all_gather": True}, None),
             ((2, 2), ("rep", "dp"), {"shard": True, "replicate": "rep"}, {"all_gather": True}, None),
             ((2,), ("dp",), {"shard": True}, {"all_gather": True}, "alternate-matmuls"),
             ((2,), ("dp",), {"shard": False}, {"recipe": "rowwise"}, None)]
    for shape, names, dp, f8, policy in cases:
        model, inputs = _llama()
        sch = treadle.create_schedule(model, mesh=Mesh(shape, names))
        sch.data_parallel(axis="dp", **dp)
        if policy:
            sch["model.layers"].checkpoint_every(1, policy=policy)
        sch["model.layers"].float8(**f8)
        rep = treadle.verify(sch, inputs)
        fidelity = [c for c in rep.checks if c.kind == "float8"]
        assert len(fidelity) == 1 + len(list(model.parameters()))  # the loss and every gradient
        assert all(FLOAT8_MIN_SQNR_DB <= float(c.diff.note.split()[1]) < math.inf for c in fidelity)
        assert {c.kind for c in rep.checks} >= {"loss", "output", "output_grad", "param_grad", "param_step"}


def _rank_gather(rank: int, world: int) -> dict:
    model, _ = _llama()
    sch = _sch(model, world)
    sch.data_parallel(axis="dp", shard=True)
    sch["model.layers"].float8(all_gather=True)
    built = treadle.build(sch)
    q = built.model.layers[0].self_attn.q_proj
    out = {"linear": type(q).__name__, "weight": type(q.weight.to_local()).__name__,
           "comm": type(built.model.layers[0]._get_fsdp_state()._fsdp_param_group._all_gather_comm).__name__,
           "head": type(built.lm_head).__name__, "scale_before": q.weight._local_tensor._precomputed_scale is not None}
    # after an optimizer step every loop runs the forms' work: float8's scales, one all-reduce for all weights
    from treadle.runtime.optimizer import adamw, after_optimizer_step

    opt = adamw(built.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 32))
    built(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    after_optimizer_step(built)
    out["scale_after"] = q.weight._local_tensor._precomputed_scale is not None
    return out


@pytest.mark.timeout(120)
def test_fsdp2_gathers_float8_weights_through_the_byte_gather_on_gloo():
    out = spawn(_rank_gather, 2, timeout_s=90)
    assert out[0] == out[1] == {"linear": "Float8Linear", "weight": "WeightWithDynamicFloat8CastTensor",
                                "comm": "_ByteGather", "head": "Linear", "scale_before": False, "scale_after": True}


def test_all_gather_without_fsdp2_is_refused_at_build():
    model, inputs = _llama()
    sch = _sch(model, 2)
    sch.data_parallel(axis="dp", shard=False)
    sch["model.layers"].float8(all_gather=True)
    with pytest.raises(VerifyError, match=r"float8\(all_gather=True\) at 'model.layers' needs FSDP2"):
        treadle.verify(sch, inputs)


def test_sqnr_bound_fails_a_lost_scale():
    from treadle.verify.float8 import sqnr_db

    x = torch.randn(64, 64)
    assert sqnr_db(x, x) == math.inf
    assert sqnr_db(x, 2 * x) == pytest.approx(0.0)
    assert sqnr_db(x, x * (1 + 2**-4)) == pytest.approx(20 * math.log10(16))


def test_price_runs_float8_products_at_the_float8_peak_on_float8_bytes():
    model, inputs = _llama(dtype=torch.bfloat16)
    sch = _sch(model)
    sch["model.layers"].float8()
    h100 = parse_cluster("1:h100")
    hw = h100.rank_hardware()
    reh = rehearse(sch, inputs, hw, None, gpu=True)
    f8 = [r for r in reh.records if r.dtype == "float8_e4m3fn"]
    # three products per linear (forward, input gradient, weight gradient), 7 linears per block
    assert len(f8) == 3 * 7 * 2
    assert {r.module.rpartition(".")[2] for r in f8} == set(LINEARS)
    q_fwd = next(r for r in f8 if r.module == "model.layers.0.self_attn.q_proj" and r.phase == "forward")
    tokens = 4 * 32
    assert q_fwd.read_bytes == tokens * 64 + 64 * 64  # float8 operands: one byte an element
    assert q_fwd.flops == 2 * tokens * 64 * 64
    # by hand: the larger of the product at the float8 peak (times the matmul efficiency at its size) and its bytes
    from treadle.profile.roofline import matmul_efficiency

    compute = q_fwd.flops / (hw.peak_flops_per_s["float8_e4m3fn"] * matmul_efficiency(q_fwd.flops, hw))
    memory = (q_fwd.read_bytes + q_fwd.write_bytes) / (hw.hbm_bytes_per_s * hw.memory_efficiency)
    assert q_fwd.time_s == pytest.approx(max(compute, memory))
    assert hw.peak_flops_per_s["float8_e4m3fn"] == pytest.approx(2 * hw.peak_flops_per_s["bfloat16"], rel=1e-4)
    plain = rehearse(_sch(_llama(dtype=torch.bfloat16)[0]), inputs, hw, None, gpu=True)
    assert not [r for r in plain.records if r.dtype == "float8_e4m3fn"]
    with pytest.raises(ProfileError, match="a float8 product needs a device with a float8 matrix unit.*"
                                           "'a100-80gb' has no peak FLOP/s for dtype 'float8_e4m3fn'"):
        treadle.price(sch, inputs, parse_cluster("1:a100-80gb"))


def test_price_gathers_float8_weights_at_one_byte_and_reduces_gradients_whole():
    model, inputs = _llama(dtype=torch.bfloat16)
    scheds = {}
    for gather in (False, True):
        sch = _sch(_llama(dtype=torch.bfloat16)[0], 2)
        sch.data_parallel(axis="dp", shard=True)
        sch["model.layers"].float8(all_gather=gather)
        scheds[gather] = treadle.price(sch, inputs, parse_cluster("2:h100"))
    block = {g: {c["kind"]: c["nbytes"] for c in p.collectives if c["module"] == "model.layers.0"}
             for g, p in scheds.items()}
    linear_elems = 2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 128
    norms = 2 * 64 * 2
    assert block[False]["all_gather"] == 2 * linear_elems + norms
    assert block[True]["all_gather"] == linear_elems + norms
    assert block[True]["reduce_scatter"] == block[False]["reduce_scatter"] == 2 * linear_elems + norms
    # the scales of the float8-gathered weights: one all-reduce of a float32 amax each, after the optimizer step
    amax = {g: [c for c in p.collectives if c["kind"] == "all_reduce" and c["source"] == "fsdp"]
            for g, p in scheds.items()}
    assert amax[False] == [] and [(c["nbytes"], c["blocking"]) for c in amax[True]] == [(4 * 7 * 2, True)]


def _run(tmp_path, *extra: str):
    return run_treadle(tmp_path, *extra, nproc=2, steps=4, warmup=1)


_losses = losses


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_treadle_run_trains_float8_under_fsdp2_resumes_bit_exact_and_loads_into_bf16(tmp_path):
    """treadle.run trains a float8 schedule (FSDP2, float8 all-gather); its checkpoint (global shapes, plain
    tensors) resumes bit-exact, and resumes a schedule without float8 (DDP) from the same step."""
    import shutil

    from treadle.run.setup import load_run_model

    for name, shard, f8 in (("f8.json", True, True), ("ddp.json", False, False)):
        sch = _sch(load_run_model("tiny-llama", seq=32, seed=0), 2)
        sch.data_parallel(axis="dp", shard=shard)
        if f8:
            sch["model.layers"].float8(all_gather=True)
        (tmp_path / name).write_text(sch.to_json())
    res = _run(tmp_path, "--schedule", "f8.json", "--ckpt-dir", "ck", "--ckpt-every", "2", "--metrics", "a.jsonl")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    first = _losses(tmp_path / "a.jsonl")
    assert sorted(first) == [1, 2, 3, 4] and first[4] < first[1]
    shutil.rmtree(tmp_path / "ck" / "step_00000004")
    res = _run(tmp_path, "--schedule", "f8.json", "--ckpt-dir", "ck", "--ckpt-every", "2", "--metrics", "b.jsonl")
    assert res.returncode == 0 and "resumed from ck/step_00000002" in res.stdout, res.stdout[-3000:]
    assert _losses(tmp_path / "b.jsonl") == {s: first[s] for s in (3, 4)}  # bit-exact
    shutil.rmtree(tmp_path / "ck" / "step_00000004")
    res = _run(tmp_path, "--schedule", "ddp.json", "--ckpt-dir", "ck", "--metrics", "c.jsonl")
    assert res.returncode == 0 and "resumed from ck/step_00000002" in res.stdout, res.stdout[-3000:]
    bf16 = _losses(tmp_path / "c.jsonl")
    assert sorted(bf16) == [3, 4] and bf16 != {s: first[s] for s in (3, 4)}
    assert all(abs(bf16[s] - first[s]) < 0.01 * first[s] for s in (3, 4))  # the same weights, without float8
