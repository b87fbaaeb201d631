"""Ready-made Megatron-LM schedules: GPT-2, BERT and LLaMA by module structure, any other transformer by the
data flow of its blocks (`schedule_by_structure`).

Each is a short recipe of primitives over the stock model: column-parallel then row-parallel linears
(one all-reduce forward and one backward per attention and per MLP), head-sharded attention,
vocab-parallel embedding and LM head with vocab-parallel cross-entropy, optional sequence parallelism in
the norm/dropout regions (reduce-scatter / all-gather instead of all-reduce), a fraction of the layers
checkpointed, and data parallelism (DDP or ZeRO-3) on a second mesh axis.
"""

from __future__ import annotations

from torch.distributed.tensor.placement_types import Replicate

from ..errors import ScheduleError
from ..forms.sequence import steps as seq
from ..forms.tensor.steps import check_heads, column, row
from ..forms.vocab import vocab_parallel
from ..schedule.core import Schedule
from .common import blocks_path, finish, has_children


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


# structure signature of one block -> recipe
_FAMILIES = (
    (("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"), schedule_gpt2),
    (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
      "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"), schedule_llama),
    (("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
      "intermediate.dense", "output.dense"), schedule_bert),
)


def schedule_by_structure(sch: Schedule, *, tp: str = "tp", dp: str | None = None, zero3: bool = False,
                          checkpoint_fraction: float = 0.0, example_inputs: dict | None = None,
                          sequence_parallel: bool = False, vocab_parallel_head: bool = False) -> Schedule:
    """Megatron for any block whose Linear leaves alternate column/row by data flow (`models.structure`):
    separate, fused or grouped q/k/v, rotary or learned positions, parallel or sequential residual, plain or
    gated MLP. Embeddings and head stay replicated. `example_inputs` (keyword inputs of the model; default a
    few token ids) run it once to capture the first block. Raises ScheduleError naming what it could not
    recognise."""
    from .structure import default_example_inputs, find_block_layout

    if sequence_parallel or vocab_parallel_head:
        raise ScheduleError("megatron by structure: sequence parallelism and a vocab-parallel head need a recipe "
                            "by name (GPT-2, BERT, LLaMA); use sequence_parallel=False, vocab_parallel_head=False")
    blocks = blocks_path(sch)
    lay = find_block_layout(sch, blocks, example_inputs or default_example_inputs(sch), sch.mesh.size(tp))
    for i in range(len(sch[blocks].mod)):
        b = sch[f"{blocks}.{i}"]
        for path, nb in lay.columns.items():
            column(b[path], tp, blocks=nb)
        for path in lay.rows:
            row(b[path], tp)
        for path, attr in lay.head_attrs:
            b[path].shard_attr(attr, axis=tp)
        for path in lay.attention:
            b[path].fork_rng(axis=tp)  # dropout on head-sharded attention probabilities
        for name, dim, inner in lay.per_head_inputs:  # ALiBi biases: this rank's heads only
            b.sync("fwd_pre", op="split", dim=dim, axis=tp, arg=name, **({"inner": inner} if inner > 1 else {}))
    return finish(sch, blocks=blocks, dp=dp, zero3=zero3, checkpoint_fraction=checkpoint_fraction)


def megatron(sch: Schedule, **kwargs) -> Schedule:
    """Apply the Megatron recipe matching the model's block structure: GPT-2, LLaMA or BERT style by their
    module names, else found by data flow (`schedule_by_structure`; pass ``example_inputs=`` for a model that
    does not take ``input_ids``). Keyword arguments go to the recipe. Raises ScheduleError naming what could
    not be recognised."""
    first = sch[blocks_path(sch)].mod[0]
    for sig, recipe in _FAMILIES:
        if has_children(first, *sig):
            kwargs.pop("example_inputs", None)
            return recipe(sch, **kwargs)
    return schedule_by_structure(sch, **kwargs)
