"""`verify(sch, example_inputs)`: does the scheduled model compute what the original computes?

It spawns the mesh's world of gloo ranks; each rank replays the schedule on a fresh copy of the original
model, builds it, and runs forward, backward and optimizer steps on its share of the batch (split over the
data-parallel axis). The parent runs the original single-process on the same slices (the data-parallel
reference is the mean of the per-slice losses) and compares: the loss of every step, every module's
output in execution order and its gradient in backward order, the input gradients, every parameter
gradient and every parameter after the first optimizer step, each assembled to global shape. A mismatch
names the first module (by path, in execution order) whose output or gradient diverges.
"""

from __future__ import annotations

import copy
import io
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import SpawnError, TreadleError, VerifyError
from ..mesh import Mesh
from ..schedule.core import Schedule
from ..schedule.expert_primitive import expert_paths
from ..schedule.replay import load_schedule, trusted_load_args
from ..runtime.batch import check_batch, split_batch
from ..loss import default_loss
from ..testing import check_process_count, spawn
from ..transport import restore_after_load, sendable
from ..runtime.params import assemble
from .compare import Diff, Tolerance, worst_copy, assemble_best, diff, tolerance
from .float8 import fidelity_checks, float8_reference, float8_split, has_float8
from ..forms.float8 import FLOAT8_STEP_RTOL
from .record import _run_pipeline_steps, _run_steps
from .report import Check, VerifyReport

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------ ranks
def _verify_rank(rank: int, world: int, payload: bytes) -> dict[str, Any]:
    from ..runtime.build import build

    p = torch.load(io.BytesIO(payload), weights_only=False)
    restore_after_load(p["model"])  # NOTE [registrations lost in transport]
    torch.manual_seed(p["seed"])
    model: nn.Module = p["model"]
    mesh = Mesh(tuple(p["mesh_shape"]), tuple(p["mesh_names"]))
    try:
        sch = load_schedule(model, p["schedule"], mesh, **p["load_args"])
        # leaves whose output is a shard interleaved in blocks (fused q|k|v), to assemble their outputs;
        # read before build, which gives parameters new identities
        out_blocks = {path: max(s.blocks for s in shards) for path, shards in _leaf_shards(sch).items()
                      if max(s.blocks for s in shards) > 1}
        built = build(sch)
    except TreadleError as exc:  # raised, not returned: spawn ranks it against the peers' echoes
        raise VerifyError(f"build failed: {type(exc).__name__}: {exc}") from exc
    st = sch.view()
    inputs = p["inputs"]
    dp_axes, dp_n, dp_i = (), 1, 0
    if st.data_parallel is not None:
        dp_axes = st.data_parallel.axes
        dp_n, dp_i = st.data_parallel.size(mesh), st.data_parallel.local_index(mesh)
    local = split_batch(inputs, dp_n, dp_i, axis=",".join(dp_axes) or None, where="verify")
    torch.manual_seed(p["seed"])
    if hasattr(built, "canonical_parameters"):  # a pipeline: its stages run whole batches (`.step`)
        res = _run_pipeline_steps(built, local, p["steps"], p["lr"])
    else:
        res = _run_steps(built, [local], p["loss_fn"], p["steps"], p["lr"], p["float_inputs"], 1.0,
                         tuple(expert_paths(st.extras)))
    res["dp"] = (dp_axes, dp_n, dp_i)
    res["out_blocks"] = out_blocks
    res["fsdp"] = bool(st.data_parallel and st.data_parallel.shard)
    return res


def rank_error_text(rank: int, error: str) -> str:
    """``rank R: <its error>`` from a spawn error report ("Type: message\nTraceback..."): a VerifyError raised on
    the rank by its name alone; any other exception (a bug in the model or the runtime) with its traceback."""
    head, _, tb = error.partition("\n")
    if head.startswith("VerifyError: "):
        return f"rank {rank}: {head.removeprefix('VerifyError: ')}"
    treadle_errors = {"TreadleError", *(c.__name__ for c in TreadleError.__subclasses__())}
    if head.split(":", 1)[0] in treadle_errors:  # said by treadle on purpose: its message is the point
        return f"rank {rank}: {head}"
    return f"rank {rank}: {head}" + (f"\n{tb}" if tb.strip() else "")


