"""Acceptance of the symbolic profiler against independent references on five tiny HF architectures:
FlopCounterMode (FLOPs), saved_tensors_hooks in a real forward (saved bytes), a live-tensor tracker in a real
training step (peak memory), and the full profile (block reuse)."""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from treadle.models.zoo import named_model
from treadle.profile import profile

FAMILIES = ["tiny-gpt2", "tiny-bert", "tiny-llama", "tiny-opt", "tiny-t5"]
BATCH, SEQ = 2, 32


@pytest.fixture(autouse=True, scope="module")
def _private_cpu_calibration_cache(tmp_path_factory):
    """profile() defaults to the calibrated cpu spec; keep its cache out of the user's home."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        yield


def _build(name, **kw):
    torch.manual_seed(0)
    return named_model(name, batch=BATCH, seq=SEQ, **kw)


def _real_flops(model, inputs):
    with FlopCounterMode(display=False) as fc:
        model(**inputs).loss.backward()
    model.zero_grad(set_to_none=True)
    return fc.get_total_flops()


def _real_saved_bytes(model, inputs):
    """Bytes autograd saves in a real forward, deduplicated by storage, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = (st.nbytes(), st)  # hold the storage so its address is not reused
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**inputs).loss
    del loss
    return sum(n for n, _ in seen.values())


class _LiveBytes(TorchDispatchMode):
    """Live bytes of storages created by ops, freed when the storage dies; records the maximum."""

    def __init__(self, preexisting):
        super().__init__()
        self.pre, self.live, self.peak, self.refs = preexisting, 0, 0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = id(st)
                if key not in self.refs and st.data_ptr() not in self.pre:
                    n = st.nbytes()
                    self.live += n
                    self.refs[key] = weakref.ref(st, lambda _, k=key, n=n: self._free(k, n))
        self.peak = max(self.peak, self.live)
        return out

    def _free(self, key, n):
        if self.refs.pop(key, None) is not None:
            self.live -= n


def _real_peak_bytes(model, inputs):
    """Peak bytes of a real training step: parameters, buffers, inputs and AdamW state resident, plus the
    maximum of live op-allocated storages over forward and backward."""
    opt = torch.optim.AdamW(model.parameters())
    model(**inputs).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    resident = [*{id(p): p for p in model.parameters()}.values(), *model.buffers(), *inputs.values()]
    resident += [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
    base = sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in resident}.values())
    tracker = _LiveBytes({t.untyped_storage().data_ptr() for t in resident})
    with tracker:
        model(**inputs).loss.backward()
    model.zero_grad(set_to_none=True)
    return base + tracker.peak


@pytest.mark.parametrize("name", FAMILIES)
def test_flops_equal_flop_counter_and_sdpa_equals_eager(name):
    model, inputs = _build(name, attn="eager")
    reference = _real_flops(model, inputs)
    prof = profile(model, inputs, hardware="a100-80gb")
    assert prof.total_flops == reference
    assert prof.recompute_flops == 0
    # per-op backward formulas account for every backward FLOP that ran
    assert sum(r.backward_flops for r in prof.ops) == prof.backward_flops
    sdpa_model, sdpa_inputs = _build(name, attn="sdpa")
    assert profile(sdpa_model, sdpa_inputs, hardware="a100-80gb").total_flops == reference


def test_cpu_flash_attention_is_counted_where_flop_counter_sees_zero():
    model, inputs = _build("tiny-llama", attn="sdpa", dropout=False)
    with FlopCounterMode(display=False) as fc:
        model(**inputs).loss.backward()
    counted = fc.get_flop_counts()["Global"]
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu not in counted  # the CPU kernel is missed
    eager_model, _ = _build("tiny-llama", attn="eager", dropout=False)
    assert profile(model, inputs).total_flops == _real_flops(eager_model, inputs) > fc.get_total_flops()


@pytest.mark.parametrize("name", FAMILIES)
def test_saved_bytes_match_saved_tensors_hooks(name):
    model, inputs = _build(name)
    reference = _real_saved_bytes(model, inputs)
    prof = profile(model, inputs)
    assert prof.saved_bytes + prof.saved_input_bytes == pytest.approx(reference, rel=0.02)


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-t5"])
def test_saved_bytes_with_checkpointed_layers(name):
    model, inputs = _build(name)
    full = profile(model, inputs)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    reference = _real_saved_bytes(model, inputs)
    prof = profile(model, inputs)
    assert prof.saved_bytes + prof.saved_input_bytes == pytest.approx(reference, rel=0.02)
    assert prof.saved_bytes < full.saved_bytes
    # each checkpointed layer runs its forward again inside backward
    assert prof.recompute_flops > 0
    assert prof.model_flops == full.model_flops
    assert prof.peak_bytes < full.peak_bytes
    # backward work stays with the module that owns it; recomputation is the checkpointed layers' forward, up to
    # the last tensor backward needs (torch.utils.checkpoint stops early: e.g. LLaMA's down_proj is not rerun)
    for path, stats in full.modules.items():
        assert prof.modules[path].backward_flops == stats.backward_flops, path
    layers = [p for p, m in prof.modules.items() if m.recompute_flops and m.type_name.endswith(("Block", "Layer"))]
    assert layers and sum(prof.modules[p].recompute_flops for p in layers) == prof.recompute_flops
    assert all(0 < prof.modules[p].recompute_flops <= full.modules[p].forward_flops for p in layers)


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_peak_memory_matches_real_training_step(name):
    model, inputs = _build(name)
    model_b, inputs_b = named_model(name, batch=4, seq=64)
    for m, inp in ((model, inputs), (model_b, inputs_b)):
        measured = _real_peak_bytes(m, inp)
        prof = profile(m, inp, optimizer="adamw")
        assert prof.peak_bytes == pytest.approx(measured, rel=0.05)


@pytest.mark.parametrize("name", FAMILIES)
def test_block_reuse_gives_the_full_profile(name):
    model, inputs = _build(name)
    fast = profile(model, inputs)
    full = profile(model, inputs, reuse_blocks=False)
    assert fast.reused_blocks and not full.reused_blocks
    assert fast.totals() | {"step_time_s": 0, "forward_time_s": 0, "backward_time_s": 0, "mfu": 0} == \
        full.totals() | {"step_time_s": 0, "forward_time_s": 0, "backward_time_s": 0, "mfu": 0}
    assert fast.step_time_s == pytest.approx(full.step_time_s, rel=1e-9)
    assert [(r.op, r.module, r.phase, r.flops, r.saved_bytes, r.live_after_bytes) for r in fast.ops] == \
        [(r.op, r.module, r.phase, r.flops, r.saved_bytes, r.live_after_bytes) for r in full.ops]
    for path, stats in full.modules.items():
        got = fast.modules[path]
        assert (got.forward_flops, got.backward_flops, got.saved_bytes, got.param_bytes) == \
            (stats.forward_flops, stats.backward_flops, stats.saved_bytes, stats.param_bytes), path


def test_block_reuse_with_checkpointed_layers():
    model, inputs = _build("tiny-llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    fast, full = profile(model, inputs), profile(model, inputs, reuse_blocks=False)
    assert fast.reused_blocks
    assert fast.totals() | {"step_time_s": 0, "forward_time_s": 0, "backward_time_s": 0, "mfu": 0} == \
        full.totals() | {"step_time_s": 0, "forward_time_s": 0, "backward_time_s": 0, "mfu": 0}
