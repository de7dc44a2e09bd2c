"""Reference models built to be sharded: ``GPT`` (see :mod:`dist_kernels.models.gpt`)."""

from .gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
