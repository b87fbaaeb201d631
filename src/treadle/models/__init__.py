"""Ready-made schedules and named configs for Hugging Face models (the one place model structure is known)."""

from .kernels import kernel_schedule
from .megatron import megatron, schedule_bert, schedule_gpt2, schedule_llama

__all__ = ["kernel_schedule", "megatron", "schedule_gpt2", "schedule_bert", "schedule_llama"]
