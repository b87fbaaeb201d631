"""A pipeline built from a model made on the meta device (NOTE [pipeline on meta]): each rank materialises only the
modules its own stages run, with the values a whole materialisation gives (NOTE [what stays on meta]), the same
stage graphs, and the same step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import treadle
from treadle import Mesh, create_schedule
from treadle.models import megatron
from treadle.run.setup import parameters_on_meta
from treadle.runtime.materialize import materialize
from treadle.testing import spawn
from tiny_models import lm_inputs, tiny_gpt2, tiny_llama


# ------------------------------------------------------------------ which modules can stay on meta, exactly
class _Tied(nn.Module):
    """emb -> body -> head; head's weight is emb's; `mix` holds emb's weight and a parameter of its own, so its init
    (reset_parameters below) writes emb's weight too."""

    def __init__(self, mix: bool):
        super().__init__()
        self.emb = nn.Linear(6, 6, bias=False)
        self.body = nn.Linear(6, 6)
        self.head = nn.Linear(6, 6, bias=False)
        self.head.weight = self.emb.weight
        if mix:
            self.mix = _Mix(self.emb.weight)


class _Mix(nn.Module):
    def __init__(self, shared: nn.Parameter):
        super().__init__()
        self.shared = shared
        self.own = nn.Parameter(torch.empty(6))

    def reset_parameters(self) -> None:
        nn.init.normal_(self.shared)
        nn.init.normal_(self.own)


def _on_meta(mix: bool) -> nn.Module:
    with parameters_on_meta():
        return _Tied(mix)


@pytest.mark.parametrize("mix, keep, kept", [
    (False, {"body"}, {"body"}),
    (False, {"head"}, {"head"}),  # the head initialises nothing: emb's weight is emb's work
    (False, {"emb"}, set()),  # the head runs and reads emb's weight: emb comes back
    (False, {"emb", "head"}, {"emb", "head"}),
    (True, {"mix"}, set()),  # mix's init rewrites emb's weight, which emb and head hold
    (True, {"mix", "emb", "head", "body"}, {"mix", "emb", "head", "body"}),
])
def test_modules_stay_on_meta_only_where_no_materialised_value_depends_on_them(mix, keep, kept):
    whole = _on_meta(mix)
    materialize(whole, None, "cpu")
    part = _on_meta(mix)
    assert materialize(part, None, "cpu", keep_meta=keep) == kept
    want = dict(whole.named_parameters(remove_duplicate=False))
    holders: dict[int, list[str]] = {}
    for name, p in part.named_parameters(remove_duplicate=False):
        holders.setdefault(id(p), []).append(name.rpartition(".")[0])
    for name, p in part.named_parameters(remove_duplicate=False):
        if all(h in kept for h in holders[id(p)]):  # a kept module's alias of a materialised one is materialised
            assert p.is_meta, name
        else:
            assert not p.is_meta and torch.equal(p, want[name]), name
    assert part.head.weight is part.emb.weight  # still tied


# ------------------------------------------------------------------ a pipeline's rank materialises its own stages
BATCH, SEQ = 8, 16


def _inputs():
    return {**lm_inputs(BATCH, SEQ, seed=3), "use_cache": False}


def _case_model(case: dict, meta: bool) -> nn.Module:
    make = (lambda: tiny_llama(4)) if case["model"] == "llama" else (lambda: tiny_gpt2(4))
    with parameters_on_meta():
        model = make()
    if not meta:  # the reference: the same model materialised whole, before the schedule
        materialize(model, None, "cpu")
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _meta_rank(rank: int, world: int, case: dict) -> dict:
    out = {}
    for meta in (False, True):
        model = _case_model(case, meta)
        sch = create_schedule(model, mesh=Mesh(tuple(case["mesh"]), tuple(case["names"])))
        container = "model.layers" if case["model"] == "llama" else "transformer.h"
        if "tp" in case["names"]:
            megatron(sch, tp="tp", vocab_parallel_head=False)
        if "dp" in case["names"]:
            sch.data_parallel(axis="dp", shard=case.get("shard", False))
        for c in case["cuts"]:
            sch[f"{container}.{c}"].cut_pipeline_stage()
        sch.pipeline(axis="pp", schedule=case["schedule"], n_microbatches=case["mb"], example_inputs=_inputs())
        pipe = treadle.build(sch)
        params = pipe.param_dict()
        before = {n: _local(p) for n, p in params.items()}
        dp = sch.view().data_parallel
        inputs = _inputs()
        if dp is not None:  # this replica's rows
            i, n = dp.local_index(sch.mesh), dp.size(sch.mesh)
            inputs = {k: (v.chunk(n)[i] if torch.is_tensor(v) else v) for k, v in inputs.items()}
        loss = pipe.step(**inputs)
        out[meta] = {"loss": loss, "before": before, "graphs": [str(st.module.code) for st in pipe.stage_plans],
                     "grads": {n: _local(p.grad) for n, p in params.items() if p.grad is not None},
                     "real": sum(p.numel() for p in model.parameters() if not p.is_meta),
                     "all": sum(p.numel() for p in model.parameters()),
                     "local_meta": [n for n, p in params.items() if _local(p).is_meta]}
    return out


def assert_same_step(rank: int, got: dict, ref: dict) -> None:
    """The same loss, parameters before the step and gradients after it, bit for bit."""
    assert got["loss"] == ref["loss"], rank
    assert got["before"].keys() == ref["before"].keys() and got["grads"].keys() == ref["grads"].keys()
    for name, t in ref["before"].items():
        assert torch.equal(got["before"][name], t), f"rank {rank}: {name}"
    for name, g in ref["grads"].items():
        assert torch.equal(got["grads"][name], g), f"rank {rank}: grad of {name}"


CASES = [
    pytest.param({"model": "llama", "mesh": (2, 2), "names": ("pp", "tp"), "cuts": [1], "schedule": "1f1b", "mb": 2},
                 id="llama-pp2xtp2-1f1b"),
    pytest.param({"model": "gpt2", "mesh": (2, 2), "names": ("pp", "dp"), "cuts": [1], "schedule": "gpipe", "mb": 2,
                  "shard": True}, id="gpt2-tied-pp2xfsdp2-gpipe"),
    pytest.param({"model": "gpt2", "mesh": (2,), "names": ("pp",), "cuts": [0, 1, 2], "schedule": "interleaved_1f1b",
                  "mb": 2}, id="gpt2-tied-4stages-interleaved"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES)
def test_a_pipeline_rank_materialises_only_its_stages_with_the_whole_models_values(case):
    world = 1
    for n in case["mesh"]:
        world *= n
    results = spawn(_meta_rank, world, case, timeout_s=240)
    for rank, res in enumerate(results):
        ref, got = res[False], res[True]
        assert got["graphs"] == ref["graphs"], f"rank {rank}: the stage graphs differ"
        assert not got["local_meta"], f"rank {rank}: its own stages hold meta parameters {got['local_meta']}"
        assert ref["real"] == ref["all"]
        assert got["real"] < got["all"], f"rank {rank}: materialised the whole model"
        assert_same_step(rank, got, ref)
