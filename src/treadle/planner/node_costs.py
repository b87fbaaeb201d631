"""Per-strategy costs of one node (a mixin of the cost-graph builder): seconds and bytes per execution.

Compute: roofline time (`treadle.profile.roofline.op_time_s`) of the local shard, FLOPs from
`treadle.profile.flops` (backward FLOPs only for inputs that need a gradient), bytes moved by the local
tensors (views move none), scaled by what the node's ops really move each way (NOTE [bytes per node] in
saved.py: measured at capture; without it, its backward twice its forward), plus the device's
dispatch overhead for every ATen op the node dispatches forward and backward (counted at capture: NOTE [ops
per node] in saved.py), the autograd engine's sums where several consumers read a value (NOTE [gradient sums at a
fork]) and the optimizer step on the parameters a node owns. Communication: the conversion at a module's exit
(`treadle.cost.convert.plan_conversion`, forward and adjoint, with the runtime's local ops around it: NOTE
[copies]), Megatron's backward all-reduce for a replicated input of an op sharded on a tensor axis, and each
parallel form's terms
(`treadle.form.Form.node_cost`, `param_cost`: the data-parallel reduction of the gradients of the parameters
the node owns, kept apart in `dp_comm_s` for the overlap of NOTE [bucketed data parallel]). Memory: parameter + gradient + optimizer state of owned parameters divided by their
shards (and by the dp axis under ZeRO-3), and saved activations: the bytes autograd really saves of each
node's storages, measured at capture (NOTE [saved by autograd] in saved.py), each divided like the tensor of
the node it is shaped like (its output, or an input: a loss's log-softmax), and the most its backward holds beside
them (`work_bytes`, NOTE [a backward's working set] in grad_live.py); only when that measurement failed
(`CapturedGraph.saved_error`) the per-op rules below decide.

NOTE [gradient sums at a fork]: a value k consumers read gets k gradients, and the autograd engine adds them up
(k - 1 adds of the value's gradient) before its producer's backward runs. The capture counts those adds as ops (NOTE
[ops per node]) but no FLOP count or byte count of the node has them, and `treadle.price` records each with its
bytes: a pre-norm block forks its residual stream twice and each norm's output into q, k, v and gate, up, five full
activations added per block. Llama-3-8B on 8 H100 under tensor parallelism, batch 1 x 4096: 0.19 ms a block a
micro-batch, 7% of its step, which the planner left out (`fork_sums_s`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..cost.convert import plan_conversion
from ..cost.layout import Layout
from ..errors import ProfileError
from ..form import forms
from ..profile import flops as flops_mod
from ..profile.roofline import matmul_efficiency, op_time_s
from ..runtime.optimizer import adamw_tensor_s
from ..placement import R
from .capture import Node, TensorMeta
from .dims import AxisOption
from .policy_facts import strategy_terms

# Ops whose backward needs their own output (so the output is saved), and ops whose backward needs no input.
_SAVES_OUTPUT = {"_softmax", "softmax", "_log_softmax", "log_softmax", "rsqrt", "tanh", "sigmoid", "exp",
                 "scaled_dot_product_attention", "relu", "sqrt"}
_SAVES_NOTHING = {"add", "sub", "neg", "to", "_to_copy", "clone", "contiguous", "alias", "detach", "view",
                  "reshape", "_unsafe_view", "transpose", "permute", "t", "unsqueeze", "squeeze", "expand",
                  "slice", "select", "cat", "split", "split_with_sizes", "getitem", "sum", "mean", "flatten",
                  "unflatten", "expand_as", "view_as", "add_", "copy_", "lift_fresh_copy", "chunk", "narrow",
                  "type_as", "pad", "constant_pad_nd", "fill_", "zeros_like", "ones_like", "full_like"}
_VIEW_OPS = {"view", "reshape", "_unsafe_view", "transpose", "permute", "t", "unsqueeze", "squeeze", "expand",
             "alias", "slice", "select", "getitem", "split", "split_with_sizes", "flatten", "unflatten",
             "expand_as", "view_as", "contiguous", "chunk", "narrow", "detach", "numpy_T"}


@dataclass(slots=True)
class StrategyCost:
    """Per execution, per device: seconds and bytes of one unit strategy (leader plus followers)."""

    compute_s: float = 0.0
    comm_s: float = 0.0
    fwd_s: float = 0.0  # forward compute + forward comm
    rec_s: float = 0.0  # of which a checkpointed block's recompute repeats (NOTE [recompute stops early] in saved.py)
    bwd_s: float = 0.0  # backward compute (the window data-parallel reductions overlap with)
    w_s: float = 0.0  # of bwd_s, the weight gradients' share (a zero-bubble schedule's W; `MATMUL_WEIGHT_GRAD_SHARE`)
    bwd_comm_s: float = 0.0  # tensor-parallel communication of the backward (blocking, on the tensor axes)
    dp_comm_s: float = 0.0  # data-parallel gradient sync, bandwidth part (NOTE [bucketed data parallel])
    opt_s: float = 0.0  # of compute_s, the optimizer step on the parameters it owns: once a step, not per micro-batch
    fsdp_s: float = 0.0  # of compute_s, FSDP2's copies and per-parameter host cost (once a step beside a pipeline
    # that keeps its stages gathered: NOTE [pipeline FSDP2 in the plan])
    act_bytes: float = 0.0  # saved for backward
    work_bytes: float = 0.0  # the most its backward holds beside them (NOTE [a backward's working set]; max, not sum)
    static_bytes: float = 0.0  # parameters + gradients + optimizer states owned here
    grad_bytes: float = 0.0  # of which the local gradients (full local shard; NOTE [the backward's end] in treadle.forms.data.plan)
    static_grad_bytes: float = 0.0  # of static_bytes, the gradients' (NOTE [a rank's memory at each moment])
    w_held_bytes: float = 0.0  # kept by a split backward from I to W: a matrix product's output gradient
    # the input-gradient sums (Megatron's "f") it needs, by (input node, tensor-axis index) -> seconds per
    # execution (NOTE [shared input-gradient sum] in `treadle.forms.tensor.plan`): each charged once per choice
    grad_sums: dict[tuple[int, int], float] = field(default_factory=dict)
    # per selective checkpoint policy: (bytes its cache keeps, seconds its recompute repeats, of the kept bytes those
    # autograd saves too) (NOTE [ops a policy keeps] in `treadle.planner.policies`)
    sac: dict[str, tuple[float, float, float]] = field(default_factory=dict)


def _tensor_axes_divisor(pl: tuple[int, ...], sizes: tuple[int, ...]) -> int:
    d = 1
    for p, n in zip(pl, sizes):
        if p >= 0:
            d *= n
    return d


class NodeCosts:
    """Cost methods of `cost_graph._Builder` (which provides the attributes they read)."""

    def _flops(self, n: Node) -> tuple[int, int]:
        try:
            f = flops_mod.forward_flops(n.target, n.fake_args, n.fake_kwargs, n.fake_out)
            # only inputs that need a gradient cost backward FLOPs (a user input or a mask needs none)
            needs = [isinstance(a, tuple) and len(a) == 2 and a[0] == "node" and self.rg[a[1]] for a in n.args]
            b = (flops_mod.backward_flops(n.target, n.fake_args, n.fake_kwargs, n.fake_out, needs_input_grad=needs)
                 if self.rg[n.index] else 0)
            return f, b
        except ProfileError:
            self.unknown_flops[n.op_name] = self.unknown_flops.get(n.op_name, 0) + 1
            return 0, 0

    def _kind(self, n: Node) -> str | None:
        try:
            return flops_mod.op_kind(n.target)
        except ProfileError:
            return None

    def _is_view(self, n: Node) -> bool:
        if n.op_name in _VIEW_OPS:
            return True
        try:
            return flops_mod.op_kind(n.target) == "view"
        except ProfileError:
            return False

    def _conversion(self, i: int, raw: tuple[int, ...], pub: tuple[int, ...]) -> tuple[float, float]:
        """Seconds (forward, backward) of node `i`'s change of layout from `raw` to `pub` at its publish: a form's
        own way where it has one (`Form.conversion`: sequence parallelism's two-step entry into the blocks),
        else the cheapest conversion (`treadle.cost.convert.plan_conversion`)."""
        if raw == pub or self.sub_cluster is None:
            return 0.0, 0.0
        for f in forms():
            own = f.conversion(self, i, raw, pub)
            if own is not None:
                return own
        meta = self.nodes[i].out
        return self.layout_change_s(self.local_dp_shape(i, meta.shape), meta.dtype.itemsize, raw, pub)

    def layout_change_s(self, shape: tuple[int, ...], itemsize: int, src: tuple[int, ...],
                        dst: tuple[int, ...]) -> tuple[float, float]:
        """Seconds (forward, backward) of the cheapest change of a (data-parallel local) `shape` from placement
        codes `src` to `dst` on the tensor axes: its collectives (`treadle.cost.convert.plan_conversion`) and the
        local ops the runtime runs around them (NOTE [copies]), priced as `treadle.price` prices those ops."""
        if src == dst:
            return 0.0, 0.0
        plan = plan_conversion(Layout.from_codes(src), Layout.from_codes(dst), global_shape=shape,
                               itemsize=itemsize, cluster=self.sub_cluster)
        return (plan.time_s + self.local_ops_s(plan.local_ops),
                plan.backward_time_s + self.local_ops_s(plan.backward_local_ops))

    def local_ops_s(self, ops) -> float:
        """Seconds of local ops, each given by the bytes it copies (NOTE [copies] in `treadle.cost.convert`), as
        `treadle.price` prices an op it records: the roofline time of the bytes read and written, plus the
        device's per-op overhead."""
        return math.fsum(op_time_s(0, int(2 * b), self.hw, torch.float32) + self.hw.op_overhead_s for b in ops)

    def traffic(self, n: Node) -> tuple[float, float]:
        """(forward, backward) bytes node `n`'s ops move, each over the bytes of its own inputs and outputs (all
        global: NOTE [bytes per node] in saved.py). Without the measurement, 1 forward and 2 backward (a pass over
        its tensors each way, its backward twice: the estimate before the measurement)."""
        got = self._traffic.get(n.index)
        if got is None:
            own = 0.0 if self._is_view(n) else float(
                sum(self.nodes[j].out.nbytes for j in n.inputs if isinstance(self.nodes[j].out, TensorMeta))
                + sum(m.nbytes for m in (n.out if isinstance(n.out, tuple) else (n.out,))
                      if isinstance(m, TensorMeta)))
            fb, bb = self.g.fwd_bytes, self.g.bwd_bytes
            rf = fb.get(n.index, 0) / own if fb is not None and own else 1.0
            rb = bb.get(n.index, 0) / own if bb is not None and own else 2.0
            got = self._traffic[n.index] = (rf, rb)
        return got

    def grad_uses(self, i: int) -> int:
        """How many consumers of node `i` hand a gradient back to it (each reads it once: `Node.inputs` holds an
        input once)."""
        got = self._uses.get(i)
        if got is None:
            got = self._uses[i] = sum(1 for u in self.nodes[i].users if self.rg[u])
        return got

    def fork_sums_s(self, n: Node, pub: tuple[int, ...]) -> float:
        """NOTE [gradient sums at a fork]: the autograd engine adds up the gradients of a value that k consumers
        read, k - 1 sums of its local gradient (in the layout `pub` it is published in; a parameter: its placement),
        each priced as `treadle.price` prices the add it records. Their dispatch overhead is in the node's counted
        backward ops already."""
        k = self.grad_uses(n.index)
        m = n.out
        if k < 2 or n.kind not in ("op", "param") or not isinstance(m, TensorMeta):
            return 0.0
        div = _tensor_axes_divisor(pub, self.tp_sizes) * self.dp_div(n.index)
        nbytes, elems = m.nbytes / div, m.numel / div
        return (k - 1) * op_time_s(0, int(3 * nbytes), self.hw, m.dtype, op="add", elems=int(elems))

    def recomputed(self, i: int) -> str:
        """How much of node `i` a checkpointed block's recompute runs again (NOTE [recompute stops early] in
        saved.py): "all" up to the block's last node whose ops save a tensor, "compute" for that node (its exit
        conversion comes after), "none" after it. Outside blocks, or without the measurement: "all"."""
        last = self.last_packer.get(self.nodes[i].block) if self.g.packers is not None else None
        if last is None:
            return "all"
        return "all" if i < last else "compute" if i == last else "none"

    def op_counts(self, i: int) -> tuple[int, int]:
        """ATen ops node `i` dispatches in forward and in backward (NOTE [ops per node] in saved.py): as counted at
        capture, or one each way when the capture could not count them."""
        fwd = self.g.fwd_ops.get(i, 0) if self.g.fwd_ops is not None else 1
        bwd = self.g.bwd_ops.get(i, 0) if self.g.bwd_ops is not None else 1
        return fwd, bwd

    def strategy_cost(self, n: Node, combo: tuple[AxisOption, ...], pub: tuple[int, ...]) -> StrategyCost:
        c = StrategyCost()
        i = n.index
        f_flops, b_flops = self.flop_cache[i]
        work = self.dp_div(i)
        for o, size in zip(combo, self.tp_sizes):
            if o.work_split:
                work *= size
        moved = 0.0
        if not self._is_view(n):
            for pos, j in enumerate(n.inputs):
                m = self.nodes[j].out
                if isinstance(m, TensorMeta):
                    pl = tuple(o.ins[pos] for o in combo)
                    moved += m.nbytes / _tensor_axes_divisor(pl, self.tp_sizes) / self.dp_div(j)
        out_elems = out_bytes = 0.0
        if not self._is_view(n):
            outs = n.out if isinstance(n.out, tuple) else (n.out,)
            for k, m in enumerate(outs):
                if isinstance(m, TensorMeta):
                    pl = tuple(o.outs[k] if k < len(o.outs) else R for o in combo)
                    local = _tensor_axes_divisor(pl, self.tp_sizes) * self.dp_div(i)
                    moved += m.nbytes / local
                    out_bytes += m.nbytes / local
                    out_elems += m.numel / local
        dtype = self.dtype_compute or _dtype_of(n)
        kind = self._kind(n)
        # each op the node dispatches also costs the device's dispatch overhead, forward and backward, as
        # `price` charges it (NOTE [ops per node] in saved.py: counted at capture; one each way when not);
        # kernel rates by kind (NOTE [kernel rates]): a backward matmul is priced at its forward product's size
        n_fwd, n_bwd = self.op_counts(i)
        rf, rb = self.traffic(n)  # NOTE [bytes per node] in saved.py: the node's ops' bytes over its tensors'
        fwd = (op_time_s(int(f_flops / work), int(rf * moved), self.hw, dtype, kind=kind, op=n.op_name,
                         elems=int(out_elems)) + n_fwd * self.hw.op_overhead_s)
        if kind == "matmul" and f_flops and b_flops:
            eff = matmul_efficiency(f_flops / work, self.hw)
            b_compute = b_flops / work / (self.hw.peak_for(dtype) * eff)
            bwd = max(b_compute, op_time_s(0, int(rb * moved), self.hw, dtype)) + n_bwd * self.hw.op_overhead_s
        else:
            bwd = (op_time_s(int(b_flops / work), int(rb * moved), self.hw, dtype, kind=kind)
                   + n_bwd * self.hw.op_overhead_s)
        if not self.rg[i]:
            bwd = forks = 0.0
        else:
            forks = self.fork_sums_s(n, pub)  # before the node's backward: input-gradient work, none of W's
        c.compute_s = fwd + bwd + forks
        c.fwd_s = fwd
        c.bwd_s = bwd + forks
        c.w_s = flops_mod.MATMUL_WEIGHT_GRAD_SHARE * bwd if kind == "matmul" else 0.0
        c.w_held_bytes = out_bytes if kind == "matmul" else 0.0  # as the pipeline's price holds it
        rec = self.recomputed(i)  # "all", "compute" (the node runs, its exit conversion does not) or "none"
        c.rec_s = fwd if rec != "none" else 0.0
        # conversion at publish
        cf, cb = self._conversion(i, tuple(o.outs[0] for o in combo), pub) if combo else (0.0, 0.0)
        if not self.rg[i]:
            cb = 0.0  # no gradient flows back through it: a local slice of such a value is free both ways
        c.comm_s += cf + cb
        c.fwd_s += cf
        if rec == "all":
            c.rec_s += cf
        c.bwd_comm_s += cb
        for f in forms():  # each form's communication of this node (the vocab-parallel loss's all-reduces)
            f.node_cost(self, n, combo, pub, c, rec)
        # parameters owned by this node (first consumer): static memory and gradient reduction
        for src, pl in self.owned_params(n, combo):
            own = self.own_split.get(src.param)  # split and reduced by another form (the experts)
            c.static_bytes += self.owned_static_bytes(src, pl)
            c.static_grad_bytes += self.param_grad_static_bytes(src.out, pl, own)
            fork = self.fork_sums_s(src, pl) / (own or 1)  # a tied parameter's gradients summed
            c.compute_s += fork
            c.bwd_s += fork
            c.grad_bytes += (src.out.numel / _tensor_axes_divisor(pl, self.tp_sizes) / (own or 1)
                             * src.out.dtype.itemsize)
            opt = self.optimizer_s(src.out, pl, own)
            c.compute_s += opt
            c.opt_s += opt
            if own is not None:
                continue
            for f in forms():  # each form's terms of a parameter (data parallelism: its gradient sync, copies)
                f.param_cost(self, src.out, pl, c)
        # saved activations: outputs of this node that some consumer saves (views count on their base)
        c.act_bytes += self.saved_bytes(n, combo, pub)
        c.work_bytes = max(c.work_bytes, self.working_bytes(n, combo, pub))
        if self.g.sac and n.block is not None:
            strategy_terms(self, i, c, fwd, rec, self.saved_divisor(n, combo, pub))
        return c

    def owned_params(self, n: Node, combo: tuple[AxisOption, ...]) -> Iterator[tuple[Node, tuple[int, ...]]]:
        """The parameters node `n` owns (it is their first consumer), each with its placement codes on the tensor
        axes under `combo`."""
        for pos, j in enumerate(n.inputs):
            src = self.nodes[j]
            if src.kind == "param" and self.param_owner.get(src.param) == n.index:
                yield src, tuple(o.ins[pos] for o in combo)

    def owned_static_bytes(self, src: Node, pl: tuple[int, ...]) -> float:
        """Static bytes per device of an owned parameter at placement `pl` (`param_static_bytes`, with what another
        form splits it over)."""
        return self.param_static_bytes(src.out, pl, self.own_split.get(src.param), self.own_gathered.get(src.param))

    def strategy_memory(self, n: Node, combo: tuple[AxisOption, ...],
                        pub: tuple[int, ...]) -> tuple[float, float, float]:
        """(static, saved, of static the gradients') bytes of a strategy as the core of `strategy_cost` counts them,
        without its conversions' times: the forms only add to either, so each bounds `strategy_cost`'s from below
        (NOTE [a memory floor before the costs] in floors.py)."""
        static = grads = 0.0
        for src, pl in self.owned_params(n, combo):
            static += self.owned_static_bytes(src, pl)
            grads += self.param_grad_static_bytes(src.out, pl, self.own_split.get(src.param))
        return static, self.saved_bytes(n, combo, pub), grads

    def param_static_bytes(self, meta: TensorMeta, pl: tuple[int, ...], own: int | None = None,
                           own_gathered: int | None = None) -> float:
        """Parameter, gradient and optimizer bytes of the local shard (1/`param_divisor` of it under ZeRO-3;
        1/`own` of it for a parameter another form splits, `own_split`); with `gathered_kept` (no reshard after
        forward), plus the gathered parameter, kept from forward to backward (the price: all units gathered at
        the end of forward) — for another form's parameter, 1/`own_gathered` of it where FSDP2 gathers it."""
        local = meta.numel / _tensor_axes_divisor(pl, self.tp_sizes)
        per = 2 * meta.dtype.itemsize + self.train.optimizer_bytes_per_elem
        if self.train.master_copy and meta.dtype != torch.float32:
            per += 4
        if own is not None:
            kept = local / own_gathered * meta.dtype.itemsize if self.gathered_kept and own_gathered else 0.0
            return local / own * per + kept
        full = local
        local /= self.param_divisor
        kept = full * meta.dtype.itemsize if self.gathered_kept else 0.0
        return local * per + kept

    def param_grad_static_bytes(self, meta: TensorMeta, pl: tuple[int, ...], own: int | None = None) -> float:
        """Of `param_static_bytes`, the gradient's: the local shard's (1/`own` of it for a parameter another form
        splits, else 1/`param_divisor`)."""
        return meta.numel / _tensor_axes_divisor(pl, self.tp_sizes) / (own or self.param_divisor) * meta.dtype.itemsize

    def optimizer_s(self, meta: TensorMeta, pl: tuple[int, ...], own: int | None = None) -> float:
        """AdamW's step on this parameter's local shard: `treadle.runtime.optimizer.adamw_tensor_s`, the price's
        own term (the list ops are the role's constant `CostGraph.host_s`)."""
        elems = meta.numel / _tensor_axes_divisor(pl, self.tp_sizes) / (own or self.param_divisor)
        return adamw_tensor_s(elems, meta.dtype, self.train.optimizer_bytes_per_elem, self.hw,
                              subclass=self.param_subclass)

    def replicated_grad_bytes(self) -> float:
        """Gradient bytes of every parameter the model reads (all blocks), unsharded; a tied parameter once (the
        graph reads it under one name, its other name's placeholder has no users)."""
        if self._grad_bytes is None:
            self._grad_bytes = float(sum(
                n.out.nbytes * (self.count(n.index) if n.block is not None else 1) for n in self.nodes
                if n.kind == "param" and n.users and isinstance(n.out, TensorMeta)
                and self.canonical(n.index) == n.index))
        return self._grad_bytes

    def saved_bytes(self, n: Node, combo, pub) -> float:
        """Bytes of n's outputs that autograd keeps, per device: the measured global figure (NOTE [saved by
        autograd] in saved.py), each part divided like the tensor of n it is shaped like (`split_bytes`; where the
        split was not measured, like n's first output); without a measurement, the per-op rules."""
        i = n.index
        outs = n.out if isinstance(n.out, tuple) else (n.out,)
        like = self.g.saved_like.get(i) if self.g.saved_like is not None else None
        if like:  # each part by the shards of the tensor it is shaped like (NOTE [a backward's working set])
            return self.split_bytes(n, combo, pub, like)
        if self.g.saved is not None:
            b = self.g.saved.get(i, 0)
            return b / self.saved_divisor(n, combo, pub) if b else 0.0
        if not self.saved[i]:
            return 0.0
        total = 0.0
        for k, m in enumerate(outs):
            if isinstance(m, TensorMeta) and self.saved[i]:
                pl = pub if k == 0 else tuple(o.outs[k] if k < len(o.outs) else R for o in combo)
                total += m.nbytes / _tensor_axes_divisor(pl, self.tp_sizes) / self.dp_div(i)
        return total

    def split_bytes(self, n: Node, combo, pub, parts: dict[int, int]) -> float:
        """Per device, the measured global bytes `parts` of node n (NOTE [a backward's working set] in grad_live.py):
        each divided by the shards of the tensor it is shaped like, an input (node index) or the output (-1)."""
        total = 0.0
        for j, b in parts.items():
            if j < 0 or j not in n.inputs:
                total += b / self.saved_divisor(n, combo, pub)
            else:
                pl = tuple(o.ins[n.inputs.index(j)] for o in combo)
                total += b / (_tensor_axes_divisor(pl, self.tp_sizes) * self.dp_div(j))
        return total

    def working_bytes(self, n: Node, combo, pub) -> float:
        """Per device, what node n's backward holds beside the saved activations (NOTE [a backward's working set]);
        0 where not measured."""
        parts = self.g.working.get(n.index) if self.g.working is not None else None
        return self.split_bytes(n, combo, pub, parts) if parts else 0.0

    def saved_divisor(self, n: Node, combo, pub) -> float:
        """What divides node n's measured global bytes per device: its first tensor output's shards."""
        outs = n.out if isinstance(n.out, tuple) else (n.out,)
        first = next((k for k, m in enumerate(outs) if isinstance(m, TensorMeta)), None)
        if first is None:
            return float(self.dp_div(n.index))
        pl = pub if first == 0 else tuple(o.outs[first] if first < len(o.outs) else R for o in combo)
        return _tensor_axes_divisor(pl, self.tp_sizes) * self.dp_div(n.index)

    def _mark_saved(self) -> None:
        """saved[i]: node i's output storage is kept for backward by some consumer (views -> their base)."""
        self.saved = [False] * len(self.nodes)

        def base(j: int) -> int:
            while self.nodes[j].kind == "op" and self.nodes[j].op_name in _VIEW_OPS and self.nodes[j].inputs:
                j = self.nodes[j].inputs[0]
            return j

        for n in self.nodes:
            if n.kind != "op" or not self.rg[n.index]:
                continue
            name = n.op_name
            if name in _SAVES_OUTPUT:
                b = base(n.index)
                if self.nodes[b].kind == "op":
                    self.saved[b] = True
            if name in _SAVES_NOTHING or name in _SAVES_OUTPUT and name != "scaled_dot_product_attention":
                continue
            for j in n.inputs:
                b = base(j)
                src = self.nodes[b]
                if src.kind == "op" and isinstance(src.out, (TensorMeta, tuple)):
                    self.saved[b] = True

    # ------------------------------------------------------------------ assembly


def _dtype_of(n: Node) -> torch.dtype:
    m = n.out[0] if isinstance(n.out, tuple) and n.out else n.out
    dt = m.dtype if isinstance(m, TensorMeta) else torch.float32
    return dt if dt.is_floating_point else torch.float32

