"""Pictures of plans and profiles: the predicted step as a Chrome trace, the timeline model, the HTML reports,
the measured trace, the CLI flags and the progress display."""

from __future__ import annotations

import html
import io
import json
from html.parser import HTMLParser

import pytest
import torch
from rich.console import Console

from treadle.cost.cluster import parse_cluster
from treadle.planner import plan_model
from treadle.planner.to_schedule import decisions_python
from treadle.planner.plan import Plan
from treadle.viz import (CommCost, MemoryTotals, ModuleCosts, StepCosts, chrome_trace, costs_from_plan,
                         timeline_from_costs, timeline_from_plan, validate_chrome_trace, write_chrome_trace)
from treadle.viz.html import PLAN_SECTIONS, PROFILE_SECTIONS, plan_html, profile_html
from treadle.viz.measured import measured_trace, step_times_s
from treadle.viz.progress import progress
from treadle.viz.chrome import track_names
from treadle.planner.rows import STEP_ROW
from treadle.viz.price_timeline import WAIT
from treadle.viz.schedule_view import collapse_schedule
from treadle.viz.timeline import COMPUTE

MS = 1e-3


# ----------------------------------------------------------------------------- a fixed plan
def fixed_plan_dict() -> dict:
    """A plan on a 2x2 (dp, tp) CPU mesh: an embedding, a 4-block template (attention sharded on tp,
    an MLP replicated) with 2 of 4 blocks checkpointed, and a head. Totals are the rows' sums."""
    rows = [  # path, count, layout, compute, comm, recompute (s), memory (bytes)
        ("emb", 1, "weight:R out:R", 3 * MS, 1 * MS, 0.0, 1e6),
        ("h.0.attn", 4, "weight:S(1) out:S(1)", 12 * MS, 4 * MS, 2 * MS, 4e6),
        ("h.0.mlp", 4, "out:R", 6 * MS, 2 * MS, 1 * MS, 2e6),
        ("head", 1, "out:R", 3 * MS, 0.0, 0.0, 1e6),
    ]
    compute = sum(r[3] for r in rows)
    comm = sum(r[4] for r in rows)
    rec = sum(r[5] for r in rows)
    static, act, transient, other = 6e6, 3e6, 1e6, 0.5e6
    est = {"step_s": compute + comm + rec, "peak_bytes": static + act + transient + other, "mfu": 0.3,
           "compute_s": compute, "comm_s": comm, "recompute_s": rec, "static_bytes": static,
           "activation_bytes": act, "transient_bytes": transient}
    decisions = [{"op": "shard", "path": f"h.{i}.attn", "args": {"names": "weight", "dim": 1, "axis": "tp"},
                  "why": "mm"} for i in range(4)]
    sync = {"mode": "fwd_post", "to": "R", "from_": "P", "axis": "tp"}
    decisions += [{"op": "sync", "path": "h.0.attn", "args": sync, "why": "mm"},
                  {"op": "checkpoint", "path": "h.0", "args": {}, "why": ""},
                  {"op": "checkpoint", "path": "h.2", "args": {}, "why": ""},
                  {"op": "data_parallel", "path": "", "args": {"axis": "dp", "shard": False}, "why": ""}]
    alts = [{"mesh": "Mesh(dp=2, tp=2)", "roles": "data-parallel dp; tensor tp", "status": "optimal",
             "step_s": est["step_s"], "peak_bytes": est["peak_bytes"]},
            {"mesh": "Mesh(dp=2, tp=2)", "roles": "tensor dp,tp", "status": "infeasible", "step_s": 0.0,
             "peak_bytes": 0.0}]
    return {"format": "treadle.plan/1", "model": {"name": "fixed"}, "cluster": parse_cluster("2x2:cpu").to_dict(),
            "roles": "data-parallel dp; tensor tp", "mode": "joint", "budget_bytes": 11e6, "decisions": decisions,
            "estimate": est,
            "rows": [{"path": p, "count": c, "layout": lay, "compute_s": a, "comm_s": b, "recompute_s": r,
                      "memory_bytes": m} for p, c, lay, a, b, r, m in rows],
            "binding": "memory binds: test", "solver": {"status": "optimal", "gap": 0.0, "alternatives": alts,
                                                        "checkpoints": {"h.0": 2}}}


