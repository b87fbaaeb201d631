"""The pipeline's price (issue 26, part 1): the action order each schedule class runs, the timeline against
hand-computed ones, and `treadle.price` of GPipe / 1F1B / interleaved / pp x tp schedules of a tiny GPT-2 —
per-stage rows, the bubble, the critical path, per-rank memory with the micro-batches in flight, one MFU."""

from __future__ import annotations

import pytest
import torch

import treadle
from treadle import Mesh, create_schedule
from treadle.cost.cluster import parse_cluster
from treadle.errors import PlanError
from treadle.forms.pipeline.facts import Action, action_order, stage_ranks
from treadle.forms.pipeline.timeline import simulate
from treadle.models import megatron
from treadle.testing import spawn
from tiny_models import lm_inputs, tiny_gpt2


def _names(acts) -> str:
    return " ".join(map(str, acts))


# ----------------------------------------------------------------------------------------------- action order
def test_gpipe_and_1f1b_orders_are_the_loops_torch_runs():
    from torch.distributed.pipelining import schedules as S
    from types import SimpleNamespace

    o = action_order("gpipe", 3, 3, 2)
    assert _names(o[2]) == "2F0 2F1 2B0 2B1"
    stage = SimpleNamespace(num_stages=3, group_size=3, group_rank=0, stage_index=0, is_first=True, is_last=False)
    ir = S.ScheduleGPipe(stage, 2).pipeline_order
    for r in range(3):
        assert _names(o[r]) == " ".join(str(a) for a in ir[r] if a is not None and str(a)[-1].isdigit())
    o = action_order("1f1b", 4, 4, 6)
    # warm-up min(m, n_stages - rank) forwards, then a backward and a forward in turn, then the backwards
    assert _names(o[0]) == "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0B3 0B4 0B5"
    assert _names(o[3]) == "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5"
    ir = S.Schedule1F1B(SimpleNamespace(**{**vars(stage), "num_stages": 4, "group_size": 4}), 6).pipeline_order
    for r in range(3):  # torch's own description agrees except on the last rank (off by one there in 2.13)
        assert _names(o[r]) == " ".join(str(a) for a in ir[r] if a is not None and str(a)[-1].isdigit())


@pytest.mark.parametrize("kind", ["interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev"])
def test_multi_stage_orders_are_the_schedule_classes_own(kind):
    o = action_order(kind, 4, 2, 4)
    ranks = stage_ranks(o)
    assert sorted(ranks) == [0, 1, 2, 3]
    for r, acts in o.items():
        assert len(set(acts)) == len(acts)  # each action once
        for s in {a.stage for a in acts}:
            assert ranks[s] == r
    every = {a for acts in o.values() for a in acts}
    for s in range(4):
        for mb in range(4):
            assert Action(s, "F", mb) in every
            assert Action(s, "B", mb) in every or {Action(s, "I", mb), Action(s, "W", mb)} <= every
    from treadle.forms.pipeline.conflicts import stage_rank

    assert ranks == {s: stage_rank(kind, s, 2) for s in range(4)}  # the order places stages as build does
    t = simulate(o, {(s, k): 1.0 for s in range(4) for k in "FBIW"}, stage_rank=ranks)  # runs to its end
    assert len(t.critical_path) >= 2 * 4 and 0 <= t.bubble_fraction < 1
    if kind in ("zbv", "dualpipev"):
        assert ranks[0] == ranks[3] == 0  # V placement
    else:
        assert (ranks[0], ranks[2]) == (0, 0)  # loop placement


def test_orders_a_schedule_cannot_run_are_refused():
    with pytest.raises(PlanError, match="unknown schedule 'zigzag'"):
        action_order("zigzag", 2, 2, 2)
    with pytest.raises(PlanError, match="runs one stage per rank; 4 stages on 2 ranks"):
        action_order("1f1b", 4, 2, 4)
    with pytest.raises(PlanError, match="at least as many micro-batches as stages \\(4\\); got 2"):
        action_order("1f1b", 4, 4, 2)
    with pytest.raises(PlanError, match="3 stages do not spread evenly over 2 pp ranks"):
        action_order("interleaved_1f1b", 3, 2, 4)


