"""Ready-made schedules and named configs for Hugging Face models (the one place model structure is known).

The recipes import when first used (`treadle.lazy.export_lazily`): ``treadle.models.zoo``'s names need no more
than torch, so the command line checks a model name before the layers below load."""

from ..lazy import export_lazily

export_lazily(__name__, {
    "kernel_schedule": "treadle.models.kernels:kernel_schedule", "megatron": "treadle.models.megatron:megatron",
    "schedule_gpt2": "treadle.models.megatron:schedule_gpt2", "schedule_bert": "treadle.models.megatron:schedule_bert",
    "schedule_llama": "treadle.models.megatron:schedule_llama",
})

__all__ = ["kernel_schedule", "megatron", "schedule_gpt2", "schedule_bert", "schedule_llama"]
