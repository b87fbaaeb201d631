"""Graph-level primitives of `Schedule`: trace, find by pattern, replace a match, decompose, fuse, checkpoint a
match or by op policy, and pipeline cuts.

They work on a sub-module captured with `trace` ("trace only what you need"): the rest of the model stays
eager. Each records itself in the schedule's log with JSON arguments (a match by its graph node names, a
replacement by import path or pickled module), so `replay` re-captures and re-applies it identically.

Names: core's ``find(regex)``, ``replace(new)`` and ``checkpoint()`` are defined on `Schedule` itself, so the
graph forms have their own names here — ``find_pattern(fn)``, ``replace_match(new, match)``,
``checkpoint_match(match)``, ``checkpoint_selective(save=...)``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.tensor.placement_types import Replicate

from .checkpoint_policies import CHECKPOINT_POLICIES, checkpoint_policy, resolve_ops
from ..errors import ScheduleError
from ..lazy import load_registrations
from .log import Ref

if TYPE_CHECKING:
    from .core import Schedule

# The graph layer (capture, pattern, rewrite modules) registers itself here on import (`treadle.graph`): the
# schedule records primitives and never imports the layers below it.
_GRAPH_LAYER: dict[str, Any] = {}


def register_graph_layer(**modules: Any) -> None:
    """Called by `treadle.graph` with its modules (capture=, pattern=, rewrite=)."""
    _GRAPH_LAYER.update(modules)


def _layer(name: str) -> Any:
    load_registrations()
    mod = _GRAPH_LAYER.get(name)
    if mod is None:
        raise ScheduleError(f"graph primitives need the graph layer, which is not loaded; import treadle.graph "
                            f"(importing treadle does)")
    return mod

logger = logging.getLogger(__name__)

# one stage per rank: gpipe, 1f1b; several, placed in a loop: interleaved_1f1b, looped_bfs, interleaved_zb (zero
# bubble: backward split into input and weight gradients); two, placed in a V (rank r holds r and 2 pp - 1 - r):
# zbv, dualpipev — each run by torch.distributed.pipelining's class of that schedule
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev")
_V_SCHEDULES = ("zbv", "dualpipev")


# ------------------------------------------------------------------------------------------ example inputs
def spec_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    """JSON form of example inputs: tensors as {"shape", "dtype"}, JSON values as they are."""
    out = {}
    for k, v in inputs.items():
        if torch.is_tensor(v):
            out[k] = {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
        elif isinstance(v, dict) and set(v) == {"shape", "dtype"}:  # already a spec (replay)
            out[k] = {"shape": list(v["shape"]), "dtype": str(v["dtype"])}
        elif v is None or isinstance(v, (bool, int, float, str)):
            out[k] = v
        else:
            raise ScheduleError(f"example input {k!r} is a {type(v).__name__}; use tensors and JSON values")
    return out


MAX_EXAMPLE_ELEMENTS = 2**31  # per example tensor a schedule file may ask for (16 GiB of int64)


def make_inputs(spec: dict[str, Any], *, seed: int = 0) -> dict[str, Any]:
    """Example tensors from `spec_inputs`: integer tensors zeros (valid ids), bool ones, floats seeded normal.
    Raises ScheduleError for a dtype that is not a torch dtype's name, or a shape that is not a list of
    non-negative ints of at most `MAX_EXAMPLE_ELEMENTS` elements (a spec may come from a file)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in spec.items():
        if isinstance(v, dict) and "shape" in v:
            dtype = getattr(torch, v["dtype"], None) if isinstance(v.get("dtype"), str) else None
            if not isinstance(dtype, torch.dtype):
                raise ScheduleError(f"example input {k!r}: dtype {v.get('dtype')!r:.40} is not a torch dtype "
                                    f"(e.g. 'int64', 'float32')")
            shape = v["shape"]
            if not (isinstance(shape, list) and len(shape) <= 16
                    and all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n for n in shape)
                    and math.prod(shape) <= MAX_EXAMPLE_ELEMENTS):
                raise ScheduleError(f"example input {k!r}: shape {shape!r:.80} must be a list of at most 16 "
                                    f"non-negative ints with at most {MAX_EXAMPLE_ELEMENTS} elements")
            shape = tuple(shape)
            if dtype.is_floating_point:
                out[k] = torch.randn(shape, generator=g, dtype=dtype)
            elif dtype == torch.bool:
                out[k] = torch.ones(shape, dtype=dtype)
            else:
                out[k] = torch.zeros(shape, dtype=dtype)
        else:
            out[k] = v
    return out


