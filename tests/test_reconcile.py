"""The numbers a user sees reconcile (issue 32): a figure shown twice is the same figure or labelled as a different
one, totals and exposed parts are labelled, a met budget never shows negative slack, a plan that shards nothing
says why, one MFU, and the reports show what they are given (measured steps, every mesh axis, readable rows)."""

from __future__ import annotations

import json
import re

import pytest

from treadle.cost.cluster import parse_cluster
from treadle.planner import plan_model
from treadle.planner.explain import COMM_COLUMN, TOTAL_ROW, explain_text, mesh_table, price_lines
from treadle.planner.plan import Plan
from treadle.planner.rows import STEP_ROW, binding_constraint
from treadle.units import GiB, MiB
from treadle.viz import chrome_trace, costs_from_plan, timeline_from_plan
from treadle.viz.chrome import track_names
from treadle.viz.html import model_text, plan_html
from treadle.viz.price_timeline import WAIT, mesh_roles_text
from treadle.viz.schedule_view import collapse_schedule, natural_key
from treadle.viz.timeline import COMPUTE


def _llama(cluster: str, **kw) -> Plan:
    """`treadle plan tiny-llama --cluster CLUSTER --batch 8 --seq 32` as the CLI plans it (a budget: chosen by
    price), priced."""
    from treadle.models.zoo import named_model

    model, inputs = named_model("tiny-llama", batch=8, seq=32, fake=True)
    plan = plan_model(model, inputs, cluster=parse_cluster(cluster), memory_budget_bytes=16 * GiB,
                      model_spec={"name": "tiny-llama", "batch": 8, "seq": 32, "dtype": "fp32"}, **kw)
    plan.estimate()
    return plan


@pytest.fixture(scope="module")
def dp_plan() -> Plan:
    return _llama("2x2:cpu", price_top=1)


@pytest.fixture(scope="module")
def replicated_plan() -> Plan:
    return _llama("1x3:cpu")


# ----------------------------------------------------------------------------- explain
def test_rows_add_up_and_comm_is_labelled_total_vs_exposed(dp_plan: Plan) -> None:
    """NOTE [the step row]: the rows' compute and recompute are the solver's, their comm the communication before
    overlap (at least the exposed part); the table says so and prints the sums; the price line says which
    comm is total and which exposed."""
    e, rows, p = dp_plan.estimated, dp_plan.rows, dp_plan.price
    assert rows[-1].path == STEP_ROW and rows[-1].comm_s > 0  # DDP's latency part and buffer broadcast
    assert sum(r.compute_s for r in rows) == pytest.approx(e.compute_s, rel=1e-9)
    assert sum(r.recompute_s for r in rows) == pytest.approx(e.recompute_s, abs=1e-12)
    assert sum(r.comm_s for r in rows) >= e.comm_s * (1 - 1e-9)
    costs_from_plan(Plan.from_dict(dict(dp_plan.to_dict(), price=None)))  # the rows-only fallback accepts them
    text = explain_text(dp_plan)
    assert COMM_COLUMN == "comm ms (total, before overlap)" and COMM_COLUMN in text
    (total,) = [ln for ln in text.splitlines() if ln.startswith(TOTAL_ROW)]
    assert total.split()[5:8] == [f"{sum(r.compute_s for r in rows) * 1e3:.3f}",
                                  f"{sum(r.comm_s for r in rows) * 1e3:.3f}",
                                  f"{sum(r.recompute_s for r in rows) * 1e3:.3f}"]
    assert (f"exposed comm {p['exposed_comm_s'] * 1e3:.3f} ms; comm (total, before overlap) "
            f"{p['comm_s'] * 1e3:.3f} ms") in text


def _figures(text: str, pattern: str) -> dict[str, set[str]]:
    """{label: values} of `pattern` (one group, the value) per line, a line's label being its head before ':'."""
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        for v in re.findall(pattern, line):
            out.setdefault(line.split(":")[0], set()).add(v)
    return out