@pytest.fixture(scope="module")
def fixed_plan() -> Plan:
    return Plan.from_dict(fixed_plan_dict())


@pytest.fixture(scope="module")
def real_plan() -> Plan:
    """The tiny GPT-2 planned on a 2x2 CPU mesh under a budget tight enough to checkpoint blocks."""
    from treadle.models.zoo import named_model

    model, inputs = named_model("tiny-gpt2", batch=4, seq=16, dropout=False)
    cluster = parse_cluster("2x2:cpu")
    free = plan_model(model, inputs, cluster=cluster)
    budget = free.estimated.peak_bytes - 0.6 * (free.estimated.activation_bytes)
    return plan_model(model, inputs, cluster=cluster, memory_budget_bytes=budget,
                      model_spec={"name": "tiny-gpt2", "batch": 4, "seq": 16})


def x_events(doc: dict) -> list[dict]:
    return [e for e in doc["traceEvents"] if e["ph"] == "X"]


def _by_track(doc: dict) -> dict[str, list[dict]]:
    names = track_names(doc)
    out: dict[str, list[dict]] = {}
    for e in x_events(doc):
        assert (e["pid"], e["tid"]) in names
        out.setdefault(names[(e["pid"], e["tid"])], []).append(e)
    return out


def assert_trace_matches_estimate(doc: dict, plan: Plan) -> None:
    """The Chrome-trace checks of the issue: required keys, monotonic timestamps per track, durations summing
    to the predicted step, and the split by phase and stream matching the estimate (explain's numbers).
    A priced plan is drawn from its price: the compute track (compute, recompute, and the waits for exposed
    collectives) covers the step; a price-less plan's slices add up to the step (nothing overlapped)."""
    assert validate_chrome_trace(doc) == []
    xs = x_events(doc)
    assert xs
    for e in xs:
        assert {"name", "ph", "ts", "dur", "pid", "tid", "cat", "args"} <= set(e)
    by_track = _by_track(doc)
    for track, evs in by_track.items():  # monotonic and disjoint, in file order
        for a, b in zip(evs, evs[1:]):
            assert b["ts"] >= a["ts"] + a["dur"] - 1e-3, (track, a["name"], b["name"])
    est = plan.estimate()
    end_us = max(e["ts"] + e["dur"] for e in xs)
    assert end_us == pytest.approx(est.step_s * 1e6, rel=0.01)
    comp = by_track[COMPUTE]
    fwd_bwd_us = sum(e["dur"] for e in comp if e["cat"] in ("forward", "backward", "optimizer"))
    assert fwd_bwd_us == pytest.approx(est.compute_s * 1e6, rel=0.01)
    assert sum(e["dur"] for e in comp if e["cat"] == "recompute") == pytest.approx(est.recompute_s * 1e6, rel=0.01,
                                                                                   abs=1e-3)
    comm = [e for t, evs in by_track.items() if t != COMPUTE for e in evs]
    exposed_us = sum(e["args"]["exposed_ms"] * 1e3 for e in comm)
    assert exposed_us == pytest.approx(est.comm_s * 1e6, rel=0.01, abs=1e-3)
    if plan.price is not None:
        assert_trace_matches_price(doc, plan.price)
    else:
        assert sum(e["dur"] for e in xs) == pytest.approx(est.step_s * 1e6, rel=0.01)  # nothing overlapped
    assert doc["otherData"]["step_ms"] == pytest.approx(est.step_s * 1e3, rel=0.01)


