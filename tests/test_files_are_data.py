"""Files are data (NOTE [files are data] in treadle.schedule.gate): a schedule, plan or run-config file names
code only through the gate. Every known bypass is refused with a one-line TreadleError naming the file, the
record and the name, through `load_schedule`, `Plan.from_json(...).schedule_for`, the CLIs and `load_toml`;
seeded random mutations of real schedule and plan files, huge and deeply nested JSON and absurd sizes either
load as data or are refused the same way; legit files (every recipe, the planner's output, graph-level
primitives, a program's own schedule sent to its ranks) still load. A marker file that each payload would
create is checked after every test: nothing ran."""

from __future__ import annotations

import base64
import copy
import json
import math
import pickle
import random
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import treadle
from slapo_models import Net
from tiny_models import lm_inputs, tiny_bert, tiny_gpt2, tiny_llama
from treadle import Mesh, create_schedule, load_schedule
from treadle.errors import PlanError, ScheduleError, TreadleError
from treadle.planner.plan import Plan
from treadle.planner.to_schedule import Decision, apply_decisions
from treadle.schedule import gate
from treadle.schedule.replay import trusted_load_args
from treadle.schedule.log import ref_targets

TP2 = Mesh((2,), ("tp",))


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return self.b(self.a(x))


@pytest.fixture
def marker(tmp_path):
    """The file every payload would create; it must not exist after the test."""
    path = tmp_path / "marker"
    yield path
    assert not path.exists(), "a file ran code: the marker was written"


def _fill(v, m):
    """Replace "{m}" in a payload's strings by the marker's path."""
    if isinstance(v, str):
        return v.replace("{m}", str(m))
    if isinstance(v, list):
        return [_fill(x, m) for x in v]
    if isinstance(v, dict):
        return {k: _fill(x, m) for k, x in v.items()}
    return v


def _schedule(records, mesh=None) -> str:
    return json.dumps({"format": "treadle.schedule/1", "mesh": mesh or {"shape": [2], "names": ["tp"]},
                       "records": records})


# ------------------------------------------------------------------------------------------ the bypasses
# every name the issue found loading (and a few more), with the payload that would write the marker
ATTACKS: dict[str, dict] = {
    "treadle.run.loop:os.system": {"command": "touch {m}"},
    "treadle.testing:os.system": {"command": "touch {m}"},
    "treadle.run.cli:subprocess.call": {"args": ["touch", "{m}"]},
    "treadle.schedule.log:importlib.import_module": {"name": "this"},
    "treadle.schedule.log:torch.load": {"f": "{m}", "weights_only": False},
    "treadle.schedule.log:io.open": {"file": "{m}", "mode": "w"},
    "treadle.schedule.log:sys.modules.os.system": {"command": "touch {m}"},
    "treadle.schedule.log:register_ref.__globals__": {},
    "treadle.schedule.log:__builtins__.eval": {"source": "open('{m}', 'w')"},
    "treadle.errors:TreadleError.__base__.__base__.__base__.__subclasses__": {},
    "treadle.schedule.log:__loader__.load_module": {"fullname": "os"},
    "treadle.nonexistent_xyz:run": {},
    "os:system": {"command": "touch {m}"},
    "builtins:open": {"file": "{m}", "mode": "w"},
    "subprocess:run": {"args": ["touch", "{m}"]},
    "pathlib:Path.touch": {"self": "{m}"},
    "treadle.schedule.gate:register": {"target": "os:system", "obj": None},
    "treadle:register_ref": {"obj": None},
    "treadle.runtime.losses:torch.save": {"obj": 1, "f": "{m}"},
    "treadle.runtime.losses:VocabParallelLoss.bind": {},
    "treadle.runtime.losses:VocabParallelLoss.__init__.__globals__": {},
    "treadle.models.kernels:sdpa_gpt2_attention.__globals__": {},
    "treadle.models.kernels:GPT2SdpaAttention": {},  # a treadle class, but not exported for files
    "__main__:os.system": {"command": "touch {m}"},
    "torch.nn.modules.linear:Linear": {"in_features": 1, "out_features": 1},  # a class: never a callable
}
# nn.Module classes of imported modules: fine as replace_all's module_type (a class a file may name)
_MODULE_CLASSES = {"treadle.models.kernels:GPT2SdpaAttention", "torch.nn.modules.linear:Linear"}
BAD_NAMES = [5, None, ["os:system"], {"ref": "os:system"}, "", ":", "os", "os:", ":system", "a" * 5000,
             "os:system\n", "os :system", "os:system()", "os:sys tem", "../../x:y"]


def _records_naming(target, kwargs) -> dict[str, list]:
    """The records of a schedule file that name `target`: as a set_attr value, a replace factory, a
    replace_all factory, a class (replace_all's module_type) and a Ref nested in an exported Ref's kwargs."""
    ref = {"ref": target, "kwargs": kwargs}
    return {
        "set_attr value": [{"op": "set_attr", "path": "", "args": {"*": "loss_function", "value": ref}}],
        "replace factory": [{"op": "replace", "path": "a", "args": {"new": ref}}],
        "replace_all factory": [{"op": "replace_all", "path": "", "args": {
            "module_type": {"type": "torch.nn.modules.linear:Linear"}, "factory": {"ref": target, "kwargs": {}}}}],
        "replace_all module_type": [{"op": "replace_all", "path": "", "args": {
            "module_type": {"type": target}, "factory": {"ref": "treadle.models.kernels:sdpa_gpt2_attention"}}}],
        "nested in an exported Ref": [{"op": "set_attr", "path": "", "args": {"*": "loss_function", "value": {
            "ref": "treadle.runtime.losses:VocabParallelLoss", "kwargs": {"axis": ref}}}}],
    }