def test_each_rehearsed_record_goes_to_the_stage_that_runs_it():
    """Blocks by index; other ops by where they ran: a module that runs before and after the blocks (a model's
    own forward: embeddings added, then the output reshaped) belongs to the first stage before and to the last
    after, and backward mirrors forward."""
    from types import SimpleNamespace as R

    from treadle.forms.pipeline.facts import stage_of_records

    fwd = ["transformer", "transformer.wte", "transformer", "transformer.h.0.attn", "transformer.h.1.mlp",
           "transformer.h.2", "transformer.h.3.mlp", "transformer", "transformer.ln_f", "lm_head", ""]
    recs = [R(module=m, phase="forward") for m in fwd] + [R(module=m, phase="backward") for m in reversed(fwd)]
    recs.insert(len(fwd) + 5, R(module="transformer.h.2.attn", phase="recompute"))
    got = stage_of_records(recs, ["transformer.h.1"])
    assert got[: len(fwd)] == [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1]
    assert got[len(fwd):] == [1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0]  # the recomputed block 2 is stage 1's


def test_block_stage_reads_the_cut_container_even_at_the_root():
    from treadle.forms.pipeline.facts import block_stage

    cuts = ["model.layers.1", "model.layers.3"]
    assert [block_stage(f"model.layers.{k}.mlp", cuts) for k in range(6)] == [0, 0, 1, 1, 2, 2]
    assert block_stage("model.embed_tokens", cuts) is None and block_stage("model.layers_norm", cuts) is None
    assert [block_stage(p, ["0"]) for p in ("0", "0.lin", "1", "head")] == [0, 0, 1, None]  # a Sequential root


# ----------------------------------------------------------------------------------------------- timeline
def _uniform(n: int, f: float, b: float) -> dict:
    return {(s, k): (f if k == "F" else b) for s in range(n) for k in "FB"}


@pytest.mark.parametrize("kind, p, m", [("gpipe", 2, 2), ("gpipe", 4, 3), ("1f1b", 4, 8), ("1f1b", 2, 5)])
def test_one_stage_per_rank_matches_the_textbook_step(kind, p, m):
    """F = 1, B = 2, no sends: (m + p - 1)(F + B), bubble (p - 1) / (m + p - 1) for both."""
    o = action_order(kind, p, p, m)
    t = simulate(o, _uniform(p, 1.0, 2.0), stage_rank=stage_ranks(o))
    assert t.makespan_s == pytest.approx((m + p - 1) * 3.0)
    assert t.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert str(t.critical_path[0]) == "0F0" and str(t.critical_path[-1]) == f"0B{m - 1}"


def test_sends_delay_the_receiver_not_the_sender():
    """GPipe, 2 stages, 1 micro-batch, F = B = 1, a send 0.5: 0F0 [0, 1], 1F0 [1.5, 2.5], 1B0 [2.5, 3.5],
    0B0 [4, 5]."""
    o = action_order("gpipe", 2, 2, 1)
    t = simulate(o, _uniform(2, 1.0, 1.0), stage_rank=stage_ranks(o), p2p_s={0: 0.5})
    got = {str(s.action): (s.start_s, s.end_s) for v in t.slots.values() for s in v}
    assert got == {"0F0": (0.0, 1.0), "1F0": (1.5, 2.5), "1B0": (2.5, 3.5), "0B0": (4.0, 5.0)}
    assert t.makespan_s == 5.0 and [str(a) for a in t.critical_path] == ["0F0", "1F0", "1B0", "0B0"]


def test_interleaving_and_zero_bubble_shrink_the_bubble():
    """The same work (8 stages of F = 1, B = 2 on 4 ranks, 8 micro-batches): interleaved 1F1B's bubble is below
    1F1B's on 4 stages of twice the work, and splitting the backward (ZB) fills more of it."""
    p, m = 4, 8
    o = action_order("1f1b", p, p, m)
    plain = simulate(o, _uniform(p, 2.0, 4.0), stage_rank=stage_ranks(o))
    o = action_order("interleaved_1f1b", 2 * p, p, m)
    inter = simulate(o, _uniform(2 * p, 1.0, 2.0), stage_rank=stage_ranks(o))
    zb_d = {**_uniform(2 * p, 1.0, 2.0), **{(s, k): 1.0 for s in range(2 * p) for k in "IW"}}
    o = action_order("interleaved_zb", 2 * p, p, m)
    zb = simulate(o, zb_d, stage_rank=stage_ranks(o))
    assert sum(plain.busy_s.values()) == pytest.approx(sum(inter.busy_s.values())) == pytest.approx(
        sum(zb.busy_s.values()))
    assert zb.makespan_s < inter.makespan_s < plain.makespan_s
    assert plain.bubble_fraction == pytest.approx(3 / 11)