def assert_trace_matches_price(doc: dict, p: dict) -> None:
    """A trace drawn by timeline_from_price: the compute track sums to step_s = compute + recompute + exposed
    comm, its waits to the exposed comm, each collective of the price is one slice on its axis's stream at
    its start and end, with its kind, axis and bytes."""
    by_track = _by_track(doc)
    comp = by_track[COMPUTE]
    assert sum(e["dur"] for e in comp) == pytest.approx(p["step_s"] * 1e6, rel=0.01)
    assert sum(e["dur"] for e in comp if e["cat"] == WAIT) == pytest.approx(p["exposed_comm_s"] * 1e6, rel=0.01,
                                                                            abs=1e-3)
    comm = [(t, e) for t, evs in by_track.items() if t != COMPUTE for e in evs]
    timed = [c for c in p["collectives"] if c["end_s"] > c["start_s"]]
    assert len(comm) == len(timed)
    assert sum(e["dur"] for _, e in comm) == pytest.approx(p["comm_s"] * 1e6, rel=0.01, abs=1e-3)
    got = sorted((t, e["args"]["kind"], e["args"]["nbytes"], e["ts"], e["ts"] + e["dur"]) for t, e in comm)
    want = sorted(("comm " + c["axis"].replace(",", "+"), c["kind"], c["nbytes"], c["start_s"] * 1e6,
                   c["end_s"] * 1e6) for c in timed)
    assert len(got) == len(want)
    for g, w in zip(got, want):  # same slice; times in microseconds agree to 1 us (float rounding of the trace)
        assert g[:3] == w[:3] and abs(g[3] - w[3]) <= 1 and abs(g[4] - w[4]) <= 1, (g, w)
    segs = [s for s in p["segments"] if s["compute_s"] > 0]
    assert len([e for e in comp if e["cat"] != WAIT]) == len(segs)


# ----------------------------------------------------------------------------- trace
def test_trace_of_a_real_plan_matches_its_estimate(real_plan: Plan, tmp_path) -> None:
    path = write_chrome_trace(timeline_from_plan(real_plan), str(tmp_path / "step.json"))
    assert real_plan.price is not None  # drawn from the plan's price
    doc = json.loads(open(path).read())
    assert_trace_matches_estimate(doc, real_plan)
    # a plan saved and loaded gives the same trace
    loaded = Plan.from_json(real_plan.to_json())
    assert chrome_trace(timeline_from_plan(loaded)) == doc
    # every (module, phase) row of the price appears, with its compute adding up to the row
    xs = x_events(doc)
    cat = {"fwd": "forward", "bwd": "backward", "recompute": "recompute", "optim": "optimizer"}
    for r in real_plan.price["rows"]:
        got = sum(e["dur"] for e in xs if e["args"]["module"] == (r["module"] or "<root>")
                  and e["cat"] == cat[r["phase"]] and "kind" not in e["args"])
        assert got == pytest.approx(r["compute_s"] * 1e6, rel=0.01, abs=1e-3), r
    assert sum(e["args"].get("flops", 0) for e in xs) > 0


def test_trace_of_a_hand_written_schedule_priced_by_treadle_price(tmp_path) -> None:
    """Megatron tp + FSDP2 on a 2x2 mesh of H100s (overlap on), half the blocks checkpointed: recompute,
    blocking tp collectives and prefetched gathers hidden behind compute, all where the price puts them."""
    import treadle
    from treadle import Mesh
    from treadle.cost.cluster import ClusterSpec
    from treadle.models.zoo import named_model
    from treadle.pricing import price
    from treadle.viz import timeline_from_price

    model, inputs = named_model("tiny-gpt2", batch=32, seq=128, dropout=False)
    mesh = Mesh((2, 2), ("dp", "tp"))
    sch = treadle.models.megatron(treadle.create_schedule(model, mesh=mesh), tp="tp", checkpoint_fraction=0.5)
    sch.data_parallel(axis="dp", shard=True)
    p = price(sch, inputs, ClusterSpec.uniform(mesh, "nvlink4", device="h100-sxm"))
    assert p.recompute_s > 0 and p.overlapped_comm_s > 0.1 * p.comm_s and p.exposed_comm_s > 0
    tl = timeline_from_price(p, title="megatron", world_size=4)
    assert tl.tracks == [COMPUTE, "comm dp", "comm tp"]
    assert tl.step_s == pytest.approx(p.step_s)
    assert tl.hidden_comm_s() == pytest.approx(p.overlapped_comm_s, rel=1e-6, abs=1e-12)
    bd = tl.breakdown()
    assert sum(bd.values()) == pytest.approx(p.step_s, rel=1e-6)
    assert bd["recompute"] == pytest.approx(p.recompute_s)
    assert bd["comm dp"] + bd["comm tp"] == pytest.approx(p.exposed_comm_s, abs=1e-12)
    doc = chrome_trace(tl)
    assert_trace_matches_price(doc, p.to_dict())
    assert timeline_from_price(p.to_dict(), title="megatron", world_size=4) == tl
    # a prefetched FSDP2 gather runs beside compute (a compute slice starts inside it) and delays nothing
    hidden = [s for s in tl.spans if s.track == "comm dp" and s.exposed_s == 0]
    assert hidden and {s.args["source"] for s in hidden} == {"fsdp"}
    assert any(hidden[0].start_s <= s.start_s < hidden[0].end_s for s in tl.spans
               if s.track == COMPUTE and s.phase != WAIT)
    # a blocking tp collective delays compute by all of it: its wait slice on the compute track
    tp = next(s for s in tl.spans if s.track == "comm tp")
    (wait,) = [s for s in tl.spans if s.phase == WAIT and s.end_s == pytest.approx(tp.end_s)]
    assert wait.duration_s == pytest.approx(tp.duration_s) and tp.args["blocking"]
    # memory: static all step, the price's peak reached at the end of the forward
    assert max(m.total_bytes for m in tl.memory) == pytest.approx(p.peak_bytes)
    assert tl.memory[0].total_bytes == pytest.approx(p.static_bytes)
    with pytest.raises(ValueError, match="compute track adds up to"):
        timeline_from_price(dict(p.to_dict(), step_s=2 * p.step_s))
    with pytest.raises(ValueError, match="holds no 'segments'"):
        timeline_from_price({"step_s": 1.0})