def _assert_named_refusal(exc: BaseException, *, source: str, record: str, target) -> None:
    msg = str(exc)
    assert isinstance(exc, TreadleError), repr(exc)
    assert "\n" not in msg, msg
    assert msg.startswith(source) and record in msg, msg
    if isinstance(target, str) and 0 < len(target) <= 200 and "\n" not in target:
        assert repr(target) in msg, msg


@pytest.mark.parametrize("target,how", [(t, h) for t in list(ATTACKS) + BAD_NAMES for h in _records_naming("x:y", {})
                                        if not (h == "replace_all module_type" and isinstance(t, str)
                                                and t in _MODULE_CLASSES)],
                         ids=lambda v: repr(v)[:60])
def test_a_schedule_file_naming_code_is_refused(target, how, marker):
    had_this = "this" in sys.modules
    kwargs = _fill(ATTACKS.get(target, {}) if isinstance(target, str) else {}, marker)
    text = _schedule(_records_naming(target, kwargs)[how])
    with pytest.raises(ScheduleError) as info:
        load_schedule(Two(), text, source="attack.json")
    _assert_named_refusal(info.value, source="attack.json", record="record 0", target=target)
    assert had_this or "this" not in sys.modules  # nothing imported


def _plan_doc(decisions, schedule=None, model=None) -> dict:
    """A minimal plan document on a 2-rank tp mesh."""
    return {"format": "treadle.plan/1", "model": model or {"name": "tiny-gpt2", "batch": 4, "seq": 16},
            "cluster": {"mesh": {"shape": [2], "names": ["tp"]},
                        "links": [{"latency_s": 1e-6, "bandwidth_bytes_per_s": 1e9}], "device": "cpu"},
            "roles": "tp", "mode": "train", "budget_bytes": None, "decisions": decisions,
            "estimate": {"step_s": 1.0, "peak_bytes": 1.0, "mfu": 0.1, "compute_s": 1.0, "comm_s": 0.0,
                         "recompute_s": 0.0, "static_bytes": 1.0, "activation_bytes": 0.0, "transient_bytes": 0.0},
            "rows": [], "binding": "", "solver": {}, "unknown_ops": {}, "price": None,
            "schedule": json.loads(schedule or _schedule([]))}


@pytest.mark.parametrize("target", list(ATTACKS) + BAD_NAMES, ids=lambda t: repr(t)[:60])
def test_a_plan_decision_naming_code_is_refused(target, marker):
    kwargs = _fill(ATTACKS.get(target, {}) if isinstance(target, str) else {}, marker)
    d = {"op": "set_attr", "path": "", "args": {"name": "loss_function", "ref": target, "kwargs": kwargs}}
    text = json.dumps(_plan_doc([d]))
    with pytest.raises(PlanError) as info:
        Plan.from_json(text, source="plan.json").schedule_for(Two())
    _assert_named_refusal(info.value, source="plan.json", record="decision 0", target=target)
    # a decision made in code (not read by from_dict) passes the same gate when applied
    if isinstance(target, str) and ":" in target:
        with pytest.raises(PlanError, match="not allowed|not a 'package.module:QualName'|cannot be called"):
            apply_decisions(create_schedule(Two(), mesh=TP2), [Decision("set_attr", "", d["args"])],
                            leaf_module=lambda p: False)


def test_the_cli_refuses_plan_and_schedule_files_that_name_code(tmp_path, marker, capsys):
    """`treadle verify plan.json` ran a plan's command before; now each file is refused before any process
    starts (exit 2, one line naming the file and the name)."""
    from treadle.cli import main

    attack = {"ref": "treadle.run.loop:os.system", "kwargs": {"command": f"touch {marker}"}}
    set_attack = [{"op": "set_attr", "path": "", "args": {"*": "loss_function", "value": attack}}]
    decision = {"op": "set_attr", "path": "", "args": {"name": "loss_function", "ref": "os:system",
                                                       "kwargs": {"command": f"touch {marker}"}}}
    files = {
        "decisions.json": _plan_doc([decision]),
        "plan_schedule.json": _plan_doc([], schedule=_schedule(set_attack)),
        "plan_model.json": _plan_doc([], model={"name": "treadle.run.loop:os.system", "batch": 1, "seq": 1}),
        "schedule.json": json.loads(_schedule(set_attack)),
        "deep.json": None,
    }
    for name, doc in files.items():
        path = tmp_path / name
        path.write_text("[" * 100_000 + "]" * 100_000 if doc is None else json.dumps(doc))
        for argv in (["verify", str(path), "--model", "tiny-gpt2"] if "model" not in name else ["verify", str(path)],
                     ["price", str(path), "--cluster", "2:cpu"] + ([] if name != "schedule.json" else
                                                                  ["--model", "tiny-gpt2"])):
            assert main(argv) == 2, argv
            out = capsys.readouterr()
            err = (out.err + out.out).strip()
            if argv[0] == "verify":
                assert err.startswith(f"treadle verify: error: {path}") and len(err.splitlines()) == 1, (argv, err)
            else:  # rich may wrap the line at the console's width
                assert "".join(str(path).split()) in "".join(err.split()), (argv, err)