def _leaf_shards(sch: Schedule) -> dict[str, list]:
    st = sch.view()
    out: dict[str, list] = {}
    for path, m in sch.model.named_modules():
        for prm in m._parameters.values():
            if prm is not None and st.shards_of(prm):
                out.setdefault(path, []).extend(st.shards_of(prm))
    return out


def _param_layouts(sch: Schedule) -> dict[str, list]:
    return {n: list(shards) for n, shards in sch.view().shards_by_name().items()}


def verify(sch: Schedule, example_inputs: dict[str, Any], *, loss_fn: Callable[[Any], torch.Tensor] | None = None,
           steps: int = 2, lr: float = 1e-3, seed: int = 0, timeout_s: float = 300.0,
           tol: Tolerance | None = None, raise_on_mismatch: bool = True) -> VerifyReport:
    """Run the original model and `sch` built on a gloo process group of the mesh's world size; compare.

    `example_inputs` are keyword arguments of the model's forward (global batch; the data-parallel axis
    splits dim 0). `loss_fn(output)` defaults to ``output.loss`` or the mean square of the first output.
    Tolerances come from the dtype of the parameters (`tolerance`). With ``raise_on_mismatch`` a failed
    check raises VerifyError carrying the report's summary; else the report says ``.ok``.
    The schedule must not have been built; its model (before any `replace`) is the reference. A model on the
    meta device is materialised for the reference with the same seeded, mesh-independent init build uses.
    A rank that raises is reported by its number and its own error (not a peer's echo of it); a mesh larger
    than this host may run is refused before anything starts (SpawnError, NOTE [process count] in
    `treadle.testing`).
    A pipeline (`Schedule.pipeline`) runs its stages a micro-batch at a time, so its modules' outputs are not
    compared: its losses (the forward), every parameter's gradient and every parameter after the first step are,
    on every group of ranks that holds it (each data-parallel replica's copy; tensor-parallel shards assembled).
    """
    st = sch.view()
    if st.built:
        raise VerifyError("verify: this schedule was already built; verify an unbuilt schedule")
    check_process_count(sch.mesh.world_size, where=f"verify on mesh {sch.mesh}")
    if st.extras.get("pipeline") is not None and loss_fn is not None:
        raise VerifyError("verify: a pipeline's loss is the model's own loss, captured with its stages "
                          "(NOTE [pipeline loss]); a loss_fn cannot replace it: verify without one")
    loss_fn = loss_fn or default_loss
    original = st.reference
    reference = original
    float8 = has_float8(st)  # NOTE [what verified means for float8]
    if any(p.is_meta for p in original.parameters()):
        # the ranks materialise it at build with the seeded, mesh-independent init: so does the reference
        if st.original is None and st.ops() & {"replace", "replace_all"}:
            raise VerifyError("verify: a meta-device model replaced before any real weights existed has no "
                              "reference; materialise it first")
        from ..runtime.materialize import materialize

        reference = copy.deepcopy(original)
        materialize(reference, None, "cpu")
    if not isinstance(example_inputs, dict):
        raise VerifyError("verify: example_inputs must be a dict of keyword arguments of forward")
    float_inputs = [k for k, v in example_inputs.items() if torch.is_tensor(v) and v.is_floating_point()]
    mesh = sch.mesh
    dp = st.data_parallel
    check_batch(example_inputs, dp.size(mesh) if dp else 1, axis=dp.label() if dp else None, where="verify")
    payload_d = dict(model=sendable(original), schedule=sch.to_json(), load_args=trusted_load_args(sch),
                     mesh_shape=mesh.shape, mesh_names=mesh.names,
                     inputs=example_inputs, loss_fn=loss_fn, steps=steps, lr=lr, seed=seed,
                     float_inputs=float_inputs)
    buf = io.BytesIO()
    try:
        torch.save(payload_d, buf)
    except Exception as exc:
        raise VerifyError(f"verify: the model, inputs or loss_fn cannot be sent to the ranks ({exc}); "
                          f"use module-level functions and picklable modules") from exc
    report = VerifyReport()
    try:
        results = spawn(_verify_rank, mesh.world_size, buf.getvalue(), timeout_s=timeout_s)
    except SpawnError as exc:
        if getattr(exc, "root_rank", None) is None:  # a rank died or hung: spawn's message names it
            raise
        # the rank that raised, not another rank's echo of it (NOTE [root cause] in treadle.testing)
        report.error = rank_error_text(exc.root_rank, exc.rank_errors[exc.root_rank])
        if raise_on_mismatch:
            raise VerifyError(report.summary()) from None
        return report

    # reference: the original, single process, on the same data-parallel slices
    dp_axes, dp_n, _ = results[0]["dp"]
    dtype = next(reference.parameters()).dtype
    if tol is None and float8 and float8_split(st):  # NOTE [what verified means for float8]: one rounding step
        tol = Tolerance(max(tolerance(dtype).rtol, FLOAT8_STEP_RTOL), tolerance(dtype).atol)  # from the start
    tol = tol or tolerance(dtype)
    ref_model = float8_reference(st, reference) if float8 else copy.deepcopy(reference)
    slices = [split_batch(example_inputs, dp_n, i, axis=",".join(dp_axes) or None, where="verify")
              for i in range(dp_n)]
    if float8:  # before the steps change ref_model's weights
        report.checks += fidelity_checks(reference, ref_model, slices, loss_fn, 1.0 / dp_n, seed=seed)
    torch.manual_seed(seed)
    ref = _run_steps(ref_model, slices, loss_fn, steps, lr, float_inputs, 1.0 / dp_n, tuple(expert_paths(st.extras)),
                     watch_random=True)
    _compare(report, ref, results, mesh, tol, dp_n, _param_layouts(sch), later_rtol=FLOAT8_STEP_RTOL if float8 else 0)
    if report.first_divergence:
        report.first_divergence += nearest_primitive(sch, report.first_divergence)
    if not report.ok and ref.get("random_draws"):  # NOTE [random draws in verify]
        report.notes.append(random_draws_note(ref["random_draws"]))
    if raise_on_mismatch:
        report.raise_if_failed()
    return report


