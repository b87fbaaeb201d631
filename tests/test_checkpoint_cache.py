"""NOTE [checkpoint and the KV cache] in runtime/build.py: a checkpointed Hugging Face decoder layer gets no KV cache
while training (its replay would write the cache a second time), as Hugging Face's own gradient checkpointing does;
any other module is replayed as called."""

import logging

import pytest
import torch
from torch import nn

import treadle
from treadle import Mesh, testing
from tiny_models import lm_inputs, tiny_gpt2, tiny_llama


def _step(rank, world, name: str, ckpt: bool):
    model = tiny_gpt2(n_layer=2) if name == "gpt2" else tiny_llama(n_layer=2)
    sch = treadle.create_schedule(model, mesh=Mesh((1,), ("tp",)))
    if ckpt:
        for i in range(2):
            sch[("transformer.h." if name == "gpt2" else "model.layers.") + str(i)].checkpoint()
    built = treadle.build(sch)
    inputs = lm_inputs(batch=2, seq=8)
    out = built(**inputs)
    out.loss.backward()
    cache = out.past_key_values
    lengths = [layer.keys.shape[-2] if getattr(layer, "is_initialized", False) else 0 for layer in cache.layers]
    grads = {n: p.grad.clone() for n, p in built.named_parameters()}
    with torch.no_grad():  # no backward, no replay: the layer runs as called, cache included
        again = built(**inputs).past_key_values
    eval_lengths = [layer.keys.shape[-2] for layer in again.layers]
    return out.loss.detach(), grads, lengths, eval_lengths


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_checkpointed_decoder_layer_writes_no_cache_in_training_and_gradients_match(name):
    plain, ckpt = (testing.spawn(_step, 1, name, c, timeout_s=120)[0] for c in (False, True))
    torch.testing.assert_close(plain[0], ckpt[0])
    assert plain[1].keys() == ckpt[1].keys()
    for n in plain[1]:
        torch.testing.assert_close(plain[1][n], ckpt[1][n], msg=n)
    assert plain[2] == [8, 8]  # without checkpointing every layer caches its 8 positions once
    assert ckpt[2] == [0, 0]  # checkpointed in training: no cache (the replay would have made it 16)
    assert ckpt[3] == [8, 8]  # without gradients the layers run as called


def test_the_cache_arguments_are_found_by_name_positional_or_keyword(caplog):
    from treadle.runtime.recompute import checkpointed_forward

    seen = []

    class Layer(nn.Module):
        _can_checkpoint_with_cache = False  # Hugging Face's declaration: this layer writes the cache

        def forward(self, x, cache=None, *, use_cache=False, **kwargs):
            seen.append((cache, use_cache, kwargs.get("layer_past")))
            return x * x  # saves x: the backward replays the forward

    class Plain(nn.Module):  # no declaration: replayed as called
        def forward(self, x, cache=None):
            seen.append((cache,))
            return x * x  # saves x: the backward replays the forward

    x = torch.ones(2, requires_grad=True)
    layer = Layer()
    fwd = checkpointed_forward(layer, layer.forward, "layer")
    with caplog.at_level(logging.WARNING, logger="treadle.runtime.build"):
        fwd(x, [1], use_cache=True, layer_past=[2]).sum().backward()
    assert seen == [(None, False, None), (None, False, None)]  # forward and its replay
    assert "Layer writes the KV cache" in caplog.text and "cache=None" in caplog.text
    seen.clear()
    layer.eval()  # not training: as called
    fwd(x, [1], use_cache=True)
    assert seen == [([1], True, None)]
    seen.clear()
    plain = Plain()
    checkpointed_forward(plain, plain.forward, "plain")(x, [1]).sum().backward()
    assert seen == [([1],), ([1],)]