def test_a_run_config_names_only_a_zoo_model_a_hf_config_or_a_registered_function(tmp_path, marker):
    from treadle.run.config import RunError, load_toml

    def toml(model: str):
        p = tmp_path / "run.toml"
        p.write_text(f"model = {json.dumps(model)}\n")
        return str(p)

    for bad in ("treadle.run.loop:os.system", "os:system", "tests.tiny_models:tiny_gpt2", "no-such-model",
                str(tmp_path / "nothing-here")):
        with pytest.raises(RunError, match="model") as info:
            load_toml(toml(bad))
        assert str(tmp_path / "run.toml") in str(info.value) and "\n" not in str(info.value)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert load_toml(toml("tiny-llama"))["model"] == "tiny-llama"
    assert load_toml(toml(str(hf)))["model"] == str(hf)
    target = treadle.Ref.of(registered_model).target
    with pytest.raises(RunError, match="register_ref"):
        load_toml(toml(target))
    treadle.register_ref(registered_model)
    try:
        assert load_toml(toml(target))["model"] == target
    finally:
        gate.unregister(target)


def registered_model(batch: int = 1, seq: int = 8):
    return tiny_gpt2(1), lm_inputs(batch, seq)


class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


_SDPA = "treadle.models.kernels:sdpa_gpt2_attention"


def test_classes_pickles_and_primitives_a_file_may_not_use(marker):
    pickled = base64.b64encode(pickle.dumps(_Evil(str(marker)))).decode()
    cases = {
        "pickle": ([{"op": "replace", "path": "a", "args": {"new": {"module_pickle": pickled, "class": "Linear"}}}],
                   "unpickling runs code"),
        "a class that is no nn.Module": ([{"op": "replace_all", "path": "", "args": {
            "module_type": {"type": "subprocess:Popen"}, "factory": {"ref": _SDPA}}}],
            "not a class of an imported module"),
        "a re-exported class": ([{"op": "replace_all", "path": "", "args": {
            "module_type": {"type": "torch.nn:Linear"}, "factory": {"ref": _SDPA}}}],
            "not a class of an imported module"),
        "a module never imported": ([{"op": "replace_all", "path": "", "args": {
            "module_type": {"type": "antigravity:Fly"}, "factory": {"ref": _SDPA}}}],
            "not a class of an imported module"),
        "a class where a factory goes": ([{"op": "replace", "path": "a", "args": {
            "new": {"type": "torch.nn.modules.container:Sequential"}}}], "where no class is expected"),
        "a class as a set_attr value": ([{"op": "set_attr", "path": "", "args": {
            "*": "loss_function", "value": {"type": "torch.nn.modules.linear:Linear"}}}], "where no class is expected"),
        "a method as a type": ([{"op": "replace_all", "path": "", "args": {
            "module_type": {"type": "torch.nn.modules.linear:Linear.forward"},
            "factory": {"ref": "treadle.models.kernels:sdpa_gpt2_attention"}}}], "not a class of an imported module"),
        "a dunder set_attr": ([{"op": "set_attr", "path": "a", "args": {"*": "__class__", "value": 1}}],
                              "not a dunder"),
        "a dunder shard_attr": ([{"op": "shard_attr", "path": "a", "args": {"*": "__dict__", "axis": "tp"}}],
                                "not a dunder"),
        "an exported loss as a replace factory": ([{"op": "replace", "path": "a", "args": {
            "new": {"ref": "treadle.runtime.losses:VocabParallelLoss"}}}], "cannot be called"),
        "an exported factory on the wrong module": ([{"op": "replace", "path": "a", "args": {
            "new": {"ref": "treadle.models.kernels:sdpa_gpt2_attention"}}}], "lacks"),
        "an exported loss with a wrong keyword": ([{"op": "set_attr", "path": "", "args": {"*": "loss_function",
            "value": {"ref": "treadle.runtime.losses:VocabParallelLoss", "kwargs": {"command": "x"}}}}],
            "cannot be called"),
        "an exported factory as a set_attr Ref": ([{"op": "set_attr", "path": "", "args": {"*": "loss_function",
            "value": {"ref": "treadle.models.kernels:sdpa_gpt2_attention"}}}], "cannot be called"),
        "an op that is no primitive": ([{"op": "to_json", "path": "", "args": {}}], "unknown primitive"),
        "a private op": ([{"op": "_record", "path": "", "args": {"*": "x"}}], "unknown primitive"),
        "a dunder op": ([{"op": "__init__", "path": "", "args": {}}], "unknown primitive"),
        "an op name walk": ([{"op": "mod.__class__", "path": "", "args": {}}], "unknown primitive"),
        "torch.ops walk": ([{"op": "checkpoint_selective", "path": "a", "args": {"save": ["load_library.x"]}}],
                           "unknown ops"),
        "torch.ops dunder": ([{"op": "checkpoint_selective", "path": "a", "args": {"save": ["__class__.mro"]}}],
                             "unknown ops"),
        "a dtype that is a function": ([{"op": "trace", "path": "a", "args": {"example_inputs": {"dict": {
            "x": {"dict": {"shape": [2, 8], "dtype": "load"}}}}, "method": "export"}}], "not a torch dtype"),
        "an example input of 10^12 elements": ([{"op": "trace", "path": "a", "args": {"example_inputs": {"dict": {
            "x": {"dict": {"shape": [10**6, 10**6], "dtype": "int64"}}}}, "method": "export"}}], "elements"),
        "a replace with no factory": ([{"op": "replace", "path": "a", "args": {"new": "os:system"}}],
                                      "needs new= a factory Ref"),
        "a bad Partial": ([{"op": "sync", "path": "a", "args": {"*": "fwd_post", "to": {
            "placement": "Partial", "reduce_op": "os.system"}, "axis": "tp"}}], "reduce_op"),
    }
    for name, (records, fragment) in cases.items():
        with pytest.raises(ScheduleError) as info:
            load_schedule(Two(), _schedule(records), source="attack.json")
        msg = str(info.value)
        assert fragment in msg and "attack.json" in msg and "record 0" in msg, (name, msg)
        assert "\n" not in msg, (name, msg)
    assert "antigravity" not in sys.modules


