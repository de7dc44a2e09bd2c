"""How long a collective may wait for its peers before it fails with CommError.

The first that applies:

1. the ``timeout=`` argument of the communicator;
2. ``DK_TIMEOUT`` (seconds) in the environment;
3. the torch group's own timeout (``init_process_group(timeout=...)``), unless it is torch's
   default of 30 minutes, which torch applies whether or not anyone chose it;
4. :data:`DEFAULT_TIMEOUT`, 5 minutes.

Why 5 minutes: a hang should be reported while someone still watches the terminal (the flight
recorder dump and the desync report come with the timeout), yet be longer than any honest
wait at a collective: the first step after a slow checkpoint load or a torch.compile on one
rank, which take minutes. Raise it with ``DK_TIMEOUT`` when a job's phases are longer.
"""

from __future__ import annotations

import datetime
import os
from typing import Optional

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)
#: torch.distributed's default (``default_pg_timeout``): what every group has unless set.
TORCH_DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


def env_timeout() -> Optional[datetime.timedelta]:
    """``DK_TIMEOUT`` as a timedelta, or None when unset."""
    text = os.environ.get("DK_TIMEOUT", "").strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"DK_TIMEOUT must be a number of seconds > 0, got {text!r}")
    return datetime.timedelta(seconds=seconds)


def resolve_timeout(
    explicit: Optional[datetime.timedelta], group: Optional[datetime.timedelta] = None
) -> datetime.timedelta:
    """The timeout a communicator uses (see the module docstring for the order)."""
    if explicit is not None:
        return explicit
    from_env = env_timeout()
    if from_env is not None:
        return from_env
    if group is not None and group != TORCH_DEFAULT_TIMEOUT:
        return group
    return DEFAULT_TIMEOUT