def test_trace_of_a_fixed_plan_has_its_structure(fixed_plan: Plan) -> None:
    tl = timeline_from_plan(fixed_plan)
    doc = chrome_trace(tl)
    assert_trace_matches_estimate(doc, fixed_plan)
    assert tl.tracks == [COMPUTE, "comm dp", "comm dp+tp"]
    comp = [s for s in tl.spans if s.track == COMPUTE]
    fwd = [s.name for s in comp if s.phase == "forward"]
    assert fwd == ["emb"] + [f"h.0.{m} [{k}/4]" for k in range(1, 5) for m in ("attn", "mlp")] + ["head"]
    bwd = [s.name for s in comp if s.phase == "backward"]
    assert bwd == list(reversed(fwd))
    # 2 of 4 blocks recomputed (instances 1 and 3 of 4, spread from the first), each right before its backward
    names = [s.name for s in comp]
    for k in (1, 3):
        i = names.index(f"h.0.attn [{k}/4]", len(fwd))
        assert [comp[i].phase, comp[i + 1].phase] == ["recompute", "recompute"]
        assert names[i + 2:i + 4] == [f"h.0.mlp [{k}/4]", f"h.0.attn [{k}/4]"]
        assert comp[i + 2].phase == "backward"
    assert sum(s.phase == "recompute" for s in comp) == 4
    # replicated modules communicate on dp in backward only; the tp-sharded one on dp+tp, half each way
    dp = [s for s in tl.spans if s.track == "comm dp"]
    assert {s.phase for s in dp} == {"backward"}
    assert sum(s.duration_s for s in dp) == pytest.approx(3 * MS)
    dptp = [s for s in tl.spans if s.track == "comm dp+tp"]
    assert sum(s.duration_s for s in dptp if s.phase == "forward") == pytest.approx(2 * MS)
    assert sum(s.duration_s for s in dptp if s.phase == "backward") == pytest.approx(2 * MS)
    assert dptp[0].args["collectives"] == ["all-reduce over tp (P -> R at the exit; its adjoint in backward)",
                                           "gradient all-reduce over dp (data parallel)"]
    assert dp[0].args["collectives"] == ["gradient all-reduce over dp (data parallel)"]
    # memory: static + other all step; the peak of the curve is below the planner's (additive) peak
    mem = tl.memory
    assert mem[0].total_bytes == pytest.approx(6.5e6)
    assert mem[-1].total_bytes == pytest.approx(6.5e6)
    assert max(p.total_bytes for p in mem) <= tl.peak_bytes + 1
    assert max(p.transient_bytes for p in mem) == pytest.approx(1e6)
    at_fwd_end = [p for p in mem if p.t_s == tl.forward_end_s]
    assert at_fwd_end[0].activation_bytes == pytest.approx(3e6)
    assert all(b.t_s >= a.t_s for a, b in zip(mem, mem[1:]))