def test_a_figure_shown_twice_is_one_figure_or_labelled(dp_plan: Plan) -> None:
    """Step, peak, static bytes and MFU: the price's on the price lines, the solver's only on the line labelled
    as the solver's; one MFU not labelled as the solver's, and it is the price's."""
    text = explain_text(dp_plan)
    p, e = dp_plan.price, dp_plan.estimated
    mfu = [m for line in text.splitlines() for m in re.findall(r"(solver's |solver )?MFU (\d+\.\d)%", line)]
    assert {v for who, v in mfu if not who} == {f"{p['mfu'] * 100:.1f}"}
    assert {v for who, v in mfu if who} == {f"{e.mfu * 100:.1f}"}
    steps = _figures(text, r"step (\d+\.\d+) ms")
    assert steps.pop("price of the schedule (rehearsed, overlap modelled)") == {f"{p['step_s'] * 1e3:.3f}"}
    assert all(k.startswith("solver's estimate") for k in steps)
    statics = _figures(text, r"static (\d+\.\d+)")
    assert statics.pop("memory (price)") == {f"{p['static_bytes'] / MiB:.3f}"}
    assert list(statics) == ["solver's estimate (its own cost model"]  # the one other static: labelled
    assert "memory binds" in dp_plan.binding or "priced peak (as built)" in dp_plan.binding
    headers = [c.header for c in mesh_table(dp_plan).columns]
    assert "solver MFU" in headers and "MFU" not in headers


def test_met_budget_never_shows_negative_slack(monkeypatch) -> None:
    """The slack is against the peak the budget was checked against: a plan chosen by price whose solver peak is
    over the budget (the price's re-solve moved the solver's budget) but whose price fits shows the price's slack."""
    from treadle.planner import rows
    from treadle.planner.ilp import Solution

    free = Solution([], {}, 1.0, 9 * MiB, "optimal", 0.0, 0.0)
    monkeypatch.setattr(rows, "solve", lambda *a, **k: free)
    sol = Solution([], {}, 1.0, 11 * MiB, "optimal", 0.0, 0.0)  # the solver's peak, over the budget
    text = binding_constraint(None, sol, 10 * MiB, 1.0, "auto", priced_peak_bytes=9.5 * MiB)
    assert text.startswith("none: memory slack 0.500 MiB") and "under the priced peak (as built) 9.500 MiB" in text
    assert "slack -" not in text
    assert "solver's peak 11.000 MiB" in binding_constraint(None, sol, 12 * MiB, 1.0, "auto")  # not priced: labelled


def test_budgeted_plan_slack_is_the_price_s(dp_plan: Plan) -> None:
    m = re.search(r"slack (-?\d+\.\d+) (MiB|GiB)", dp_plan.binding)
    assert m and float(m.group(1)) >= 0
    assert f"{dp_plan.price['peak_bytes'] / MiB:.3f} MiB" in dp_plan.binding  # the figure explain shows as the peak


@pytest.mark.parametrize("which", ["dp_plan", "replicated_plan"])
def test_one_mfu_numerator_for_solver_and_price(which: str, request) -> None:
    """MFU is the model's useful FLOPs of the step / world / step time / peak, for the solver and the price alike:
    a 3-rank plan that replicates everything does every FLOP three times, which is work but not useful work, so the
    price's MFU is not inflated by it (it was 14.9% against the solver's 4.7%); the two MFUs differ only as their
    step times do."""
    plan: Plan = request.getfixturevalue(which)
    p, e = plan.price, plan.estimated
    assert p["mfu"] * p["step_s"] == pytest.approx(e.mfu * e.step_s, rel=0.02)
    world = plan.cluster.world_size
    if which == "replicated_plan":  # every rank computes the whole model
        assert p["executed_flops"] == pytest.approx(p["model_flops"], rel=0.02)
    else:
        assert p["executed_flops"] >= p["model_flops"] / world * 0.98


def test_replicated_plan_says_why(replicated_plan: Plan, dp_plan: Plan) -> None:
    why = replicated_plan.solver["replicated"]
    assert "the batch 8 does not split over 3 ranks" in why
    assert "no op can shard over tp=3" in why and "every axis replicated" in why
    assert f"why nothing is sharded: {why}" in explain_text(replicated_plan)
    assert "replicated" not in dp_plan.solver
    assert Plan.from_json(replicated_plan.to_json()).solver["replicated"] == why  # kept in the file
    assert "why nothing is sharded" in plan_html(replicated_plan)


