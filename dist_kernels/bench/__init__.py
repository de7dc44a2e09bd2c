"""The collective benchmark, ``python -m dist_kernels.bench`` (nccl-tests columns, Gloo beside).

``cli`` parses options and spawns or joins the ranks; ``ops`` runs and checks one collective at
one size for each backend; ``report`` prints the table, the summary and the plot.
"""

from .cli import main

__all__ = ["main"]
