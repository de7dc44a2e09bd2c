// OpQueue: the asynchronous operations of one communicator, started in issue order.
//
// A dispatcher thread starts queued operations. A collective (both lanes) starts once every
// earlier operation has finished and executes on the dispatcher itself; a send or a receive
// (one lane) starts once its lane is free and no earlier queued operation wants that lane, and
// executes on the lane's worker thread. So a send queued behind receives that wait for their
// peer starts at once. This
// is what lets isend/irecv pairs be issued in any order, as with torch.distributed: two ranks
// that both isend a large message and then irecv would otherwise wait for each other forever.
//
// Invariants: operations on one lane start in issue order and one at a time; a collective
// starts only after every earlier operation has finished, and nothing starts while it runs.
// So every rank's message sequence on each FIFO is its issue order.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "comm/request.h"
#include "comm/work.h"
#include "common/status.h"
#include "transport/shm_transport.h"

namespace dk {

class OpQueue {
 public:
  using Execute = std::function<Status(const Request&)>;

  // Starts the threads. `onStart` runs first on the dispatcher thread and its status is
  // returned (nothing runs if it fails); `onStop` runs last on it, after the queue drained.
  Status start(Execute execute, std::function<Status()> onStart, std::function<void()> onStop);
  // Fails once stop() has begun.
  Status submit(Request request, std::shared_ptr<Work> work, shm::Lane lane);
  // Waits until no queued or running operation uses `lane` (kBoth: until nothing is left).
  void drain(shm::Lane lane);
  // Runs what is queued, then stops and joins the threads. Idempotent.
  void stop();
  ~OpQueue() { stop(); }

 private:
  struct Op {
    Request request;
    std::shared_ptr<Work> work;
    shm::Lane lane;
  };
  void dispatchLoop(std::function<Status()> onStart, std::function<void()> onStop,
                    std::promise<Status>* started);
  void laneLoop(int lane);
  std::deque<Op>::iterator startable();  // under mutex_
  bool idle(shm::Lane lane) const;       // no started operation on `lane` is unfinished
  bool quiet(shm::Lane lane) const;      // ... and none queued uses it either
  void finished(shm::Lane lane);         // under mutex_
  static bool uses(shm::Lane op, shm::Lane lane);

  Execute execute_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Op> queue_;         // submitted, not started
  int running_[2] = {0, 0};      // started, unfinished, per lane (a collective on both)
  std::optional<Op> handed_[2];  // started, waiting for its lane worker to pick it up
  bool stopping_ = false;        // stop(): run what is queued, then exit
  bool lanesStopping_ = false;   // the dispatcher has exited: lane workers exit too
  std::thread dispatcher_;
  std::thread laneWorkers_[2];
};

}  // namespace dk
