"""The first hour of a user: every entry point checks its arguments, its files and the world size before it builds
a model or starts a process; a user error is one line naming the culprit and what would work, exit status 2;
``treadle --help`` imports none of the heavy layers; output for logs keeps its tables whole and says no warnings
of treadle's own making; the README's snippets run once however many ranks they start (issue 32)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "scipy", "rich", "treadle.planner", "treadle.runtime.build", "treadle.viz")


def _python(code: str, *, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter with this tree's src first on the path."""
    import os

    full = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}", HF_HUB_OFFLINE="1")
    full.pop("TREADLE_RUN_LAUNCHER", None)
    full.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True, text=True,
                          timeout=timeout)


class Built(AssertionError):
    """Raised by a builder or spawner that a check should have kept from running."""


@pytest.fixture
def nothing_built(monkeypatch):
    """Every way an entry point builds a model or starts processes raises `Built`."""
    import torch.distributed.run

    from treadle import testing
    from treadle.models import zoo

    def refuse(what):
        def fn(*a, **k):
            raise Built(f"{what} was called before the arguments were checked")
        return fn

    monkeypatch.setattr(zoo, "named_model", refuse("named_model"))
    monkeypatch.setattr(zoo, "load_model", refuse("load_model"))
    monkeypatch.setattr(testing, "spawn", refuse("testing.spawn"))
    monkeypatch.setattr(torch.distributed.run, "run", refuse("torchrun"))


def _one_line(capsys, command: str) -> str:
    out = capsys.readouterr()
    err = out.err.strip()
    assert out.out == "" and err.startswith(f"treadle {command}: error: ") and "\n" not in err, out
    return err


def _plan_file(path: Path, *, model: dict | None = None, shape=(16, 4), names=("dp", "tp")) -> Path:
    """A plan file as `treadle plan -o` writes one, reduced to what is read before a model is built."""
    doc = {"format": "treadle.plan/1", "model": model or {"name": "llama-3-8b", "batch": 32, "seq": 4096},
           "decisions": [], "schedule": {"format": "treadle.schedule/1",
                                         "mesh": {"shape": list(shape), "names": list(names)}, "records": []}}
    path.write_text(json.dumps(doc))
    return path


# ------------------------------------------------------------------------------------------- start-up
def test_the_parser_and_import_treadle_load_none_of_the_heavy_layers():
    res = _python(f"""
        import sys
        import treadle
        from treadle.cli import build_parser
        build_parser().format_help()
        print([m for m in {HEAVY!r} if m in sys.modules])
    """)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr


def test_registrations_load_on_first_use_whichever_module_comes_first():
    """A fresh process that imports one planner module sees every form, the build steps in their fixed order,
    the Conv1D leaf rule (registered by name: transformers not imported for it) and plans GPT-2's Conv1D."""
    res = _python("""
        import sys
        from treadle.planner.search import plan_model
        from treadle.form import forms
        from treadle.runtime.steps import build_steps
        assert "transformers" not in sys.modules
        print([f.name for f in forms()])
        print({p: [f.__name__ for f in build_steps(p)] for p in ("pre_materialize", "pre_shard", "post_hooks", "wrap")})
        from treadle.cost.cluster import parse_cluster
        from treadle.models.zoo import named_model
        from treadle.sharding_rules import has_leaf_rule
        model, inputs = named_model("tiny-gpt2", batch=8, seq=64, dropout=False)
        print(has_leaf_rule(model.transformer.h[0].attn.c_attn))
        plan = plan_model(model, inputs, cluster=parse_cluster("2x2:cpu"), dp_axis="dp", price_top=0, pp_axis=None)  # sharded c_fc
        print([line for line in plan.schedule.to_python().splitlines() if "mlp.c_fc" in line][:1])
        import treadle, treadle.verify.verify, treadle.models.megatron
        print(callable(treadle.verify), callable(treadle.models.megatron), treadle.Shard.__name__)
    """, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    assert lines[0] == "['tensor', 'sequence', 'vocab', 'data', 'pipeline', 'expert', 'float8']"
    assert lines[1] == ("{'pre_materialize': ['_sync_decomposed', 'capture_root'], "
                        "'pre_shard': ['install_float8', 'slice_running_stats', 'plan_experts'], "
                        "'post_hooks': ['_selective', 'install_split_gather_scales'], 'wrap': ['wrap_pipeline', "
                        "'wrap_data_parallel']}")
    assert lines[2] == "True" and "c_fc" in lines[3] and "shard" in lines[3], lines
    assert lines[4] == "True True Shard"


def test_a_leaf_rule_by_name_and_by_class_are_one_rule():
    from treadle import sharding_rules
    from treadle.sharding_rules import RuleError, register_leaf_rule

    class Leaf:
        pass

    def rule(path, mod, shards):
        return None

    try:
        register_leaf_rule(Leaf)(rule)
        with pytest.raises(RuleError, match="already registered"):
            register_leaf_rule(f"{Leaf.__module__}.{Leaf.__qualname__}")(rule)
        assert sharding_rules.has_leaf_rule(Leaf())
    finally:
        sharding_rules._LEAVES.pop(Leaf, None)


# ------------------------------------------------------------------------------------------- verify / train
@pytest.mark.parametrize("command", ["verify", "train"])
def test_world_against_the_plans_mesh_before_the_model_is_built(tmp_path, capsys, nothing_built, command):
    """The README's `treadle verify plan.json --world 4` on the Llama-3-8B plan (64 devices) was killed for
    memory building the model; now it is one line naming both sizes and what would work."""
    from treadle.cli import main

    plan = _plan_file(tmp_path / "plan.json")
    assert main([command, str(plan), "--world", "4"]) == 2
    err = _one_line(capsys, command)
    assert (f"{plan}: the schedule's mesh {{'dp': 16, 'tp': 4}} needs world size 64, not --world 4; {command} runs "
            f"one CPU process per device: give --world 64, or plan for 4 devices") in err


def test_a_mesh_beyond_the_hosts_processes_before_the_model_is_built(tmp_path, capsys, nothing_built):
    from treadle.cli import main

    plan = _plan_file(tmp_path / "plan.json", shape=(1000, 1000))
    assert main(["verify", str(plan)]) == 2
    assert "1,000,000 processes on this host exceed the limit" in _one_line(capsys, "verify")


def test_verify_names_a_missing_file_a_bad_model_and_shows_the_traceback_with_debug(tmp_path, capsys,
                                                                                     nothing_built):
    from treadle.cli import main

    assert main(["verify", str(tmp_path / "nope.json")]) == 2
    assert _one_line(capsys, "verify").endswith(f"No such file or directory: {tmp_path / 'nope.json'}")
    plan = _plan_file(tmp_path / "plan.json", shape=(2,), names=("dp",))
    assert main(["verify", str(plan), "--model", "tiny-gtp2"]) == 2
    assert "unknown model 'tiny-gtp2'; did you mean 'tiny-gpt2'" in _one_line(capsys, "verify")
    with pytest.raises(FileNotFoundError):
        main(["--debug", "verify", str(tmp_path / "nope.json")])
    with pytest.raises(FileNotFoundError):  # after the sub-command as well
        main(["verify", str(tmp_path / "nope.json"), "--debug"])


# ------------------------------------------------------------------------------------------- plan / profile / price
def test_plan_names_a_misspelt_model_before_building(capsys, nothing_built):
    from treadle.cli import main

    assert main(["plan", "lama-3-8b", "--cluster", "8x8:h100", "--batch", "32", "--seq", "4096"]) == 2
    err = _one_line(capsys, "plan")
    assert "unknown model 'lama-3-8b'; did you mean 'llama-3-8b'" in err and "package.module:function" in err
    assert main(["plan", "tiny-gpt2", "--cluster", "2x2:cpu", "--batch", "8", "--seq", "64", "--pin", "x"]) == 2
    assert "cannot read pin 'x'" in _one_line(capsys, "plan")
    assert main(["plan", "tiny-gpt2", "--cluster", "2x2:cpu", "--batch", "0", "--seq", "64"]) == 2
    assert "--batch must be >= 1, got 0" in _one_line(capsys, "plan")
    assert main(["plan", "tiny-gpt2", "--cluster", "2x2:cpu", "--batch", "8", "--seq", "64",
                 "--checkpoint-policy", "attention-core"]) == 2
    assert "checkpoint_policies: 'attention-core' is not a policy the planner searches" in _one_line(capsys, "plan")


def test_profile_names_a_misspelt_model_before_building(capsys, nothing_built):
    from treadle.cli import main

    assert main(["profile", "gpt-2"]) == 2
    assert "unknown model 'gpt-2'; did you mean 'gpt2'" in _one_line(capsys, "profile")
    assert main(["profile"]) == 2
    assert "give a model name (see --list)" in _one_line(capsys, "profile")


def test_price_errors_are_one_line_on_stderr(tmp_path, capsys, nothing_built):
    from treadle.cli import main

    assert main(["price", str(tmp_path / "missing.json"), "--cluster", "2x2:cpu"]) == 2
    assert _one_line(capsys, "price").endswith(f"No such file or directory: {tmp_path / 'missing.json'}")
    plan = _plan_file(tmp_path / "plan.json", model={"name": "tiny-gpt2", "batch": 8, "seq": 64}, shape=(4,),
                      names=("dp",))
    assert main(["price", str(plan), "--cluster", "2x2:cpu", "--model", "tiny-gtp2"]) == 2
    assert "did you mean 'tiny-gpt2'" in _one_line(capsys, "price")
    assert main(["price", str(plan), "--cluster", "2x2:cpu", "--threads-per-rank", "0"]) == 2
    assert "--threads-per-rank must be >= 1, got 0" in _one_line(capsys, "price")


def test_price_keeps_the_rank_placement_of_a_cluster_file(tmp_path):
    """`treadle price --cluster cluster.json` applied its flags' defaults over the file (core sharing lost)."""
    import argparse

    from treadle.cli.price import with_placement
    from treadle.cost.cluster import parse_cluster

    path = tmp_path / "cluster.json"
    path.write_text(parse_cluster("2x2:cpu").with_ranks(threads_per_rank=2, ranks_per_host=4,
                                                        cores_per_host=3).to_json())
    cluster = parse_cluster(str(path))
    kept = with_placement(cluster, argparse.Namespace(threads_per_rank=None, cores_per_host=None))
    assert (kept.threads_per_rank, kept.ranks_per_host, kept.cores_per_host) == (2, 4, 3)
    one = with_placement(cluster, argparse.Namespace(threads_per_rank=1, cores_per_host=None))
    assert (one.threads_per_rank, one.ranks_per_host, one.cores_per_host) == (1, 4, 3)


def test_price_cli_prices_with_the_cluster_files_placement(tmp_path):
    import treadle
    from treadle.cli import main
    from treadle.cost.cluster import parse_cluster
    from treadle.models.zoo import named_model

    cluster_file = ROOT / "tests" / "golden" / "cpu_2x2_cluster.json"
    model, inputs = named_model("tiny-gpt2", batch=8, seq=32, dropout=False)
    sch = treadle.create_schedule(model, mesh=treadle.Mesh((2, 2), ("dp", "tp")))
    treadle.models.megatron(sch, tp="tp", dp="dp")
    f = tmp_path / "schedule.json"
    f.write_text(sch.to_json())
    out = tmp_path / "price.json"
    assert main(["price", str(f), "--model", "tiny-gpt2", "--cluster", str(cluster_file), "--batch", "8",
                 "--seq", "32", "--json", str(out)]) == 0
    expected = treadle.price(sch, inputs, parse_cluster(str(cluster_file)))
    got = json.loads(out.read_text())
    assert parse_cluster(str(cluster_file)).cores_per_host == 2
    assert got["step_s"] == pytest.approx(expected.step_s, rel=1e-12)


def test_calibrate_defaults_are_the_cost_models():
    from treadle.cli import cost
    from treadle.cost.calibrate import DEFAULT_CHAIN, DEFAULT_LEAD_COMPUTE_S, DEFAULT_ROUNDS

    assert cost.CHAIN_DEFAULT == DEFAULT_CHAIN and cost.LEAD_MS_DEFAULT == pytest.approx(DEFAULT_LEAD_COMPUTE_S * 1e3)
    assert cost.ROUNDS_DEFAULT == DEFAULT_ROUNDS


# ------------------------------------------------------------------------------------------- treadle run
@pytest.fixture
def corpus(tmp_path) -> Path:
    p = tmp_path / "corpus.txt"
    p.write_text("a line of text for the byte tokenizer\n" * 50)
    return p


@pytest.mark.parametrize("argv,msg", [
    (["--model", "tiny-llama"], "give --data (text, JSONL or Parquet files, or directories of them)"),
    (["--model", "tiny-llama", "--data", "{tmp}/missing.txt"], "data path '{tmp}/missing.txt' does not exist"),
    (["--model", "tiny-llama", "--data", "{corpus}", "--recipe", "zero"],
     "unknown --recipe 'zero'; known: ddp, fsdp, megatron, megatron-fsdp"),
    (["--nproc", "3", "--mesh", "2x2", "--model", "tiny-llama", "--data", "{corpus}"],
     "--mesh 2x2 has 4 ranks but the job has 3; give a DPxTP mesh of 3 ranks, or launch 4 processes"),
    (["--model", "tiny-lama", "--data", "{corpus}"],
     "--model 'tiny-lama': unknown model 'tiny-lama'; did you mean 'tiny-llama'"),
    (["--model", "{tmp}", "--data", "{corpus}"], "--model '{tmp}': no config.json there"),
    (["--model", "tiny-llama", "--data", "{corpus}", "--tokenizer", "{tmp}"],
     "tokenizer '{tmp}': no tokenizer.json there"),
    (["--nproc", "2", "--model", "tiny-llama", "--data", "{corpus}", "--plan", "{plan4}"],
     "the schedule's mesh {{'dp': 4}} needs 4 ranks, but the job has 2"),
    (["--model", "tiny-llama", "--data", "{corpus}", "--export-hf", "{tmp}/hf"],
     "--export-hf writes from the final checkpoint; give --ckpt-dir too"),
])
def test_treadle_run_checks_before_spawning(tmp_path, corpus, capsys, nothing_built, argv, msg):
    from treadle.cli import main

    plan4 = _plan_file(tmp_path / "plan4.json", model={"name": "tiny-llama", "batch": 8, "seq": 32}, shape=(4,),
                       names=("dp",))
    fill = {"tmp": tmp_path, "corpus": corpus, "plan4": plan4}
    argv = [a.format(**fill) for a in argv]
    assert main(["run", *(["--nproc", "1"] if "--nproc" not in argv else []), *argv]) == 2
    err = _one_line(capsys, "run")
    assert err.startswith(f"treadle run: error: {msg.format(**fill)}"), err


def test_treadle_run_takes_the_plans_model_batch_and_seq(tmp_path, corpus, capsys, monkeypatch):
    """`treadle run --plan plan.json` asked for --model; the plan names it, with its batch and seq. A flag
    overrides the plan's and says so, once (the launcher; its ranks stay quiet)."""
    import torch.distributed.run

    from treadle.cli import build_parser, main
    from treadle.run.config import config_from_args

    plan = _plan_file(tmp_path / "plan.json", model={"name": "tiny-llama", "batch": 8, "seq": 32}, shape=(2,),
                      names=("dp",))
    said: list[str] = []
    args = build_parser().parse_args(["run", "--plan", str(plan), "--data", str(corpus)])
    cfg = config_from_args(args, say=said.append)
    assert (cfg.model, cfg.batch, cfg.seq, said) == ("tiny-llama", 8, 32, [])
    args = build_parser().parse_args(["run", "--plan", str(plan), "--data", str(corpus), "--seq", "16"])
    cfg = config_from_args(args, say=said.append)
    assert (cfg.model, cfg.batch, cfg.seq) == ("tiny-llama", 8, 16)
    assert said == [f"treadle.run: --seq 16 overrides {plan}'s seq 32"]
    args = build_parser().parse_args(["run", "--plan", str(plan), "--data", str(corpus), "--seq", "16", "--batch",
                                      "4", "--model", "tiny-gpt2"])
    config_from_args(args, say=said.append)
    assert said[1] == (f"treadle.run: --model tiny-gpt2, --batch 4, --seq 16 override {plan}'s model tiny-llama, "
                       f"batch 8, seq 32")
    assert config_from_args(build_parser().parse_args(["run", "--plan", str(plan), "--data", str(corpus)])).compile \
        is False
    doc = json.loads(plan.read_text())
    plan.write_text(json.dumps({**doc, "execution": "compiled"}))  # a plan made for compiled blocks runs them so
    for extra, want in (([], True), (["--no-compile"], False)):
        args = build_parser().parse_args(["run", "--plan", str(plan), "--data", str(corpus), *extra])
        assert config_from_args(args).compile is want
    plan.write_text(json.dumps(doc))

    launched: list[list[str]] = []
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what the launcher would set for its ranks
    monkeypatch.setattr(torch.distributed.run, "run", lambda a: launched.append(a.training_script_args))
    assert main(["run", "--nproc", "2", "--plan", str(plan), "--data", str(corpus), "--batch", "4"]) == 0
    out = capsys.readouterr()
    assert out.err == f"treadle run: --batch 4 overrides {plan}'s batch 8\n", out.err
    assert len(launched) == 1 and "--model" not in launched[0]  # each rank reads the plan's model itself
    bad = _plan_file(tmp_path / "bad.json", model={"name": "os:system", "batch": 8, "seq": 32}, shape=(2,),
                     names=("dp",))
    assert main(["run", "--nproc", "2", "--plan", str(bad), "--data", str(corpus)]) == 2
    assert "names model function 'os:system', which a file may not name" in _one_line(capsys, "run")


def test_a_plans_model_entry_is_checked_as_data(tmp_path, corpus):
    from treadle.cli import build_parser
    from treadle.run.config import RunError, config_from_args

    def cfg(doc_model, *extra):
        plan = tmp_path / "plan.json"
        plan.write_text(json.dumps({"format": "treadle.plan/1", "model": doc_model}))
        return config_from_args(build_parser().parse_args(["run", "--plan", str(plan), "--data", str(corpus),
                                                           *extra]))

    with pytest.raises(RunError, match="'model' must be an object with name, batch, seq; got 'tiny-llama'"):
        cfg("tiny-llama")
    with pytest.raises(RunError, match="the plan's batch must be a positive integer, got '8'"):
        cfg({"name": "tiny-llama", "batch": "8"})
    with pytest.raises(RunError, match="neither a zoo name"):
        cfg({"name": "no-such-model"})
    assert cfg({"name": "no-such-model"}, "--model", "tiny-llama").model == "tiny-llama"  # the flag's is used
    (tmp_path / "plan.json").write_text("{")
    with pytest.raises(RunError, match="plan.json is not JSON"):
        config_from_args(build_parser().parse_args(["run", "--plan", str(tmp_path / "plan.json"), "--data",
                                                    str(corpus), "--model", "tiny-llama"]))


def test_the_facade_names_what_it_exports_only():
    import treadle

    with pytest.raises(AttributeError, match="module 'treadle' has no attribute 'no_such_name'"):
        treadle.no_such_name  # noqa: B018
    assert {"build", "verify", "Shard", "models"} <= set(dir(treadle))


def test_python_m_treadle_run_checks_before_its_process_group(tmp_path, corpus):
    """Each rank of `python -m treadle.run` checks its settings against WORLD_SIZE before it loads the job's
    modules or joins a process group (no MASTER_ADDR here: the check comes first)."""
    code = f"""
        import runpy, sys
        sys.argv = ["treadle.run", "--model", "tiny-llama", "--data", {str(corpus)!r}, "--mesh", "2x2"]
        try:
            runpy.run_module("treadle.run", run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            print("STATUS", exc.code, [m for m in ("treadle.run.loop", "torch.distributed.checkpoint",
                                                   "transformers", "treadle.planner") if m in sys.modules])
    """
    res = _python(code, env={"RANK": "0", "WORLD_SIZE": "3"})
    assert res.stdout.strip() == "STATUS 2 []", res.stdout + res.stderr
    assert res.stderr == "treadle.run: --mesh 2x2 has 4 ranks but the job has 3; give a DPxTP mesh of 3 ranks, " \
                         "or launch 4 processes\n"
    res = _python(code, env={"RANK": "1", "WORLD_SIZE": "3"})  # every rank meets it; rank 0 alone says it
    assert res.stdout.strip() == "STATUS 2 []" and res.stderr == "", res.stdout + res.stderr
    res = _python(code.replace('"2x2"]', '"2x2", "--debug"]'), env={"RANK": "0", "WORLD_SIZE": "3"})
    assert res.stdout.strip() == "STATUS 2 []", res.stdout + res.stderr  # --debug: the traceback, then the line
    assert res.stderr.startswith("treadle.run: rank 0 traceback (--debug):\nTraceback (most recent call last):")
    assert "treadle/run/precheck.py" in res.stderr and res.stderr.endswith(
        "treadle.run: --mesh 2x2 has 4 ranks but the job has 3; give a DPxTP mesh of 3 ranks, or launch 4 processes\n")


# ------------------------------------------------------------------------------------------- output for logs
def test_tables_keep_their_width_when_stdout_is_not_a_terminal(capsys):
    from rich.table import Table

    from treadle.cli.output import console

    path = "model.layers.31.self_attn.q_proj.with.a.long.path"
    t = Table("module", "layout", "comm ms")
    t.add_row(path, "weight:S(0) out:S(2) and more layout text to go past eighty columns", "1.234")
    console().print(t)
    out = capsys.readouterr().out
    assert path in out and "…" not in out and max(map(len, out.splitlines())) > 80


def test_treadles_tiny_configs_say_no_warnings():
    """transformers said that tiny-gpt2's special token ids lie outside its vocabulary and that GPT-2 names no
    loss (its logger; fresh process: it says each once)."""
    res = _python("""
        import logging, warnings
        said = []
        class Keep(logging.Handler):
            def emit(self, record):
                said.append(record.getMessage())
        logging.getLogger("transformers").addHandler(Keep(level=logging.WARNING))
        warnings.simplefilter("always")
        from treadle.models.zoo import MODEL_CONFIGS, named_model
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for name in [n for n in MODEL_CONFIGS if n.startswith("tiny-")]:
                model, inputs = named_model(name, batch=2, seq=8, dropout=False)
                model(**inputs).loss.backward()
        print(said, [str(w.message)[:80] for w in caught])
    """, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "[] []", res.stdout + res.stderr[-2000:]


@pytest.mark.parametrize("copier,warns", [("treadle.profile.fake_gaps.copy_model", False), ("copy.deepcopy", True)])
def test_a_fake_model_copies_without_the_fake_tensor_data_ptr_warning(copier, warns):
    """The warning `treadle plan` printed on every run, from deep-copying its fake model (and the control: a plain
    deepcopy says it, so the check can fail). Fresh processes: torch says it once per process."""
    module, _, fn = copier.rpartition(".")
    res = _python(f"""
        import warnings
        warnings.simplefilter("always")
        from {module} import {fn} as copier
        from treadle.models.zoo import named_model
        model, _ = named_model("tiny-gpt2", batch=2, seq=8, fake=True)
        copier(model)
    """)
    assert res.returncode == 0, res.stderr[-2000:]
    assert ("Accessing the data pointer of FakeTensor" in res.stderr) == warns, res.stderr[-2000:]


def test_treadle_plan_to_a_log_says_no_warnings_and_keeps_rows_whole(tmp_path):
    res = _python(f"""
        import sys
        from treadle.cli import main
        sys.exit(main(["plan", "tiny-gpt2", "--cluster", "2x2:cpu", "--nominal", "--batch", "8", "--seq", "64",
                       "--memory", "64MiB", "-o", {str(tmp_path / 'plan.json')!r}]))
    """, timeout=300)
    assert res.returncode == 0 and res.stderr == "", res.stderr[-3000:]
    assert "transformer.h.0.attn.resid_dropout" in res.stdout and "…" not in res.stdout


# ------------------------------------------------------------------------------------------- README
def _readme_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def _is_main_guard(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test).replace("'", '"') == '__name__ == "__main__"'


def test_readme_snippets_that_start_processes_run_once():
    """verify, train and spawn start ranks that import the user's script (multiprocessing's forkserver imports
    `__main__`): a snippet that starts them keeps everything but imports and definitions under the guard."""
    starting = [b for b in _readme_blocks() if re.search(r"\b(verify|train|spawn)\(", b)]
    assert len(starting) >= 2
    for block in starting:
        tree = ast.parse(block)
        kept = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)
        loose = [ast.unparse(n)[:60] for n in tree.body if not (isinstance(n, kept) or _is_main_guard(n))]
        assert loose == [], f"README snippet runs in every rank: {loose}"


def test_what_native_code_prints_during_a_solve_goes_to_stderr():
    # NOTE [a native solver's stdout]: `treadle plan --json` prints the plan on stdout; a line HiGHS prints from C
    # while it solves must not land there. A child process, since pytest captures descriptor 1 itself.
    import subprocess
    import sys

    code = ("import ctypes, sys\n"
            "from treadle.quiet import native_stdout_to_stderr\n"
            "libc = ctypes.CDLL(None)\n"
            "print('before', flush=True)\n"
            "with native_stdout_to_stderr():\n"
            "    libc.printf(b'solver noise\\n')\n"
            "print('after')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "before\nafter\n"
    assert "solver noise" in out.stderr



def test_the_planners_solver_runs_with_descriptor_1_on_stderr(monkeypatch):
    import os

    import scipy.optimize

    from treadle.planner import ilp

    seen = []
    real = scipy.optimize.milp

    def spy(*a, **k):
        one, two = os.fstat(1), os.fstat(2)
        seen.append((one.st_dev, one.st_ino) == (two.st_dev, two.st_ino))
        return real(*a, **k)

    monkeypatch.setattr(scipy.optimize, "milp", spy)
    m = ilp._Model()
    x = m.var(cost=-1.0, integer=True)
    m.row({x: 1.0}, 0.0, 1.0, "x")
    before = os.fstat(1).st_ino
    assert m.solve(5.0, 0.0).x[x] == 1.0
    assert seen == [True] and os.fstat(1).st_ino == before  # restored after the solve