def test_costs_from_plan_refuses_rows_that_do_not_add_up() -> None:
    d = fixed_plan_dict()
    d["rows"][1]["compute_s"] += 1.0
    with pytest.raises(ValueError, match="rows' compute adds up to"):
        costs_from_plan(Plan.from_dict(d))
    d = fixed_plan_dict()
    d["estimate"]["comm_s"] += 1.0
    with pytest.raises(ValueError, match="less than the estimate's exposed"):
        costs_from_plan(Plan.from_dict(d))


def test_price_less_plan_with_hidden_sync_draws_the_estimate() -> None:
    """A plan file without a price whose solver hid part of the sync: the rows' comm exceeds the exposed
    estimate; every collective is drawn exposed by estimate / rows, and the breakdown is the estimate's."""
    d = fixed_plan_dict()
    d["estimate"]["comm_s"] -= 3.5 * MS  # 7 ms of comm in the rows, 3.5 ms exposed
    d["estimate"]["step_s"] -= 3.5 * MS
    plan = Plan.from_dict(d)
    tl = timeline_from_plan(plan)
    bd = tl.breakdown()
    assert bd["comm dp"] + bd["comm dp+tp"] == pytest.approx(3.5 * MS)
    assert tl.hidden_comm_s() == pytest.approx(3.5 * MS)
    assert sum(bd.values()) == pytest.approx(plan.estimate().step_s)
    assert validate_chrome_trace(chrome_trace(tl)) == []


def test_overlapped_communication_runs_beside_compute() -> None:
    mem = MemoryTotals(1e6, 0.0, 2e6, 0.0, None)
    mods = [ModuleCosts("a", 1, 2 * MS, 4 * MS, 0.0, [CommCost(("tp",), "forward", 3 * MS, 1 * MS)]),
            ModuleCosts("b", 1, 1 * MS, 2 * MS, 0.0, [CommCost(("dp",), "backward", 1 * MS, 0.0)])]
    costs = StepCosts("overlap", mods, 10 * MS, 9 * MS, 4 * MS, 0.0, mem, 2, ["comm tp", "comm dp"])
    tl = timeline_from_costs(costs)
    assert tl.tracks == [COMPUTE, "comm tp", "comm dp"]
    assert tl.step_s == pytest.approx(10 * MS)  # compute 9 ms + 1 ms exposed
    assert tl.hidden_comm_s() == pytest.approx(3 * MS)
    assert tl.breakdown() == pytest.approx({"forward": 3 * MS, "backward": 6 * MS, "comm tp": 1 * MS, "comm dp": 0.0})
    comp = {(s.name, s.phase): s for s in tl.spans if s.track == COMPUTE}
    (tp,) = [s for s in tl.spans if s.track == "comm tp"]
    (dp,) = [s for s in tl.spans if s.track == "comm dp"]
    # a's collective starts when a's forward ends; 1 ms of it delays b, 2 ms run beside b's compute
    assert tp.start_s == pytest.approx(comp["a", "forward"].end_s)
    assert comp["b", "forward"].start_s == pytest.approx(tp.start_s + 1 * MS)
    assert comp["b", "backward"].start_s < tp.end_s < comp["b", "backward"].end_s
    # b's gradient collective runs entirely beside a's backward
    assert dp.start_s == pytest.approx(comp["b", "backward"].end_s)
    assert dp.end_s < comp["a", "backward"].end_s
    assert validate_chrome_trace(chrome_trace(tl)) == []
    with pytest.raises(ValueError, match="exposed_s <= seconds"):
        CommCost(("dp",), "backward", 1.0, 2.0)


