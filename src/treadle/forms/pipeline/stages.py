"""The stages of a pipeline: the model captured once by need, split at the `cut_pipeline_stage` marks into stage
graphs (the "pre_materialize" build step of the pipeline form; `runtime.py` runs them).

At build ("pre_materialize": before meta parameters get values and weights are sliced) the model is captured once
with torch.export on one micro-batch — the batch / (data-parallel size x n_microbatches), the shape each stage runs
— by need (`stage_leaves`): only the forwards from the root down to the cut container are traced; the container's
blocks and every other module off that path stay leaf calls (the original modules: tensor-parallel shards, hooks and
sub-schedules apply to them unchanged), with output shapes taken from one eager run, so a leaf may branch on tensor
values. Ops are assigned to stages in graph order; the ops that read the loss target form the loss function run
after the last stage.

Stage I/O is found by liveness: the values crossing boundary b are those defined before it and read at or
after it, so only what later stages need is sent (values a stage merely forwards pass through it). Values
that depend on no input (positions, masks built from shapes) are recomputed in each stage that reads them
rather than sent.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn

from ...errors import BuildError

logger = logging.getLogger(__name__)

_IMPURE = ("dropout", "native_dropout", "rand", "randn", "bernoulli", "randint", "rand_like", "randn_like")
_RANDOM = ("rand", "bernoulli", "dropout", "normal", "uniform", "multinomial", "exponential", "geometric", "poisson",
           "cauchy", "log_normal")
METADATA_ONLY = "treadle_metadata_only"  # node.meta key: a leaf call recomputable from stand-ins


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
    if n.op == "call_module":  # a leaf that reads only metadata of its non-free inputs (NOTE [metadata-only inputs])
        return bool(n.meta.get(METADATA_ONLY)) and all(i in free for i in n.all_input_nodes)
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


def micro_batch_size(batch: int, dp: int, n_microbatches: int, *, axes: str, where: str) -> int:
    """The rows of one micro-batch: `batch` split over `dp` data-parallel replicas (mesh `axes`), then into
    `n_microbatches`. Raises BuildError naming the sizes when it does not divide."""
    if batch % (dp * n_microbatches):
        raise BuildError(f"{where}: batch {batch} does not split into {dp} data-parallel replicas ({axes}) x "
                         f"{n_microbatches} micro-batches; use a batch divisible by {dp * n_microbatches}")
    return batch // (dp * n_microbatches)


def capture_root(builder) -> None:
    """The "pre_materialize" build step: capture the model on one micro-batch for `runtime.wrap_pipeline` to split
    (with zeros standing for a meta model's parameters, naming the modules this rank never runs: NOTE [pipeline on
    meta])."""
    cfg = builder.v.extras.get("pipeline")
    if cfg is None:
        return
    from ...graph.capture import capture_export, record_leaf_outputs
    from ...schedule.graph_primitives import make_inputs
    from .meta import bound_attrs_refused, modules_not_run, standin_parameters

    dp = builder.v.data_parallel
    dp_size = dp.size(builder.mesh) if dp is not None else 1
    if dp is not None and cfg["axis"] in dp.axes:
        raise BuildError(f"pipeline: axis {cfg['axis']!r} carries the stages and cannot also be a data-parallel "
                         f"axis ({dp}); use another mesh axis for data parallelism")

    model = builder.model
    cuts = builder.v.extras["pipeline_cuts"]
    container = cuts[0].rpartition(".")[0]
    leaves = stage_leaves(model, container)
    full = make_inputs(cfg["example_inputs"])
    m = cfg["n_microbatches"]
    rows = {k: v.shape[0] for k, v in full.items() if torch.is_tensor(v) and v.dim()}
    size = {k: micro_batch_size(b, dp_size, m, axes=dp.label() if dp is not None else "-",
                                where=f"pipeline: input {k!r}") for k, b in rows.items()}
    mb = {k: (v[: size[k]].clone() if k in size else v) for k, v in full.items()}
    names = [k for k, v in mb.items() if torch.is_tensor(v)]
    constants = {k: v for k, v in mb.items() if not torch.is_tensor(v)}
    # capture runs the leaves on global shapes: undo shard_attr's division (already applied by build) meanwhile
    saved = [(builder.module(p), a, getattr(builder.module(p), a)) for p, a, _ in builder.v.shard_attrs]
    for (mod, a, v), (_, _, axis) in zip(saved, builder.v.shard_attrs):
        setattr(mod, a, v * builder.sizes[axis])
    # NOTE [pipeline autocast]: traced under the autocast the stages will run in, so the graph's dtypes are theirs
    amp = (torch.autocast(builder.mesh.device.type, dtype=builder.autocast_dtype) if builder.autocast_dtype
           else contextlib.nullcontext())
    cast = _fsdp_param_dtype(builder)  # NOTE [pipeline capture under FSDP2's mixed precision]
    # NOTE [pipeline on meta]: zeros stand for meta parameters while the leaves run eagerly
    standins = standin_parameters(model, leaves, builder.mesh.device)
    try:
        with amp, standins as on_meta, _params_as(model, cast):
            with eager_nones(model, leaves) as nones, parameter_free_calls(model, leaves) as calls, \
                    bound_attrs_refused(builder, leaves):
                eager = record_leaf_outputs(model, leaves, mb)
        with amp, _params_as(model, cast):
            gm = capture_export(model, leaves, (), mb, where="pipeline capture of the model", dynamic=False,
                                eager_outputs=eager)
    finally:
        for mod, a, v in saved:
            setattr(mod, a, v)
    undone = hand_leaves_eager_nones(gm, nones)
    if undone:
        logger.info("pipeline: %d leaf argument(s) the eager forward passes as None restored (%s)", len(undone),
                    ", ".join(undone[:4]))
    with amp, _params_as(model, cast):
        standins = hand_leaves_standins(gm, model, calls)
    if standins:
        logger.info("pipeline: leaf argument(s) %s read for their shape and dtype only: recomputed in each stage "
                    "instead of sent", ", ".join(standins[:4]))
    if on_meta:
        axis = cfg["axis"]
        split = split_stages(gm, cut_paths=cuts, input_names=names, target=cfg["target"])
        builder.keep_meta |= modules_not_run(model, split, cuts=cuts, schedule=cfg["schedule"],
                                             pp=builder.sizes[axis], rank_pp=builder.coords[axis])
    builder.scratch["_pipeline_graph"] = (gm, names, constants)
    builder.scratch["_pipeline_rows"] = {k: size[k] * m for k in size}  # rows of each input a replica's step takes
    logger.info("pipeline: captured the model (%d nodes, %d leaves)", len(gm.graph.nodes), len(leaves))




# NOTE [pipeline capture under FSDP2's mixed precision]: with FSDP2 beside the pipeline and a MixedPrecisionPolicy
# (`treadle.run --precision bf16`: bf16 parameters in compute, fp32 shards, gradients reduced in fp32) every stage
# computes with its parameters cast to the policy's `param_dtype`, so the embedding, the blocks and the head return
# that dtype. The capture therefore runs with the floating parameters cast to it (in place, restored after; buffers
# as they are, as FSDP2 leaves them): the graph's dtype assertions and the leaves' recorded outputs are the stages'
# own. Without FSDP2 the stages run an autocast instead (NOTE [pipeline autocast]).
def _fsdp_param_dtype(builder) -> torch.dtype | None:
    dp = builder.v.data_parallel
    if dp is None or not dp.shard or builder.mp_policy is None:
        return None
    return getattr(builder.mp_policy, "param_dtype", None)


@contextlib.contextmanager
def _params_as(model: nn.Module, dtype: torch.dtype | None):
    saved = []
    try:
        if dtype is not None:
            for p in model.parameters():
                if p.is_floating_point() and p.dtype != dtype:
                    saved.append((p, p.data))
                    p.data = p.data.to(dtype)
        yield
    finally:
        for p, data in saved:
            p.data = data


# NOTE [eager None arguments]: a traced forward may take another branch than the eager one. Hugging Face's
# `create_causal_mask` returns None eagerly (the attention then runs SDPA's causal kernel) but materialises an
# (S x S) boolean mask under tracing, which makes every block's SDPA take the explicit-mask path: the same
# numbers, much slower (20% of a PP2 x DP2 step of a tiny LLaMA on CPU). The capture therefore records which
# arguments the eager forward hands each leaf call as None, and where the graph hands that call a value computed
# from no input (a constant of the fixed micro-batch shapes, so the eager branch is the same at every step) it
# hands None again: the leaf runs exactly as in the model as written. A value computed from the inputs is left
# as traced.


@contextlib.contextmanager
def eager_nones(model: nn.Module, leaves: list[str]):
    """Inside: the forward pre-hooks recording, per leaf and call, which arguments are None (positions and
    keywords); the dict they fill is yielded."""
    out: dict[str, list[set]] = {p: [] for p in leaves}
    handles = []
    for p in leaves:
        def hook(mod, args, kwargs, p=p):
            out[p].append({i for i, a in enumerate(args) if a is None} | {k for k, v in kwargs.items() if v is None})
        handles.append(model.get_submodule(p).register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield out
    finally:
        for h in handles:
            h.remove()


def hand_leaves_eager_nones(gm: fx.GraphModule, nones: dict[str, list[set]]) -> list[str]:
    """NOTE [eager None arguments]: replace, in each leaf call of `gm`, an argument computed from no input by
    None where the eager forward's same call passed None. Returns "path.argument" for each one replaced."""
    free: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if _is_free(n, free):
            free.add(n)
    calls: dict[str, int] = {}
    done = []
    for n in gm.graph.nodes:
        if n.op != "call_module" or n.target not in nones:
            continue
        i = calls.get(n.target, 0)
        calls[n.target] = i + 1
        seen = nones[n.target][i] if i < len(nones[n.target]) else set()
        args, kwargs = list(n.args), dict(n.kwargs)
        for key in seen:
            if isinstance(key, int) and key < len(args) and isinstance(args[key], fx.Node) and args[key] in free:
                args[key] = None
                done.append(f"{n.target}[{key}]")
            elif isinstance(key, str) and isinstance(kwargs.get(key), fx.Node) and kwargs[key] in free:
                kwargs[key] = None
                done.append(f"{n.target}.{key}")
        n.args, n.kwargs = tuple(args), kwargs
    if done:  # the mask's nodes stay, unread: a stage copies a value of no input only where it reads one
        gm.recompile()
    return done