# ------------------------------------------------------------------------------------------ legit files
def test_selective_checkpoint_op_names_resolve_private_aten_ops_but_no_dunder():
    """The op-level SAC policy of the bench's torchtitan recipe saves aten._scaled_dot_product_* outputs: a
    private op is an op (only a dunder is refused, as above)."""
    from treadle.schedule.checkpoint_policies import resolve_ops

    ops = resolve_ops(["aten.mm", "aten._scaled_dot_product_flash_attention_for_cpu"], "test")
    assert [o._qualified_op_name for o in ops] == ["aten::mm", "aten::_scaled_dot_product_flash_attention_for_cpu"]
    with pytest.raises(ScheduleError, match="unknown ops"):
        resolve_ops(["aten.__class__"], "test")


def test_every_exported_name_is_what_it_says():
    for target in gate.FILE_EXPORTS:
        obj = gate.resolve_callable(target, where="test")
        assert f"{obj.__module__}:{obj.__qualname__}" == target and callable(obj)


def _recipes() -> dict[str, treadle.Schedule]:
    from treadle.models import kernel_schedule, megatron

    out = {}
    for name, make in (("gpt2", tiny_gpt2), ("llama", tiny_llama), ("bert", tiny_bert)):
        sch = create_schedule(make(1), mesh=Mesh((2, 2), ("dp", "tp")))
        out[f"megatron {name}"] = megatron(sch, tp="tp", dp="dp", sequence_parallel=name != "bert",
                                           checkpoint_fraction=1.0)
    for name, make in (("gpt2", tiny_gpt2), ("llama", tiny_llama)):
        sch = create_schedule(make(1), mesh=Mesh((1,), ("tp",)))
        out[f"kernels {name}"] = kernel_schedule(sch, example_inputs={**lm_inputs(2, 8), "use_cache": False},
                                                 compiler="aot_eager")
    return out


MAKERS = {"gpt2": tiny_gpt2, "llama": tiny_llama, "bert": tiny_bert}


def test_every_recipe_loads_from_its_file_with_no_allow_list():
    """What treadle writes, it exports: a recipe's file loads with no register_ref and no allow_refs."""
    for name, sch in _recipes().items():
        text = sch.to_json()
        assert ref_targets(sch.records) <= set(gate.FILE_EXPORTS), name
        again = load_schedule(MAKERS[name.split()[1]](1), text, source=f"{name}.json")
        assert again.to_json() == text, name


