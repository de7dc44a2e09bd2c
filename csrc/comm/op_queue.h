// OpQueue: the asynchronous operations of one communicator, started in issue order.
//
// Three worker threads: one for collectives (both lanes), one for sends, one for receives.
// Whoever changes the queue's state (a submit, a finished operation) starts what may start
// now, so a queued operation reaches its worker in one thread handoff. A collective starts
// once every earlier operation has finished; a send or a receive once its lane is free and no
// earlier queued operation wants that lane. So a send queued behind receives that wait for
// their peer starts at once: isend/irecv pairs may be issued in any order, as with
// torch.distributed (two ranks that both irecv and then isend a large message would
// otherwise wait for each other forever).
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

  // Starts the threads. `onStart` runs first on the collective worker, which lives as long
  // as the queue, and its status is returned (nothing runs if it fails); `onStop` runs last
  // on it, once the queue has drained.
  Status start(Execute execute, std::function<Status()> onStart, std::function<void()> onStop);
  // Fails once stop() has begun.
  Status submit(Request request, std::shared_ptr<Work> work, shm::Lane lane);
  // Waits until no queued or running operation uses `lane` (kBoth: until nothing is left).
  void drain(shm::Lane lane);
  // Calls `fn` with the queue locked if nothing queued or running uses `lane` (an operation
  // on it would start at once anyway) and returns what it returns; else returns false without
  // calling it. `fn` must not block: every submit() waits for it.
  bool ifQuiet(shm::Lane lane, const std::function<bool()>& fn);
  // Runs what is queued, then stops and joins the threads. Idempotent.
  void stop();
  ~OpQueue() { stop(); }

 private:
  struct Op {
    Request request;
    std::shared_ptr<Work> work;
    shm::Lane lane;
  };
  // Worker slots: indexed by shm::Lane (kSend, kRecv, kBoth = the collective worker).
  static constexpr int kWorkers = 3;

  void collectiveLoop(std::function<Status()> onStart, std::function<void()> onStop,
                      std::promise<Status>* started);
  void workerLoop(int slot);
  bool mayExit(int slot) const;          // under mutex_
  void pump();                           // under mutex_: starts what may start now
  std::deque<Op>::iterator startable();  // under mutex_
  bool idle(shm::Lane lane) const;       // no started operation on `lane` is unfinished
  bool quiet(shm::Lane lane) const;      // ... and none queued uses it either
  void finished(shm::Lane lane);         // under mutex_
  static bool uses(shm::Lane op, shm::Lane lane);

  Execute execute_;
  std::mutex mutex_;
  std::condition_variable changed_;               // drain() and stop() wait on it
  std::condition_variable handedOver_[kWorkers];  // a worker waits on its own
  std::deque<Op> queue_;                          // submitted, not started
  int running_[2] = {0, 0};             // started, unfinished, per lane (a collective on both)
  std::optional<Op> handed_[kWorkers];  // started, not yet picked up by its worker
  bool stopping_ = false;               // stop(): run what is queued, then exit
  std::thread workers_[kWorkers];
};

}  // namespace dk
