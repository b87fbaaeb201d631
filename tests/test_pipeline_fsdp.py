"""FSDP2 beside a pipeline: the states of NOTE [pipeline FSDP2] (`treadle.forms.pipeline.fsdp.fsdp_states`) against
the all-gathers and reduce-scatters FSDP2 issues under each schedule kind on 4 gloo ranks (PP2 x FSDP2), and the
price of PP x FSDP2 / HSDP built on them."""

from __future__ import annotations

import pytest
import torch

import treadle
from treadle import Mesh, create_schedule
from treadle.forms.pipeline.facts import action_order
from treadle.forms.pipeline.fsdp import fsdp_states
from treadle.testing import spawn
from tiny_models import lm_inputs, tiny_llama

BATCH, SEQ = 8, 16
# (schedule, cuts after blocks, micro-batches per replica, reshard_after_forward)
CASES = [("gpipe", [1], 4, True), ("1f1b", [1], 4, True), ("1f1b", [1], 4, False),
         ("interleaved_1f1b", [0, 1, 2], 4, True), ("looped_bfs", [0, 1, 2], 2, True),
         ("interleaved_zb", [0, 1, 2], 4, False), ("zbv", [0, 1, 2], 2, False), ("dualpipev", [0, 1, 2], 4, False)]


def _inputs():
    return {**lm_inputs(BATCH, SEQ, seed=3), "use_cache": False}


def _measure(rank: int, world: int) -> list[dict]:
    """Per case: this rank's stage actions and FSDP2's gathers / reduce-scatters in the order they ran, on the
    second step (the first runs the shape inference)."""
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as G

    from treadle.forms.pipeline import runtime as R

    events: list[tuple] = []
    owner: dict[int, int] = {}  # id(module) -> its stage
    unshard, post_backward, reduce = G.FSDPParamGroup.unshard, G.FSDPParamGroup.post_backward, G.foreach_reduce
    current: list = [None]

    def stage_of(group) -> int:
        return owner[id(group.modules[0])]

    def unshard_logged(self, async_op=False):
        before = self._all_gather_result is None and not self.is_unsharded
        unshard(self, async_op)
        if before and self._all_gather_result is not None:
            events.append(("AG", stage_of(self)))

    def post_backward_logged(self, *a):
        current[0] = stage_of(self)
        return post_backward(self, *a)

    def reduce_logged(*a, **k):
        events.append(("RS", current[0]))
        return reduce(*a, **k)

    def timed(self, stage, kind, mb, fn, *a, **k):
        events.append(("start", stage, kind, mb))
        out = fn(*a, **k)
        events.append(("end", stage, kind, mb))
        return out

    G.FSDPParamGroup.unshard, G.FSDPParamGroup.post_backward, G.foreach_reduce = (
        unshard_logged, post_backward_logged, reduce_logged)
    R.ActionLog.timed = timed
    out = []
    for kind, cuts, mb, raf in CASES:
        sch = _schedule(kind, cuts, mb, raf)
        mesh = sch.mesh
        pipe = treadle.build(sch)
        owner.clear()
        for s, m in zip(pipe.local_stage_indices, pipe.stages):
            owner.update({id(x): s for x in m.modules()})
        i = sch.view().data_parallel.local_index(mesh)
        inputs = {k: (v.chunk(2)[i] if torch.is_tensor(v) else v) for k, v in _inputs().items()}
        pipe.step(**inputs)
        events.clear()
        with pipe.recording():
            pipe.step(**inputs)
        out.append(list(events))
    try:  # refused: a forward between I and W would reshard the stage (NOTE in conflicts.fsdp_split_conflict)
        treadle.build(_schedule("zbv", [0, 1, 2], 2, True))
        out.append("built")
    except treadle.BuildError as exc:
        out.append(str(exc))
    return out