def test_why_replicated_names_each_cause() -> None:
    from treadle.mesh import Mesh
    from treadle.planner.roles import Roles, why_replicated

    mesh = Mesh((2, 2), ("dp", "tp"))
    off = why_replicated(mesh, Roles(dp=(), zero=False, tp=("tp",), off=("dp",)), batch=8,
                         tensor_shardable={"tp": True}, dp_axis=None, forbid_axes=("dp",))
    assert off.startswith("data parallelism was not allowed (dp_axis=None); replicating on tp=2 was fastest")
    assert "axis dp=2 forbidden" in off
    odd = why_replicated(mesh, Roles(dp=(), zero=False, tp=("dp", "tp")), batch=3,
                         tensor_shardable={"dp": False, "tp": False})
    assert "the batch 3 does not split over dp=2 or tp=2 (or their products)" in odd


# ----------------------------------------------------------------------------- trace
def test_exposed_waits_carry_their_exposed_time(dp_plan: Plan) -> None:
    doc = chrome_trace(timeline_from_plan(dp_plan))
    names = track_names(doc)
    waits = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == WAIT]
    assert waits and all(names[(e["pid"], e["tid"])] == COMPUTE for e in waits)
    for e in waits:
        assert e["args"]["exposed_ms"] > 0 and e["args"]["exposed_ms"] * 1e3 == pytest.approx(e["dur"], abs=2e-3)
    total_ms = sum(e["args"]["exposed_ms"] for e in waits)
    assert total_ms == pytest.approx(dp_plan.price["exposed_comm_s"] * 1e3, rel=1e-4)
    assert "exposed_ms" in doc["otherData"]  # says what it means
    assert sum(doc["otherData"]["breakdown_ms"].values()) == pytest.approx(dp_plan.price["step_s"] * 1e3)


# ----------------------------------------------------------------------------- HTML
def test_schedule_is_collapsed_by_block_and_sorted_numerically() -> None:
    lines = ["sch.data_parallel(axis='dp', shard=False)", "sch['lm_head'].shard('weight', dim=0, axis='tp')"]
    lines += [f"sch['model.layers.{i}.mlp.up'].shard('weight', dim=0, axis='tp')" for i in range(12)]
    lines += [f"sch['model.layers.{i}.mlp.down'].shard('weight', dim=1, axis='tp')" for i in range(12)]
    lines += [f"sch['model.layers.{i}'].checkpoint()" for i in (2, 10)]
    out = collapse_schedule(lines)
    assert out[0].startswith("# 28 calls") and out[1] == lines[0]
    assert out[2:] == [
        "sch['lm_head'].shard('weight', dim=0, axis='tp')",
        "# model.layers.{0-1, 3-9, 11}: x 10 identical blocks (model.layers.0 shown)",
        "sch['model.layers.0.mlp.down'].shard('weight', dim=1, axis='tp')",
        "sch['model.layers.0.mlp.up'].shard('weight', dim=0, axis='tp')",
        "# model.layers.{2, 10}: x 2 identical blocks (model.layers.2 shown)",
        "sch['model.layers.2'].checkpoint()",
        "sch['model.layers.2.mlp.down'].shard('weight', dim=1, axis='tp')",
        "sch['model.layers.2.mlp.up'].shard('weight', dim=0, axis='tp')"]
    assert sorted(["layers.10", "layers.2", "layers.1"], key=natural_key) == ["layers.1", "layers.2", "layers.10"]
    same = [f"sch['h.{i}.attn'].shard('weight', dim=0, axis='tp')" for i in (10, 2, 0, 1)]
    assert collapse_schedule(same)[1:] == ["# h.{0-2, 10}: x 4 identical blocks (h.0 shown)",
                                           "sch['h.0.attn'].shard('weight', dim=0, axis='tp')"]
    assert collapse_schedule(same[1:])[1] == "# h.0 .. h.2: x 3 identical blocks (h.0 shown)"


def test_html_model_row_and_price_figures(dp_plan: Plan) -> None:
    page = plan_html(dp_plan)
    assert model_text(dp_plan.model) == "tiny-llama, batch 8, seq 32, fp32"
    assert "<td>model</td><td>tiny-llama, batch 8, seq 32, fp32</td>" in page and "{&#x27;name" not in page
    assert f"<td>MFU (price)</td><td>{dp_plan.price['mfu'] * 100:.1f}%</td>" in page
    assert f"solver&#x27;s MFU {dp_plan.estimated.mfu * 100:.1f}%" in page
    assert "comm (total, before overlap)" in page and "exposed comm" in page