def test_an_order_that_deadlocks_is_refused():
    o = {0: [Action(0, "B", 0), Action(0, "F", 0)], 1: [Action(1, "F", 0), Action(1, "B", 0)]}
    with pytest.raises(PlanError, match=r"deadlocks; each rank waits at \{0: '0B0'"):
        simulate(o, _uniform(2, 1.0, 1.0), stage_rank={0: 0, 1: 1})


# ----------------------------------------------------------------------------------------------- price
def _inputs() -> dict:
    return {**lm_inputs(8, 16, seed=3), "use_cache": False}


def _pipelined(shape, names, kind, cuts, mb=4, tp=False, inputs=None):
    sch = create_schedule(tiny_gpt2(4), mesh=Mesh(shape, names))
    if tp:
        megatron(sch, tp="tp", vocab_parallel_head=False)
    for c in cuts:
        sch[f"transformer.h.{c}"].cut_pipeline_stage()
    sch.pipeline(axis="pp", schedule=kind, n_microbatches=mb, example_inputs=inputs or _inputs())
    return sch


def _cluster(shape) -> object:
    return parse_cluster("x".join(map(str, shape)) + ":cpu")


@pytest.fixture(scope="module")
def priced() -> dict:
    cases = {"gpipe": ((2,), ("pp",), "gpipe", [1]), "1f1b": ((2,), ("pp",), "1f1b", [1]),
             "interleaved": ((2,), ("pp",), "interleaved_1f1b", [0, 1, 2]),
             "pp x tp": ((2, 2), ("pp", "tp"), "1f1b", [1])}
    out = {}
    for name, (shape, names, kind, cuts) in cases.items():
        out[name] = treadle.price(_pipelined(shape, names, kind, cuts, tp="tp" in names), _inputs(), _cluster(shape))
    return out


def test_price_reports_stages_bubble_and_critical_path(priced):
    for name, p in priced.items():
        pi = p.pipeline
        ranks = pi["ranks"]
        assert p.step_s == pytest.approx(max(r["step_s"] for r in ranks.values())), name
        assert p.step_s >= pi["makespan_s"] > 0
        busy = sum(r["busy_s"] for r in ranks.values())
        assert pi["bubble_fraction"] == pytest.approx(1 - busy / (len(ranks) * pi["makespan_s"]))
        assert p.step_s == pytest.approx(p.compute_s + p.recompute_s + p.exposed_comm_s)
        assert pi["critical_path"][0] == "0F0" and pi["critical_path"][-1].startswith("0B")
        assert [s["stage"] for s in pi["stages"]] == list(range(pi["n_stages"]))
        assert all(s["forward_s"] > 0 and s["backward_s"] > 0 and s["saved_bytes"] > 0 for s in pi["stages"])
        assert p.peak_bytes == max(r["peak_bytes"] for r in ranks.values())
        assert len(pi["slots"]) == 2 * pi["n_stages"] * pi["n_microbatches"]  # every F and B, timed once
    # the activation a stage sends is the block's output: batch/4 x seq x hidden fp32
    assert priced["1f1b"].pipeline["stages"][0]["send_bytes"] == 2 * 16 * 64 * 4
    assert priced["pp x tp"].pipeline["stages"][0]["tp_comm_s"] > 0 == priced["1f1b"].pipeline["stages"][0]["tp_comm_s"]


def test_micro_batches_in_flight_set_the_activation_peak(priced):
    """GPipe holds every micro-batch's activations on the first stage before its first backward; 1F1B holds
    min(m, n_stages - rank) of them: 4 against 2 on rank 0, 4 against 1 on the last rank."""
    for rank, one in ((0, 2), (1, 1)):
        saved = priced["gpipe"].pipeline["stages"][rank]["saved_bytes"]
        assert priced["gpipe"].pipeline["ranks"][str(rank)]["activation_bytes"] == pytest.approx(4 * saved)
        assert priced["1f1b"].pipeline["ranks"][str(rank)]["activation_bytes"] == pytest.approx(one * saved)
    assert priced["1f1b"].peak_bytes < priced["gpipe"].peak_bytes
    assert priced["interleaved"].pipeline["bubble_fraction"] < priced["1f1b"].pipeline["bubble_fraction"]