def _compare(report: VerifyReport, ref: dict, results: list[dict], mesh: Mesh, tol: Tolerance, dp_n: int,
             layouts: dict[str, list], *, later_rtol: float = 0.0) -> None:
    """The checks of a run against the reference. `later_rtol`: the least relative tolerance of the checks after
    an optimizer step (the losses of later steps, the model's output after a step): float8's one rounding step
    (NOTE [what verified means for float8])."""
    # losses: the data-parallel mean of the rank losses (identical over the other axes)
    report.ref_losses = ref["losses"]
    by_coord = [mesh.coordinate(r) for r in range(mesh.world_size)]
    dp_axes = results[0]["dp"][0]
    report.losses = []
    for step in range(len(ref["losses"])):
        vals = [results[r]["losses"][step] for r in range(mesh.world_size)
                if all(c == 0 for ax, c in by_coord[r].items() if ax not in dp_axes)]
        report.losses.append(sum(vals) / len(vals))
    loss_tol = Tolerance(max(tol.rtol * 0.1, 1e-5), tol.atol * 0.1)
    later_loss_tol = Tolerance(max(loss_tol.rtol, later_rtol), loss_tol.atol)
    for step, (a, b) in enumerate(zip(report.losses, report.ref_losses)):
        report.checks.append(Check("loss", f"step {step}", diff(torch.tensor(a), torch.tensor(b),
                                                                later_loss_tol if step else loss_tol)))
    # every rank, every step: a rank's loss equals its data-parallel replica's representative (a NaN or a drift
    # on a rank the mean above does not read fails here)
    for r in range(mesh.world_size):
        rep_r = next(q for q in range(mesh.world_size)
                     if all(c == 0 or ax in dp_axes for ax, c in by_coord[q].items())
                     and all(by_coord[q][ax] == by_coord[r][ax] for ax in dp_axes))
        if r == rep_r:
            continue
        for step in range(len(ref["losses"])):
            d = diff(torch.tensor(results[r]["losses"][step]), torch.tensor(results[rep_r]["losses"][step]), loss_tol)
            if not d.ok or not math.isfinite(results[r]["losses"][step]):
                report.checks.append(Check("loss", f"step {step} rank {r} vs rank {rep_r}",
                                           Diff(d.max_abs, d.max_rel, False, note="ranks of one replica disagree")))

    def gathered(ref_slices: list[torch.Tensor], key: str, path: str, call: int, scale: float = 1.0) -> Diff:
        locals_ = []
        for r in results:
            calls = r[key].get(path)
            if not calls or call >= len(calls):
                return Diff(math.nan, math.nan, True, note="not recorded on the ranks (recomputed or unused)")
            locals_.append(calls[call][0] * scale)
        ref_t, locals_ = _by_slice(ref_slices, locals_)
        return assemble_best(locals_, ref_t, mesh, tol, blocks=results[0]["out_blocks"].get(path, 1))

    def label(path: str, call: int) -> str:
        return (path or "<model>") + (f" (call {call + 1})" if call else "")

    # the model's output after each optimizer step, on every rank (a rank that drifts or turns NaN later)
    for step, ref_slices in sorted(ref.get("step_outputs", {}).items()):
        locals_ = [r.get("step_outputs", {}).get(step) for r in results]
        if any(not x for x in locals_) or len(ref_slices) != dp_n:
            continue
        ref_t, got = _by_slice(ref_slices, [x[0] for x in locals_])
        step_tol = Tolerance(max(tol.rtol * STEP_OUTPUT_TOL_FACTOR, later_rtol), tol.atol * STEP_OUTPUT_TOL_FACTOR)
        report.checks.append(Check("output", f"<model> after step {step}", assemble_best(got, ref_t, mesh, step_tol)))
    first = None
    for path in ref["order"]:
        for call, ref_slices in enumerate(ref["outputs"].get(path, [])):
            d = gathered(ref_slices, "outputs", path, call)
            report.checks.append(Check("output", label(path, call), d))
            if not d.ok and first is None:
                first = f"output of {label(path, call)!r} (max abs err {d.max_abs:.3e}, max rel err {d.max_rel:.3e})"
    first_bwd = None
    for path in ref["grad_order"]:
        for call, ref_slices in enumerate(ref["grads"][path]):
            d = gathered(ref_slices, "grads", path, call, scale=1.0 / dp_n)
            report.checks.append(Check("output_grad", label(path, call), d))
            if not d.ok and first_bwd is None:
                first_bwd = (f"gradient of the output of {label(path, call)!r} (max abs err {d.max_abs:.3e}, "
                             f"max rel err {d.max_rel:.3e})")
    for k, ref_list in ref["input_grads"].items():
        locals_ = [r["input_grads"][k][0] * (1.0 / dp_n) for r in results]
        report.checks.append(Check("input_grad", k, assemble_best(locals_, torch.cat(ref_list, 0), mesh, tol)))
    pipelined = bool(results[0].get("pipeline"))
    for kind, key in (("param_grad", "param_grads"), ("param_step", "params")):
        for name, ref_t in ref[key].items():
            if ref_t is None:
                continue
            if pipelined:  # held by the ranks of the stages that read it: each pp group's copy is checked
                d = _pipeline_param_diff(name, ref_t, ref["param_grads"].get(name), results, by_coord, layouts,
                                         mesh, tol, step=kind == "param_step")
                report.checks.append(Check(kind, name, d))
                if kind == "param_grad" and not d.ok and first is None and first_bwd is None:
                    first_bwd = f"gradient of parameter {name!r} (max abs err {d.max_abs:.3e})"
                continue
            locals_ = [r[key].get(name) for r in results]
            if any(t is None for t in locals_):
                report.checks.append(Check(kind, name, Diff(math.inf, math.inf, False, note="missing on a rank")))
                continue
            shards = layouts.get(name)
            if shards:  # the recorded layout, exactly (interleaved blocks included)
                got = assemble({tuple(c.values()): t for c, t in zip(by_coord, locals_)}, shards, mesh.names,
                               dict(zip(mesh.names, mesh.shape)))
            elif all(t.shape == ref_t.shape for t in locals_):  # replicated: every rank holds all of it
                got = worst_copy(locals_)  # each rank's copy counts
            else:
                report.checks.append(Check(kind, name, assemble_best(locals_, ref_t, mesh, tol, allow_partial=False)))
                continue
            if kind == "param_step":
                d = _step_diff(got, ref_t, ref["param_grads"].get(name), tol)
            else:
                d = diff(got, ref_t, tol)
            report.checks.append(Check(kind, name, d))
            if kind == "param_grad" and not d.ok and first is None and first_bwd is None:
                first_bwd = f"gradient of parameter {name!r} (max abs err {d.max_abs:.3e})"
    if first is not None:
        first += _pending_sum_hint(report, first)
    report.first_divergence = first or first_bwd


