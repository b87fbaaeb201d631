"""Expert parallelism (`Schedule.expert_parallel`, `treadle.forms.expert`): experts split over a data-parallel axis,
tokens exchanged by uneven all-to-all. Numerics against one process (forward, every gradient, the router's
included, and an optimizer step) on gloo, with skewed and dropped routing; the primitive's and build's refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import treadle
from treadle.errors import BuildError, PlanError, ScheduleError
from treadle.forms.expert import expert_parallel_moe
from treadle.forms.expert.facts import expert_modules

from test_moe import tiny_mixtral
from tiny_models import VOCAB, lm_inputs


# ------------------------------------------------------------------------------------------ a toy MoE layer
class LoopExperts(nn.Module):
    """Experts stacked on dim 0, run one by one as Hugging Face's eager loop does; an index E means "no expert"."""

    def __init__(self, experts: int, hidden: int, inner: int, bias: bool = True):
        super().__init__()
        self.num_experts = experts
        self.up = nn.Parameter(torch.randn(experts, inner, hidden) / hidden ** 0.5)
        self.down = nn.Parameter(torch.randn(experts, hidden, inner) / inner ** 0.5)
        self.bias = nn.Parameter(torch.randn(experts, hidden) / 10) if bias else None

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            tok, slot = torch.where(top_k_index == e)
            if tok.numel() == 0:
                continue
            h = torch.relu(hidden_states[tok] @ self.up[e].T) @ self.down[e].T
            if self.bias is not None:
                h = h + self.bias[e]
            out.index_add_(0, tok, h * top_k_weights[tok, slot, None])
        return out


class SkewedMoE(nn.Module):
    """A router that sends most tokens to expert 0 (its bias) and drops the pairs whose weight is below
    `drop` (index E, the model's own "no expert"), then the experts, then a head."""

    def __init__(self, experts: int = 8, hidden: int = 16, k: int = 2, drop: float = 0.0, bias: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.k, self.drop, self.experts_n = k, drop, experts
        self.router = nn.Linear(hidden, experts)
        with torch.no_grad():
            self.router.bias.zero_()
            self.router.bias[0] = 3.0
        self.experts = LoopExperts(experts, hidden, 24, bias)
        self.head = nn.Linear(hidden, 4)

    def forward(self, x):
        h = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.router(h), dim=-1)
        w, idx = torch.topk(probs, self.k, dim=-1)
        if self.drop:
            idx = torch.where(w < self.drop, torch.full_like(idx, self.experts_n), idx)
        return self.head(self.experts(h, idx, w).reshape(x.shape))


def _toy_inputs(rows: int = 16) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(rows, 3, 16, generator=torch.Generator().manual_seed(2))}


def _ep_schedule(model, shape, names, *, ep, dp, shard=False):
    sch = treadle.create_schedule(model, mesh=treadle.Mesh(shape, names))
    expert_parallel_moe(sch, axis=ep)
    sch.data_parallel(axis=dp, shard=shard)
    return sch


def test_the_toy_routing_is_uneven_and_drops_pairs():
    m = SkewedMoE(drop=0.05)
    h = _toy_inputs()["x"].reshape(-1, 16)
    w, idx = torch.topk(torch.softmax(m.router(h), -1), 2, -1)
    idx = torch.where(w < 0.05, torch.full_like(idx, 8), idx)
    counts = torch.bincount(idx.reshape(-1), minlength=9)
    assert counts[0] == h.shape[0]  # every token picks expert 0 first
    assert counts[8] > 0 and counts[1:8].max() < counts[0] / 4  # some pairs dropped; the rest spread thinly
    assert expert_modules(m) == {"experts": 8}


@pytest.mark.parametrize("drop", [0.0, 0.05])
def test_skewed_and_dropped_routing_matches_one_process_on_4_ranks(drop):
    # 8 experts over 4 ranks: rank 0 holds expert 0 and receives most rows; every gradient and a step compared
    sch = _ep_schedule(SkewedMoE(drop=drop), (4,), ("dp",), ep="dp", dp="dp")
    report = treadle.verify(sch, _toy_inputs(), steps=2, timeout_s=240)
    names = {c.name for c in report.checks if c.kind == "param_grad"}
    assert {"experts.up", "experts.down", "experts.bias", "router.weight", "router.bias"} <= names
    assert report.ok


def test_expert_axis_inside_a_larger_data_parallel_group_on_4_ranks():
    # EP2 x DP2: each expert has two copies (dp); its gradient sums the ep tokens, then averages over dp
    sch = _ep_schedule(SkewedMoE(), (2, 2), ("dp", "ep"), ep="ep", dp=("dp", "ep"))
    assert treadle.verify(sch, _toy_inputs(), steps=2, timeout_s=240).ok


