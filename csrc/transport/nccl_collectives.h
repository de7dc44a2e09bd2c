// NCCL's own collectives on an NcclComm: algorithm="nccl", the baseline that ring and tree are
// measured against and a fallback users can choose. Counts follow torch.distributed: all_reduce
// and broadcast `count` elements; reduce_scatter and all_gather `count` elements per rank.
// Each call enqueues on `stream` (a cudaStream_t) and returns. In every build (through the loaded
// table only), like NcclComm.
#pragma once

#include <cstddef>

#include "common/dtype.h"
#include "common/status.h"
#include "transport/nccl_comm.h"

namespace dk::nccl {

Status allReduce(NcclComm& comm, const void* send, void* recv, size_t count, DType dtype, RedOp op,
                 void* stream);
// recv holds `count` elements: this rank's shard of the reduction of the ranks' `send`
// (count * world_size elements each).
Status reduceScatter(NcclComm& comm, const void* send, void* recv, size_t count, DType dtype,
                     RedOp op, void* stream);
// recv holds count * world_size elements: rank r's `send` at offset r * count.
Status allGather(NcclComm& comm, const void* send, void* recv, size_t count, DType dtype,
                 void* stream);
Status broadcast(NcclComm& comm, const void* send, void* recv, size_t count, DType dtype, int root,
                 void* stream);

}  // namespace dk::nccl