def _schedule(kind: str, cuts: list[int], mb: int, raf: bool, shard: bool = True):
    sch = create_schedule(tiny_llama(4), mesh=Mesh((2, 2), ("pp", "dp")))
    for c in cuts:
        sch[f"model.layers.{c}"].cut_pipeline_stage()
    sch.data_parallel(axis="dp", shard=shard, reshard_after_forward=raf)
    sch.pipeline(axis="pp", schedule=kind, n_microbatches=mb, example_inputs=_inputs())
    return sch


@pytest.fixture(scope="module")
def measured():
    return spawn(_measure, 4, timeout_s=600)


def _observed(events: list[tuple]) -> dict:
    """What the events show: the compute actions that gathered their own stage, the gathers issued between
    actions (stage, the next action), and after which action each stage reduce-scattered."""
    gathers, prefetch, reduce_after = set(), [], {}
    inside, last, waiting = None, None, []
    for e in events:
        if e[0] == "start":
            inside = (e[1], e[2], e[3])
            if e[2] != "loss":
                for s in dict.fromkeys(waiting):
                    prefetch.append((s, inside))
                waiting = []
        elif e[0] == "end":
            inside = None
            if e[2] not in ("loss", "sync"):
                last = (e[1], e[2], e[3])
        elif e[0] == "AG":
            if inside is not None and inside[1] != "loss":
                if inside[0] == e[1]:
                    gathers.add(inside)
            else:
                waiting.append(e[1])
        elif e[0] == "RS":
            reduce_after.setdefault(e[1], last)
    return {"gathers": gathers, "prefetch": sorted(prefetch), "reduce_after": reduce_after}


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{c[0]}-raf{int(c[3])}" for c in CASES])
def test_fsdp_states_match_what_fsdp2_issues(measured, case):
    kind, cuts, mb, raf = CASES[case]
    order = action_order(kind, len(cuts) + 1, 2, mb)
    predicted = fsdp_states(kind, order, raf)
    for rank in (0, 2):  # the pp ranks of replica 0
        seen = _observed(measured[rank][case])
        want = predicted[rank // 2]
        key = lambda a: (a.stage, a.kind, a.mb)  # noqa: E731
        assert seen["gathers"] == {key(a) for a in want.gathers}, (kind, rank)
        assert seen["prefetch"] == sorted((s, key(a)) for s, a in want.prefetch), (kind, rank)
        assert seen["reduce_after"] == {s: key(a) for s, a in want.reduce_after.items()}, (kind, rank)
        assert want.gathers or want.prefetch  # every stage is gathered at least once a step


@pytest.mark.slow
def test_split_backward_under_fsdp_resharding_after_forward_is_refused(measured):
    for rank in range(4):
        msg = measured[rank][-1]
        assert msg.startswith("pipeline: schedule 'zbv' splits each backward"), msg
        assert "wrong weight gradients" in msg and "data_parallel(..., reshard_after_forward=False)" in msg, msg


def _priced(kind: str, cuts: list[int], mb: int, shard: bool, raf: bool = True):
    from treadle.cost.cluster import parse_cluster

    sch = _schedule(kind, cuts, mb, raf, shard)
    return treadle.price(sch, _inputs(), parse_cluster("2x2:cpu"))


def test_price_of_pp_x_fsdp2_shards_state_and_reduces_once_per_stage():
    from treadle.cost.cluster import parse_cluster
    from treadle.cost.collective_cost import collective_time_s
    from treadle.forms.data.facts import fsdp_copy_s

    ddp, fsdp = _priced("1f1b", [1], 4, False), _priced("1f1b", [1], 4, True)
    assert fsdp.data_parallel.startswith("pipeline 1f1b over pp x ") and "fsdp2" in fsdp.data_parallel, fsdp.data_parallel
    model = tiny_llama(4)
    params = dict(model.named_parameters())
    stage0 = [p for n, p in params.items() if not n.startswith(("model.layers.2", "model.layers.3", "model.norm",
                                                                 "lm_head"))]
    pbytes = sum(p.numel() * p.element_size() for p in stage0)
    adam = sum(p.numel() * 8 for p in stage0)
    d0, f0 = ddp.pipeline["ranks"]["0"], fsdp.pipeline["ranks"]["0"]
    assert f0["static_bytes"] == pytest.approx(d0["static_bytes"] - (pbytes + adam) / 2, rel=1e-9)
    # the reduce-scatters of stage 0's units (its root: the embedding; its blocks) once, after its last backward
    link, hw = parse_cluster("2x2:cpu").link("dp"), parse_cluster("2x2:cpu").rank_hardware()
    units = {"": params["model.embed_tokens.weight"].numel() * 4}
    for b in ("0", "1"):
        units[b] = sum(p.numel() * 4 for n, p in params.items() if n.startswith(f"model.layers.{b}."))
    want = sum(collective_time_s("reduce_scatter", x, 2, link) + fsdp_copy_s(x, 2, hw) for x in units.values())
    assert f0["fsdp_reduce_s"] == pytest.approx(want, rel=1e-9)
    assert f0["fsdp_gather_s"] > 0 and d0["fsdp_gather_s"] == 0
    assert fsdp.pipeline["dp_grad_allreduce_s"] == 0 and ddp.pipeline["dp_grad_allreduce_s"] > 0
    # each slot is its stage's compute plus what FSDP2 adds to that action: none shorter than without FSDP2
    base = {(s["stage"], s["kind"], s["mb"]): s["end_s"] - s["start_s"] for s in ddp.pipeline["slots"]}
    for s in fsdp.pipeline["slots"]:
        assert s["end_s"] - s["start_s"] >= base[(s["stage"], s["kind"], s["mb"])] - 1e-12


def test_keeping_stages_gathered_gathers_once_and_holds_the_same_peak_under_1f1b():
    """Under 1F1B resharding after forward saves no peak: the first backward gathers the whole stage again while
    every warm-up micro-batch is in flight, as keeping it gathered holds it then."""
    keep, reshard = _priced("1f1b", [1], 4, True, raf=False), _priced("1f1b", [1], 4, True, raf=True)
    stage_bytes = {"0": 0, "1": 0}
    for n, p in tiny_llama(4).named_parameters():
        late = n.startswith(("model.layers.2", "model.layers.3", "model.norm", "lm_head"))
        stage_bytes["1" if late else "0"] += p.numel() * p.element_size()
    for r in ("0", "1"):
        k, s = keep.pipeline["ranks"][r], reshard.pipeline["ranks"][r]
        assert k["fsdp_gather_s"] < s["fsdp_gather_s"]  # one gather of the stage a step, not one per backward
        assert k["fsdp_reduce_s"] == pytest.approx(s["fsdp_reduce_s"])
        assert k["activation_bytes"] == pytest.approx(s["activation_bytes"])  # the same micro-batches in flight
        assert k["gathered_bytes"] == s["gathered_bytes"] == stage_bytes[r]
        assert k["peak_bytes"] == pytest.approx(s["peak_bytes"])


def test_price_refuses_a_split_backward_under_fsdp2_resharding_after_forward():
    from treadle.errors import PlanError

    with pytest.raises(PlanError, match=r"price: schedule 'zbv' splits each backward .* reshard_after_forward=False"):
        _priced("zbv", [0, 1, 2], 2, True, raf=True)
    assert _priced("zbv", [0, 1, 2], 2, True, raf=False).pipeline["ranks"]["0"]["fsdp_gather_s"] > 0


def test_price_lines_say_each_ranks_fsdp2_traffic():
    from treadle.planner.explain import price_lines

    p = _priced("1f1b", [1], 4, True).to_dict()
    line = next(x for x in price_lines(p) if "reduce-scatters" in x)
    r0 = p["pipeline"]["ranks"]["0"]
    assert line.startswith(f"{p['pipeline']['data_parallel']} per step, ms (inside the actions above): rank 0 gathers "
                           f"{r0['fsdp_gather_s'] * 1e3:.3f} reduce-scatters {r0['fsdp_reduce_s'] * 1e3:.3f}"), line
    assert not any("reduce-scatters" in x for x in price_lines(_priced("1f1b", [1], 4, False).to_dict()))