class GraphPrimitives:
    """Mixin of `Schedule` with the graph-level primitives (see the module docstring)."""

    # ------------------------------------------------------------------ capture
    def trace(self: "Schedule", *, flatten: bool = False, leaves: Sequence[type | str] = (),
              example_inputs: dict[str, Any] | None = None,
              method: Literal["auto", "fx", "export"] = "auto") -> "Schedule":
        """Capture this module as a graph. Its direct children stay leaf calls (and sub-schedules) unless
        ``flatten=True``, which inlines everything except `leaves` (module types or relative paths).

        `method`: ``"fx"`` (torch.fx symbolic trace, for simple modules), ``"export"`` (torch.export
        non-strict, for model code such as transformers; needs `example_inputs`: keyword inputs of the
        *whole model*, used to record the arguments this module really receives), ``"auto"`` (export when
        example inputs are given, else fx). Batch and sequence dims stay symbolic.
        Raises ScheduleError naming the module and the capture error; nothing falls back silently.
        """
        cap = _layer("capture")
        capture_export, capture_fx = cap.capture_export, cap.capture_fx
        record_call, resolve_leaves = cap.record_call, cap.resolve_leaves
        from .tree import copy_hooks as _copy_hooks, swap_module as _swap_module

        self._check_not_built("trace")
        if not self.path and "pipeline" in self._state.extras:
            raise ScheduleError("trace: a pipelined model captures its root itself at build; trace a sub-module")
        if isinstance(self.mod, fx.GraphModule):
            raise ScheduleError(f"trace at {self._where()}: already traced")
        if method not in ("auto", "fx", "export"):
            raise ScheduleError(f"trace at {self._where()}: unknown method {method!r}; use 'auto', 'fx' or 'export'")
        leaf_paths = resolve_leaves(self.mod, flatten=flatten, leaves=leaves)
        spec = spec_inputs(example_inputs) if example_inputs is not None else None
        if method == "auto":
            method = "export" if spec is not None else "fx"
        if method == "fx":
            gm = capture_fx(self.mod, leaf_paths, where=self._where())
        else:
            if spec is None:
                raise ScheduleError(f"trace at {self._where()}: method='export' needs example_inputs= (keyword "
                                    f"inputs of the whole model)")
            args, kwargs = record_call(self.model, self.path, make_inputs(spec))
            gm = capture_export(self.mod, leaf_paths, args, kwargs, where=self._where())
        self._state.snapshot()
        if self.path:
            _swap_module(self._state.model, self.path, self.mod, gm)
        else:  # the root: the schedule's model becomes the graph (verify keeps the snapshot as reference)
            _copy_hooks(self.mod, gm)
            self._state.model = gm
        self.mod = gm
        rec: dict[str, Any] = {"flatten": flatten, "method": method}
        if leaves:
            rec["leaves"] = list(leaves)
        if spec is not None:
            rec["example_inputs"] = spec
        self._record("trace", **rec)
        logger.info("trace %s: %d graph nodes, leaves %s", self._where(), len(gm.graph.nodes), leaf_paths)
        return self

    @property
    def graph(self: "Schedule") -> fx.Graph:
        """The captured graph of this module (after `trace`)."""
        return self._traced("graph").graph

    def _traced(self: "Schedule", op: str) -> fx.GraphModule:
        if not isinstance(self.mod, fx.GraphModule):
            raise ScheduleError(f"{op} at {self._where()}: {type(self.mod).__name__} is not traced; call "
                                f"{self._where()}.trace(...) first")
        return self.mod

    # ------------------------------------------------------------------ patterns
    def find_pattern(self: "Schedule", pattern: Callable) -> list["Match"]:
        """Matches of a subgraph pattern (a function such as ``lambda x, bias: F.gelu(x + bias)``) in this
        module's graph, non-overlapping, in graph order; empty if there is none. Needs `trace` first.
        Raises ScheduleError when the pattern cannot be captured."""
        find_matches = _layer("pattern").find_matches

        gm = self._traced("find")
        return find_matches(pattern, gm, path=self.path)

    def _match(self: "Schedule", match: "Match | dict", op: str) -> tuple[fx.GraphModule, "Match", str]:
        Match, match_from_spec = _layer("pattern").Match, _layer("pattern").match_from_spec

        if match is None or (isinstance(match, list) and not match):
            raise ScheduleError(f"{op} at {self._where()}: no match given (the pattern matched nothing)")
        if isinstance(match, list):
            raise ScheduleError(f"{op} at {self._where()}: give one match, not a list of {len(match)}")
        path = match.path if isinstance(match, Match) else self.path
        try:
            gm = self._state.model.get_submodule(path) if path else self._state.model
        except AttributeError:
            raise ScheduleError(f"{op}: the match's module {path!r} no longer exists") from None
        if not isinstance(gm, fx.GraphModule):
            raise ScheduleError(f"{op} at {path!r}: the module is not traced")
        if isinstance(match, dict):
            match = match_from_spec(path, gm, match)
        return gm, match, path

    def replace_match(self: "Schedule", new: nn.Module | Callable | Ref, match: "Match | dict") -> "Schedule":
        """Put `new` (a module or a module-level function) in place of the matched subgraph, called with the
        match's inputs *by name*. Hooks of the surrounding modules are kept; primitives and hooks of the matched
        leaves it removes move onto it where their meaning is kept (`treadle.schedule.carry`), else this is a
        ScheduleError naming the leaf, the primitive and why. A replacement whose signature
        cannot bind (a parameter without a match input of its name, or an input it would drop) is rejected
        with ScheduleError and the schedule is unchanged; so is an empty match."""
        replace_match = _layer("rewrite").replace_match

        self._check_not_built("replace_match")
        new = new.load() if isinstance(new, Ref) else new
        gm, m, path = self._match(match, "replace_match")
        arg = new if isinstance(new, nn.Module) else Ref.of(new)
        from .carry import plan_carry

        carry = plan_carry(self, gm, m, path, new)
        spec = m.spec()
        self._state.snapshot()
        name = replace_match(gm, m, new, pre_hooks=carry.pre_hooks, post_hooks=carry.post_hooks,
                             takeover=carry.takeover)
        carry.apply(self, f"{path}.{name}" if path and name else (name or path))
        self._state.records.append(_record("replace_match", path, new=arg, match=spec))
        logger.info("replace_match at %r: %s -> %s", path, spec["pattern"], getattr(arg, "target", type(new).__name__))
        return self

    # ------------------------------------------------------------------ decompose / fuse / checkpoint
    def decompose(self: "Schedule") -> "Schedule":
        """Split Linear-like leaves into ``matmul`` and a separate ``+ bias`` so the bias can fuse with what
        follows. On a traced module: every decomposable leaf call in its graph; on a leaf: its calls in the
        nearest traced ancestor. A column-sharded weight keeps working (build inserts the input-gradient
        reduction); a row-sharded one is a BuildError. Raises ScheduleError if nothing can decompose."""
        decomposable, decompose_node = _layer("rewrite").decomposable, _layer("rewrite").decompose_node

        self._check_not_built("decompose")
        if isinstance(self.mod, fx.GraphModule):
            gm, prefix = self.mod, self.path
            nodes = [n for n in gm.graph.nodes if n.op == "call_module" and decomposable(gm.get_submodule(n.target))]
        else:
            if not decomposable(self.mod):
                raise ScheduleError(f"decompose at {self._where()}: {type(self.mod).__name__} has no decomposition "
                                    f"(registered: Linear, and model-specific ones in treadle.models)")
            gm, prefix = _traced_ancestor(self)
            rel = self.path[len(prefix) + 1:] if prefix else self.path
            nodes = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == rel]
        if not nodes:
            raise ScheduleError(f"decompose at {self._where()}: no call of a decomposable leaf in the traced graph")
        for n in nodes:
            full = f"{prefix}.{n.target}" if prefix else n.target
            _check_decomposable_primitives(self, gm.get_submodule(n.target), full)
        self._state.snapshot()
        done = []
        st = self._state
        for n in nodes:
            full = f"{prefix}.{n.target}" if prefix else n.target
            moving = [i for i, s in enumerate(st.syncs) if s.path == full and s.op is not None
                      and not _reduces_input_grad(st, gm.get_submodule(n.target), s)]
            ins = [i for i in moving if st.syncs[i].mode in ("fwd_pre", "bwd_post")]
            outs = [i for i in moving if st.syncs[i].mode == "fwd_post"]
            b_in, b_out = decompose_node(gm, n, full_path=full, boundary_in=bool(ins), boundary_out=bool(outs))
            for idxs, name in ((ins, b_in), (outs, b_out)):
                for i in idxs:  # the explicit sync now sits on the identity at the leaf's input / output
                    st.syncs[i] = dataclasses.replace(st.syncs[i], path=f"{prefix}.{name}" if prefix else name,
                                                      arg=0)
            done.append(full)
        self._state.extras.setdefault("decomposed", []).extend(done)
        self._record("decompose")
        return self

    def fuse(self: "Schedule", match: "Match | dict", *, compiler: str = "inductor") -> "Schedule":
        """Compile the matched region with ``torch.compile(backend=compiler, fullgraph=True)`` (on first call);
        numerics are unchanged up to the backend's rounding. Raises ScheduleError for an unavailable compiler
        (listing the available ones) or an empty match."""
        rw = _layer("rewrite")
        FusedRegion, check_compiler, inline_leaf_forms, wrap_region = (rw.FusedRegion, rw.check_compiler,
                                                                       rw.inline_leaf_forms, rw.wrap_region)

        self._check_not_built("fuse")
        check_compiler(compiler, self._where())
        gm, m, path = self._match(match, "fuse")
        _check_no_primitives_inside(self, gm, m, path)
        spec = m.spec()
        self._state.snapshot()
        def make(region):
            inline_leaf_forms(region)
            return FusedRegion(region, compiler)

        name = wrap_region(gm, m, make, "fused")
        self._state.records.append(_record("fuse", path, match=spec, compiler=compiler))
        logger.info("fuse at %r: %d ops -> %s (%s)", path, len(spec["nodes"]), name, compiler)
        return self

    def checkpoint_match(self: "Schedule", match: "Match | dict") -> "Schedule":
        """Recompute the matched part of the graph in backward instead of saving its activations."""
        CheckpointRegion, wrap_region = _layer("rewrite").CheckpointRegion, _layer("rewrite").wrap_region

        self._check_not_built("checkpoint_match")
        gm, m, path = self._match(match, "checkpoint_match")
        spec = m.spec()
        self._state.snapshot()
        wrap_region(gm, m, CheckpointRegion, "checkpointed")
        self._state.records.append(_record("checkpoint_match", path, match=spec))
        return self

    def checkpoint_selective(self: "Schedule", *, save: Sequence[str] | None = None,
                             policy: str | None = None) -> "Schedule":
        """Checkpoint this module selectively (`torch.utils.checkpoint.create_selective_checkpoint_contexts`).
        With `save`: outputs of the ops named (aten op names such as ``"aten.mm"``, ``"aten.addmm"``,
        ``"aten._scaled_dot_product_flash_attention"``) are saved, every other op is recomputed in backward.
        With `policy`: a named policy as a peer project defines it ("alternate-matmuls": torchtitan's op-level
        SAC; "attention-core": Megatron's selective recomputation; NOTE [checkpoint policies as peers define
        them]). Raises ScheduleError for an unknown op or policy, both or neither given, or a module already
        checkpointed."""
        self._check_not_built("checkpoint_selective")
        if (save is None) == (policy is None):
            raise ScheduleError(f"checkpoint_selective at {self._where()}: give save=[ops] or policy=name "
                                f"(one of {list(CHECKPOINT_POLICIES)})")
        if policy is not None:
            if checkpoint_policy(policy, self._where()) is None:  # "full" is a plain checkpoint
                raise ScheduleError(f"checkpoint_selective at {self._where()}: policy 'full' is checkpoint(); "
                                    f"a selective policy is one of {list(CHECKPOINT_POLICIES)}")
        else:
            resolve_ops(save, self._where())
        if self.path in self._state.checkpoints or any(p == self.path for p, _ in self._state.extras.get("selective", [])):
            raise ScheduleError(f"checkpoint_selective at {self._where()}: already checkpointed")
        # an entry is (path, list of op names) or (path, policy name)
        self._state.extras.setdefault("selective", []).append((self.path, policy if policy is not None else list(save)))
        if policy is not None:
            self._record("checkpoint_selective", policy=policy)
        else:
            self._record("checkpoint_selective", save=list(save))
        return self

    # ------------------------------------------------------------------ pipeline
    def cut_pipeline_stage(self: "Schedule") -> "Schedule":
        """End a pipeline stage after this module. It must be an element of a sequential container
        (nn.ModuleList / nn.Sequential) such as the model's stack of blocks, and not its last element.
        Raises ScheduleError otherwise, naming the containers where a cut would work."""
        self._check_not_built("cut_pipeline_stage")
        parent_path, _, name = self.path.rpartition(".")
        parent = self.model.get_submodule(parent_path) if parent_path else self.model
        if not self.path or not isinstance(parent, (nn.ModuleList, nn.Sequential)):
            seqs = [p for p, m in self.model.named_modules() if isinstance(m, (nn.ModuleList, nn.Sequential))]
            raise ScheduleError(f"cut_pipeline_stage at {self._where()}: {type(self.mod).__name__} is not an element "
                                f"of a sequential container, so the model does not run in stages there; cut after "
                                f"an element of one of {seqs} (e.g. sch[{(seqs[0] + '.0') if seqs else '...'!r}])")
        if name == str(len(parent) - 1):
            raise ScheduleError(f"cut_pipeline_stage at {self._where()}: the last element of {parent_path!r} ends no "
                                f"stage of blocks; cut after an earlier element")
        cuts = self._state.extras.setdefault("pipeline_cuts", [])
        if self.path in cuts:
            raise ScheduleError(f"cut_pipeline_stage at {self._where()}: already cut here")
        if cuts and cuts[0].rpartition(".")[0] != parent_path:
            raise ScheduleError(f"cut_pipeline_stage at {self._where()}: earlier cuts are in {cuts[0].rpartition('.')[0]!r}; "
                                f"cut one sequential container")
        cuts.append(self.path)
        self._record("cut_pipeline_stage")
        return self

    def pipeline(self: "Schedule", *, axis: str = "pp", schedule: str = "1f1b", n_microbatches: int,
                 example_inputs: dict[str, Any], target: str | None = "labels", scale_grads: bool = True
                 ) -> "Schedule":
        """Run the model as a pipeline over mesh axis `axis`, cut where `cut_pipeline_stage` was applied.
        `build` then returns a `treadle.forms.pipeline.runtime.PipelineModel` (``.step(**inputs)`` trains one batch).

        `schedule`: ``"gpipe"``, ``"1f1b"`` (one stage per rank), ``"interleaved_1f1b"`` (when each rank holds
        several stages, i.e. stages = k x axis size; chosen automatically for k > 1 in place of the first two),
        ``"looped_bfs"``, ``"interleaved_zb"`` (zero bubble), ``"zbv"`` or ``"dualpipev"`` (two stages per rank
        in a V) — torch.distributed.pipelining's schedules of those names. `example_inputs`: keyword inputs of
        the model for one *whole batch* (their shapes fix the micro-batch shape, batch / `n_microbatches`).
        `target`: the input that only the loss reads (sent to the last stage, not through the pipe).
        `scale_grads`: divide gradients by `n_microbatches` (torch.distributed.pipelining's default), so
        they equal the gradient of the mean of the micro-batch losses.
        Raises ScheduleError for a missing axis, no cuts, an unknown schedule or a batch that does not split."""
        self._check_not_built("pipeline")
        if self.path:
            raise ScheduleError(f"pipeline applies to the whole model: call it on the root schedule, not {self._where()}")
        self._check_axis(axis, "pipeline")
        if schedule not in PIPELINE_SCHEDULES:
            raise ScheduleError(f"pipeline: unknown schedule {schedule!r}; use one of {list(PIPELINE_SCHEDULES)}")
        cuts = self._state.extras.get("pipeline_cuts", [])
        if not cuts:
            raise ScheduleError("pipeline: no stage boundaries; mark them with sch[path].cut_pipeline_stage()")
        n_stages = len(cuts) + 1
        pp = self.mesh.size(axis)
        if n_stages % pp:
            raise ScheduleError(f"pipeline: {n_stages} stages do not spread evenly over mesh axis {axis!r} of size "
                                f"{pp}; use a multiple of {pp} stages")
        spec = spec_inputs(example_inputs)
        batches = {k: v["shape"][0] for k, v in spec.items() if isinstance(v, dict) and v["shape"]}
        for k, b in batches.items():
            if b % n_microbatches:
                raise ScheduleError(f"pipeline: input {k!r} has batch {b}, not divisible by n_microbatches="
                                    f"{n_microbatches}")
        if target is not None and target not in example_inputs:
            raise ScheduleError(f"pipeline: target {target!r} is not among the example inputs {sorted(example_inputs)}")
        if schedule in _V_SCHEDULES and n_stages != 2 * pp:
            raise ScheduleError(f"pipeline: schedule {schedule!r} places two stages on each rank of {axis!r} in a V; "
                                f"{n_stages} stages on {pp} ranks need {2 * pp}")
        if n_stages // pp > 1 and schedule in ("gpipe", "1f1b"):
            logger.info("pipeline: %d stages on %d ranks: using interleaved_1f1b", n_stages, pp)
            schedule = "interleaved_1f1b"
        self._state.extras["pipeline"] = dict(axis=axis, schedule=schedule, n_microbatches=n_microbatches,
                                              example_inputs=spec, target=target, scale_grads=scale_grads)
        self._record("pipeline", axis=axis, schedule=schedule, n_microbatches=n_microbatches, example_inputs=spec,
                     target=target, scale_grads=scale_grads)
        return self


