// The wake-up channel of the debug monitor (dist_kernels/debug/monitor.py): a self-pipe whose
// read end a Python thread waits on. A SIGUSR1 writes 'U' (the handler does nothing but that
// write, so a collective running on another thread is not disturbed), a communicator that
// fails writes 'F'. The thread then dumps the flight recorders and, after a failure, prints
// the desync report. Writes never block and are async-signal-safe; before open() they do
// nothing.
#pragma once

#include "common/status.h"

namespace dk::debug_wakeup {

constexpr char kDumpSignal = 'U';
constexpr char kFailure = 'F';

// Creates the pipe (once per process) and returns its read end.
Status open(int* readFd);

// Writes `reason` to the pipe (dropped if the pipe is full: the reader is awake anyway).
void notify(char reason);

// Makes SIGUSR1 write kDumpSignal, unless SIGUSR1 already has a handler or is ignored (the
// program's own choice wins). `installed` says whether ours is in place now.
Status handleSigusr1(bool* installed);

}  // namespace dk::debug_wakeup