def test_validator_reports_each_kind_of_problem() -> None:
    assert validate_chrome_trace({}) == ["no 'traceEvents' list"]
    doc = {"traceEvents": [
        {"name": "a", "ph": "X", "ts": 0, "pid": 1, "tid": 1},  # no dur
        {"name": "b", "ph": "X", "ts": -1, "dur": 1, "pid": 1, "tid": 2},
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": 3, "args": {}},
        {"name": "c", "ph": "X", "ts": 10, "dur": 10, "pid": 1, "tid": 4},
        {"name": "d", "ph": "X", "ts": 15, "dur": 10, "pid": 1, "tid": 4},  # overlaps c without nesting
        {"name": "e", "ph": "X", "ts": 11, "dur": 2, "pid": 1, "tid": 5},
        {"name": "f", "ph": "X", "ts": 10, "dur": 10, "pid": 1, "tid": 5},  # e nests inside f: fine
    ]}
    errs = validate_chrome_trace(doc)
    assert any("missing 'dur'" in e for e in errs)
    assert any("ts must be a number >= 0" in e for e in errs)
    assert any("without a string args.name" in e for e in errs)
    assert any("'d'" in e and "overlaps" in e for e in errs)
    assert len(errs) == 4


# ----------------------------------------------------------------------------- HTML
class _Sections(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.sections: list[str] = []
        self.charts: list[str] = []
        self.tags: set[str] = set()
        self.urls: list[str] = []
        self.parts: dict[str, float] = {}
        self.pres: list[str] = []  # the text of each <pre>
        self._in_pre = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.add(tag)
        if tag == "section":
            self.sections.append(a["id"])
        if tag == "svg":
            self.charts.append(a["data-chart"])
        if "data-seconds" in a:
            self.parts[a["data-part"]] = float(a["data-seconds"])
        self.urls += [v for k, v in a.items() if k in ("src", "href") and v]
        if tag == "pre":
            self.pres.append("")
        self._in_pre = tag == "pre" or self._in_pre

    def handle_endtag(self, tag):
        if tag == "pre":
            self._in_pre = False

    def handle_data(self, data):
        if self._in_pre:
            self.pres[-1] += data


def test_plan_report_has_every_section_and_needs_no_network(real_plan: Plan, fixed_plan: Plan) -> None:
    for plan in (real_plan, fixed_plan):
        page = plan_html(plan)
        assert ("transient" in page) == (plan.price is not None)
        p = _Sections()
        p.feed(page)
        p.close()
        assert p.sections == list(PLAN_SECTIONS)
        assert {"mesh", "breakdown", "timeline", "memory"} <= set(p.charts)
        assert not p.urls and not {"script", "link", "img", "iframe"} & p.tags  # self-contained
        assert sum(p.parts.values()) == pytest.approx(plan.estimate().step_s, rel=0.01)
        collapsed, in_order = (x.strip().splitlines() for x in p.pres)  # the report's view, then every call
        assert collapsed == collapse_schedule(decisions_python(plan.decisions))
        assert in_order == decisions_python(plan.decisions)
        assert plan.binding.split(":")[0] in page
        for r in plan.rows:
            if r.path != STEP_ROW:  # NOTE [the step row]: no module, no layout
                assert f"<td>{html.escape(r.path)}</td>" in page


@pytest.fixture(scope="module")
def tiny_profile():
    from treadle.models.zoo import named_model
    from treadle.profile import profile

    model, inputs = named_model("tiny-gpt2", batch=2, seq=16, fake=True)
    return profile(model, inputs, hardware="h100-sxm")


def test_profile_report_has_every_section(tiny_profile) -> None:
    prof = tiny_profile
    p = _Sections()
    p.feed(profile_html(prof))
    assert p.sections == list(PROFILE_SECTIONS)
    assert "memory" in p.charts and not p.urls
    page = profile_html(prof, depth=2)
    rows = prof.rows(max_depth=2)
    assert len(rows) > 3 and all(m.path in page for m in rows)
    assert page.count("<tr>") == len(rows) + 1 + 9  # module rows + header + summary rows


def test_profile_trace_has_one_slice_per_timed_op(tiny_profile, tmp_path) -> None:
    from treadle.cli import main
    from treadle.profile.records import ModelProfile
    from treadle.viz import timeline_from_profile

    prof = tiny_profile
    doc = chrome_trace(timeline_from_profile(prof))
    assert validate_chrome_trace(doc) == []
    xs = x_events(doc)
    timed = [r for r in prof.ops if r.time_s > 0]
    assert [e["args"]["op_index"] for e in xs] == [r.index for r in timed]
    assert sum(e["dur"] for e in xs) == pytest.approx(prof.step_time_s * 1e6, rel=0.01)
    assert sum(e["args"]["flops"] for e in xs) == sum(r.flops for r in timed)
    assert {e["cat"] for e in xs} <= {"forward", "backward", "recompute"}
    mem = [e for e in doc["traceEvents"] if e["ph"] == "C"]
    assert max(sum(e["args"].values()) for e in mem) == pytest.approx(prof.peak_bytes, abs=4)
    with pytest.raises(ValueError, match="holds no op records"):
        timeline_from_profile(ModelProfile.from_dict(prof.to_dict(ops=False)))


# ----------------------------------------------------------------------------- measured, CLI, progress
def test_measured_trace_is_a_valid_chrome_trace(tmp_path) -> None:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(8, 16)

    def step():
        m(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    path = measured_trace(step, str(tmp_path / "measured.json"), steps=2)
    doc = json.loads(open(path).read())
    assert validate_chrome_trace(doc) == []
    times = step_times_s(doc)
    assert len(times) == 2 and all(t > 0 for t in times)
    assert any("aten::addmm" in str(e.get("name")) for e in x_events(doc))
    with pytest.raises(ValueError, match="steps >= 1"):
        measured_trace(step, str(tmp_path / "x.json"), steps=0)


def test_explain_cli_writes_trace_and_report(fixed_plan: Plan, tmp_path, capsys) -> None:
    from treadle.cli import main

    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(fixed_plan_dict()))
    trace, report = tmp_path / "step.json", tmp_path / "report.html"
    assert main(["explain", str(plan_path), "--trace", str(trace), "--html", str(report), "-q"]) == 0
    assert f"wrote {trace}" in capsys.readouterr().out
    assert_trace_matches_estimate(json.loads(trace.read_text()), fixed_plan)
    assert '<section id="layouts">' in report.read_text()


def test_explain_of_a_priced_plan_draws_its_price(real_plan: Plan, tmp_path, capsys) -> None:
    from treadle.cli import main

    real_plan.estimate()
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(real_plan.to_json())
    trace = tmp_path / "step.json"
    assert main(["explain", str(plan_path), "--trace", str(trace), "-q"]) == 0
    out = capsys.readouterr().out
    e = real_plan.estimate()
    assert f"step {e.step_s * 1e3:.3f} ms" in out  # explain's step is the trace's
    doc = json.loads(trace.read_text())
    assert doc == chrome_trace(timeline_from_plan(real_plan))
    assert_trace_matches_estimate(doc, Plan.from_json(plan_path.read_text()))


def test_price_cli_writes_trace_and_report(tmp_path, capsys) -> None:
    import treadle
    from treadle import Mesh
    from treadle.cli import main
    from treadle.models.zoo import named_model

    model, _ = named_model("tiny-gpt2", batch=8, seq=32, dropout=False)
    sch = treadle.models.megatron(treadle.create_schedule(model, mesh=Mesh((2, 2), ("dp", "tp"))), tp="tp", dp="dp")
    f = tmp_path / "schedule.json"
    f.write_text(sch.to_json())
    out, trace, report = tmp_path / "price.json", tmp_path / "step.json", tmp_path / "price.html"
    assert main(["price", str(f), "--model", "tiny-gpt2", "--cluster", "2x2:cpu", "--batch", "8", "--seq", "32",
                 "--json", str(out), "--trace", str(trace), "--html", str(report)]) == 0
    assert f"wrote {trace}" in capsys.readouterr().out
    p = json.loads(out.read_text())
    doc = json.loads(trace.read_text())
    assert_trace_matches_price(doc, p)
    assert doc["otherData"]["step_ms"] == pytest.approx(p["step_s"] * 1e3)
    parsed = _Sections()
    parsed.feed(report.read_text())
    assert parsed.sections == ["summary", "breakdown", "memory"] and not parsed.urls
    assert {"breakdown", "timeline", "memory"} <= set(parsed.charts)
    assert sum(parsed.parts.values()) == pytest.approx(p["step_s"], rel=0.01)


def test_progress_is_quiet_off_a_terminal_and_with_quiet() -> None:
    buf = io.StringIO()
    with progress("planning", console=Console(file=buf, force_terminal=False)) as report:
        report("solve", 0.5)
    with progress("planning", quiet=True, console=Console(file=buf, force_terminal=True)) as report:
        report("solve")
    assert buf.getvalue() == ""
    tty = io.StringIO()
    with progress("planning", console=Console(file=tty, force_terminal=True, width=80)) as report:
        report("solve (12 units)", 0.5)
    assert "planning: solve (12 units)" in tty.getvalue()


# ----------------------------------------------------------------------------- the acceptance plans
def _demo_gpt2_plan() -> Plan:
    """The plan of examples/demo_gpt2.py: its GPT-2 on a 2x2 CPU mesh at 0.6x the unconstrained peak."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("demo_gpt2", Path(__file__).parents[1] / "examples" / "demo_gpt2.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    ids = torch.randint(0, 1024, (8, 64), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids}
    model, cluster = demo.gpt2(), parse_cluster("2x2:cpu")
    # one step's timeline (pipelined plans draw a track per pp rank: test_a_pipelined_plan_draws_its_stages)
    free = plan_model(model, inputs, cluster=cluster, pp_axis=None)
    return plan_model(model, inputs, cluster=cluster, memory_budget_bytes=0.6 * free.estimated.peak_bytes,
                      pp_axis=None)


def _readme_llama_plan() -> Plan:
    """The README's `treadle plan llama-3-8b --cluster 8x8:h100 --memory 80GiB --batch 32 --seq 4096`."""
    from treadle.models.zoo import named_model

    model, inputs = named_model("llama-3-8b", batch=32, seq=4096, fake=True)
    return plan_model(model, inputs, cluster=parse_cluster("8x8:h100"), memory_budget_bytes=80 * 2**30,
                      model_spec={"name": "llama-3-8b", "batch": 32, "seq": 4096, "dtype": "fp32"})


@pytest.mark.slow
@pytest.mark.parametrize("make", [_demo_gpt2_plan, _readme_llama_plan], ids=["demo-gpt2", "readme-llama-3-8b"])
def test_acceptance_plans_trace_and_report(make) -> None:
    planned = make()
    planned.estimate()  # as `treadle plan -o` writes it: with its price
    plan = Plan.from_json(planned.to_json())  # as `treadle explain plan.json` sees it
    assert plan.price is not None and plan.estimate() == planned.estimate()
    assert_trace_matches_estimate(chrome_trace(timeline_from_plan(plan)), plan)
    p = _Sections()
    p.feed(plan_html(plan))
    assert p.sections == list(PLAN_SECTIONS) and not p.urls


@pytest.mark.slow
def test_a_pipelined_plan_draws_its_stages() -> None:
    """A planned pipeline is drawn from its price: a track per pp rank whose slices cover the step, and its HTML
    report has every section."""
    from treadle.models.zoo import named_model

    model, inputs = named_model("tiny-llama", batch=8, seq=32, dropout=False)
    planned = plan_model(model, inputs, cluster=parse_cluster("2x2:cpu"), pp_axis="dp")
    est = planned.estimate()
    plan = Plan.from_json(planned.to_json())
    tl = timeline_from_plan(plan)
    ranks = [t for t in tl.tracks if t.startswith("pp rank")]
    assert len(ranks) == 2
    for track in ranks:
        assert sum(s.duration_s for s in tl.spans if s.track == track) == pytest.approx(est.step_s)
    assert validate_chrome_trace(chrome_trace(tl)) == []
    p = _Sections()
    p.feed(plan_html(plan))
    assert p.sections == list(PLAN_SECTIONS) and not p.urls
    assert "stages over dp (" in plan.explain()  # the stages, each with its blocks and time


def test_plan_whose_schedule_cannot_be_priced_is_drawn_from_its_rows(fixed_plan: Plan, monkeypatch) -> None:
    """A planned model whose price fails (PlanError) falls back to the rows, saying why, instead of raising."""
    from treadle.errors import PlanError

    plan = Plan.from_dict(fixed_plan_dict())

    def fails() -> None:
        raise PlanError("price: pipeline schedules are not priced")

    monkeypatch.setattr(Plan, "estimate", lambda self: fails())
    tl = timeline_from_plan(plan)
    assert tl.step_s == pytest.approx(plan.estimated.step_s)
    assert "pipeline schedules are not priced" in tl.notes[0]
    monkeypatch.undo()
    assert validate_chrome_trace(chrome_trace(tl)) == []