@pytest.fixture(scope="module")
def vocab_plan() -> Plan:
    """A real plan whose decisions hold the vocab-parallel loss (GPT-2, vocab 1024, a slow link, tp=2)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from treadle.cost.cluster import ClusterSpec
    from treadle.cost.links import LinkSpec
    from treadle.planner import plan_model

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=1024, n_positions=64, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, use_cache=False,
                     loss_type="ForCausalLM")
    ids = torch.randint(1, 1024, (8, 32), generator=torch.Generator().manual_seed(1))
    cluster = ClusterSpec.uniform(Mesh((2,), ("tp",)), LinkSpec(latency_s=1e-6, bandwidth_bytes_per_s=2e9),
                                  device="cpu")
    plan = plan_model(GPT2LMHeadModel(cfg).train(), {"input_ids": ids, "labels": ids.clone()}, cluster=cluster,
                      dp_axis=None, price_top=0)
    return plan


@pytest.fixture(scope="module")
def gpt2_1024():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=1024, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0, use_cache=False, loss_type="ForCausalLM")).train()


def test_the_planners_output_with_its_vocab_parallel_loss_loads(vocab_plan, gpt2_1024):
    from treadle.runtime.losses import VocabParallelLoss

    back = Plan.from_json(vocab_plan.to_json(), source="plan.json")
    assert back.decisions == vocab_plan.decisions
    (rec,) = [r for r in back.schedule_for(copy.deepcopy(gpt2_1024)).records if r.op == "set_attr"]
    assert rec.args["value"].load() is VocabParallelLoss
    again = load_schedule(copy.deepcopy(gpt2_1024), json.dumps(json.loads(vocab_plan.to_json())["schedule"]))
    assert [r.op for r in again.records] == [r.op for r in vocab_plan.schedule.records]


def bias_gelu(x, bias):
    return F.gelu(x + bias)


def fused_bias_gelu(x, bias):
    return F.gelu(x + bias)


def scaled_linear(old: nn.Module, *, scale: float = 1.0) -> nn.Module:
    return nn.Sequential(old, nn.Identity()) if scale == 1.0 else old


def make_tag(*, label: str = "t") -> str:
    return label


def test_graph_primitives_with_registered_factories_round_trip():
    sch = create_schedule(Net(), mesh=Mesh((1,), ("tp",)))
    sch["mlp"].trace()
    sch["mlp.fc1"].decompose()
    (m,) = sch["mlp"].find_pattern(bias_gelu)
    sch["mlp"].replace_match(fused_bias_gelu, m)
    text = sch.to_json()
    with pytest.raises(ScheduleError, match="fused_bias_gelu"):
        load_schedule(Net(), text, source="graph.json")
    treadle.register_ref(fused_bias_gelu)
    try:
        again = load_schedule(Net(), text, source="graph.json")
        assert [r.op for r in again.records] == ["trace", "decompose", "replace_match"]
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(again.model(x), sch.model(x))
    finally:
        gate.unregister(treadle.Ref.of(fused_bias_gelu).target)
    fused = create_schedule(Net(), mesh=Mesh((1,), ("tp",)))
    fused["mlp"].trace()
    fused["mlp.fc1"].decompose()
    fused["mlp"].fuse(fused["mlp"].find_pattern(bias_gelu)[0], compiler="aot_eager")
    assert [r.op for r in load_schedule(Net(), fused.to_json()).records] == ["trace", "decompose", "fuse"]


def test_a_programs_own_schedule_reaches_its_ranks_and_classes_of_imported_modules_load():
    """`trusted_load_args`: the names a program's code recorded resolve on its ranks, and only those."""
    sch = create_schedule(Two(), mesh=TP2)
    sch.replace_all(nn.Linear, scaled_linear, scale=2.0)
    sch.set_attr("tag", treadle.Ref(treadle.Ref.of(make_tag).target, label="x"))
    sch["b"].replace(nn.Linear(8, 8))
    text = sch.to_json()
    with pytest.raises(ScheduleError, match="scaled_linear"):
        load_schedule(Two(), text)
    with pytest.raises(ScheduleError, match="cannot be called"):  # set_attr's Ref is called at build: checked now
        bad = json.loads(text)
        bad["records"][1]["args"]["value"]["kwargs"] = {"colour": "x"}
        load_schedule(Two(), json.dumps(bad), **trusted_load_args(sch))
    again = load_schedule(Two(), text, **trusted_load_args(sch))
    assert [r.op for r in again.records] == ["replace_all", "set_attr", "replace"]
    assert again.records[0].args["module_type"] is nn.Linear  # a class of an imported module, by exact name
    attack = json.loads(text)
    attack["records"][1]["args"]["value"]["ref"] = "treadle.run.loop:os.system"
    with pytest.raises(ScheduleError, match="os.system"):
        load_schedule(Two(), json.dumps(attack), **trusted_load_args(sch))
    with pytest.raises(ScheduleError, match="pickled module"):  # the module instance needs allow_pickle
        load_schedule(Two(), text, allow_refs=trusted_load_args(sch)["allow_refs"])


# ------------------------------------------------------------------------------------------ huge, deep, absurd
def test_huge_and_deeply_nested_files_are_refused_or_load_as_data():
    deep = {"list": "[" * 100_000 + "]" * 100_000, "dict": '{"a":' * 100_000 + "1" + "}" * 100_000}
    for kind, text in deep.items():
        with pytest.raises(ScheduleError, match="nested"):
            load_schedule(Two(), text, source="deep.json")
        with pytest.raises(PlanError, match="nested"):
            Plan.from_json(text, source="deep.json")
    value = 1
    for _ in range(70):  # valid JSON, deeper than any treadle file
        value = [value]
    with pytest.raises(ScheduleError, match="nested 6"):
        load_schedule(Two(), _schedule([{"op": "annotate", "path": "a", "args": {"*": "weight", "key": "k",
                                                                                 "value": value}}]))
    with pytest.raises(ScheduleError, match="does not parse"):  # an integer of 5000 digits
        load_schedule(Two(), _schedule([]).replace('"records": []', '"records": [' + "9" * 5000 + "]"))
    big = [{"op": "annotate", "path": "a", "args": {"*": "weight", "key": f"k{i}", "value": "x" * 1000}}
           for i in range(3000)] + [{"op": "annotate", "path": "b", "args": {"*": "weight", "key": "blob",
                                                                               "value": "y" * 2_000_000}}]
    text = _schedule(big)
    assert len(text) > 5_000_000
    assert len(load_schedule(Two(), text).records) == 3001  # a multi-MB file is data
    with pytest.raises(ScheduleError, match="record 0"):  # 100 000 bad records stop at the first
        load_schedule(Two(), _schedule([{"op": "nope", "path": "", "args": {}}] * 100_000))


