#include "comm/op_queue.h"

namespace dk {

using shm::Lane;

namespace {
constexpr int kSend = static_cast<int>(Lane::kSend);
constexpr int kRecv = static_cast<int>(Lane::kRecv);
}  // namespace

Status OpQueue::start(Execute execute, std::function<Status()> onStart,
                      std::function<void()> onStop) {
  execute_ = std::move(execute);
  std::promise<Status> started;
  auto ready = started.get_future();
  dispatcher_ =
      std::thread(&OpQueue::dispatchLoop, this, std::move(onStart), std::move(onStop), &started);
  Status status = ready.get();
  if (!status.ok()) {
    dispatcher_.join();  // it returned without entering its loop
    return status;
  }
  laneWorkers_[kSend] = std::thread(&OpQueue::laneLoop, this, kSend);
  laneWorkers_[kRecv] = std::thread(&OpQueue::laneLoop, this, kRecv);
  return Status::Ok();
}

Status OpQueue::submit(Request request, std::shared_ptr<Work> work, Lane lane) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // After stop() nothing would ever run it, and its Work would never complete.
    if (stopping_) return Status(Code::kPeerFailure, "the communicator is closed");
    queue_.push_back({std::move(request), std::move(work), lane});
  }
  changed_.notify_all();
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

void OpQueue::drain(Lane lane) {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return quiet(lane); });
}

void OpQueue::finished(Lane lane) {
  if (lane != Lane::kRecv) running_[kSend] -= 1;
  if (lane != Lane::kSend) running_[kRecv] -= 1;
  changed_.notify_all();
}

void OpQueue::dispatchLoop(std::function<Status()> onStart, std::function<void()> onStop,
                           std::promise<Status>* started) {
  Status status = onStart();
  started->set_value(status);
  if (!status.ok()) return;
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    auto next = queue_.end();
    changed_.wait(lock, [&] {
      next = startable();
      return next != queue_.end() || (queue_.empty() && stopping_ && idle(Lane::kBoth));
    });
    if (next == queue_.end()) break;  // stopping, and everything has finished
    Op op = std::move(*next);
    queue_.erase(next);
    const Lane lane = op.lane;
    if (lane != Lane::kRecv) running_[kSend] += 1;
    if (lane != Lane::kSend) running_[kRecv] += 1;
    if (lane != Lane::kBoth) {
      handed_[static_cast<int>(lane)] = std::move(op);
      changed_.notify_all();
      continue;
    }
    lock.unlock();
    op.work->complete(execute_(op.request));
    lock.lock();
    finished(lane);
  }
  lanesStopping_ = true;
  changed_.notify_all();
  lock.unlock();
  onStop();
}

void OpQueue::laneLoop(int lane) {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    changed_.wait(lock, [&] { return handed_[lane].has_value() || lanesStopping_; });
    if (!handed_[lane]) break;
    Op op = std::move(*handed_[lane]);
    handed_[lane].reset();
    lock.unlock();
    op.work->complete(execute_(op.request));
    lock.lock();
    finished(op.lane);
  }
}

void OpQueue::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  if (dispatcher_.joinable()) dispatcher_.join();
  for (std::thread& worker : laneWorkers_) {
    if (worker.joinable()) worker.join();
  }
}

}  // namespace dk