def _recorded_on(sch: "Schedule", mod: nn.Module, full: str) -> list[str]:
    """Primitives recorded on module `full` (and its parameters) and hooks registered on it, as short names."""
    st = sch._state
    hooks = [name for name, attr in (("forward pre-hooks", "_forward_pre_hooks"), ("forward hooks", "_forward_hooks"),
                                     ("backward hooks", "_backward_hooks"),
                                     ("backward pre-hooks", "_backward_pre_hooks")) if getattr(mod, attr, None)]
    return ([f"sync {s.mode}" + (f" op={s.op!r}" if s.op else "") for s in st.syncs if s.path == full]
            + ["reduce_grads" for p, _, _ in st.reduce_grads if p == full]
            + ["checkpoint" for p in st.checkpoints if p == full]
            + ["fork_rng" for p, _ in st.fork_rngs if p == full]
            + [f"shard {name}" for name, prm in mod.named_parameters() if id(prm) in st.param_shards]
            + hooks)


def _check_no_primitives_inside(sch: "Schedule", gm: fx.GraphModule, m: "Match", path: str, *, op: str = "fuse",
                                what: str = "a compiled region") -> None:
    """A compiled region (or a replacement) runs instead of the matched leaves: primitives recorded on them
    (syncs, gradient reductions, checkpoints, RNG forks, sharded parameters) and their hooks would be
    bypassed, so refuse to rewrite over them."""
    for n in m.nodes:
        if n.op != "call_module":
            continue
        full = f"{path}.{n.target}" if path else n.target
        found = _recorded_on(sch, gm.get_submodule(n.target), full)
        if found:
            raise ScheduleError(f"{op} at {sch._where()}: leaf {full!r} has recorded primitives or hooks ({', '.join(found)}) that "
                                f"{what} would bypass; {op} a region without that leaf, or apply them to the "
                                f"module that replaces it")


