"""CNNs (treadle.models.cnn, a plain-PyTorch bottleneck / wide ResNet): the profiler against independent
references (FlopCounterMode, saved_tensors_hooks, a live-bytes tracker), the planner's plan verified against one
process on gloo, priced."""

from __future__ import annotations

import pytest
from test_profile import _real_peak_bytes, _real_saved_bytes
from torch.utils.flop_counter import FlopCounterMode

from treadle.models.cnn import resnet50, tiny_wide_resnet, wide_resnet50_2
from treadle.models.zoo import load_model
from treadle.profile import profile


@pytest.fixture(autouse=True, scope="module")
def _private_cpu_calibration_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        yield


def test_the_shapes_are_torchvisions():
    """Parameter counts of torchvision's resnet50 / wide_resnet50_2 (its model cards)."""
    assert sum(p.numel() for p in resnet50(fake=True)[0].parameters()) == 25_557_032
    assert sum(p.numel() for p in wide_resnet50_2(fake=True)[0].parameters()) == 68_883_240
    model, inputs = load_model("treadle.models.cnn:tiny_wide_resnet", batch=3, seq=999)  # seq: not an image size
    assert tuple(inputs["pixel_values"].shape) == (3, 3, 32, 32)
    out = model(**inputs)
    assert out.loss.dim() == 0 and tuple(out.logits.shape) == (3, 10)


def test_profile_counts_every_flop_saved_byte_and_the_peak_of_a_real_step():
    model, inputs = tiny_wide_resnet(batch=4)
    with FlopCounterMode(display=False) as fc:
        model(**inputs).loss.backward()
    model.zero_grad(set_to_none=True)
    prof = profile(model, inputs, hardware="a100-80gb", optimizer="adamw")
    assert prof.total_flops == fc.get_total_flops()
    assert sum(r.backward_flops for r in prof.ops) == prof.backward_flops
    kinds = {r.op: r.kind for r in prof.ops}
    assert kinds["aten.max_pool2d_with_indices.default"] == "reduction"
    assert prof.saved_bytes + prof.saved_input_bytes == pytest.approx(_real_saved_bytes(model, inputs), rel=0.02)
    assert prof.peak_bytes == pytest.approx(_real_peak_bytes(model, inputs), rel=0.05)


def test_a_wide_resnet_profiles_on_fake_tensors():
    """wide_resnet50_2 at ImageNet size, batch 32, on fake tensors: forward FLOPs as published for the shape
    (11.4 GMACs per image, torchvision's model card), backward about twice."""
    model, inputs = wide_resnet50_2(batch=32, fake=True)
    prof = profile(model, inputs, hardware="a100-80gb")
    per_image_gmacs = prof.forward_flops / 2 / 32 / 1e9
    assert per_image_gmacs == pytest.approx(11.4, rel=0.02)
    assert 1.8 < prof.backward_flops / prof.forward_flops < 2.0  # no input gradient for the images


def test_the_planner_does_not_split_the_batch_of_a_training_batch_norm():
    """NOTE [batch statistics]: data parallelism would normalise each replica by its own shard's statistics;
    the planner proposes none for a model with a training-mode batch norm, says why, and refuses it when asked."""
    from treadle import Mesh, PlanError
    from treadle.cost.cluster import ClusterSpec
    from treadle.planner import plan_model

    model, inputs = tiny_wide_resnet(batch=8)
    cluster = ClusterSpec.uniform(Mesh((2,), ("dp",)), "loopback")
    plan = plan_model(model, inputs, cluster=cluster)
    assert plan.solver["unknown_flops"] == {}  # conv2d, batch_norm, pooling as the capture sees them: all priced
    assert "data_parallel" not in plan.schedule.to_json()
    assert plan.solver["replicated"].startswith("data parallelism would change the batch statistics of 'bn1' and "
                                                "14 more batch norms (training mode; NOTE [batch statistics])")
    with pytest.raises(PlanError, match=r"data-parallel axis 'dp': 'bn1' normalises over the batch in training "
                                        r"mode, which data parallelism splits"):
        plan_model(model, inputs, cluster=cluster, dp_axis="dp")
    model.eval()  # running statistics: per-sample, the batch splits exactly
    assert "data_parallel" in plan_model(model, inputs, cluster=cluster, dp_axis="dp").schedule.to_json()


def _ddp_bn_rank(rank: int, world: int) -> str:
    import treadle
    from treadle import Mesh, create_schedule

    model, _ = tiny_wide_resnet(batch=4)
    sch = create_schedule(model, mesh=Mesh((2,), ("dp",)))
    sch.data_parallel(axis="dp")
    try:
        treadle.build(sch)
    except treadle.BuildError as exc:
        return str(exc)
    return ""


def test_build_refuses_data_parallelism_over_a_training_batch_norm():
    from treadle.testing import spawn

    got = spawn(_ddp_bn_rank, 2, timeout_s=120)
    assert got[0] == got[1] == (
        "data_parallel over dp (2 replicas): 'bn1' (BatchNorm2d) (and 14 more) normalises over the batch in training "
        "mode, and data parallelism splits the batch: each replica would use its own shard's statistics, not the "
        "model's. Convert the norms to torch.nn.SyncBatchNorm (GPU), put them in eval mode, or shard channels "
        "instead (tensor parallelism of the convolutions and norms)")


@pytest.mark.slow
def test_a_planned_channel_parallel_cnn_verifies_and_prices():
    """On a GPU preset the planner shards the wide 3x3 convolutions over output channels (their FLOPs counted as
    the capture sees them); the plan verifies against one process on 2 gloo ranks and prices as built."""
    from treadle import Mesh
    from treadle.cost.cluster import ClusterSpec
    from treadle.models.cnn import resnet
    from treadle.planner import plan_model
    from treadle.pricing import price
    from treadle.schedule.replay import load_schedule
    from treadle.verify import verify

    def make():
        return resnet((2, 2), width=4, batch=8, image=32, num_classes=10, base=32, fake=False)

    model, inputs = make()
    cluster = ClusterSpec.uniform(Mesh((2,), ("tp",)), "nvlink4", device="a100-80gb")
    plan = plan_model(model, inputs, cluster=cluster, checkpoint="none")
    lines = [r.to_python() for r in plan.schedule.records]
    assert any(".conv2'].shard('weight', dim=0, axis='tp')" in x for x in lines), lines
    report = verify(plan.schedule, inputs, timeout_s=300, raise_on_mismatch=False)
    assert report.ok, report.summary()
    fresh, fresh_inputs = make()
    p = price(load_schedule(fresh, plan.schedule.to_json()), fresh_inputs, cluster)
    assert p.step_s > 0 and p.peak_bytes > 0


def test_which_norms_normalise_over_the_batch():
    """NOTE [batch statistics]: training mode, or any mode without running statistics (as _BatchNorm decides);
    not SyncBatchNorm, not an eval-mode norm with running statistics."""
    from torch import nn

    from treadle.forms.data.facts import batch_statistics_modules

    m = nn.ModuleDict({"in_training": nn.BatchNorm2d(4), "in_eval": nn.BatchNorm2d(4).eval(),
                       "no_stats": nn.BatchNorm1d(4, track_running_stats=False).eval(),
                       "sync": nn.SyncBatchNorm(4)})
    assert batch_statistics_modules(m) == ["in_training", "no_stats"]