def _shard(**args):
    return lambda d: d["decisions"].append({"op": "shard", "path": "a", "args": {"names": "weight", "axis": "tp",
                                                                                **args}})


# name -> (edit of a minimal plan, whether Plan.from_json accepts it as data)
ABSURD_PLANS = {
    "nothing changed": (lambda d: None, True),
    "a mesh of 10^6 ranks": (lambda d: d["cluster"]["mesh"].update(shape=[10**6]), True),
    "a mesh of 10^6 x 10^6 ranks": (lambda d: (d["cluster"]["mesh"].update(shape=[10**6, 10**6], names=["tp", "dp"]),
                                               d["cluster"]["links"].append(d["cluster"]["links"][0])), True),
    "a mesh of 0 ranks": (lambda d: d["cluster"]["mesh"].update(shape=[0]), False),
    "a negative mesh": (lambda d: d["cluster"]["mesh"].update(shape=[-2]), False),
    "a mesh of 10^30 ranks": (lambda d: d["cluster"]["mesh"].update(shape=[10**30]), True),
    "a shard over 10^6 ranks": (lambda d: (d["cluster"]["mesh"].update(shape=[10**6]), _shard(dim=0)(d)), True),
    "a negative dim": (_shard(dim=-1), False),
    "a huge dim": (_shard(dim=2**62), False),
    "a dim past the weight's": (_shard(dim=7), True),
    "zero blocks": (_shard(dim=0, blocks=0), False),
    "a NaN budget": (lambda d: d.update(budget_bytes=math.nan), True),
    "an infinite budget": (lambda d: d.update(budget_bytes=math.inf), True),
    "a negative budget": (lambda d: d.update(budget_bytes=-1e30), True),
    "a NaN estimate": (lambda d: d["estimate"].update(step_s=math.nan, peak_bytes=math.inf), True),
    "a negative latency": (lambda d: d["cluster"]["links"][0].update(latency_s=-1.0), False),
    "a NaN bandwidth": (lambda d: d["cluster"]["links"][0].update(bandwidth_bytes_per_s=math.nan), True),
    "an unknown estimate field": (lambda d: d["estimate"].update(evil=1), False),
    "a huge sync placement": (lambda d: d["decisions"].append({"op": "sync", "path": "a", "args": {
        "mode": "fwd_post", "to": "S99999999", "from_": "R", "axis": "tp"}}), False),
    "an unknown decision": (lambda d: d["decisions"].append({"op": "exec", "path": "", "args": {}}), False),
    "a decision with extra args": (lambda d: d["decisions"].append(
        {"op": "checkpoint", "path": "a", "args": {"policy": "os:system"}}), False),
    "a NaN loss kwarg": (lambda d: d["decisions"].append({"op": "set_attr", "path": "", "args": {
        "name": "loss_function", "ref": "treadle.runtime.losses:VocabParallelLoss", "kwargs": {"causal": math.nan}}}),
        False),
    "10^5 checkpoint decisions": (lambda d: d["decisions"].extend([{"op": "checkpoint", "path": "a"}] * 100_000),
                                  True),
}


@pytest.mark.parametrize("name", list(ABSURD_PLANS))
def test_absurd_sizes_in_a_plan_load_as_data_or_are_refused(name, marker):
    edit, accepted = ABSURD_PLANS[name]
    doc = _plan_doc([])
    edit(doc)
    text = json.dumps(doc)
    if not accepted:
        with pytest.raises(PlanError) as info:
            Plan.from_json(text, source="plan.json")
        assert str(info.value).startswith("plan.json") and "\n" not in str(info.value), str(info.value)
        return
    plan = Plan.from_json(text, source="plan.json")  # data, whatever its sizes
    try:
        plan.schedule_for(Two())
    except TreadleError as exc:  # a size the model cannot take: refused when applied, naming where
        assert "\n" not in str(exc) and str(exc), str(exc)


# ------------------------------------------------------------------------------------------ fuzz
ATTACK_VALUES = [{"ref": t, "kwargs": ATTACKS[t]} for t in list(ATTACKS)[:8]] + [
    {"type": "subprocess:Popen"}, {"type": "antigravity:Fly"}, {"module_pickle": "AAAA", "class": "X"},
    {"placement": "Shard", "dim": 10**9}, {"placement": "Partial", "reduce_op": "os.system"}, {"placement": "Evil"},
    {"dict": {"ref": "os:system"}}, {"dict": [1]}, {"ref": "treadle.runtime.losses:VocabParallelLoss",
                                                    "kwargs": {"axis": {"ref": "os:system"}}}]
POOL = [None, True, False, 0, -1, 1, 2, 3, 7, 2**31, 2**63, -2**63, 10**30, 1.5, math.nan, math.inf, -math.inf, "",
        "tp", "dp", "x" * 1000, "../../etc/passwd", "R", "P", "S0", "S99999", "fwd_post", "__class__", "os:system",
        "treadle.run.loop:os.system", "lm_head", "transformer.h.0", [], {}, [1, 2], {"a": 1}, ["weight"]]


