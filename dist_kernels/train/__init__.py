"""Training driver: ``python -m dist_kernels.train`` (see docs/train.md).

Small parts composed in ``driver.py``: ``config`` (the typed options), ``data`` (the local
character corpus and its layout-independent sampler), ``model`` (the model seam), ``engines``
(the parallel layouts), ``metrics`` and ``stragglers`` (what each interval measures),
``checkpoints`` (resume and elastic recovery), ``report`` (summary table and plot), ``cli``.
"""

from .config import ConfigError, TrainConfig
from .driver import RunResult, train

__all__ = ["ConfigError", "RunResult", "TrainConfig", "train"]
