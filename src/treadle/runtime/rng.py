"""Named random-number streams (Megatron's RNG-state tracker) beside `Schedule.fork_rng`.

A tracker holds one generator state per name. ``with tracker.fork("model-parallel"):`` runs its body on that
stream (dropout inside tensor-parallel regions draws different masks per tensor-parallel rank) and leaves the
default stream exactly as it was, so code outside the fork draws the same numbers on every rank.
`model_parallel_seed(seed, mesh=..., axis="tp")` seeds the default stream with `seed` on every rank and adds
the stream ``"model-parallel"`` seeded ``seed + 2718 + rank along axis`` (Megatron's offset), so ranks that
differ only on other axes (data parallel) share it.

States are the device generator's states (CPU: `torch.get_rng_state`; CUDA: `torch.cuda.get_rng_state` of the
current device); a tracker is plain per-process data, nothing global.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..errors import BuildError
from ..mesh import Mesh

MODEL_PARALLEL = "model-parallel"
MODEL_PARALLEL_OFFSET = 2718  # Megatron-LM's model-parallel seed offset (megatron/core/tensor_parallel/random.py)


class RNGStatesTracker:
    """Named generator states: `add`, `fork`, `get_states`, `set_states`, `reset`.

    `device`: ``"cpu"`` or ``"cuda"`` (the current CUDA device). Raises BuildError for a name added twice, a
    seed already used by another name, or a fork of an unknown name."""

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise BuildError(f"RNGStatesTracker: device must be cpu or cuda, got {self.device}")
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: dict[int, str] = {}

    # ---------------------------------------------------------------- device generator
    def _get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state() if self.device.type == "cuda" else torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state)
        else:
            torch.set_rng_state(state)

    def _seed(self, seed: int) -> None:
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    # ---------------------------------------------------------------- API
    def add(self, name: str, seed: int) -> None:
        """A new stream `name` seeded with `seed` (the default stream is left unchanged)."""
        if name in self._states:
            raise BuildError(f"RNG tracker: stream {name!r} already exists; reset() first or pick another name")
        if seed in self._seeds:
            raise BuildError(f"RNG tracker: seed {seed} is already used by stream {self._seeds[seed]!r}; streams "
                             f"with one seed would draw the same numbers")
        saved = self._get()
        try:
            self._seed(seed)
            self._states[name] = self._get()
        finally:
            self._set(saved)
        self._seeds[seed] = name

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL) -> Iterator[None]:
        """Run the body on stream `name`; afterwards the stream has advanced and the default stream is restored."""
        if name not in self._states:
            raise BuildError(f"RNG tracker: no stream {name!r}; streams: {sorted(self._states)}")
        saved = self._get()
        self._set(self._states[name])
        try:
            yield
        finally:
            self._states[name] = self._get()
            self._set(saved)

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every stream's state (for checkpoints)."""
        return {k: v.clone() for k, v in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the streams by `states` (from `get_states`)."""
        self._states = {k: v.clone() for k, v in states.items()}

    def reset(self) -> None:
        """Forget every stream and seed."""
        self._states.clear()
        self._seeds.clear()

    def names(self) -> list[str]:
        return sorted(self._states)


def model_parallel_seed(seed: int, *, mesh: Mesh, axis: str = "tp",
                        tracker: RNGStatesTracker | None = None) -> RNGStatesTracker:
    """Seed the default stream with `seed` (the same on every rank) and add stream ``"model-parallel"`` seeded
    ``seed + 2718 + rank along axis``. Needs a launched job whose world matches `mesh`. Returns the tracker
    (a new one on the mesh's device unless given; an existing one is reset first)."""
    mesh.bind()
    if tracker is None:
        tracker = RNGStatesTracker(mesh.device.type)
    tracker.reset()
    tracker._seed(seed)
    tracker.add(MODEL_PARALLEL, seed + MODEL_PARALLEL_OFFSET + mesh.local_rank(axis))
    return tracker
