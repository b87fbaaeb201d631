"""Slapo parity, tracing: any child name (``self`` as in BERT's ``BertAttention.self``, Python keywords), the
root module traceable, and a pipeline stage that ends in a gathered tensor-parallel output (pp x tp on gloo)."""

import torch
import torch.nn.functional as F
from torch import nn

import treadle
from treadle import Mesh, Replicate, create_schedule
from treadle.runtime.params import local_slice
from treadle.testing import spawn

MESH1 = Mesh((1,), ("tp",))


class OddNames(nn.Module):
    """Children named like BERT's attention (`self`) and like Python keywords."""

    def __init__(self):
        super().__init__()
        self.add_module("self", nn.Linear(8, 8))
        self.add_module("lambda", nn.Linear(8, 8))
        self.add_module("class", nn.LayerNorm(8))
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        h = getattr(self, "lambda")(self.self(x))
        return self.out(getattr(self, "class")(h) + x)


class Root(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.attention = OddNames()
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(F.gelu(self.attention(x)))


def _x():
    return torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1))


def test_trace_children_named_self_and_python_keywords():
    ref = Root()(_x())
    for method in ("fx", "export"):
        sch = create_schedule(Root(), mesh=MESH1)
        kw = {"example_inputs": {"x": _x()}} if method == "export" else {}
        sch["attention"].trace(method=method, **kw)
        targets = [n.target for n in sch["attention"].graph.nodes if n.op == "call_module"]
        assert targets == ["self", "lambda", "class", "out"], targets
        assert sch["attention.self"].mod is sch.model.attention.self  # still a sub-schedule by its own name
        torch.testing.assert_close(sch.model(_x()), ref)
    treadle.verify(sch, {"x": _x()})


def test_the_root_module_traces_and_verifies():
    sch = create_schedule(Root(), mesh=Mesh((2,), ("tp",)))
    sch.trace(flatten=False)
    assert isinstance(sch.model, torch.fx.GraphModule) and sch.mod is sch.model
    assert [n.target for n in sch.graph.nodes if n.op == "call_module"] == ["attention", "head"]
    sch["head"].shard(["weight", "bias"], dim=0, axis="tp").sync("fwd_post", to=Replicate(), axis="tp")
    (m,) = sch.find_pattern(lambda x: F.gelu(x))
    assert m.nodes
    treadle.verify(sch, {"x": _x()})
    again = treadle.load_schedule(Root(), sch.to_json())  # replays: the root trace is in the log
    assert isinstance(again.model, torch.fx.GraphModule)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.fc(x)) + x


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.h = nn.ModuleList([Block() for _ in range(2)])

    def forward(self, x, labels):
        for b in self.h:
            x = b(x)
        return ((x - labels) ** 2).mean()


def _stack_inputs():
    g = torch.Generator().manual_seed(2)
    return {"x": torch.randn(4, 3, 8, generator=g), "labels": torch.randn(4, 3, 8, generator=g)}


def _pp_tp(rank, world):
    mesh = Mesh((2, 2), ("pp", "tp"))
    sch = create_schedule(Stack(), mesh=mesh)
    for i in range(2):  # column-parallel, gathered at the block's end: the stage sends the gather's result
        sch[f"h.{i}.fc"].shard(["weight", "bias"], dim=0, axis="tp").sync("fwd_post", to=Replicate(), axis="tp")
    sch["h.0"].cut_pipeline_stage()
    sch.pipeline(axis="pp", schedule="gpipe", n_microbatches=2, example_inputs=_stack_inputs())
    pipe = treadle.build(sch)
    loss = pipe.step(**_stack_inputs())
    grads = {n: p.grad for n, p in pipe.param_dict().items()}
    return loss, grads, mesh.coordinate(rank), {n: sch._state.param_shards.get(id(p)) for n, p in pipe.param_dict().items()}


def test_pipeline_with_tensor_parallel_gathered_stage_output():
    ref_model = Stack()
    loss_ref = ref_model(**_stack_inputs())
    loss_ref.backward()
    ref = {n: p.grad for n, p in ref_model.named_parameters()}
    for loss, grads, coords, shards in spawn(_pp_tp, 4, timeout_s=240):
        assert abs(loss - float(loss_ref.detach())) < 1e-5
        assert grads
        for name, g in grads.items():
            expect = local_slice(ref[name], shards[name], coords, {"pp": 2, "tp": 2}) if shards[name] else ref[name]
            torch.testing.assert_close(g, expect, atol=1e-5, rtol=1e-5, msg=name)
