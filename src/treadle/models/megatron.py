"""Ready-made Megatron-LM schedules: GPT-2, BERT and LLaMA blocks by module names, any other model as a
constrained plan (`schedule_by_plan`): the planner's own data-flow analysis and emission with the roles fixed.

The named recipes are short compositions of the forms' steps over the stock model: column-parallel then
row-parallel linears (one all-reduce forward and one backward per attention and per MLP), head-sharded
attention, vocab-parallel embedding and LM head with vocab-parallel cross-entropy, optional sequence
parallelism in the norm/dropout regions (reduce-scatter / all-gather instead of all-reduce), a fraction of the
layers checkpointed, and data parallelism (DDP or ZeRO-3) on a second mesh axis. A named recipe is used only
when every module of the block that holds parameters is one it names (NOTE [a named recipe only for its own
blocks] in common.py); anything else goes to the plan.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.tensor.placement_types import Replicate

from ..errors import ScheduleError, TreadleError
from ..forms.sequence import steps as seq
from ..forms.tensor.steps import check_heads, column, row
from ..forms.vocab import vocab_parallel
from ..schedule.core import Schedule
from .common import blocks_path, checkpoint_layers, finish, is_block_stack, named_family, path_of

logger = logging.getLogger(__name__)


def _row_to(sp: bool):
    """Where a row-parallel output goes: reduce-scattered over the sequence under sequence parallelism."""
    return seq.SEQUENCE if sp else Replicate()


def schedule_gpt2(sch: Schedule, *, tp: str = "tp", dp: str | None = None, zero3: bool = False,
                  sequence_parallel: bool = False, checkpoint_fraction: float = 0.0,
                  vocab_parallel_head: bool = True) -> Schedule:
    """GPT-2 (fused q|k|v in Conv1D `c_attn`). Needs heads, vocab and 4*hidden divisible by the tp size."""
    blocks = blocks_path(sch)
    n = sch.mesh.size(tp)
    sp = sequence_parallel
    if vocab_parallel_head:
        vocab_parallel(sch, tp=tp, causal=True, sequence_parallel=False)
    if sp:
        seq.split_output(sch[blocks.rsplit(".", 1)[0] + ".drop"], tp)
    for i in range(len(sch[blocks].mod)):
        b = sch[f"{blocks}.{i}"]
        check_heads(b.path, b["attn"].mod.num_heads, n)
        column(b["attn.c_attn"], tp, blocks=3)  # the fused q|k|v
        b["attn"].shard_attr("split_size", axis=tp)
        row(b["attn.c_proj"], tp, to=_row_to(sp))
        column(b["mlp.c_fc"], tp)
        row(b["mlp.c_proj"], tp, to=_row_to(sp))
        if sp:
            seq.sharded_norms([b["ln_1"], b["ln_2"]], tp)
            seq.gather_input(b["attn.c_attn"], tp)
            seq.gather_input(b["mlp.c_fc"], tp)
            b["attn"].fork_rng(axis=tp)  # attention and residual dropout both see sharded data
            b["mlp"].fork_rng(axis=tp)
    if sp:
        top = blocks.rsplit(".", 1)[0]
        seq.sharded_norms([sch[f"{top}.ln_f"]], tp)
        seq.gather_output(sch[f"{top}.ln_f"], tp)
    return finish(sch, blocks=blocks, dp=dp, zero3=zero3, checkpoint_fraction=checkpoint_fraction)


def schedule_bert(sch: Schedule, *, tp: str = "tp", dp: str | None = None, zero3: bool = False,
                  sequence_parallel: bool = False, checkpoint_fraction: float = 0.0,
                  vocab_parallel_head: bool = True) -> Schedule:
    """BERT (post-norm encoder). Sequence parallelism is not offered for post-norm layers: the residual
    enters the norm inside the output module, so it raises ScheduleError."""
    if sequence_parallel:
        raise ScheduleError("schedule_bert: sequence parallelism is not supported for post-norm BERT layers")
    blocks = blocks_path(sch)
    n = sch.mesh.size(tp)
    if vocab_parallel_head:
        # BertForMaskedLM computes its loss inline with CrossEntropyLoss, so the logits are gathered
        vocab_parallel(sch, tp=tp, causal=False, sequence_parallel=False, parallel_loss=False)
    for i in range(len(sch[blocks].mod)):
        b = sch[f"{blocks}.{i}"]
        check_heads(b.path, b["attention.self"].mod.num_attention_heads, n)
        for proj in ("query", "key", "value"):
            column(b[f"attention.self.{proj}"], tp)
        b["attention.self"].fork_rng(axis=tp)  # dropout on head-sharded attention probabilities
        row(b["attention.output.dense"], tp)
        column(b["intermediate.dense"], tp)
        row(b["output.dense"], tp)
    return finish(sch, blocks=blocks, dp=dp, zero3=zero3, checkpoint_fraction=checkpoint_fraction)


def schedule_llama(sch: Schedule, *, tp: str = "tp", dp: str | None = None, zero3: bool = False,
                   sequence_parallel: bool = False, checkpoint_fraction: float = 0.0,
                   vocab_parallel_head: bool = True) -> Schedule:
    """LLaMA (GQA, RMSNorm, rotary): q/k/v/gate/up column-parallel, o/down row-parallel; needs query and
    key/value heads divisible by the tp size."""
    blocks = blocks_path(sch)
    n = sch.mesh.size(tp)
    sp = sequence_parallel
    if vocab_parallel_head:
        # positions and masks are computed from the embedding's output shape, so the sequence is split
        # at the first block's input, not at the embedding
        vocab_parallel(sch, tp=tp, causal=True, sequence_parallel=sp, split_embedding=False)
        if sp:
            seq.split_input(sch[f"{blocks}.0"], tp)
    elif sp:
        raise ScheduleError("schedule_llama: sequence_parallel needs vocab_parallel_head=True")
    for i in range(len(sch[blocks].mod)):
        b = sch[f"{blocks}.{i}"]
        cfg = b["self_attn"].mod.config
        check_heads(b.path, cfg.num_attention_heads, n)
        check_heads(b.path, cfg.num_key_value_heads, n, "key/value heads")
        if sp:  # gather at the module input: attention reshapes its output with the input's sequence length
            for mod in ("self_attn", "mlp"):  # the gradient reduce-scattered, as Megatron-LM does
                seq.gather_input(b[mod], tp, reduce_scatter_grad=True)
        for proj in ("q_proj", "k_proj", "v_proj"):
            column(b[f"self_attn.{proj}"], tp)
        b["self_attn"].fork_rng(axis=tp)  # dropout on head-sharded attention probabilities
        row(b["self_attn.o_proj"], tp, to=_row_to(sp))
        for proj in ("gate_proj", "up_proj"):
            column(b[f"mlp.{proj}"], tp)
        row(b["mlp.down_proj"], tp, to=_row_to(sp))
        if sp:
            seq.sharded_norms([b["input_layernorm"], b["post_attention_layernorm"]], tp)
    if sp:
        seq.sharded_norms([sch[blocks.rsplit(".", 1)[0] + ".norm"]], tp)
    return finish(sch, blocks=blocks, dp=dp, zero3=zero3, checkpoint_fraction=checkpoint_fraction)


# the named recipes (NOTE [a named recipe only for its own blocks] in common.py)
_RECIPES: dict[str, Callable[..., Schedule]] = {"gpt2": schedule_gpt2, "llama": schedule_llama, "bert": schedule_bert}


def _stack_of(model: nn.Module, path: str) -> str | None:
    """The outermost stack of repeated blocks (an nn.ModuleList, or an nn.ModuleDict keyed 0, 1, ...) module
    `path` sits in an entry of, of the main stack or any other (an encoder's, a decoder's); None if none."""
    parts = path.split(".")
    for k in range(1, len(parts)):
        if is_block_stack(model.get_submodule(".".join(parts[:k]))):
            return ".".join(parts[:k])
    return None


def megatron_pins(sch: Schedule, *, tp: str, vocab_parallel_head: bool) -> dict[str, dict[str, str]]:
    """The recipe's pins: every weight of a Linear-like leaf (nn.Linear, transformers' Conv1D) inside a repeated
    block is sharded over `tp`, on the dim the solver picks by data flow (column- or row-parallel: a pin "S"), one
    pattern per place in the block (``layers.*.mlp.up.weight``: every block alike); the input embedding's and the
    output head's weights (where the model names them) split over the vocabulary with `vocab_parallel_head`, else
    replicated."""
    from ..forms.tensor.leaf_rules import matmul_dims

    model = sch.model
    pins: dict[str, dict[str, str]] = {}
    for path, mod in model.named_modules():
        stack = _stack_of(model, path) if path and matmul_dims(mod) is not None else None
        if stack is not None:
            rel = path[len(stack) + 1:].partition(".")[2]
            pins[f"{stack}.*.{rel}.weight" if rel else f"{stack}.*.weight"] = {tp: "S"}
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            mod = getattr(model, getter)()
        except (AttributeError, NotImplementedError, TypeError):  # not a Hugging Face model, or none of its own
            mod = None
        where = path_of(sch, mod)
        if vocab_parallel_head and (mod is None or where is None):
            raise ScheduleError(f"megatron: vocab_parallel_head needs the model's {getter}() (a Hugging Face "
                                f"method) to find the vocabulary; {type(model).__name__} has none: pass "
                                f"vocab_parallel_head=False")
        if where is not None and isinstance(getattr(mod, "weight", None), torch.Tensor):
            pins[f"{where}.weight"] = {tp: "S0" if vocab_parallel_head else "R"}  # the user's word, either way
    return pins


def _example_batch(sch: Schedule, dp: str | None) -> dict:
    """A small batch of token ids for a model that takes ``input_ids`` (zeros are valid ids; as labels too when it
    takes them), as many rows as the data-parallel axis has ranks, without a KV cache (a graph cannot hold one)."""
    import inspect

    rows = sch.mesh.size(dp) if dp is not None else 1
    device = next((p.device for p in sch.model.parameters()), torch.device("cpu"))  # meta for a meta-device model
    out: dict = {"input_ids": torch.zeros(rows, 7, dtype=torch.long, device=device)}  # 7: unlike a head count
    try:
        params = inspect.signature(sch.model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    if "input_ids" not in params and not any(q.kind == q.VAR_KEYWORD for q in params.values()):
        raise ScheduleError(f"megatron: {type(sch.model).__name__}.forward takes no input_ids; pass example_inputs= "
                            f"(the model's keyword inputs, e.g. pixel_values and labels)")
    if "labels" in params:  # the model's own training loss, as training computes it
        out["labels"] = out["input_ids"]
    if "use_cache" in params or any(q.kind == q.VAR_KEYWORD for q in params.values()):
        out["use_cache"] = False
    return out


def schedule_by_plan(sch: Schedule, *, tp: str = "tp", dp: str | None = None, zero3: bool = False,
                     checkpoint_fraction: float = 0.0, example_inputs: dict | None = None,
                     sequence_parallel: bool = False, vocab_parallel_head: bool = False) -> Schedule:
    """Megatron for any model, as a constrained plan: the planner's capture, data-flow analysis and emission
    with the roles fixed (`tp` tensor-parallel, `dp` DDP or ZeRO-3, every other axis replicated, no pipeline) and
    the recipe's layouts pinned (`megatron_pins`: every Linear-like weight of the repeated blocks sharded over
    `tp`, the vocabulary split or kept whole as `vocab_parallel_head` says). The analysis decides what is column-,
    row- or head-parallel, which gradients need a sum over `tp` (a norm every head shares) and which attributes
    count heads; weights no data flow can split stay replicated (`_plan_holding`). `example_inputs`: the model's keyword inputs (default: a few token ids);
    the schedule does not depend on their sizes. A fraction of the blocks is checkpointed as in the named
    recipes. Sequence parallelism needs a named recipe. A mixture-of-experts model's experts stay whole on each rank
    (Megatron's default expert-model-parallel size, 1): state `expert_parallel` after the recipe to split them."""
    from ..planner.capabilities import runtime_capabilities
    from ..planner.to_schedule import apply_decisions

    if sequence_parallel:
        raise ScheduleError("megatron as a plan: sequence parallelism needs a recipe by name (GPT-2, BERT, LLaMA "
                            "blocks); use sequence_parallel=False, or plan the model (treadle.planner.plan_model "
                            "weighs sequence parallelism itself)")
    names = sch.mesh.names
    for axis, what in ((tp, "tp"), (dp, "dp")):
        if axis is not None and axis not in names:
            raise ScheduleError(f"megatron: {what}={axis!r} is not an axis of the mesh {names}")
    blocks = blocks_path(sch)
    pins = megatron_pins(sch, tp=tp, vocab_parallel_head=vocab_parallel_head)
    if not pins:
        raise ScheduleError(f"megatron: no Linear-like weight inside the repeated blocks at {blocks!r} "
                            f"({type(sch[f'{blocks}.0'].mod).__name__}); nothing to split over {tp!r}")
    inputs = example_inputs if example_inputs is not None else _example_batch(sch, dp)
    plan = _plan_holding(sch, inputs, pins, tp=tp, dp=dp, zero3=zero3)
    _, is_leaf_module = runtime_capabilities(sch.model)
    apply_decisions(sch, [d for d in plan.decisions if d.op != "checkpoint"], leaf_module=is_leaf_module)
    checkpoint_layers(sch, blocks, checkpoint_fraction)
    return sch


def _plan_holding(sch: Schedule, inputs: Any, pins: dict, *, tp: str, dp: str | None, zero3: bool) -> Any:
    """The constrained plan with every pin of `pins` that can hold: all of them when they hold together; else the
    weights are added one pattern at a time, in model order, each kept when a plan still exists, and the ones
    that cannot hold stay replicated on `tp` (Megatron's answer to key/value heads that do not divide), each
    named in a warning with the reason. Raises ScheduleError when no block weight can be split, when the
    vocabulary cannot be kept as asked, or when the roles have no plan."""
    from ..cost.cluster import ClusterSpec
    from ..errors import PlanError
    from ..planner import plan_model
    from ..planner.capture import capture

    where = f"megatron on {type(sch.model).__name__}"
    names = sch.mesh.names
    args, kwargs = ((), inputs) if isinstance(inputs, dict) else (tuple(inputs), {})
    try:
        graph = capture(sch.model, args, kwargs, gpu_attention=False)
    except TreadleError as e:
        raise ScheduleError(f"{where}: the model cannot be captured: {e}") from e

    def plan(p: dict) -> Any:
        return plan_model(sch.model, inputs, cluster=ClusterSpec.uniform(sch.mesh, "loopback"), pins=p,
                          dp_axis=dp, zero=bool(zero3) if dp else None, graph=graph, pp_axis=None, ep_axis=None,
                          forbid_axes=tuple(a for a in names if a not in (tp, dp)), checkpoint="none", price_top=0)

    try:
        return plan(pins)
    except PlanError as whole:
        first = str(whole)
    kept: dict = {}
    dropped: dict[str, str] = {}
    for pattern, per_axis in pins.items():
        try:
            plan({**kept, pattern: per_axis})
            kept[pattern] = per_axis
        except PlanError as e:
            dropped[pattern] = str(e)
    split = [p for p in kept if kept[p] == {tp: "S"}]
    if not split or any(pins[p] != {tp: "S"} for p in dropped):  # nothing split; or the vocabulary as asked
        raise ScheduleError(f"{where}: the recipe's layout cannot be built: {first}")
    for pattern, why in dropped.items():
        logger.warning("%s: %s stays replicated over %r: %s", where, pattern, tp, why)
    return plan(kept)


def megatron(sch: Schedule, **kwargs) -> Schedule:
    """Apply the Megatron recipe: the named recipe (GPT-2, LLaMA or BERT) when block 0 holds exactly that
    family's modules (NOTE [a named recipe only for its own blocks] in common.py), else the constrained plan
    (`schedule_by_plan`; pass ``example_inputs=`` for a model that does not take ``input_ids``). Keyword
    arguments go to the recipe. Raises ScheduleError naming what cannot be built."""
    family = named_family(sch[f"{blocks_path(sch)}.0"].mod)
    if family is not None:
        kwargs.pop("example_inputs", None)
        return _RECIPES[family](sch, **kwargs)
    return schedule_by_plan(sch, **kwargs)