def test_pipeline_mfu_is_the_models_useful_flops(priced):
    p = priced["pp x tp"]
    cl = _cluster((2, 2))
    assert p.model_flops == pytest.approx(priced["1f1b"].model_flops)  # the model's, whatever the schedule
    assert p.mfu == pytest.approx(p.model_flops / 4 / p.step_s / cl.rank_hardware().peak_for(torch.float32),
                                  rel=1e-6)


def test_a_cut_without_pipeline_is_refused():
    sch = create_schedule(tiny_gpt2(4), mesh=Mesh((2,), ("pp",)))
    sch["transformer.h.1"].cut_pipeline_stage()
    with pytest.raises(PlanError, match=r"cut_pipeline_stage at \['transformer.h.1'\] without sch.pipeline"):
        treadle.price(sch, _inputs(), _cluster((2,)))


def test_pp_x_ddp_price_is_a_replicas_pipeline_then_its_gradient_allreduce():
    """PP2 x DP2 on a batch of 8 runs each replica's pipeline on 4 rows: its price is PP2's on those 4 rows plus
    the all-reduce of the rank's gradients over dp after the step (one bucket: under 25 MiB here)."""
    from treadle.cost.collective_cost import collective_time_s

    cl = _cluster((2, 2))
    sch = _pipelined((2, 2), ("pp", "dp"), "1f1b", [1])
    sch.data_parallel(axis="dp", shard=False)
    p = treadle.price(sch, _inputs(), cl)
    half = {k: (v[:4] if torch.is_tensor(v) else v) for k, v in _inputs().items()}
    q = treadle.price(_pipelined((2, 2), ("pp", "dp"), "1f1b", [1], inputs=half), half, cl)
    info = p.pipeline
    assert info["data_parallel"] == "ddp over dp"
    model = tiny_gpt2(4)
    stage_prefixes = {0: ("transformer.wte", "transformer.wpe", "transformer.h.0.", "transformer.h.1."),
                      1: ("transformer.h.2.", "transformer.h.3.", "transformer.ln_f", "lm_head")}
    for r, prefixes in stage_prefixes.items():
        nbytes = sum(p_.numel() * 4 for n, p_ in model.named_parameters(remove_duplicate=False) if n.startswith(prefixes))
        want = collective_time_s("all_reduce", nbytes, 2, cl.group_link(("dp",)))
        got = info["ranks"][str(r)]
        assert got["dp_s"] == pytest.approx(want, rel=1e-9)
        assert got["step_s"] == pytest.approx(q.pipeline["ranks"][str(r)]["step_s"] + want, rel=1e-9)
        assert got["peak_bytes"] >= q.pipeline["ranks"][str(r)]["peak_bytes"]
    assert info["dp_grad_allreduce_s"] == info["ranks"][str(info["slowest_rank"])]["dp_s"]
    assert p.step_s == pytest.approx(max(d["step_s"] for d in info["ranks"].values()))


# ----------------------------------------------------------------------------------------------- pictures
def test_the_predicted_pipeline_timeline_has_a_track_per_rank_and_visible_bubbles(priced, tmp_path):
    from treadle.viz import chrome_trace
    from treadle.viz.chrome import track_names, validate_chrome_trace
    from treadle.viz.price_timeline import timeline_from_price

    p = priced["1f1b"]
    tl = timeline_from_price(p)  # dispatches on the price's pipeline entry
    assert tl.tracks[:2] == ["pp rank 0 (stage 0)", "pp rank 1 (stage 1)"]
    assert {"send s0->s1", "send s1->s0"} <= set(tl.tracks)
    for track in tl.tracks[:2]:  # each rank's slices cover the step end to end
        assert sum(s.duration_s for s in tl.spans if s.track == track) == pytest.approx(p.step_s)
    names = {s.name for s in tl.spans}
    assert {"F0 s0", "B3 s1", "optimizer", "bubble"} <= names
    bubble = sum(s.duration_s for s in tl.spans if s.phase == "bubble" and s.track == tl.tracks[0])
    assert bubble > 0 and "bubble" in tl.title and "1f1b over pp=2" in tl.title
    doc = chrome_trace(tl)
    assert validate_chrome_trace(doc) == []
    assert "pp rank 1 (stage 1)" in track_names(doc).values()
    inter = timeline_from_price(priced["interleaved"].to_dict())
    assert inter.tracks[0] == "pp rank 0 (stages 0, 2)"
    assert validate_chrome_trace(chrome_trace(inter)) == []


