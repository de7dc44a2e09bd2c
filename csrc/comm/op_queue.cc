#include "comm/op_queue.h"

namespace dk {

using shm::Lane;

namespace {
constexpr int kSend = static_cast<int>(Lane::kSend);
constexpr int kRecv = static_cast<int>(Lane::kRecv);
constexpr int kBoth = static_cast<int>(Lane::kBoth);
}  // namespace

Status OpQueue::start(Execute execute, std::function<Status()> onStart,
                      std::function<void()> onStop) {
  execute_ = std::move(execute);
  std::promise<Status> started;
  auto ready = started.get_future();
  workers_[kBoth] =
      std::thread(&OpQueue::collectiveLoop, this, std::move(onStart), std::move(onStop), &started);
  Status status = ready.get();
  if (!status.ok()) {
    workers_[kBoth].join();  // it returned without entering its loop
    return status;
  }
  workers_[kSend] = std::thread(&OpQueue::workerLoop, this, kSend);
  workers_[kRecv] = std::thread(&OpQueue::workerLoop, this, kRecv);
  return Status::Ok();
}

Status OpQueue::submit(Request request, std::shared_ptr<Work> work, Lane lane) {
  std::lock_guard<std::mutex> lock(mutex_);
  // After stop() nothing would ever run it, and its Work would never complete.
  if (stopping_) return Status(Code::kPeerFailure, "the communicator is closed");
  queue_.push_back({std::move(request), std::move(work), lane});
  pump();
  return Status::Ok();
}

bool OpQueue::uses(Lane op, Lane lane) {
  return op == Lane::kBoth || lane == Lane::kBoth || op == lane;
}

bool OpQueue::idle(Lane lane) const {
  if (lane == Lane::kBoth) return running_[kSend] == 0 && running_[kRecv] == 0;
  return running_[static_cast<int>(lane)] == 0;
}

bool OpQueue::quiet(Lane lane) const {
  if (!idle(lane)) return false;
  for (const Op& op : queue_) {
    if (uses(op.lane, lane)) return false;
  }
  return true;
}

// The first queued operation that may start now: its lanes are idle and no earlier queued
// operation wants one of them (that one must start first: per-lane issue order).
std::deque<OpQueue::Op>::iterator OpQueue::startable() {
  bool claimed[2] = {false, false};
  for (auto it = queue_.begin(); it != queue_.end(); ++it) {
    const bool send = it->lane != Lane::kRecv;
    const bool recv = it->lane != Lane::kSend;
    if (!(send && claimed[kSend]) && !(recv && claimed[kRecv]) && idle(it->lane)) return it;
    claimed[kSend] |= send;
    claimed[kRecv] |= recv;
    if (claimed[kSend] && claimed[kRecv]) break;
  }
  return queue_.end();
}

void OpQueue::pump() {
  for (auto next = startable(); next != queue_.end(); next = startable()) {
    const int slot = static_cast<int>(next->lane);
    if (slot != kRecv) running_[kSend] += 1;
    if (slot != kSend) running_[kRecv] += 1;
    handed_[slot] = std::move(*next);
    queue_.erase(next);
    handedOver_[slot].notify_one();
  }
}

bool OpQueue::ifQuiet(Lane lane, const std::function<bool()>& fn) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (stopping_ || !quiet(lane)) return false;
  return fn();
}

void OpQueue::drain(Lane lane) {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return quiet(lane); });
}

void OpQueue::finished(Lane lane) {
  if (lane != Lane::kRecv) running_[kSend] -= 1;
  if (lane != Lane::kSend) running_[kRecv] -= 1;
  pump();
  changed_.notify_all();
  if (stopping_ && queue_.empty() && idle(Lane::kBoth)) {
    for (auto& worker : handedOver_) worker.notify_one();
  }
}

bool OpQueue::mayExit(int slot) const {
  return !handed_[slot] && stopping_ && queue_.empty() && idle(Lane::kBoth);
}

void OpQueue::workerLoop(int slot) {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    handedOver_[slot].wait(lock, [&] { return handed_[slot].has_value() || mayExit(slot); });
    if (!handed_[slot]) break;
    Op op = std::move(*handed_[slot]);
    handed_[slot].reset();
    lock.unlock();
    op.work->complete(execute_(op.request));
    lock.lock();
    finished(op.lane);
  }
}

void OpQueue::collectiveLoop(std::function<Status()> onStart, std::function<void()> onStop,
                             std::promise<Status>* started) {
  Status status = onStart();
  started->set_value(status);
  if (!status.ok()) return;
  workerLoop(kBoth);
  onStop();  // nothing runs any more: the queue is empty and every lane idle
}

void OpQueue::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    for (auto& worker : handedOver_) worker.notify_one();
  }
  for (std::thread& worker : workers_) {
    if (worker.joinable()) worker.join();
  }
}

}  // namespace dk
