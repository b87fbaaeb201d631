"""NOTE [eager masks]: treadle's fake-tensor runs (the profiler, the price's rehearsal) take the attention-mask
decisions an eager run takes on the same inputs, so a grouped-query model is priced with SDPA's own GQA and no
explicit mask, as it runs — and a padded batch keeps its mask."""

from __future__ import annotations

import pytest
import torch

from treadle.profile.eager_masks import eager_masks, plain_inputs
from treadle.profile.profiler import profile
from tiny_models import lm_inputs, tiny_gpt2, tiny_llama


def _saved_by_eager_run(model, inputs) -> int:
    """Bytes autograd saves in one real forward (storages once, parameters and their views excluded)."""
    params = {id(p.untyped_storage()) for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if not isinstance(t, torch.nn.Parameter) and id(st) not in params:
            seen.setdefault(id(st), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**inputs)
    del out
    return sum(seen.values())


def _padded(inputs: dict) -> dict:
    mask = torch.ones_like(inputs["input_ids"])
    mask[0, :3] = 0  # left padding on the first row
    return {**inputs, "attention_mask": mask}


def test_plain_inputs_reads_the_values_an_eager_run_reads():
    ids = lm_inputs(2, 8)
    assert plain_inputs(ids)
    assert plain_inputs({**ids, "attention_mask": torch.ones(2, 8, dtype=torch.long)})
    assert not plain_inputs(_padded(ids))
    assert plain_inputs({**ids, "position_ids": torch.arange(3, 11).expand(2, 8)})  # an offset is one sequence
    packed = torch.cat([torch.arange(4), torch.arange(4)]).expand(2, 8)
    assert not plain_inputs({**ids, "position_ids": packed})
    assert not plain_inputs({**ids, "attention_mask": torch.ones(2, 1, 8, 8)})  # a 4-D mask is the model's own
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.ones(2, 8, dtype=torch.long)
    assert not plain_inputs({**ids, "attention_mask": fake})  # values unknown: the tracing path is kept


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2], ids=["llama-gqa", "gpt2"])
@pytest.mark.parametrize("padded", [False, True], ids=["plain", "padded"])
def test_the_profile_saves_what_the_eager_run_saves(make, padded):
    """A model built with transformers directly (no treadle zoo): the fake step's saved bytes equal a real run's,
    with no padding (no mask, SDPA's grouped-query path) and with padding (both build the mask)."""
    model = make(2)
    model.config.use_cache = False  # training: no cache (then transformers checks the position ids for packing)
    model.train()
    inputs = lm_inputs(2, 16)
    if padded:
        inputs = _padded(inputs)
    prof = profile(model, inputs, reuse_blocks=False)
    assert prof.saved_bytes + prof.saved_input_bytes == _saved_by_eager_run(model, inputs)


def test_the_decisions_are_restored_after_the_run():
    from transformers import masking_utils

    before = {n: getattr(masking_utils, n) for n in ("is_torchdynamo_exporting", "_ignore_causal_mask_sdpa",
                                                      "find_packed_sequence_indices")}
    with eager_masks(lm_inputs(2, 8)):
        assert masking_utils.find_packed_sequence_indices(torch.zeros(2, 8, dtype=torch.long)) is None
        assert masking_utils.is_torchdynamo_exporting() is False
    assert {n: getattr(masking_utils, n) for n in before} == before
    with eager_masks(_padded(lm_inputs(2, 8))):  # padding: nothing is changed
        assert {n: getattr(masking_utils, n) for n in before} == before


def test_the_price_rehearses_the_attention_the_run_takes():
    """`treadle.price`'s rehearsal (fake tensors) of a DDP step of the GQA model: its activations are what one rank's
    real forward saves (within the token ids and labels, which the price counts as inputs)."""
    import treadle
    from treadle import Mesh, create_schedule
    from treadle.cost.cluster import parse_cluster

    model = tiny_llama(2)
    model.config.use_cache = False
    model.train()
    inputs = lm_inputs(4, 16)
    sch = create_schedule(model, mesh=Mesh((2,), ("dp",)))
    sch.data_parallel(axis="dp")
    price = treadle.price(sch, inputs, parse_cluster("2:cpu"))
    local = {k: v[:2] for k, v in inputs.items()}
    ids = sum(v.numel() * v.element_size() for v in local.values())
    assert abs(price.activation_bytes - _saved_by_eager_run(model, local)) <= ids


def test_the_planners_capture_takes_the_attention_the_run_takes():
    """The export the planner reads (NOTE [eager masks], taken in full there too): grouped-query attention hands its
    key / value heads to SDPA as they are, with no mask built, and autograd saves what the eager run saves."""
    from treadle.planner.capture import capture

    model = tiny_llama(2)
    model.config.use_cache = False
    model.train()
    inputs = lm_inputs(2, 16)
    g = capture(model, (), inputs)
    sdpa = [n for n in g.nodes if n.op_name == "scaled_dot_product_attention"]
    assert len(sdpa) == 2
    for n in sdpa:
        q, k, v = (g.nodes[j].out for j in n.inputs[:3])
        assert k.shape[1] == v.shape[1] == q.shape[1] // 2  # 2 KV heads under 4 query heads: not repeated
        assert n.kwargs.get("attn_mask") is None and (len(n.args) < 4 or n.args[3] is None)
    ids = sum(v.numel() * v.element_size() for v in inputs.values())
    assert abs(sum(g.saved.values()) - _saved_by_eager_run(model, inputs)) <= ids