def _nodes(doc, path=()):
    """Every (container, key, path) in a JSON tree."""
    out = []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for k, v in items:
        out.append((doc, k, path + (k,)))
        out += _nodes(v, path + (k,))
    return out


def _mutate(doc, rng: random.Random):
    """1-3 random edits, mostly of primitives' and decisions' arguments and of the mesh (what reaches code)."""
    doc = copy.deepcopy(doc)
    for _ in range(rng.randint(1, 3)):
        nodes = _nodes(doc)
        inner = [n for n in nodes if "args" in n[2][:-1] or "mesh" in n[2] or "cluster" in n[2]]
        if not nodes:
            return doc
        parent, key, _ = rng.choice(inner if inner and rng.random() < 0.8 else nodes)
        kind = rng.randrange(10)
        if kind == 0 and isinstance(parent, dict):
            del parent[key]
        elif kind == 0:
            parent.pop(key)
        elif kind == 1:
            parent[key] = copy.deepcopy(rng.choice(ATTACK_VALUES))
        elif kind == 2:  # nest, now and then past the depth limit
            for _ in range(rng.choice([1, 2, 3, 70])):
                parent[key] = [parent[key]] if rng.random() < 0.5 else {"dict": parent[key]}
        elif kind == 3 and isinstance(parent[key], list) and parent[key]:
            parent[key] = parent[key] * rng.choice([2, 50])
        elif kind == 4 and isinstance(parent[key], str):
            parent[key] = rng.choice(POOL) if rng.random() < 0.5 else parent[key] + rng.choice([".x", "_", "0", ":a"])
        elif kind == 5 and isinstance(parent[key], (int, float)) and not isinstance(parent[key], bool):
            parent[key] = rng.choice([-parent[key], parent[key] * 10**6, parent[key] + 1, 0, -1, 10**18, math.nan])
        else:
            parent[key] = copy.deepcopy(rng.choice(POOL))
    return doc


def _fuzz_base() -> tuple[nn.Module, dict]:
    from treadle.models import megatron

    model = tiny_gpt2(1)
    sch = create_schedule(copy.deepcopy(model), mesh=Mesh((2, 2), ("dp", "tp")))
    megatron(sch, tp="tp", dp="dp", sequence_parallel=True, checkpoint_fraction=1.0)
    sch["transformer.h.0.mlp.c_fc"].annotate("weight", "tag", {"a": [1, 2]})
    return model, json.loads(sch.to_json())


def test_random_mutations_of_real_schedule_and_plan_files_load_as_data_or_are_refused(
        marker, vocab_plan, gpt2_1024):
    rng = random.Random(30)
    model, sched = _fuzz_base()
    plan = json.loads(vocab_plan.to_json())
    plan.pop("rows")  # the per-module rows are plain numbers; mutate the parts that reach code
    plan["rows"] = []
    outcomes = {"loaded": 0, "refused": 0}
    for i in range(600):
        is_plan = i % 2 == 1
        doc = _mutate(plan if is_plan else sched, rng)
        text = json.dumps(doc)
        try:
            if is_plan:
                Plan.from_json(text, source="fuzz.json").schedule_for(copy.deepcopy(gpt2_1024))
            else:
                load_schedule(copy.deepcopy(model), text, source="fuzz.json")
            outcomes["loaded"] += 1
        except TreadleError as exc:
            assert str(exc), i
            outcomes["refused"] += 1
        except Exception as exc:  # noqa: BLE001 - the point: anything else is a bug
            pytest.fail(f"mutation {i} ({'plan' if is_plan else 'schedule'}) raised {type(exc).__name__}: {exc}\n"
                        f"{text[:2000]}")
        assert not marker.exists(), i
    assert outcomes["loaded"] > 50 and outcomes["refused"] > 50, outcomes


# ------------------------------------------------------------------------------------------ every raise
def _bad_export(monkeypatch):
    monkeypatch.setitem(gate.FILE_EXPORTS, "treadle.runtime.losses:MovedAway", "a stale entry")
    gate.resolve_callable("treadle.runtime.losses:MovedAway", where="w")


def _not_callable():
    gate.register("tests_gate_fake:NOT_CALLABLE", 5)
    try:
        load_schedule(Two(), _schedule([{"op": "set_attr", "path": "", "args": {"*": "x", "value": {
            "ref": "tests_gate_fake:NOT_CALLABLE"}}}]))
    finally:
        gate.unregister("tests_gate_fake:NOT_CALLABLE")


def _plan_with(decision):
    return Plan.from_json(json.dumps(_plan_doc([decision])), source="plan.json")