def _check_decomposable_primitives(sch: "Schedule", leaf: nn.Module, full: str) -> None:
    """What a decomposition keeps: a column-sharded weight (and bias) and a reduction of the input gradient on
    that axis (build puts it where the leaf's input was); forward pre-hooks and forward hooks (run around the
    loose ops). Anything else recorded on the leaf would be silently dropped, so it is a ScheduleError."""
    decomposition_dims, leaf_hook_problems = _layer("rewrite").decomposition_dims, _layer("rewrite").leaf_hook_problems

    st = sch._state
    out_dim, in_dim = decomposition_dims(leaf)
    bad = [f"shard weight dim {s.dim} over {s.axis!r} (row parallel: its output is a pending sum)"
           for s in st.param_shards.get(id(leaf.weight), []) if s.dim == in_dim]
    for s in st.syncs:
        if s.path != full or _reduces_input_grad(st, leaf, s) or s.op is not None:
            continue  # explicit ops move to identities at the leaf's input / output
        bad.append(f"sync {s.mode} to={[p for _, p in s.to]} (a typed sync reads the leaf's layout; state it "
                   f"with op=)")
    bad += ["reduce_grads" for p, _, _ in st.reduce_grads if p == full]
    bad += ["checkpoint" for p in st.checkpoints if p == full]
    bad += ["fork_rng" for p, _ in st.fork_rngs if p == full]
    bad += leaf_hook_problems(leaf)
    if bad:
        raise ScheduleError(f"decompose at {full!r}: the leaf has {'; '.join(bad)}, which its loose ops (matmul, + bias) cannot "
                            f"carry; apply them to its parent module, or do not decompose this leaf")


