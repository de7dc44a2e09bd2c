// The Python stack of the calling thread, for flight-recorder entries (DK_TRACE_PYTHON_STACK=1).
// Needs the GIL.
#pragma once

#include "comm/flight_recorder.h"

namespace dk::bindings {

TraceFrames capturePythonStack();

}  // namespace dk::bindings
