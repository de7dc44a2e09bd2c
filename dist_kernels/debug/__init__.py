"""See what a distributed run is doing: flight recorder, desync report, traces.

    DK_TRACE_BUFFER_SIZE=2000        entries per communicator (0: off)
    DK_TRACE_FILE=/tmp/dk_trace_rank_   dump prefix: one file per rank, <prefix><global rank>
    DK_TRACE_PYTHON_STACK=1          record each call's Python stack (costs microseconds)
    DK_DUMP_ON_SIGUSR1=0             leave SIGUSR1 alone (default: kill -USR1 <pid> dumps)
    torchfrtrace --prefix dk_trace_rank_ /tmp      torch's analyzer reads the dumps unchanged

    dk.debug.dump(path=None)             # this rank's recorders now
    with dk.debug.trace("trace_{rank}.json"):  # this rank's calls, as a Chrome trace
        ...
    dk.debug.merge(paths, "merged.json") # ranks' traces in one file, for Perfetto
    torch.profiler.profile(on_trace_ready=dk.debug.trace_handler("prof"))

Every communicator records its calls (csrc/comm/flight_recorder.h); a failed one dumps them and
prints the desync report on every surviving rank (monitor.py). docs/debugging.md walks from a
hang to the culprit rank.
"""

from .flight_recorder import buffer_size, dump, trace_file_prefix
from .monitor import reports
from .profiler import prepare as prepare_profiler_events
from .trace import add_spans, merge, trace, trace_handler

__all__ = [
    "add_spans",
    "buffer_size",
    "dump",
    "merge",
    "prepare_profiler_events",
    "reports",
    "trace",
    "trace_file_prefix",
    "trace_handler",
]
