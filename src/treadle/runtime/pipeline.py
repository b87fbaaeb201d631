"""Pipeline parallelism: split the captured model at `cut_pipeline_stage` marks into stage graphs and run them
with `torch.distributed.pipelining` (GPipe, 1F1B, interleaved 1F1B) on a ``pp`` mesh axis.

At build ("pre_shard", before weights are sliced) the model is captured once with torch.export on one
micro-batch, by need (`stage_leaves`): only the forwards from the root down to the cut container are traced;
the container's blocks and every other module off that path stay leaf calls (the original modules:
tensor-parallel shards, hooks and sub-schedules apply to them unchanged), with output shapes taken from one
eager run, so a leaf may branch on tensor values. Ops are assigned to stages in graph order; the ops that read
the loss target form the loss function run after the last stage.

Stage I/O is found by liveness: the values crossing boundary b are those defined before it and read at or
after it, so only what later stages need is sent (values a stage merely forwards pass through it). Values
that depend on no input (positions, masks built from shapes) are recomputed in each stage that reads them
rather than sent. A parameter read by stages on several ranks (tied input embedding / output head) gets
its gradient summed over the ``pp`` group after each step, so the copies stay equal.

Loss semantics (NOTE [pipeline loss]): each micro-batch loss is the model's own loss on that micro-batch
(a mean over its tokens). With ``scale_grads=True`` (pipelining's default) the summed micro-batch gradients
are divided by the micro-batch count, i.e. they are the gradients of the *mean of the micro-batch losses*,
which equals the single-process full-batch mean loss when micro-batches hold equal token counts.
`PipelineModel.step` returns that mean loss on every rank.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from ..errors import BuildError
from .steps import register_build_extension

logger = logging.getLogger(__name__)

_IMPURE = ("dropout", "native_dropout", "rand", "randn", "bernoulli", "randint", "rand_like", "randn_like")


@dataclass
class StagePlan:
    """One stage: its graph module, the names of the values it receives and returns."""

    index: int
    module: fx.GraphModule
    inputs: list[str]
    outputs: list[str]


def _is_free(n: fx.Node, free: set[fx.Node]) -> bool:
    if n.op == "get_attr":
        return True
    if n.op != "call_function":
        return False
    name = getattr(n.target, "__name__", str(n.target))
    if any(name.startswith(p) for p in _IMPURE):
        return False
    return all(i in free for i in n.all_input_nodes)


def split_stages(gm: fx.GraphModule, *, cut_paths: list[str], input_names: list[str], target: str | None
                 ) -> tuple[list[StagePlan], fx.GraphModule | None, list[str]]:
    """Split captured graph `gm` (placeholders in the order of `input_names`) after the leaf calls of
    `cut_paths`. Returns the stages, the loss graph (last stage's outputs + target -> loss) and the names of
    the stage-0 inputs. Raises BuildError when a cut leaf is not called, or called out of order."""
    nodes = list(gm.graph.nodes)
    phs = [n for n in nodes if n.op == "placeholder"]
    name_of = {p: input_names[i] if i < len(input_names) else p.name for i, p in enumerate(phs)}
    calls = {n.target: n for n in nodes if n.op == "call_module"}
    missing = [p for p in cut_paths if p not in calls]
    if missing:
        raise BuildError(f"pipeline: the cut module(s) {missing} are not called by the model's forward")
    pos = [nodes.index(calls[p]) for p in cut_paths]
    if pos != sorted(pos):
        raise BuildError(f"pipeline: cuts {cut_paths} are not in execution order")
    free: set[fx.Node] = set()
    for n in nodes:
        if _is_free(n, free):
            free.add(n)
    # loss region: everything downstream of the target input
    loss_nodes: set[fx.Node] = set()
    tgt = next((p for p in phs if name_of[p] == target), None) if target else None
    if target is not None and tgt is None:
        raise BuildError(f"pipeline: target input {target!r} is not an input of the captured model")
    if tgt is not None:
        for n in nodes:
            if n is tgt or any(i in loss_nodes for i in n.all_input_nodes):
                if n.op != "output":
                    loss_nodes.add(n)
    stage_of: dict[fx.Node, int] = {}
    cut_nodes = {calls[p] for p in cut_paths}
    s = 0
    for n in nodes:
        if n.op in ("placeholder", "output") or n in free or n in loss_nodes:
            continue
        ins = [stage_of[i] for i in n.all_input_nodes if i in stage_of]
        plumbing = n.op == "call_function" and (n.target.__name__ in ("getitem", "_tensor_leaves"))
        stage_of[n] = max(ins) if plumbing and ins else s
        if n in cut_nodes:
            s += 1
    n_stages = len(cut_paths) + 1
    out_node = nodes[-1]
    # the tensors the model returns that are not the loss are not needed for training: the pipeline ends in
    # the loss; without a target, the model's first output is the loss
    uses: dict[fx.Node, set[int]] = {}
    loss_inputs: list[fx.Node] = []
    for n in nodes:
        if n.op == "output":
            continue
        consumer = n_stages if n in loss_nodes else stage_of.get(n)
        if consumer is None:
            continue
        for i in n.all_input_nodes:
            if i not in free and i is not tgt and i not in loss_nodes:
                uses.setdefault(i, set()).add(consumer)
                if consumer == n_stages and i not in loss_nodes and i not in loss_inputs:
                    loss_inputs.append(i)
    if tgt is None:
        first = out_node.args[0][0] if isinstance(out_node.args[0], (tuple, list)) else out_node.args[0]
        uses.setdefault(first, set()).add(n_stages)
        loss_inputs = [first]

    def defined_at(v: fx.Node) -> int:
        return -1 if v.op == "placeholder" else stage_of[v]

    live: list[list[fx.Node]] = []  # live[b]: values entering stage b (b = n_stages: the loss)
    for b in range(n_stages + 1):
        lv = [v for v in nodes if v in uses and defined_at(v) < b and max(uses[v]) >= b]
        live.append(lv)
    stages = []
    for si in range(n_stages):
        body = [n for n in nodes if stage_of.get(n) == si]
        ins = live[si]
        outs = live[si + 1] if si + 1 < n_stages else loss_inputs
        stages.append(StagePlan(si, _subgraph(gm, body, ins, outs, free, f"Stage{si}"), [v.name for v in ins],
                                [v.name for v in outs]))
    loss_gm = None
    if tgt is not None:
        body = [n for n in nodes if n in loss_nodes and n is not tgt]
        out_val = out_node.args[0][0] if isinstance(out_node.args[0], (tuple, list)) else out_node.args[0]
        if out_val not in loss_nodes:
            raise BuildError("pipeline: the model's first output is not computed from the target; it must be the loss")
        loss_gm = _subgraph(gm, body, loss_inputs + [tgt], [out_val], free, "Loss", single=True)
    stage0_inputs = [name_of[v] for v in live[0] if v.op == "placeholder"]
    if [v for v in live[0] if v.op != "placeholder"]:
        raise BuildError("pipeline: internal error: stage 0 needs a non-input value")
    return stages, loss_gm, stage0_inputs


def _subgraph(gm: fx.GraphModule, body: list[fx.Node], ins: list[fx.Node], outs: list[fx.Node], free: set[fx.Node],
              name: str, single: bool = False) -> fx.GraphModule:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for v in ins:
        env[v] = g.placeholder(v.name)

    def get(v: fx.Node) -> fx.Node:
        if v not in env:
            if v not in free:
                raise BuildError(f"pipeline: {name} reads {v.name!r}, which is neither live into it nor recomputable")
            env[v] = g.node_copy(v, get)
        return env[v]

    for n in body:
        env[n] = g.node_copy(n, get)
    # what a stage sends must be contiguous (gloo refuses views such as a tensor-parallel gather's result)
    res = [g.call_method("contiguous", (get(o),)) for o in outs]
    g.output(res[0] if single else tuple(res))
    out = fx.GraphModule(gm, g, name)
    return out


class _LossFn:
    def __init__(self, loss_gm: fx.GraphModule):
        self.loss_gm = loss_gm

    def __call__(self, output, target):
        outs = output if isinstance(output, tuple) else (output,)
        return self.loss_gm(*outs, target)


class PipelineModel(nn.Module):
    """The local stages of a pipelined model and the schedule that runs them.

    ``step(**inputs)`` runs forward and backward of one batch (split into micro-batches) and returns the mean
    micro-batch loss (NOTE [pipeline loss]) on every rank; gradients are left in the parameters for an
    optimizer over ``parameters()`` (this rank's stages only). `param_dict()` maps original parameter names
    to this rank's parameters."""

    def __init__(self, stages: list[StagePlan], local: list[int], schedule: Any, *, group, stage0_inputs: list[str],
                 target: str | None, constants: dict[str, Any], tied: list[str], last_rank: int, n_stages: int,
                 tied_params: list[nn.Parameter]):
        super().__init__()
        self.stages = nn.ModuleList([stages[i].module for i in local])
        self.local_stage_indices = local
        self.stage_plans = stages
        self._schedule = schedule
        self._group = group
        self.stage0_inputs = stage0_inputs
        self.target = target
        self.constants = constants
        self.tied = tied  # names (in the first stage that reads them) of parameters read on several ranks
        self._tied_params = tied_params
        self.last_rank = last_rank
        self.n_stages = n_stages

    def param_dict(self) -> dict[str, nn.Parameter]:
        out: dict[str, nn.Parameter] = {}
        for st in self.stages:
            for n, p in st.named_parameters():
                out.setdefault(n, p)
        return out

    def forward(self, *args, **kwargs):
        raise BuildError("a pipelined model runs whole batches: call .step(**inputs), not forward")

    def step(self, **inputs: Any) -> float:
        for k, v in self.constants.items():
            if k in inputs and inputs[k] != v:
                raise BuildError(f"pipeline step: input {k}={inputs[k]!r} differs from the captured {v!r}")
        args = [inputs[n] for n in self.stage0_inputs]
        target = inputs[self.target] if self.target else None
        losses: list[torch.Tensor] = []
        holds_first = 0 in self.local_stage_indices
        holds_last = (self.n_stages - 1) in self.local_stage_indices
        kw = {}
        if holds_last:
            kw = {"target": target, "losses": losses}
        self._schedule.step(*(args if holds_first else ()), **kw)
        self._sync_tied()
        loss = torch.zeros((), dtype=torch.float64)
        if holds_last:
            loss = torch.stack([x.detach().double() for x in losses]).mean()
        dist.broadcast(loss, self.last_rank, group=self._group)
        return float(loss)

    def _sync_tied(self) -> None:
        local = {id(p) for p in self.parameters()}
        for p in self._tied_params:  # the same objects on every rank, in the same order
            mine = id(p) in local
            g = p.grad if mine and p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(g, group=self._group)
            if mine:  # ranks that do not hold it only contribute zeros
                p.grad = g


def stage_leaves(model: nn.Module, container: str) -> list[str]:
    """Trace by need: the modules a pipeline capture keeps as leaf calls. Only the forwards on the path from
    the root to the cut container are captured (they decide what runs before, between and after the blocks);
    the container's elements and every other module hanging off that path stay eager leaf calls, so their
    code may branch on tensor values. E.g. GPT-2 cut in ``transformer.h``: the root's and ``transformer``'s
    forwards are captured; ``transformer.h.*``, ``wte``, ``wpe``, ``drop``, ``ln_f``, ``lm_head`` are leaves."""
    parts = container.split(".")
    chain = [".".join(parts[:i]) for i in range(len(parts))]  # the root .. the container's parent
    leaves = [f"{container}.{n}" for n, _ in model.get_submodule(container).named_children()]
    for anc in chain:
        mod = model.get_submodule(anc) if anc else model
        for name, _ in mod.named_children():
            path = f"{anc}.{name}" if anc else name
            if path != container and path not in chain:
                leaves.append(path)
    return leaves


def _capture_root(builder) -> None:
    cfg = builder.v.extras.get("pipeline")
    if cfg is None:
        return
    if builder.v.data_parallel is not None:
        raise BuildError(f"pipeline: data_parallel ({builder.v.data_parallel}) together with a pipeline "
                         f"is not supported yet; use pp with tensor parallelism only")
    from ..graph.capture import capture_export, record_leaf_outputs
    from ..schedule.graph_primitives import make_inputs

    model = builder.model
    cuts = builder.v.extras["pipeline_cuts"]
    container = cuts[0].rpartition(".")[0]
    leaves = stage_leaves(model, container)
    full = make_inputs(cfg["example_inputs"])
    m = cfg["n_microbatches"]
    mb = {k: (v.chunk(m, 0)[0].clone() if torch.is_tensor(v) else v) for k, v in full.items()}
    names = [k for k, v in mb.items() if torch.is_tensor(v)]
    constants = {k: v for k, v in mb.items() if not torch.is_tensor(v)}
    # capture runs the leaves on global shapes: undo shard_attr's division (already applied by build) meanwhile
    saved = [(builder.module(p), a, getattr(builder.module(p), a)) for p, a, _ in builder.v.shard_attrs]
    for (mod, a, v), (_, _, axis) in zip(saved, builder.v.shard_attrs):
        setattr(mod, a, v * builder.sizes[axis])
    try:
        eager = record_leaf_outputs(model, leaves, mb)
        gm = capture_export(model, leaves, (), mb, where="pipeline capture of the model", dynamic=False,
                            eager_outputs=eager)
    finally:
        for mod, a, v in saved:
            setattr(mod, a, v)
    builder.scratch["_pipeline_graph"] = (gm, names, constants)
    logger.info("pipeline: captured the model (%d nodes, %d leaves)", len(gm.graph.nodes), len(leaves))


# schedule name -> torch.distributed.pipelining class
SCHEDULE_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
                    "looped_bfs": "ScheduleLoopedBFS", "interleaved_zb": "ScheduleInterleavedZeroBubble",
                    "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
V_SCHEDULES = ("zbv", "dualpipev")
SPLIT_BACKWARD = ("interleaved_zb", "zbv", "dualpipev")  # input- and weight-gradient backward apart


def stage_rank(schedule: str, stage: int, pp: int) -> int:
    """The pp rank that holds `stage` under `schedule`: in a V for zbv / dualpipev (rank r holds r and
    2 pp - 1 - r), else in a loop (stage mod pp) — as torch.distributed.pipelining places them."""
    if schedule in V_SCHEDULES:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def split_backward_conflict(schedule: str, pp: int, readers: list[tuple[str, set[int]]]) -> str | None:
    """Why `schedule` cannot run these stages, or None: a split-backward schedule (input, then weight gradients,
    per stage, around each weight's one gradient accumulator) on which two stages of one rank read one parameter
    (`readers`: (parameter name, the stages that read it)) — its gradient comes out wrong in torch 2.13."""
    if schedule not in SPLIT_BACKWARD:
        return None
    for name, stages in sorted(readers, key=lambda r: r[0]):
        by_rank: dict[int, list[int]] = {}
        for s in sorted(stages):
            by_rank.setdefault(stage_rank(schedule, s, pp), []).append(s)
        for same in by_rank.values():
            if len(same) > 1:
                return (f"schedule {schedule!r} places stages {same[0]} and {same[1]} on one rank and both read "
                        f"{name}; its split backward (input, then weight gradients) cannot share a parameter "
                        f"between two stages of a rank; untie it, or use a schedule that places them on different "
                        f"ranks (interleaved_1f1b, looped_bfs)")
    return None


def _wrap_pipeline(builder) -> PipelineModel | None:
    cfg = builder.v.extras.get("pipeline")
    if cfg is None:
        return None
    from torch.distributed.pipelining import PipelineStage, schedules as torch_schedules

    gm, names, constants = builder.scratch["_pipeline_graph"]
    cuts = builder.v.extras["pipeline_cuts"]
    stages, loss_gm, stage0_inputs = split_stages(gm, cut_paths=cuts, input_names=names, target=cfg["target"])
    axis = cfg["axis"]
    pp = builder.sizes[axis]
    rank_pp = builder.coords[axis]
    n = len(stages)
    kind = cfg["schedule"]
    local = [i for i in range(n) if stage_rank(kind, i, pp) == rank_pp]
    group = builder.group(axis)
    device = builder.mesh.device
    pstages = [PipelineStage(stages[i].module, i, n, device, group=group) for i in local]
    loss_fn = _LossFn(loss_gm) if loss_gm is not None else (lambda out, tgt: out if not isinstance(out, tuple) else out[0])
    mbs = cfg["n_microbatches"]
    cls = getattr(torch_schedules, SCHEDULE_CLASSES[kind])
    if issubclass(cls, torch_schedules.PipelineScheduleSingle):
        if len(pstages) != 1:
            raise BuildError(f"pipeline: schedule {kind!r} runs one stage per rank; {n} stages on {pp} ranks need "
                             f"'interleaved_1f1b'")
        sched = cls(pstages[0], mbs, loss_fn=loss_fn, scale_grads=cfg["scale_grads"])
    else:
        try:
            sched = cls(pstages, mbs, loss_fn=loss_fn, scale_grads=cfg["scale_grads"])
        except (ValueError, RuntimeError) as exc:
            raise BuildError(f"pipeline: {SCHEDULE_CLASSES[kind]} with {n} stages on {pp} ranks and {mbs} "
                             f"micro-batches: {exc}") from exc
    # parameters read by stages that live on different ranks (tied embeddings)
    holders: dict[int, set[int]] = {}
    names_by_id: dict[int, str] = {}
    for st in stages:
        for pn, p in st.module.named_parameters():
            holders.setdefault(id(p), set()).add(stage_rank(kind, st.index, pp))
            names_by_id.setdefault(id(p), pn)
    readers: dict[int, tuple[str, set[int]]] = {}
    for st in stages:
        for pn, p in st.module.named_parameters():
            readers.setdefault(id(p), (pn, set()))[1].add(st.index)
    conflict = split_backward_conflict(kind, pp, list(readers.values()))
    if conflict:
        raise BuildError(f"pipeline: {conflict}")
    objs = {id(p): p for st in stages for p in st.module.parameters()}
    tied_ids = sorted((i for i, r in holders.items() if len(r) > 1), key=names_by_id.__getitem__)
    tied = [names_by_id[i] for i in tied_ids]
    last_rank_pp = stage_rank(kind, n - 1, pp)
    coords = dict(builder.coords)
    coords[axis] = last_rank_pp
    last_global = _rank_of(builder, coords)
    logger.info("pipeline: %d stages on %s=%d (%s, %d micro-batches), local stages %s, tied %s", n, axis, pp, kind,
                mbs, local, tied)
    return PipelineModel(stages, local, sched, group=group, stage0_inputs=stage0_inputs, target=cfg["target"],
                         constants=constants, tied=tied, last_rank=last_global, n_stages=n,
                         tied_params=[objs[i] for i in tied_ids])


def _rank_of(builder, coords: dict[str, int]) -> int:
    mesh = builder.sch.mesh
    for r in range(mesh.world_size):
        if mesh.coordinate(r) == coords:
            return r
    raise BuildError(f"pipeline: no rank at mesh coordinate {coords}")


register_build_extension("pre_shard", _capture_root)
register_build_extension("wrap", _wrap_pipeline)