@pytest.mark.slow
@pytest.mark.parametrize("shard", [False, True], ids=["ddp", "fsdp2"])
def test_mixtral_expert_parallel_verifies_on_4_ranks(shard):
    sch = _ep_schedule(tiny_mixtral(), (2, 2), ("dp", "ep"), ep="ep", dp=("dp", "ep"), shard=shard)
    assert [r.op for r in sch.records].count("expert_parallel") == 2
    report = treadle.verify(sch, lm_inputs(8, 16), steps=2, timeout_s=300)
    grads = {c.name for c in report.checks if c.kind == "param_grad"}
    assert "model.layers.0.mlp.experts.gate_up_proj" in grads and "model.layers.1.mlp.gate.weight" in grads
    assert report.ok


def tiny_deepseek_v3():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV3Config(num_hidden_layers=2, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                           num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
                           num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
                           q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8, vocab_size=VOCAB,
                           max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return DeepseekV3ForCausalLM(cfg)


@pytest.mark.slow
def test_deepseek_v3_grouped_sigmoid_routing_with_shared_experts_verifies_on_4_ranks():
    model = tiny_deepseek_v3()
    assert expert_modules(model) == {"model.layers.1.mlp.experts": 8}  # the shared experts are a plain MLP
    sch = _ep_schedule(model, (4,), ("dp",), ep="dp", dp="dp")
    assert treadle.verify(sch, lm_inputs(8, 16), steps=2, timeout_s=300).ok


# ------------------------------------------------------------------------------------------ refusals
def test_expert_parallel_refuses_what_it_cannot_split():
    mesh = treadle.Mesh((3, 2), ("dp", "tp"))
    sch = treadle.create_schedule(SkewedMoE(), mesh=mesh)
    with pytest.raises(ScheduleError, match=r"sch\['head'\] \(Linear\).*do not all stack the experts on dim 0"):
        sch["head"].expert_parallel(axis="dp")
    with pytest.raises(ScheduleError, match=r"8 experts do not divide over mesh axis 'dp' of size 3"):
        sch["experts"].expert_parallel(axis="dp")
    with pytest.raises(ScheduleError, match=r"on an experts module, not the whole model"):
        sch.expert_parallel(axis="tp")
    sch.data_parallel(axis="dp")
    with pytest.raises(ScheduleError, match=r"mesh axis 'tp' is not data-parallel"):
        sch["experts"].expert_parallel(axis="tp")
    sch2 = treadle.create_schedule(SkewedMoE(), mesh=treadle.Mesh((2, 2), ("dp", "tp")))
    sch2["experts"].expert_parallel(axis="tp")
    with pytest.raises(ScheduleError, match=r"sch\['experts'\] is expert-parallel over 'tp', which is not one of"):
        sch2.data_parallel(axis="dp")
    with pytest.raises(ScheduleError, match=r"already expert-parallel over 'tp'"):
        sch2["experts"].expert_parallel(axis="tp")
    with pytest.raises(ScheduleError, match="has no experts module"):
        expert_parallel_moe(treadle.create_schedule(nn.Linear(4, 4), mesh=mesh), axis="dp")


def test_build_refuses_experts_without_data_parallelism_or_split_over_another_axis():
    from treadle.testing import spawn

    for r in spawn(_build_refusals_rank, 4, timeout_s=120):
        assert r == "ok"


def _build_refusals_rank(rank, world):
    mesh = treadle.Mesh((2, 2), ("dp", "tp"))
    sch = treadle.create_schedule(SkewedMoE(), mesh=mesh)
    sch["experts"].expert_parallel(axis="dp")
    with pytest.raises(BuildError, match=r"expert_parallel at sch\['experts'\] over 'dp'.*must be data-parallel"):
        treadle.build(sch)
    sch = treadle.create_schedule(SkewedMoE(), mesh=mesh)
    sch["experts"].expert_parallel(axis="dp")
    sch["experts"].shard("up", dim=1, axis="tp")
    sch.data_parallel(axis="dp")
    with pytest.raises(BuildError, match=r"the experts' weights split over 'tp' as \(dim, blocks\) \{'up': \(1, 1\)\}: "
                                         r"its forward fails on the slices"):  # down not split with it
        treadle.build(sch)
    return "ok"


def test_the_primitive_round_trips_through_a_schedule_file():
    sch = _ep_schedule(SkewedMoE(), (2,), ("dp",), ep="dp", dp="dp")
    again = treadle.load_schedule(SkewedMoE(), sch.to_json())
    assert again.to_python() == sch.to_python()
    assert "sch['experts'].expert_parallel(axis='dp')" in sch.to_python()


# ------------------------------------------------------------------------------------------ the price
def test_the_price_counts_the_exchanges_and_the_local_experts_by_hand():
    from treadle.cost.cluster import parse_cluster
    from treadle.cost.collective_cost import collective_time_s

    cl = parse_cluster("4x1:cpu")
    inputs = lm_inputs(8, 16)
    sch = _ep_schedule(tiny_mixtral(), cl.mesh.shape, cl.mesh.names, ep="dp", dp="dp")
    p = treadle.price(sch, inputs, cl)
    ep = [c for c in p.collectives if c.get("source") == "ep"]
    tokens, k, hidden, n = 8 // 4 * 16, 2, 64, 4  # this rank's tokens; balanced load (NOTE [expert load ...])
    rows = tokens * k * hidden * 4
    for layer in ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts"):
        fwd = [(c["kind"], c["nbytes"]) for c in ep if c["module"] == layer and c["phase"] == "fwd"]
        # the pair counts (one int64 per expert: tiny Mixtral has 4), the rows, their routing weights (fp32),
        # the results back
        weights = tokens * k * 4
        assert fwd == [("all_to_all", 8 * 4), ("all_to_all", rows), ("all_to_all", weights), ("all_to_all", rows)]
        bwd = [(c["kind"], c["nbytes"]) for c in ep if c["module"] == layer and c["phase"] == "bwd"]
        # the adjoints in reverse: the results' gradients there, the weights' and the rows' gradients back
        assert sorted(bwd) == sorted([("all_to_all", rows), ("all_to_all", weights), ("all_to_all", rows)])
    c = ep[1]
    assert c["time_s"] == pytest.approx(collective_time_s("all_to_all", rows, n, cl.link("dp")))
    # DDP all-reduces every gradient but the experts' (summed by the exchanges: NOTE [expert gradients])
    model = tiny_mixtral()
    dense = sum(t.numel() * 4 for name, t in model.named_parameters() if ".experts." not in name)
    experts = sum(t.numel() * 4 for name, t in model.named_parameters() if ".experts." in name)
    assert sum(c["nbytes"] for c in p.collectives if c["source"] == "ddp" and c["kind"] == "all_reduce") == dense
    # memory: each rank holds a quarter of the experts
    ddp = treadle.price(_dp_only(tiny_mixtral(), cl.mesh), inputs, cl)
    # (DDP-only: weight, two moments and the bucket copy of all; EP: weight and moments of a quarter, no copy)
    assert ddp.static_bytes - p.static_bytes == pytest.approx(4 * experts - 3 * experts / 4, rel=1e-6)


def _dp_only(model, mesh):
    sch = treadle.create_schedule(model, mesh=mesh)
    sch.data_parallel(axis="dp")
    return sch


@pytest.mark.slow
def test_tensor_parallel_attention_with_experts_over_the_data_axis_verifies_on_4_ranks():
    from treadle.models import megatron

    sch = treadle.create_schedule(tiny_mixtral(), mesh=treadle.Mesh((2, 2), ("dp", "tp")))
    megatron(sch, tp="tp", dp="dp")  # attention split over tp; the experts replicated over tp, split over dp
    expert_parallel_moe(sch, axis="dp")
    assert treadle.verify(sch, lm_inputs(8, 16), steps=2, timeout_s=300).ok


# ------------------------------------------------------------------------------------------ checkpoints
EP_SCHEDULES = {"ep4": ((4, 1), "dp", "dp"), "ep2xdp2": ((2, 2), "tp", ("dp", "tp")), "ddp4": ((4, 1), None, "dp"),
                "ep2-fsdp2x2": ((2, 2), "tp", ("dp", "tp")), "ep2-etp2": ((2, 2), "dp", "dp", "tp"),
                "ep4x": ((2, 2), ("dp", "tp"), ("dp", "tp"))}  # ep4x: one expert group over both axes


def _make_ep(name: str):
    from treadle import Mesh, build, create_schedule
    from treadle.run.config import RunConfig
    from treadle.run.layout import fsdp_unit_axes, layouts, shards_by_name
    from treadle.run.optim import init_optimizer_state, make_optimizer

    shape, ep, dp, *tensor = EP_SCHEDULES[name]
    sch = create_schedule(tiny_mixtral(), mesh=Mesh(shape, ("dp", "tp")))
    if ep is not None:
        expert_parallel_moe(sch, axis=ep, tensor=tensor[0] if tensor else None)  # each expert split over tp too
    sch.data_parallel(axis=dp, shard="fsdp" in name)
    before = shards_by_name(sch)
    built = build(sch)
    spec = sch.view().data_parallel
    lay = layouts(built, before, sch.mesh, spec.shard_axes if spec.shard else None, fsdp_unit_axes(sch))
    opt = make_optimizer(built, lay, RunConfig(model="tiny-llama", data=["unused"], lr=1e-2, warmup_steps=0, steps=9))
    init_optimizer_state(opt)
    return sch, built, lay, opt


def _ep_reshard_rank(rank: int, world: int, src: str, dst: str, path: str):
    from test_run_reshard import _batches, _step
    from treadle.run import checkpoint as ckpt
    from treadle.run.layout import unwrap

    batches = _batches()
    a = _make_ep(src)
    first = _step(*a, batches[0], with_norm=True)
    _step(*a, batches[1])
    ckpt.Checkpointer(path).save(a[1], a[3], a[2], a[0].mesh, step=2)
    full_a = {n: a[2][n].gather_full(p, a[0].mesh) for n, p in unwrap(a[1]).named_parameters()}
    after_a = [_step(*a, b) for b in batches[2:]]
    b_ = _make_ep(dst)
    step = ckpt.load(ckpt.step_dir(path, 2), b_[1], b_[3], b_[2], b_[0].mesh)
    full_b = {n: b_[2][n].gather_full(p, b_[0].mesh) for n, p in unwrap(b_[1]).named_parameters()}
    after_b = [_step(*b_, b) for b in batches[2:]]
    local = tuple(unwrap(a[1]).get_parameter("model.layers.0.mlp.experts.down_proj").shape)
    return step, {n: float((full_a[n] - full_b[n]).abs().max()) for n in full_a}, after_a, after_b, first, local


@pytest.mark.slow
@pytest.mark.parametrize("src,dst", [("ep4", "ep2xdp2"), ("ep2-fsdp2x2", "ddp4"), ("ddp4", "ep4"),
                                     ("ep4", "ep2-fsdp2x2"), ("ep2-etp2", "ep4"), ("ep4x", "ep2-fsdp2x2"),
                                     ("ep2xdp2", "ep4x")])
def test_checkpoints_reshard_across_expert_degrees(tmp_path, src, dst):
    from treadle.testing import spawn

    ids = __import__("test_run_reshard")._batches()[0]
    torch.manual_seed(0)
    ref = tiny_mixtral()
    loss = ref(input_ids=ids, labels=ids).loss
    loss.backward()
    ref_norm = float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))
    experts = ref.model.layers[0].mlp.experts.down_proj.shape[0]
    ep = {"ep4": 4, "ep2xdp2": 2, "ep2-fsdp2x2": 2, "ddp4": 1, "ep2-etp2": 2, "ep4x": 4}[src]
    for step, max_diff, after_a, after_b, (loss0, norm0), local in spawn(_ep_reshard_rank, 4, src, dst,
                                                                         str(tmp_path / "ck"), timeout_s=240):
        assert local[0] == experts // ep  # this rank's experts only
        # the norm over expert shards and replicas is the single-process norm
        assert loss0 == pytest.approx(float(loss.detach()), rel=1e-5) and norm0 == pytest.approx(ref_norm, rel=1e-5)
        assert step == 2 and max(max_diff.values()) == 0.0, {n: d for n, d in max_diff.items() if d}
        torch.testing.assert_close(torch.tensor(after_b), torch.tensor(after_a), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ training
def _loads_rank(rank: int, world: int):
    from treadle.forms.expert.runtime import expert_loads

    sch = _ep_schedule(SkewedMoE(drop=0.05), (2, 2), ("dp", "ep"), ep="ep", dp=("dp", "ep"))
    built = treadle.build(sch)
    x = _toy_inputs()["x"]
    built(x=x.chunk(world)[rank]).sum().backward()
    (load,) = expert_loads(built)
    return load.module, load.rows, load.imbalance, expert_loads(built)[0].rows


def test_expert_loads_count_every_replica_routed_rows_per_expert():
    from treadle.testing import spawn

    m = SkewedMoE(drop=0.05)
    h = _toy_inputs()["x"].reshape(-1, 16)
    w, idx = torch.topk(torch.softmax(m.router(h), -1), 2, -1)
    idx = torch.where(w < 0.05, torch.full_like(idx, 8), idx)
    want = torch.bincount(idx.reshape(-1), minlength=9)[:8].tolist()  # the dropped pairs are no expert's
    for module, rows, imbalance, again in spawn(_loads_rank, 4, timeout_s=120):
        assert (module, list(rows)) == ("experts", want)
        assert imbalance == pytest.approx(max(want) / (sum(want) / 8))
        assert sum(again) == 0  # read and reset


def _run_main_rank(rank: int, world: int, argv: list[str]):
    """`python -m treadle.run argv` on this rank: (exit status, stdout)."""
    import contextlib
    import io

    from treadle.run.loop import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(argv)
    return status, out.getvalue()


@pytest.mark.slow
def test_treadle_run_trains_an_expert_parallel_schedule_as_ddp_does(tmp_path):
    import json
    from pathlib import Path

    from treadle.models.zoo import named_model
    from treadle.testing import spawn

    corpus = Path(__file__).resolve().parents[1] / "examples" / "data" / "village.txt"
    losses = {}
    for name in ("ep4", "ddp4"):
        model, _ = named_model("tiny-mixtral", batch=1, seq=16)
        sch = treadle.create_schedule(model, mesh=treadle.Mesh((4,), ("dp",)))
        if name == "ep4":
            expert_parallel_moe(sch, axis="dp")
        sch.data_parallel(axis="dp")
        (tmp_path / f"{name}.json").write_text(sch.to_json())
        argv = ["--model", "tiny-mixtral", "--data", str(corpus), "--seq", "32", "--batch", "8", "--steps", "4",
                "--schedule", str(tmp_path / f"{name}.json"), "--lr", "3e-3", "--warmup-steps", "1", "--log-every", "2",
                "--metrics", str(tmp_path / f"{name}.jsonl"), "--timeout-s", "60"]
        res = spawn(_run_main_rank, 4, argv, timeout_s=240)
        assert [status for status, _ in res] == [0] * 4, res[0][1][-3000:]
        rows = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        losses[name] = [r["loss"] for r in rows]
        if name == "ep4":
            assert "experts: busiest / mean rows" in res[0][1]
            logged = [r["experts"] for r in rows if r["experts"]]
            assert len(logged) == 2 and all(len(e) == 2 for e in logged)  # steps 2 and 4; two MoE blocks
            # each reading covers 2 steps x 8 x 32 tokens x 2 experts per token
            assert all(sum(m["rows"]) == 2 * 8 * 32 * 2 for e in logged for m in e)
            # the busiest rank over the mean (8 experts over 4 ranks: rank r holds 2r and 2r+1), what
            # expert_parallel(load_imbalance=) states
            for m in (m for e in logged for m in e):
                per_rank = [m["rows"][2 * r] + m["rows"][2 * r + 1] for r in range(4)]
                assert len(m["rows"]) == 8
                assert m["rank_imbalance"] == pytest.approx(max(per_rank) / (sum(per_rank) / 4))
            assert "busiest / mean rank" in res[0][1]
        else:
            assert all(r["experts"] is None for r in rows)
    torch.testing.assert_close(torch.tensor(losses["ep4"]), torch.tensor(losses["ddp4"]), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_experts_data_and_tensor_parallelism_together_verify_on_8_ranks():
    # EP2 x DP2 x TP2: attention split over tp, the experts over ep, the batch over (dp, ep)
    from treadle.models import megatron

    sch = treadle.create_schedule(tiny_mixtral(), mesh=treadle.Mesh((2, 2, 2), ("dp", "ep", "tp")))
    megatron(sch, tp="tp", dp=None)
    expert_parallel_moe(sch, axis="ep")
    sch.data_parallel(axis=("dp", "ep"))
    assert treadle.verify(sch, lm_inputs(8, 16), steps=2, timeout_s=400).ok


@pytest.mark.slow
def test_experts_split_inside_pipeline_stages_verify_and_price_on_4_ranks():
    # PP2 x EP2: each data-parallel replica runs its own 1F1B pipeline; the experts of a stage over dp
    from treadle.cost.cluster import parse_cluster

    inputs = lm_inputs(8, 16)

    def schedule(ep: bool):
        model = tiny_mixtral()
        model.config.use_cache = False
        sch = treadle.create_schedule(model, mesh=treadle.Mesh((2, 2), ("pp", "dp")))
        sch["model.layers.0"].cut_pipeline_stage()
        if ep:
            expert_parallel_moe(sch, axis="dp")
        sch.data_parallel(axis="dp")
        sch.pipeline(axis="pp", schedule="1f1b", n_microbatches=2, example_inputs=inputs)
        return sch

    assert treadle.verify(schedule(True), inputs, steps=2, timeout_s=300).ok
    cl = parse_cluster("2x2:cpu")
    split, whole = (treadle.price(schedule(ep), inputs, cl) for ep in (True, False))
    assert split.static_bytes < whole.static_bytes  # each stage keeps half of its experts


@pytest.mark.slow
def test_checkpointed_blocks_recompute_their_exchanges_on_4_ranks():
    # a checkpointed block runs its dispatch again in backward: the same rows to the same ranks
    sch = _ep_schedule(tiny_mixtral(), (2, 2), ("dp", "ep"), ep="ep", dp=("dp", "ep"))
    for i in range(2):
        sch[f"model.layers.{i}"].checkpoint()
    assert treadle.verify(sch, lm_inputs(8, 16), steps=2, timeout_s=300).ok


def _mixed_precision_rank(rank: int, world: int):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    out = []
    for ep in (None, "ep"):
        sch = treadle.create_schedule(tiny_mixtral(), mesh=treadle.Mesh((2, 2), ("dp", "ep")))
        if ep:
            expert_parallel_moe(sch, axis=ep)
        sch.data_parallel(axis=("dp", "ep"), shard=True)
        built = treadle.build(sch, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                  reduce_dtype=torch.float32))
        ids = lm_inputs(8, 16)["input_ids"].chunk(world)[rank]
        dtypes = []
        built.get_submodule("model.layers.0.mlp.experts").register_forward_hook(
            lambda m, a, o: dtypes.append(o.dtype))
        loss = built(input_ids=ids, labels=ids).loss
        loss.backward()
        router = built.get_parameter("model.layers.0.mlp.gate.weight")
        experts = built.get_parameter("model.layers.0.mlp.experts.down_proj")
        out.append((float(loss.detach()), dtypes, router.grad.full_tensor(), experts.grad.dtype))
    return out


def test_fsdp2_mixed_precision_casts_the_experts_as_it_casts_the_rest():
    from treadle.testing import spawn

    for (loss0, out0, router0, _), (loss1, out1, router1, dtype1) in spawn(_mixed_precision_rank, 4, timeout_s=180):
        assert out0 == out1 == [torch.bfloat16]  # the experts compute in bf16, split or not
        assert dtype1 == torch.float32  # the master weights' gradients stay fp32
        assert loss1 == pytest.approx(loss0, rel=1e-2)  # bf16 compute either way
        torch.testing.assert_close(router1, router0, rtol=5e-2, atol=5e-3)


# ------------------------------------------------------------------------------------------ experts under FSDP2
def _fsdp_experts_rank(rank: int, world: int):
    sch = treadle.create_schedule(tiny_mixtral(), mesh=treadle.Mesh((2, 2), ("dp", "ep")))
    expert_parallel_moe(sch, axis="ep")
    sch.data_parallel(axis=("dp", "ep"), shard=True)
    built = treadle.build(sch)
    experts = built.get_parameter("model.layers.0.mlp.experts.down_proj")
    dense = built.get_parameter("model.layers.0.mlp.gate.weight")
    # NOTE [nested prefetch]: the units whose gathers each unit's backward issues, where not FSDP2's default
    states = {id(m._get_fsdp_state()): p for p, m in built.named_modules() if hasattr(m, "_get_fsdp_state")}
    prefetch = {p: [states[id(s)] for s in m._get_fsdp_state()._states_to_backward_prefetch or []]
                for p, m in built.named_modules() if hasattr(m, "_get_fsdp_state")}
    return (tuple(experts.shape), tuple(experts.to_local().shape), experts.device_mesh.mesh_dim_names,
            dense.device_mesh.mesh_dim_names, {p: t for p, t in prefetch.items() if t})


def test_zero3_shards_the_experts_over_the_axes_the_expert_axis_leaves():
    # EP2 x FSDP2 over (dp, ep): each rank keeps 2 of the 4 experts (ep), FSDP2 halves them again over dp
    from treadle.testing import spawn

    e, hidden, inner = tiny_mixtral().model.layers[0].mlp.experts.down_proj.shape
    for shape, local, experts_mesh, dense_mesh, prefetch in spawn(_fsdp_experts_rank, 4, timeout_s=120):
        assert shape == (e // 2, hidden, inner) and local == (e // 4, hidden, inner)
        assert experts_mesh == ("dp",) and dense_mesh == ("dp_ep",)
        # the last unit of block 1 to start its backward gathers block 0 and its experts at once
        assert prefetch == {"model.layers.1.mlp.experts": ["model.layers.0", "model.layers.0.mlp.experts"]}


def test_backward_prefetch_issues_the_next_block_and_its_nested_units_at_once():
    from treadle.forms.data.facts import backward_prefetch

    def block():
        return torch.nn.ModuleDict({"x": torch.nn.Linear(2, 2), "y": torch.nn.Linear(2, 2)})

    model = torch.nn.ModuleDict({"a": torch.nn.ModuleDict({str(i): block() for i in (0, 1, 2, 10)})})
    blocks = ["a.0", "a.1", "a.2"]
    nested = ["a.2.y", "a.0.x", "a.0.y", "a.1.x", "a.1.y", "a.2.x"]  # taken in the model's order
    # the first nested unit of a block (forward order) is the last of the block to start its backward
    assert backward_prefetch(model, blocks, nested) == {"a.2.x": ["a.1", "a.1.y", "a.1.x"],
                                                        "a.1.x": ["a.0", "a.0.y", "a.0.x"]}
    assert backward_prefetch(model, blocks, []) == {}  # FSDP2's default order
    # a block without nested units: its own start issues the next block's; a nested unit's, the plain block
    assert backward_prefetch(model, blocks, ["a.1.x"]) == {"a.2": ["a.1", "a.1.x"], "a.1.x": ["a.0"]}
    assert backward_prefetch(model, ["a.1", "a.10"], ["a.10.x"]) == {"a.10.x": ["a.1"]}  # a prefix is no parent


def test_hsdp_shards_and_replicates_the_experts_on_8_ranks():
    # HSDP: replicated over rep, sharded over (dp, ep); the experts split over ep, FSDP2 shards them over dp and
    # replicates them over rep (their gradients: FSDP2's average over rep x dp, the exchanges' sum over ep)
    sch = treadle.create_schedule(SkewedMoE(), mesh=treadle.Mesh((2, 2, 2), ("rep", "dp", "ep")))
    expert_parallel_moe(sch, axis="ep")
    sch.data_parallel(axis=("dp", "ep"), shard=True, replicate="rep")
    assert [(u.path, u.shard_axes, u.replicate_axes) for u in treadle.form.get_form("expert").shard_units(
        sch.model, sch.view())] == [("experts", ("dp",), ("rep",))]
    assert treadle.verify(sch, _toy_inputs(), steps=2, timeout_s=300).ok


def test_the_price_of_experts_under_zero3_by_hand():
    from treadle.cost.cluster import parse_cluster
    from treadle.cost.collective_cost import collective_time_s

    cl = parse_cluster("2x2:cpu")
    a, b = cl.mesh.names
    inputs = lm_inputs(8, 16)
    sch = _ep_schedule(tiny_mixtral(), cl.mesh.shape, cl.mesh.names, ep=b, dp=(a, b), shard=True)
    p = treadle.price(sch, inputs, cl)
    model = tiny_mixtral()
    for layer in ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts"):
        local = sum(t.numel() * 4 for t in model.get_submodule(layer).parameters()) / 2  # this rank's experts
        mine = [(c["kind"], c["axis"], c["phase"], c["nbytes"]) for c in p.collectives
                if c["source"] == "fsdp" and c["module"] == layer]
        # the experts' own unit over the axis the expert axis leaves: gathered in forward and backward, reduced
        assert sorted(mine) == sorted([("all_gather", a, "fwd", local), ("all_gather", a, "bwd", local),
                                       ("reduce_scatter", a, "bwd", local)])
        rs = next(c for c in p.collectives if c["module"] == layer and c["kind"] == "reduce_scatter")
        assert rs["time_s"] == pytest.approx(collective_time_s("reduce_scatter", local, 2, cl.link(a)))
    # the blocks' units hold no expert; every parameter is split 4 ways, as under FSDP4 without experts split
    block = [c for c in p.collectives if c["module"] == "model.layers.0" and c["kind"] == "reduce_scatter"]
    assert block[0]["nbytes"] == sum(t.numel() * 4 for n, t in model.model.layers[0].named_parameters()
                                     if ".experts." not in n)
    fsdp4 = treadle.create_schedule(tiny_mixtral(), mesh=cl.mesh)
    fsdp4.data_parallel(axis=(a, b), shard=True)
    assert p.static_bytes == pytest.approx(treadle.price(fsdp4, inputs, cl).static_bytes, rel=1e-9)
    # the experts' gradients leave the exchanges' own reduction (no all-reduce over a)
    assert not [c for c in p.collectives if c["source"] in ("ep", "tp") and c["kind"] == "all_reduce"]


def test_the_price_issues_the_nested_units_backward_gathers_as_build_prefetches_them():
    # NOTE [nested prefetch]: block 1's experts, the last of its units to start backward, issue block 0's gather
    # and block 0's experts' gather at once (on a host where the gathers overlap compute)
    from treadle.cost.cluster import parse_cluster

    cl = parse_cluster("2x2:h100")
    a, b = cl.mesh.names
    sch = _ep_schedule(tiny_mixtral(), cl.mesh.shape, cl.mesh.names, ep=b, dp=(a, b), shard=True)
    p = treadle.price(sch, lm_inputs(8, 16), cl)
    bwd = {c["module"]: c for c in p.collectives
           if c["source"] == "fsdp" and c["kind"] == "all_gather" and c["phase"] == "bwd"}
    assert set(bwd) == {"model.layers.0", "model.layers.0.mlp.experts", "model.layers.1",
                        "model.layers.1.mlp.experts"}
    assert not bwd["model.layers.0.mlp.experts"]["blocking"]
    assert bwd["model.layers.0.mlp.experts"]["start_s"] == pytest.approx(bwd["model.layers.0"]["start_s"])
    assert bwd["model.layers.0.mlp.experts"]["exposed_s"] == 0.0  # hidden behind block 1's experts' backward


def _pp_fsdp_experts(ep: bool, schedule: str = "1f1b"):
    model = tiny_mixtral()
    model.config.use_cache = False
    sch = treadle.create_schedule(model, mesh=treadle.Mesh((2, 2, 2), ("pp", "dp", "ep")))
    sch["model.layers.0"].cut_pipeline_stage()
    if ep:
        expert_parallel_moe(sch, axis="ep")
    sch.data_parallel(axis=("dp", "ep"), shard=True)
    sch.pipeline(axis="pp", schedule=schedule, n_microbatches=2, example_inputs=lm_inputs(8, 16))
    return sch


def test_experts_under_zero3_inside_pipeline_stages_are_priced_by_hand():
    # PP2 x (EP2 over ep, FSDP2 over dp,ep): each stage's FSDP2 holds its block, its root and the block's experts as
    # a unit of their own over dp (NOTE [experts under FSDP2], NOTE [pipeline FSDP2 price])
    from treadle.cost.cluster import parse_cluster
    from treadle.cost.collective_cost import collective_time_s
    from treadle.forms.data.facts import fsdp_copy_s

    cl = parse_cluster("1x8:cpu")
    inputs = lm_inputs(8, 16)
    split, whole = (treadle.price(_pp_fsdp_experts(ep), inputs, cl) for ep in (True, False))
    # every parameter 1/4 on a rank either way: the local half of the experts, halved again over dp (rank by rank:
    # the largest rank, whose static bytes the price reports, may differ by a transient)
    for r, got in split.pipeline["ranks"].items():
        assert got["static_bytes"] == pytest.approx(whole.pipeline["ranks"][r]["static_bytes"], rel=1e-9)
    model = tiny_mixtral()
    nbytes = {n: t.numel() * 4 for n, t in model.named_parameters()}
    experts = sum(b for n, b in nbytes.items() if n.startswith("model.layers.0.mlp.experts.")) / 2  # the local half
    block = sum(b for n, b in nbytes.items() if n.startswith("model.layers.0.") and ".experts." not in n)
    root = nbytes["model.embed_tokens.weight"]  # stage 0's parameters outside its block
    sizes, hw = {"dp": 2, "ep": 2}, cl.for_mesh(_pp_fsdp_experts(True).mesh)
    dp_link, both = hw.link("dp"), hw.group_link(("dp", "ep"))
    reduce = (collective_time_s("reduce_scatter", experts, sizes["dp"], dp_link) + fsdp_copy_s(experts, 2, hw.rank_hardware())
              + sum(collective_time_s("reduce_scatter", b, 4, both) + fsdp_copy_s(b, 4, hw.rank_hardware())
                    for b in (block, root)))
    assert split.pipeline["ranks"]["0"]["fsdp_reduce_s"] == pytest.approx(reduce, rel=1e-9)


@pytest.mark.slow
def test_experts_under_zero3_inside_pipeline_stages_verify_on_8_ranks():
    assert treadle.verify(_pp_fsdp_experts(True), lm_inputs(8, 16), steps=2, timeout_s=400).ok


@pytest.mark.slow
def test_experts_inside_pipeline_stages_under_zero3_over_the_expert_axis_on_4_ranks():
    # PP2 x (EP2 = FSDP2 over dp): FSDP2 leaves the experts to the expert axis, so a rank keeps the same bytes
    # as under FSDP2 without experts split (each expert weight: half of the experts, whole; the rest: half)
    from treadle.cost.cluster import parse_cluster

    inputs = lm_inputs(8, 16)

    def schedule(ep: bool):
        model = tiny_mixtral()
        model.config.use_cache = False
        sch = treadle.create_schedule(model, mesh=treadle.Mesh((2, 2), ("pp", "dp")))
        sch["model.layers.0"].cut_pipeline_stage()
        if ep:
            expert_parallel_moe(sch, axis="dp")
        sch.data_parallel(axis="dp", shard=True)
        sch.pipeline(axis="pp", schedule="1f1b", n_microbatches=2, example_inputs=inputs)
        return sch

    cl = parse_cluster("2x2:cpu")
    split, whole = (treadle.price(schedule(ep), inputs, cl) for ep in (True, False))
    assert split.static_bytes == pytest.approx(whole.static_bytes, rel=1e-9)
    assert treadle.verify(schedule(True), inputs, steps=2, timeout_s=300).ok