REFUSALS = {
    "a stale export": (_bad_export, ScheduleError, "update treadle.schedule.gate.FILE_EXPORTS"),
    "a trusted name that does not import": (
        lambda mp: gate.resolve_callable("no_such_module_zz:f", where="w", trusted={"no_such_module_zz:f"}),
        ScheduleError, "w: cannot import 'no_such_module_zz:f'"),
    "a registered object that is not callable": (lambda mp: _not_callable(), ScheduleError, "is not callable"),
    "JSON that is no text": (lambda mp: gate.parse_json(None, source="f.json"), ScheduleError,
                             "f.json: expected JSON text, got NoneType"),
    "records that are no list": (lambda mp: load_schedule(Two(), json.dumps({
        "format": "treadle.schedule/1", "mesh": {"shape": [2], "names": ["tp"]}, "records": {}}), source="s.json"),
        ScheduleError, "s.json is malformed: missing or wrong field (it needs a 'mesh' object and a 'records' list)"),
    "an encoded dict holding a list": (lambda mp: load_schedule(Two(), _schedule([{"op": "annotate", "path": "a",
        "args": {"*": "weight", "key": "k", "value": {"dict": [1]}}}]), source="s.json"), ScheduleError,
        "s.json: record 0 (annotate at 'a'): an encoded dict must hold an object, got list"),
    "ref kwargs that are no object": (lambda mp: load_schedule(Two(), _schedule([{"op": "set_attr", "path": "",
        "args": {"*": "x", "value": {"ref": "treadle.runtime.losses:VocabParallelLoss", "kwargs": [1]}}}])),
        ScheduleError, "the kwargs of ref 'treadle.runtime.losses:VocabParallelLoss' must be an object"),
    "a primitive given wrong arguments": (lambda mp: load_schedule(Two(), _schedule([{"op": "shard", "path": "a",
        "args": {"dim": 0, "axis": "tp"}}]), source="s.json"), ScheduleError,
        "s.json: record 0 (shard at 'a'): bad arguments {'dim': 0, 'axis': 'tp'} (TypeError"),
    "a replace_all without a factory Ref": (lambda mp: load_schedule(Two(), _schedule([{"op": "replace_all",
        "path": "", "args": {"module_type": {"type": "torch.nn.modules.linear:Linear"}, "factory": "x"}}])),
        ScheduleError, "replace_all needs factory= a Ref"),
    "a bad mesh": (lambda mp: load_schedule(Two(), _schedule([], mesh={"shape": ["x"], "names": ["tp"]}),
                                            source="s.json"), ScheduleError, "s.json: bad mesh"),
    "a decision that is no object": (lambda mp: Plan.from_json(json.dumps(_plan_doc([5])), source="plan.json"),
                                     PlanError, "plan.json: decision 0: a decision must be an object, got int"),
    "a decision path that is no string": (lambda mp: _plan_with({"op": "checkpoint", "path": 5}), PlanError,
                                          "plan.json: decision 0 (checkpoint): path and why must be strings"),
    "decision args that are no object": (lambda mp: _plan_with({"op": "checkpoint", "path": "a", "args": [1]}),
                                         PlanError,
                                         "plan.json: decision 0 (checkpoint at 'a'): args must be an object"),
    "a checkpoint policy no table names": (lambda mp: _plan_with({"op": "checkpoint", "path": "a",
                                                                  "args": {"policy": "os.system"}}),
                                           PlanError, "argument 'policy' must be policy name, got 'os.system'"),
    "a decision missing an argument": (lambda mp: _plan_with({"op": "fork_rng", "path": "a", "args": {}}),
                                       PlanError, "missing argument 'axis'"),
    "a decision argument of the wrong kind": (lambda mp: _plan_with({"op": "fork_rng", "path": "a",
                                                                     "args": {"axis": 5}}),
                                              PlanError, "argument 'axis' must be str, got 5"),
    "an unknown decision made in code": (lambda mp: apply_decisions(create_schedule(Two(), mesh=TP2),
                                                                    [Decision("exec", "a", {})],
                                                                    leaf_module=lambda p: False),
                                         PlanError, "apply_decisions: unknown decision op 'exec' at 'a'"),
    "not a plan": (lambda mp: Plan.from_json("[1]", source="plan.json"), PlanError,
                   "plan.json: not a treadle plan (format 'list'"),
    "a plan's cluster the mesh refuses": (lambda mp: Plan.from_dict(
        {**_plan_doc([]), "cluster": {**_plan_doc([])["cluster"], "mesh": {"shape": [2, 2], "names": ["tp", "tp"]}}},
        source="plan.json"), PlanError, "plan.json: Mesh: axis names must be unique"),
    "a run config's model that is no name": (
        lambda mp: __import__("treadle.models.zoo", fromlist=["x"]).check_file_model_spec(5, source="run.toml"),
        TreadleError, "run.toml: model must be a non-empty name, got 5"),
    "a plan's model that is no zoo name": (
        lambda mp: __import__("treadle.models.zoo", fromlist=["x"]).zoo_name_from_file("os:system", source="p.json"),
        TreadleError, "p.json: the plan's model 'os:system' is not a zoo name"),
    "a kernel factory on a LLaMA-less module": (
        lambda mp: __import__("treadle.models.kernels", fromlist=["x"]).sdpa_llama_attention(nn.Linear(2, 2)),
        ScheduleError, "sdpa_llama_attention replaces a LLAMA attention module; Linear lacks ['q_proj'"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_each_refusal_names_what_is_wrong(name, monkeypatch, marker):
    fn, exc_type, fragment = REFUSALS[name]
    with pytest.raises(exc_type) as info:
        fn(monkeypatch)
    assert fragment in str(info.value) and "\n" not in str(info.value), str(info.value)