def _pipeline_param_diff(name: str, ref_t: torch.Tensor, ref_grad: torch.Tensor | None, results: list[dict],
                         by_coord: list[dict[str, int]], layouts: dict[str, list], mesh: Mesh, tol: Tolerance, *,
                         step: bool) -> Diff:
    """A pipelined parameter (or its gradient) against the reference: assembled over the tensor-parallel shards
    of every group of ranks that holds it (one per pp coordinate whose stages read it); the worst group's diff.
    Missing on every rank is a failure."""
    key = "params" if step else "param_grads"
    groups: dict[tuple, dict[tuple, torch.Tensor]] = {}
    for r, res in enumerate(results):
        t = res[key].get(name)
        if t is not None:
            other = tuple(c for ax, c in by_coord[r].items() if ax not in {s.axis for s in layouts.get(name, [])})
            groups.setdefault(other, {})[tuple(by_coord[r].values())] = t
    if not groups:
        return Diff(math.inf, math.inf, False, note="held by no rank")
    sizes = dict(zip(mesh.names, mesh.shape))
    shards = layouts.get(name)
    diffs = []
    for members in groups.values():
        got = assemble(members, shards, mesh.names, sizes) if shards else next(iter(members.values()))
        diffs.append(_step_diff(got, ref_t, ref_grad, tol) if step else diff(got, ref_t, tol))
    return max(diffs, key=lambda d: (not d.ok, d.max_abs))  # a failing group first, else the largest error


