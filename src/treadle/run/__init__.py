"""Train for real under torchrun: `python -m treadle.run` builds a schedule (a file, ``--plan auto`` or a
recipe), trains with AdamW on packed local text, bf16 if asked, checkpoints with torch.distributed.checkpoint
(resharding on load across schedules), and reports live metrics; it never loses or corrupts its state.
Modules: config (settings, TOML), data, setup (model and schedule), layout (parameter placements), optim, step
(one agreed optimizer step: non-finite guard, stop requests), checkpoint (DCP save / load / export), manifest
(checkpoint directories and their checksums), safe_pickle (DCP metadata as data), lock (one job per checkpoint
directory), preflight (checks before the first step), preempt (SIGTERM / SIGUSR1), agree (ranks agreeing on an
error), health (heartbeats, who is to blame), failure (one line per error, exit status), metrics, loop (the
job), cli."""

from .config import RunConfig, RunError

__all__ = ["RunConfig", "RunError"]