def _reduces_input_grad(st: Any, leaf: nn.Module, s: Any) -> bool:
    """`s` is the reduction of a column-parallel leaf's input gradient (build puts it where the input was)."""
    out_dim, _ = _layer("rewrite").decomposition_dims(leaf)
    col_axes = {p.axis for p in st.param_shards.get(id(leaf.weight), []) if p.dim == out_dim}
    return s.mode == "bwd_post" and (
        (s.op == "all_reduce" and s.axis in col_axes)
        or (s.op is None and all(ax in col_axes and isinstance(p, Replicate) for ax, p in s.to)))


def _record(op: str, path: str, **args: Any):
    from .log import Record

    rec = Record(op, path, args)
    logger.info("%s", rec.to_python())
    return rec


def _traced_ancestor(sch: "Schedule") -> tuple[fx.GraphModule, str]:
    parts = sch.path.split(".")
    for i in range(len(parts) - 1, -1, -1):
        prefix = ".".join(parts[:i])
        mod = sch.model.get_submodule(prefix) if prefix else sch.model
        if isinstance(mod, fx.GraphModule):
            return mod, prefix
    raise ScheduleError(f"{sch._where()}: no traced ancestor; trace its parent first "
                        f"(e.g. sch[{sch.path.rpartition('.')[0]!r}].trace(...))")
