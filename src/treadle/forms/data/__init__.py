"""Data parallelism — DDP, ZeRO-3 (FSDP2) and HSDP over any set of mesh axes — as one parallel form.

How a user states it: ``sch.data_parallel(axis=..., shard=..., replicate=..., reshard_after_forward=...)``, a
primitive of the language (`treadle.schedule.data_parallel` checks and records it). Everything else is here:

- `facts.py`    what the runtime does, stated once (DDP buckets and buffers, FSDP2 units, host and copy costs);
- `runtime.py`  what `build` installs (the "wrap" step: DDP / `fully_shard`);
- `price.py`    its part of a priced step (`treadle.pricing`);
- `plan.py`     the planner's role options, cost terms, MILP rows, decisions and label.
"""

from __future__ import annotations

from ...form import Form
from . import plan as _plan
from . import price as _price
from .runtime import wrap_data_parallel


class DataParallelForm(Form):
    """The faces of data parallelism (each delegates to the module that holds it)."""

    name = "data"

    def capture_facts(self, model):
        return _plan.capture_facts(model)

    def role_options(self, mesh, live, *, batch, request):
        return _plan.role_options(mesh, live, batch=batch, request=request)

    def role_label(self, roles):
        return _plan.role_label(roles)

    def prepare(self, b):
        _plan.prepare(b)

    def param_cost(self, b, meta, pl, cost):
        _plan.param_cost(b, meta, pl, cost)

    def graph_terms(self, b, cg):
        _plan.graph_terms(b, cg)

    def ilp_rows(self, m, cg, s, shared):
        _plan.ilp_rows(m, cg, s, shared)

    def evaluate(self, cg, choice, acc):
        _plan.evaluate(cg, choice, acc)

    def adjust_rows(self, cg, choice, rows, shared):
        _plan.adjust_rows(cg, choice, rows, shared)

    def memory_rows(self, m, cg, v):
        return _plan.memory_rows(m, cg, v)

    def peak_bytes(self, cg, choice, ckpt, counts):
        return _plan.peak_bytes(cg, choice, ckpt, counts)

    def decisions(self, cg, choice, ckpt, ctx):
        return _plan.decisions(cg, choice, ckpt, ctx)

    def price_step(self, ctx):
        return _price.price_step(ctx)


FORM = DataParallelForm()
BUILD_STEPS = {"wrap": wrap_data_parallel}
