"""Train for real under torchrun: `python -m treadle.run` builds a schedule (a file, ``--plan auto`` or a
recipe), trains with AdamW on packed local text, bf16 if asked, checkpoints with torch.distributed.checkpoint
(resharding on load across schedules), and reports live metrics. Modules: config (settings, TOML), data,
setup (model and schedule), layout (parameter placements), optim, checkpoint, metrics, health (ranks behind),
loop (the job), cli."""

from .config import RunConfig, RunError

__all__ = ["RunConfig", "RunError"]
