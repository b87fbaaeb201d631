"""The vocab-parallel embedding and loss as a recipe step: how a person (or a ready-made schedule) states it."""

from __future__ import annotations

from torch.distributed.tensor.placement_types import Replicate, Shard

from ...errors import ScheduleError
from ...schedule.core import Schedule
from ...schedule.log import Ref
from .plan import VOCAB_LOSS


def _path_of(sch: Schedule, module) -> str | None:
    if module is None:
        return None
    return next((p for p, m in sch.model.named_modules() if m is module), None)


def vocab_parallel(sch: Schedule, *, tp: str, causal: bool, sequence_parallel: bool,
                   parallel_loss: bool = True, split_embedding: bool = True) -> None:
    """Vocab-parallel input embedding (masked lookup + all-reduce, or reduce-scatter over the sequence)
    and vocab-parallel output head with vocab-parallel cross-entropy as the model's ``loss_function``.
    With ``parallel_loss=False`` (a model that computes its loss inline, not through ``loss_function``)
    the head's logits are gathered over the vocab instead, and the model's own loss runs on them.
    With `sequence_parallel` the head gathers the sequence first, and (if `split_embedding`) the
    embedding reduce-scatters over the sequence instead of all-reducing."""
    emb_path = _path_of(sch, sch.model.get_input_embeddings())
    head_path = _path_of(sch, sch.model.get_output_embeddings() if hasattr(sch.model, "get_output_embeddings") else None)
    if emb_path is None:
        raise ScheduleError("vocab_parallel: the model has no input embedding (get_input_embeddings)")
    emb = sch[emb_path]
    emb.shard("weight", dim=0, axis=tp)
    emb.sync("fwd_post", to=Shard(1) if sequence_parallel and split_embedding else Replicate(), axis=tp)
    if head_path is not None:
        head = sch[head_path]
        if head.mod.weight is not emb.mod.weight:
            head.shard("weight", dim=0, axis=tp)
        if getattr(head.mod, "bias", None) is not None:
            head.shard("bias", dim=0, axis=tp)
        if sequence_parallel:
            head.sync("fwd_pre", to=Replicate(), from_=Shard(1), axis=tp)
        if parallel_loss:
            sch.set_attr("loss_function", Ref(VOCAB_LOSS, axis=tp, causal=causal))
        else:
            head.sync("fwd_post", to=Replicate(), axis=tp)
