"""Profiler details on hand-built modules: attribution to modules in forward and backward, memory accounting,
errors, the model zoo and the CLI."""

import json
import pickle

import pytest
import torch
from torch import nn

from treadle.cli import main as cli_main
from treadle.errors import ProfileError
from treadle.models.zoo import load_model, named_model
from treadle.profile import HardwareSpec, ModelProfile, profile
from treadle.profile.memory import optimizer_state_bytes

B, D_IN, D_HID, D_OUT = 8, 16, 32, 4


@pytest.fixture(autouse=True, scope="module")
def _private_cpu_calibration_cache(tmp_path_factory):
    """profile() defaults to the calibrated cpu spec; keep its cache out of the user's home."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        yield


class MLP(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.up = nn.Linear(D_IN, D_HID, dtype=dtype)
        self.act = nn.GELU()
        self.down = nn.Linear(D_HID, D_OUT, bias=False, dtype=dtype)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class Net(nn.Module):
    def __init__(self, n_blocks=5, dtype=torch.float32):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D_IN, D_IN, dtype=dtype), nn.ReLU())
                                    for _ in range(n_blocks))
        self.head = MLP(dtype)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x).sum()


def test_flops_and_saved_bytes_are_attributed_to_modules():
    net = Net()
    x = torch.randn(B, D_IN)
    prof = profile(net, (x,))
    up, down = prof.modules["head.up"], prof.modules["head.down"]
    assert up.forward_flops == 2 * B * D_IN * D_HID and down.forward_flops == 2 * B * D_HID * D_OUT
    # backward: grad of input and of weight for each linear
    assert up.backward_flops == 2 * up.forward_flops and down.backward_flops == 2 * down.forward_flops
    # the first block's input needs no gradient: only its weight gradient is computed
    first = prof.modules["blocks.0.0"]
    assert first.forward_flops == 2 * B * D_IN * D_IN and first.backward_flops == first.forward_flops
    assert prof.modules[""].forward_flops == prof.forward_flops == 5 * 2 * B * D_IN * D_IN + up.forward_flops + \
        down.forward_flops
    # GELU saves its input (the output of up, fp32), down saves its input (GELU's output)
    assert up.saved_bytes == B * D_HID * 4 and prof.modules["head.act"].saved_bytes == B * D_HID * 4
    # parameters per module, inclusive
    assert prof.modules["head"].n_params == D_IN * D_HID + D_HID + D_HID * D_OUT
    assert prof.modules[""].param_bytes == prof.param_bytes == 4 * sum(p.numel() for p in net.parameters())
    # the profiled model is untouched: no gradients, real parameters
    assert all(p.grad is None and not isinstance(p, torch._subclasses.FakeTensor) for p in net.parameters())


def test_block_reuse_on_a_user_model_and_forward_only():
    net, x = Net(n_blocks=6), torch.randn(B, D_IN)
    fast, full = profile(net, (x,)), profile(net, (x,), reuse_blocks=False)
    assert fast.reused_blocks == [{"container": "blocks", "first": "blocks.0", "last": "blocks.5", "count": 6,
                                   "template": "blocks.1"}]
    assert {r.module.split(".")[1] for r in fast.ops if r.module.startswith("blocks.")} == set("012345")
    assert [(r.op, r.module, r.live_after_bytes) for r in fast.ops] == \
        [(r.op, r.module, r.live_after_bytes) for r in full.ops]
    fwd = profile(net, (x,), train=False)
    assert fwd.backward_flops == 0 and fwd.saved_bytes == 0 and fwd.grad_bytes == 0
    assert fwd.forward_flops == full.forward_flops and all(r.phase == "forward" for r in fwd.ops)


class IndexedBlock(nn.Module):
    def __init__(self, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx  # numbering attributes do not split a run of identical blocks
        self.lin = nn.Linear(D_IN, D_IN)

    def forward(self, x):
        x = self.lin(x)
        return x @ x.T @ x if self.layer_idx == 5 else x  # ... but this block behaves differently


class IndexedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(IndexedBlock(i) for i in range(6))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_progress_reports_stages_in_order():
    seen = []
    model, inputs = named_model("tiny-gpt2", batch=2, seq=16)
    profile(model, inputs, progress=lambda stage, frac: seen.append((stage, frac)))
    stages = [s for s, _ in seen]
    assert stages[0] == "blocks" and stages[-1] == "done" and "forward" in stages and "aggregate" in stages
    assert all(0.0 <= f <= 1.0 for _, f in seen)
    assert stages.index("forward") < stages.index("aggregate")


def test_position_dependent_blocks_fall_back_to_the_full_profile(caplog):
    net, x = IndexedNet(), torch.randn(B, D_IN)
    fast, full = profile(net, (x,)), profile(net, (x,), reuse_blocks=False)
    assert fast.reused_blocks == [] and "does not run the ops" in caplog.text
    assert fast.total_flops == full.total_flops == 3 * (6 * 2 * B * D_IN * D_IN + 2 * 2 * B * B * D_IN) - \
        2 * B * D_IN * D_IN  # fwd + 2x bwd, less the first block's input gradient


def test_optimizer_state_bytes_fp32_and_mixed_precision():
    p32 = nn.Parameter(torch.zeros(10))
    p16 = nn.Parameter(torch.zeros(10, dtype=torch.bfloat16))
    assert optimizer_state_bytes(p32) == 2 * 4 * 10  # two fp32 moments
    assert optimizer_state_bytes(p16) == 3 * 4 * 10  # fp32 master + two fp32 moments
    assert optimizer_state_bytes(p16, master_weights=False) == 2 * 4 * 10
    assert optimizer_state_bytes(p32, optimizer="sgd") == 4 * 10
    assert optimizer_state_bytes(p32, optimizer="none") == 0
    frozen = nn.Parameter(torch.zeros(10), requires_grad=False)
    assert optimizer_state_bytes(frozen) == 0
    with pytest.raises(ProfileError, match="unknown optimizer 'lamb'; known"):
        optimizer_state_bytes(p32, optimizer="lamb")
    net = Net(dtype=torch.bfloat16)
    prof = profile(net, (torch.randn(B, D_IN, dtype=torch.bfloat16),), hardware="h100-sxm")
    n = sum(p.numel() for p in net.parameters())
    # ZeRO's 16 bytes per parameter for mixed-precision AdamW: 2 param + 2 grad + 12 optimizer
    assert (prof.param_bytes, prof.grad_bytes, prof.optimizer_state_bytes) == (2 * n, 2 * n, 12 * n)
    assert prof.dtype == "bfloat16" and prof.mfu > 0


def test_timeline_peak_and_roofline_time():
    net, x = Net(), torch.randn(B, D_IN)
    hw = HardwareSpec(name="toy", peak_flops_per_s={"float32": 1e9}, hbm_bytes_per_s=1e9, memory_bytes=2**30,
                      compute_efficiency=1.0, memory_efficiency=1.0)
    prof = profile(net, (x,), hardware=hw)
    peak_op = prof.ops[prof.peak_op_index]
    assert prof.activation_peak_bytes == max(r.live_after_bytes for r in prof.ops) == peak_op.live_after_bytes
    assert prof.peak_module == peak_op.module and prof.peak_phase == peak_op.phase
    assert prof.peak_bytes == prof.resident_bytes + prof.activation_peak_bytes
    mm = next(r for r in prof.ops if r.op == "aten.addmm.default" and r.module == "head.up")
    assert mm.time_s == pytest.approx(max(mm.flops, mm.read_bytes + mm.write_bytes) / 1e9)
    assert prof.step_time_s == pytest.approx(sum(r.time_s for r in prof.ops))
    assert prof.mfu == pytest.approx(prof.model_flops / prof.step_time_s / 1e9)
    # grads of every parameter are alive at the end of the step
    assert prof.ops[-1].live_after_bytes >= prof.grad_bytes


class SVDUser(nn.Module):
    def forward(self, x):
        return torch.linalg.svdvals(x).sum()


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.spectral = SVDUser()

    def forward(self, x):
        return self.spectral(self.proj(x))


def test_errors_name_the_op_and_module():
    with pytest.raises(ProfileError, match=r"no FLOP rule for op aten\._linalg_svd.*module 'spectral' during forward"):
        profile(Wrapper(), (torch.randn(4, 4),))
    with pytest.raises(ProfileError, match="cannot find a loss in the model output"):
        profile(_TupleOut(), (torch.randn(2, 4),))
    with pytest.raises(ProfileError, match=r"profiling failed at op aten\._local_scalar_dense\.default in "
                       r"module 'inner' during forward: DataDependent"):
        profile(_Holder(), (torch.randn(2, 4),))
    with pytest.raises(ProfileError, match="unknown optimizer 'adam8bit'"):
        profile(Net(), (torch.randn(B, D_IN),), optimizer="adam8bit")
    with pytest.raises(ProfileError, match="unknown hardware 'b200'"):
        profile(Net(), (torch.randn(B, D_IN),), hardware="b200")
    with pytest.raises(ProfileError, match="the loss does not require grad"):
        profile(Net().requires_grad_(False), (torch.randn(B, D_IN),))


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return y.sum() if bool(y.sum() > 0) else -y.sum()  # needs a value fake tensors do not have


class _Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = DataDependent()

    def forward(self, x):
        return self.inner(x)


class _TupleOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):  # no floating output: no default loss (treadle.loss.default_loss)
        return (self.lin(x).argmax(-1), x.long())


def test_zoo_configs_and_loader():
    model, inputs = named_model("gpt2", batch=1, seq=16, fake=True)
    assert isinstance(inputs["input_ids"], torch._subclasses.FakeTensor)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, as in the released model
    with pytest.raises(ProfileError, match="unknown model 'gpt5'; known: .*llama-2-70b"):
        named_model("gpt5", batch=1, seq=8)
    with pytest.raises(ProfileError, match="seq=2048 exceeds its 128 positions"):
        named_model("tiny-gpt2", batch=1, seq=2048)
    real, _ = named_model("tiny-llama", batch=1, seq=8)
    again = pickle.loads(pickle.dumps(real))  # ranks receive zoo models by pickle
    assert not again._forward_pre_hooks and not again._forward_hooks  # nothing installed (NOTE [eager masks])
    m, inp = load_model("test_profile_units:user_model", batch=3, seq=5)
    assert isinstance(m, Net) and inp[0].shape == (3, D_IN)
    with pytest.raises(ProfileError, match="cannot load 'nosuchpkg.mod:fn'"):
        load_model("nosuchpkg.mod:fn", batch=1, seq=1)
    with pytest.raises(ProfileError, match="must return \\(nn.Module, example_inputs\\)"):
        load_model("test_profile_units:not_a_model", batch=1, seq=1)


def user_model(batch, seq):
    return Net(), (torch.randn(batch, D_IN),)


def not_a_model(batch):
    return 3


# Parameter counts of the released checkpoints (Hugging Face model cards / config arithmetic); MLM heads for BERT.
PUBLISHED_PARAMS = {
    "gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080, "gpt2-xl": 1_557_611_200,
    "bert-base": 109_514_298, "bert-large": 335_174_458, "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320, "llama-2-70b": 68_976_648_192, "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496, "llama-3.1-405b": 405_853_388_800,
    "opt-1.3b": 1_315_758_080, "opt-6.7b": 6_658_473_984, "t5-base": 222_903_552,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_named_configs_have_the_published_sizes(name):
    model, inputs = named_model(name, batch=1, seq=8, fake=True, dtype=torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMS[name]
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert inputs["input_ids"].shape == (1, 8)


def test_cli_profile_writes_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the cpu calibration below caches here
    out = tmp_path / "p.json"
    rc = cli_main(["profile", "tiny-llama", "--batch", "2", "--seq", "16", "--hardware", "a100-80gb",
                   "--dtype", "float32", "--depth", "3", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "LlamaDecoderLayer" in printed and "0..3" in printed and "peak memory" in printed and "MFU" in printed
    doc = json.loads(out.read_text())
    back = ModelProfile.from_json(out.read_text())
    assert back.totals() == ModelProfile.from_dict(back.to_dict()).totals() == doc["totals"]
    assert [r.to_dict() for r in back.ops] == doc["ops"] and back.hardware.name == "a100-80gb"
    model, inputs = named_model("tiny-llama", batch=2, seq=16)
    ref = profile(model, inputs, hardware="a100-80gb")
    assert doc["totals"]["total_flops"] == ref.total_flops
    assert doc["totals"]["peak_bytes"] == ref.peak_bytes
    assert doc["hardware"]["name"] == "a100-80gb" and len(doc["ops"]) == len(ref.ops)
    assert {m["path"] for m in doc["modules"]} >= {"", "model.layers.3.mlp"}
    rc = cli_main(["profile", "no-such-model"])
    assert rc == 2 and "unknown model 'no-such-model'" in capsys.readouterr().err
    assert cli_main(["profile", "--list"]) == 0 and "llama-2-70b" in capsys.readouterr().out.split()
    assert cli_main(["profile", "test_profile_units:user_model", "--hardware", "cpu", "--batch", "3"]) == 0
    assert "head" in capsys.readouterr().out