def _measured_doc(steps_ms: list[float]) -> dict:
    """A measured trace as `treadle.viz.measured_trace` writes it: one user_annotation range per step."""
    ev, t = [], 0.0
    for i, ms in enumerate(steps_ms):
        ev.append({"name": f"treadle step {i}", "cat": "user_annotation", "ph": "X", "ts": t, "dur": ms * 1e3,
                   "pid": 1, "tid": 1})
        t += ms * 1e3
    return {"traceEvents": ev}


def test_explain_measured_puts_the_measured_step_in_the_html(dp_plan: Plan, tmp_path, capsys) -> None:
    from treadle.cli import main

    plan_path, measured, report = tmp_path / "plan.json", tmp_path / "step.json", tmp_path / "r.html"
    plan_path.write_text(dp_plan.to_json())
    measured.write_text(json.dumps(_measured_doc([31.0, 30.0])))
    assert main(["explain", str(plan_path), "--measured", str(measured), "--html", str(report), "-q"]) == 0
    assert "measured 2 step(s): 31.000 ms, 30.000 ms" in capsys.readouterr().out
    page = report.read_text()
    ratio = 30e-3 / dp_plan.price["step_s"]
    assert (f"<td>measured step</td><td>fastest 30.000 ms of 2 step(s) (31.000, 30.000 ms); measured / predicted = "
            f"{ratio:.2f}x</td>") in page
    assert 'data-chart="measured"' in page and 'data-bar-seconds="0.03"' in page
    assert 'data-chart="measured"' not in plan_html(dp_plan)  # nothing measured: no bar


# ----------------------------------------------------------------------------- links and mesh axes
def test_a_link_has_one_bandwidth_everywhere() -> None:
    from treadle.cli.cost import cluster_table

    c = parse_cluster("2x8:h100")
    ib = c.link("dp")
    assert str(ib) == "ib-ndr(10.0 us, 42.5 GB/s = 85% of 50)"  # what collectives reach, from the peak
    cells = [list(col.cells) for col in cluster_table(c).columns]
    assert cells[5][0] == "42.5" and cluster_table(c).columns[5].header == "GB/s (effective)"
    assert "42.5 GB/s" in str(c)


def test_price_titles_name_every_mesh_axis(tmp_path, capsys) -> None:
    import treadle
    from treadle import Mesh
    from treadle.cli import main
    from treadle.models.zoo import named_model

    assert mesh_roles_text(("dp", "tp", "x"), (2, 2, 1), data_axes={"dp"}, tensor_axes={"tp"}) == \
        "dp=2 data-parallel x tp=2 tensor x x=1"
    model, _ = named_model("tiny-gpt2", batch=8, seq=32, dropout=False)
    sch = treadle.models.megatron(treadle.create_schedule(model, mesh=Mesh((2, 2), ("dp", "tp"))), tp="tp", dp="dp")
    f, report = tmp_path / "schedule.json", tmp_path / "price.html"
    f.write_text(sch.to_json())
    assert main(["price", str(f), "--model", "tiny-gpt2", "--cluster", "2x2:cpu", "--batch", "8", "--seq", "32",
                 "--html", str(report)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "price on dp=2 data-parallel x tp=2 tensor" in out
    assert "comm (total, before overlap)" in out and "MFU" in out
    assert "<title>treadle price: tiny-gpt2 on dp=2 data-parallel x tp=2 tensor (ddp over dp)</title>" in \
        report.read_text()


def test_price_lines_add_up() -> None:
    p = {"step_s": 0.010, "compute_s": 0.006, "recompute_s": 0.001, "exposed_comm_s": 0.003, "comm_s": 0.005,
         "overlapped_comm_s": 0.002, "peak_bytes": 3 * MiB, "static_bytes": 1 * MiB, "activation_bytes": 1.5 * MiB,
         "transient_bytes": 0.5 * MiB, "mfu": 0.25, "device": {"name": "cpu"}}
    step, mem, mfu = price_lines(p)
    assert "step 10.000 ms = compute 6.000 + recompute 1.000 + exposed comm 3.000 ms" in step
    assert "comm (total, before overlap) 5.000 ms, of which 2.000 hidden behind compute" in step
    assert mem == "memory (price): peak 3.000 MiB per device = static 1.000 + activations 1.500 + transient 0.500 MiB"
    assert mfu == "MFU 25.0% (price, on cpu)"
