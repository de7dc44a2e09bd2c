// A POSIX shared-memory segment mapped into this process. Names are random ("/dk-<hex>", or
// "/dk-<tag>-<hex>" with DK_SHM_TAG), created with mode 0600 and O_EXCL; the creator unlinks the
// name as soon as every rank has mapped it (the communicator's rendezvous), so a crash
// afterwards leaks nothing: the memory lives exactly as long as the last mapping.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "common/status.h"

namespace dk::shm {

class Segment {
 public:
  // Creates a fresh segment of `bytes` (rounded up to a page) under a new random name, every
  // page reserved in /dev/shm now: a full /dev/shm fails here, never later with SIGBUS.
  static Status create(size_t bytes, std::shared_ptr<Segment>* out);
  // Maps an existing segment created by a peer; `bytes` must match the creator's size.
  static Status open(const std::string& name, size_t bytes, std::shared_ptr<Segment>* out);

  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  // Removes the name from /dev/shm (idempotent); the mapping stays valid.
  Status unlink();

  const std::string& name() const { return name_; }
  void* data() const { return data_; }
  size_t size() const { return size_; }
  bool contains(const void* p, size_t bytes) const;

 private:
  Segment(std::string name, void* data, size_t size, bool owner)
      : name_(std::move(name)), data_(data), size_(size), owner_(owner) {}
  static Status map(const std::string& name, int fd, size_t bytes, bool owner,
                    std::shared_ptr<Segment>* out);

  std::string name_;
  void* data_;
  size_t size_;
  bool owner_;  // created here: unlink() removes the name
  bool unlinked_ = false;
};

}  // namespace dk::shm