def _by_slice(ref_slices: list[torch.Tensor], locals_: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The reference over all data-parallel slices (concatenated on dim 0) and the rank tensors to assemble
    into it. A 0-dim value (a loss) of several slices is stacked, each rank's value becoming a 1-element row,
    so every slice is compared (not only the first)."""
    if len(ref_slices) == 1:
        return ref_slices[0], locals_
    if ref_slices[0].dim() == 0:
        return torch.stack(ref_slices), [t.reshape(1) for t in locals_]
    return torch.cat(ref_slices, dim=0), locals_


# NOTE [Adam's ill-conditioned entries]: AdamW's first update of an entry is lr * g / (|g| + eps). Where |g| is
# within a few orders of eps (1e-8), rounding-level differences of g (a distributed sum in another order) move
# the update by a visible fraction of lr, in either direction. Those entries are checked through their
# gradients (compared above at full tolerance); the step check covers the entries with |g| > 1e-6.
ADAM_WELL_CONDITIONED_GRAD = 1e-6
# The model's output after an optimizer step carries those entries' drift too: compared at 10x the tolerance
# (enough for the drift; a NaN, a wrong rank or a wrong update is off by far more).
STEP_OUTPUT_TOL_FACTOR = 10.0


def _step_diff(got: torch.Tensor, ref_t: torch.Tensor, ref_grad: torch.Tensor | None, tol: Tolerance) -> Diff:
    if ref_grad is None or ref_grad.shape != ref_t.shape:
        return diff(got, ref_t, tol)
    keep = ref_grad.abs() > ADAM_WELL_CONDITIONED_GRAD
    d = diff(got[keep], ref_t[keep], tol) if got.shape == ref_t.shape else diff(got, ref_t, tol)
    skipped = int((~keep).sum())
    note = f"{skipped} entries with |grad| <= {ADAM_WELL_CONDITIONED_GRAD:g} left to the gradient check" if skipped else ""
    return Diff(d.max_abs, d.max_rel, d.ok, d.layout, d.note or note)


def _pending_sum_hint(report: VerifyReport, first: str) -> str:
    """A module whose output matched only as a pending sum (Partial), inside the first diverging module,
    is the usual cause: a reduction the schedule never made."""
    path = first.split("'")[1].split(" (call ")[0]
    inner = [c for c in report.checks if c.kind == "output" and c.diff.ok and "=P" in c.diff.layout
             and c.name.startswith(path + ".")]
    if not inner:
        return ""
    c = inner[-1]
    axes = [part.split("=")[0] for part in c.diff.layout.split() if part.endswith("=P")]
    return (f"; inside it, {c.name!r} leaves a pending sum (Partial over {', '.join(axes)}) that is never "
            f"reduced")


# NOTE [random draws in verify]: a model whose training forward draws random numbers (dropout, a router that samples
# its experts, input jitter) cannot match one process: each rank draws from its own generator, on its own slice, in
# its own order, where the reference draws once for all slices. Verify still compares, and when it fails it says so,
# naming each drawing op and the first module that ran it in the reference's first forward, so that a user sees
# why and what to turn off (dropout 0, the model's eval-mode routing) before reading the diffs as a defect.
def random_draws_note(draws: dict[str, str]) -> str:
    """The report's line for a failed verify of a model whose forward draws random numbers."""
    ops = ", ".join(f"aten.{op} in {mod or '<model>'!r}" for op, mod in sorted(draws.items())[:4])
    return (f"the model's training forward draws random numbers ({ops}{' ...' if len(draws) > 4 else ''}): each "
            f"rank draws its own, so its outputs cannot match one process; turn that randomness off (dropout 0, the "
            f"model's eval-mode routing) to verify the schedule (NOTE [random draws in verify])")


def nearest_primitive(sch: Schedule, first: str) -> str:
    """The primitives recorded nearest the first diverging tensor, as ``; nearest primitive: sch[...]....``.

    `first` names a module output or gradient (``... of 'path' ...``) or a parameter gradient. Nearest: recorded
    at that module (for the gradient of its output: only its fwd_post syncs), then, for an output, inside it;
    for the gradient of an output, at the modules that run after it in forward (their backward makes it);
    ties go to the closest in module order. Empty if nothing is recorded on any module path."""
    import re

    m = re.search(r"'([^']*)'", first)
    if m is None:
        return ""
    path = m.group(1).split(" (call ")[0]
    if path == "<model>":
        path = ""
    if first.startswith("gradient of parameter"):
        path = path.rpartition(".")[0]
    order = {p: i for i, (p, _) in enumerate(sch.model.named_modules())}
    here = order.get(path)
    out_grad = first.startswith("gradient of the output")
    backward = first.startswith("gradient")
    best, best_key = [], None
    for r in sch.records:
        if r.path not in order or r.op in ("data_parallel", "pipeline", "trace", "annotate"):
            continue
        inside = path == "" or r.path.startswith(path + ".")
        after = here is not None and order[r.path] > here and not inside
        if r.path == path and (not out_grad or (r.op == "sync" and r.args.get("*") == "fwd_post")):
            rank = 0  # the gradient of an output is made downstream: of this module's own, only its output syncs
        elif out_grad:
            rank = 1 if after else 2 if inside else 3
        else:
            rank = 1 if inside else 2 if after == backward else 3
        key = (rank, abs(order[r.path] - here) if here is not None else 0)
        if best_key is None or key < best_key:
            best, best_key = [r], key
        elif key == best_key:
            best.append(r)
    if not best:
        return ""
    where = "at it" if best_key[0] == 0 else "nearest"
    return f"; primitives {where}: " + "; ".join(r.to_python() for r in best[:3])