def test_price_lines_say_the_bubble_and_each_stage(priced):
    from treadle.planner.explain import price_lines

    p = priced["1f1b"].to_dict()
    lines = price_lines(p)
    assert lines[0].startswith("pipeline 1f1b over pp=2, 2 stages, 4 micro-batches: bubble "
                               f"{p['pipeline']['bubble_fraction'] * 100:.1f}% of rank time")
    assert "critical path 0F0 " in lines[0]
    assert lines[1].startswith("per stage and micro-batch, ms: s0 (rank 0) F ") and "send 8 KiB" in lines[1]
    assert lines[2].startswith(f"price of the schedule (rehearsed, overlap modelled): step {p['step_s'] * 1e3:.3f}")


def test_treadle_price_prints_and_draws_a_pipeline(tmp_path, capsys):
    import json

    from treadle.cli import main
    from treadle.models.zoo import named_model
    from treadle.viz.chrome import validate_chrome_trace

    model, inputs = named_model("tiny-gpt2", batch=8, seq=32)
    sch = create_schedule(model, mesh=Mesh((2,), ("pp",)))
    sch[f"transformer.h.{len(model.transformer.h) // 2 - 1}"].cut_pipeline_stage()
    sch.pipeline(axis="pp", schedule="1f1b", n_microbatches=4, example_inputs=inputs)
    path = tmp_path / "pp.json"
    path.write_text(sch.to_json())
    trace, html = tmp_path / "pp.trace.json", tmp_path / "pp.html"
    assert main(["price", str(path), "--model", "tiny-gpt2", "--cluster", "2:cpu", "--batch", "8", "--seq", "32",
                 "--trace", str(trace), "--html", str(html)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "pipeline 1f1b over pp=2, 2 stages, 4 micro-batches: bubble" in out
    assert validate_chrome_trace(json.loads(trace.read_text())) == []
    page = html.read_text()
    assert "pp=2 pipeline" in page and "pp rank 1 (stage 1)" in page and "bubble" in page


def test_the_price_refuses_what_build_refuses_and_prices_the_v_schedules():
    with pytest.raises(PlanError, match="schedule 'zbv' places stages 0 and 3 on one rank and both read "
                                        "transformer.wte.weight"):
        treadle.price(_pipelined((2,), ("pp",), "zbv", [0, 1, 2]), _inputs(), _cluster((2,)))
    model = tiny_gpt2(4)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.transformer.wte.weight.detach().clone())
    sch = create_schedule(model, mesh=Mesh((2,), ("pp",)))
    for c in (0, 1, 2):
        sch[f"transformer.h.{c}"].cut_pipeline_stage()
    sch.pipeline(axis="pp", schedule="zbv", n_microbatches=4, example_inputs=_inputs())
    p = treadle.price(sch, _inputs(), _cluster((2,)))
    assert p.pipeline["ranks"]["0"]["stages"] == [0, 3] and p.pipeline["stages"][3]["weight_s"] > 0
    assert {s["kind"] for s in p.pipeline["slots"]} == {"F", "I", "W"}


def test_a_split_backward_costs_its_host_work_per_backward_op():
    """NOTE [pipeline price]: a zero-bubble schedule's I action carries `split_backward_op_s` per backward op of
    its stage (torch's graph walk and second autograd pass), on top of the same I + W = B split of the work;
    a schedule that does not split its backward pays nothing."""
    import dataclasses

    sch = _pipelined((2,), ("pp",), "interleaved_zb", [0, 1, 2])
    base = _cluster((2,))

    def with_split(cost: float):
        return dataclasses.replace(base, device=dataclasses.replace(base.hardware(), split_backward_op_s=cost))

    free, dear = (treadle.price(sch, _inputs(), with_split(c)) for c in (0.0, 1e-4))
    for a, b in zip(free.pipeline["stages"], dear.pipeline["stages"]):
        assert a["split_host_s"] == 0.0 and (b["split_host_s"] > 0) == (b["stage"] > 0)
        assert b["backward_s"] == pytest.approx(a["backward_s"]) and b["weight_s"] == pytest.approx(a["weight_s"])
    # the first stage's I is empty and its W is the whole backward (no input of it needs a gradient)
    first = {s["kind"]: s["end_s"] - s["start_s"] for s in dear.pipeline["slots"] if s["stage"] == 0}
    assert first["I"] == 0.0 and first["W"] == pytest.approx(dear.pipeline["stages"][0]["backward_s"])

    def i_slots(p):
        return {(s["stage"], s["mb"]): s["end_s"] - s["start_s"] for s in p.pipeline["slots"] if s["kind"] == "I"}

    extra = {s["stage"]: s["split_host_s"] for s in dear.pipeline["stages"]}
    for key, d in i_slots(dear).items():
        assert d == pytest.approx(i_slots(free)[key] + extra[key[0]])
    assert dear.step_s > free.step_s
    one = treadle.price(_pipelined((2,), ("pp",), "1f1b", [1]), _inputs(), with_split(1e-4))
    assert all(s["split_host_s"] == 0.0 for s in one.pipeline["stages"])


def _llama_pipelined(kind: str, mb: int = 4):
    from tiny_models import tiny_llama

    sch = create_schedule(tiny_llama(4), mesh=Mesh((2,), ("pp",)))  # untied: ZBV's V holds embedding and head
    for c in (0, 1, 2):
        sch[f"model.layers.{c}"].cut_pipeline_stage()
    sch.pipeline(axis="pp", schedule=kind, n_microbatches=mb, example_inputs=_inputs())
    return sch


def _saved_left_rank(rank: int, world: int, kind: str) -> tuple[int, int]:
    """(bytes of saved activations whose storages are still alive after a step, of them the stages' received
    inputs) on this rank: each tracked until its storage dies (the hook hands autograd a detached alias, so it
    keeps no node alive itself)."""
    import weakref

    pipe = treadle.build(_llama_pipelined(kind))
    pipe.step(**_inputs())  # the first step also infers the stages' shapes
    alive: dict[int, tuple[int, bool]] = {}
    refs = []

    def pack(t):
        st = t.untyped_storage()
        key = id(st)
        if not isinstance(t, torch.nn.Parameter) and not isinstance(t._base, torch.nn.Parameter) and key not in alive:
            alive[key] = (st.nbytes(), t.grad_fn is None and t.requires_grad)  # a leaf: a received input
            refs.append(weakref.ref(st, lambda _r, key=key: alive.pop(key, None)))
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        pipe.step(**_inputs())
    return sum(b for b, _ in alive.values()), sum(b for b, leaf in alive.values() if leaf)


@pytest.mark.parametrize("kind", ["interleaved_zb", "zbv"])
def test_a_split_backward_frees_each_stage_graph_at_its_weight_gradients(kind):
    """NOTE [a split backward's memory]: measured on 2 gloo ranks, nothing a stage saved outlives the step but the
    stages' received inputs (the runtime steps with return_outputs=False: torch's default kept the last stage's
    outputs, and with a view's graph every saved tensor of that stage); the price and the planner's rows free
    each stage's micro-batch at its W, as at a full backward's B."""
    for rank, (left, inputs) in enumerate(spawn(_saved_left_rank, 2, kind, timeout_s=180)):
        assert left == inputs, (rank, left, inputs)
    # the last stage's rank holds no more at 8 micro-batches than at 4: nothing accumulates to the step's end
    four, eight = (treadle.price(_llama_pipelined(kind, m), _inputs(), _cluster((2,))) for m in (4, 8))
    st = {s["stage"]: s for s in four.pipeline["stages"]}
    rank = str(st[3]["rank"])
    assert eight.pipeline["ranks"][rank]["activation_bytes"] <= four.pipeline["ranks"][rank]["activation_bytes"]
    from treadle.forms.pipeline import cuts

    for r, moments in cuts.inflight(cuts._Layout([], [], [], p=2, m=4, schedule=kind)).items():
        assert max(kv.get(3, 0) for kv in moments) < 4, (r, moments)
