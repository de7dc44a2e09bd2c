// Ctrl-C while a rank waits for a peer. Python's SIGINT handler only sets a flag that the
// interpreter checks between bytecodes, so a call blocked in C++ (GIL released) would ignore
// Ctrl-C until its timeout. This counts SIGINTs in a handler placed in front of the one it
// replaces (Python's, which it still calls, so KeyboardInterrupt is raised as usual once the
// call returns): a wait that sees the count change gives up with Code::kInterrupted.
#pragma once

#include <cstdint>

namespace dk::interrupt {

// SIGINTs received since the counter was first armed (async-signal-safe reads).
uint64_t sigintCount();

// Puts the counting handler in front of the current SIGINT handler, unless it is there
// already (Python's signal.signal() replaces it: waits re-arm when they start sleeping) or
// SIGINT is ignored. Costs a sigaction() call: callers arm on their slow path only.
void armSigint();

}  // namespace dk::interrupt