# NOTE [metadata-only inputs]: a leaf may read a tensor argument for its shape, dtype and device only. Hugging
# Face's rotary embedding takes the hidden states `x` for `x.dtype` and `x.device` and computes cos / sin from
# the positions: as a leaf of the capture its output depends on `x`, so a stage after the first would receive
# cos and sin with every micro-batch (two more sends beside the activation; 3 ms of a 60 ms PP2 x DP2 step of a
# tiny LLaMA here). The capture proves which arguments a parameter-free leaf's call reads for metadata only:
# torch.export of that call (its eager arguments, the fixed micro-batch shapes) leaves their placeholders
# without users but ops that read metadata (`_METADATA_ARGS`: expand_as's size argument, zeros_like, ...), and
# its graph draws no random numbers. Those arguments are handed a stand-in (torch.empty of
# the recorded shape, dtype and device; its values are never read), the call becomes a value of no input, and
# each stage that reads it recomputes it as it recomputes positions. A call export cannot trace, one that reads
# the values, one with parameters (a stage would share them) or one that draws random numbers stays as it is.


@contextlib.contextmanager
def parameter_free_calls(model: nn.Module, leaves: list[str]):
    """Inside: forward pre-hooks recording each call of a parameter-free leaf (args, kwargs), per leaf in call
    order; the dict they fill is yielded."""
    out: dict[str, list[tuple]] = {}
    handles = []
    for p in leaves:
        mod = model.get_submodule(p)
        if any(True for _ in mod.parameters()):
            continue
        out[p] = []

        def hook(mod, args, kwargs, p=p):
            out[p].append((args, dict(kwargs)))
        handles.append(mod.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield out
    finally:
        for h in handles:
            h.remove()


def metadata_only_arguments(mod: nn.Module, args: tuple, kwargs: dict) -> list[int | str]:
    """The tensor arguments (positions, keywords) of the call `mod(*args, **kwargs)` whose values its output
    provably does not read (NOTE [metadata-only inputs]); empty when it has parameters, draws random numbers or
    does not export."""
    from torch.utils._pytree import tree_flatten

    if any(True for _ in mod.parameters()):
        return []
    try:
        ep = torch.export.export(mod, tuple(args), dict(kwargs), strict=False)
    except Exception:  # noqa: BLE001 - a call export cannot trace is left as it is
        return []
    g = ep.graph
    if any(any(r in str(n.target) for r in _RANDOM) for n in g.nodes if n.op == "call_function"):
        return []
    phs = {n.name: n for n in g.nodes if n.op == "placeholder"}
    users = [sum(not _reads_metadata(u, phs[name]) for u in phs[name].users) if name in phs else 1
             for name in ep.graph_signature.user_inputs]
    keys: list[int | str] = list(range(len(args))) + list(kwargs)
    values = list(args) + list(kwargs.values())
    if len(tree_flatten(values)[0]) != len(users):
        return []
    out, i = [], 0
    for k, v in zip(keys, values):
        n = len(tree_flatten(v)[0])
        if torch.is_tensor(v) and n == 1 and users[i] == 0:
            out.append(k)
        i += n
    return out


# ATen ops that read the given argument positions for their shape, dtype and device only
_METADATA_ARGS = {"aten.expand_as.default": (1,), "aten.empty_like.default": (0,), "aten.zeros_like.default": (0,),
                  "aten.ones_like.default": (0,), "aten.full_like.default": (0,), "aten.sym_size.int": (0,),
                  "aten.sym_numel.default": (0,), "aten.sym_stride.int": (0,),
                  "aten._assert_tensor_metadata.default": (0,)}


def _reads_metadata(user: fx.Node, value: fx.Node) -> bool:
    """Whether `user` reads `value` for its metadata only (`_METADATA_ARGS`, and nowhere else in its arguments)."""
    pos = _METADATA_ARGS.get(str(user.target))
    if pos is None:
        return False
    flat = list(user.args) + list(user.kwargs.values())
    return all(i in pos for i, a in enumerate(flat) if a is value)


def hand_leaves_standins(gm: fx.GraphModule, model: nn.Module, calls: dict[str, list[tuple]]) -> list[str]:
    """NOTE [metadata-only inputs]: in each call of a leaf of `calls` (a module of `model`: its eager arguments,
    per call), hand the
    arguments it reads for metadata only a stand-in, and mark the call recomputable. Returns "path.argument" for
    each one replaced."""
    seen: dict[str, int] = {}
    done = []
    for n in list(gm.graph.nodes):
        if n.op != "call_module" or n.target not in calls:
            continue
        i = seen.get(n.target, 0)
        seen[n.target] = i + 1
        if i >= len(calls[n.target]):
            continue
        args, kwargs = calls[n.target][i]
        keys = metadata_only_arguments(model.get_submodule(n.target), args, kwargs)
        new_args, new_kwargs = list(n.args), dict(n.kwargs)
        for k in keys:
            v = args[k] if isinstance(k, int) else kwargs[k]
            holder = new_args if isinstance(k, int) else new_kwargs
            if (k >= len(holder) if isinstance(k, int) else k not in holder) or not isinstance(holder[k], fx.Node):
                continue
            with gm.graph.inserting_before(n):
                holder[k] = gm.graph.call_function(torch.empty, (tuple(v.shape),),
                                                   {"dtype": v.dtype, "device": v.device})
            done.append(f"{n.target}.{k}" if isinstance(k, str) else f"{n.target}[{k}]")
        if keys:
            n.args, n.kwargs = tuple(new_args), new_kwargs
            n.meta[METADATA_ONLY] = True
    if done:
        gm.recompile()
    return done
