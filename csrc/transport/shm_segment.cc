#include "transport/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>

#include "transport/shm_layout.h"

namespace dk::shm {

namespace {

Status randomName(std::string* name) {
  uint64_t bits = 0;
  if (getrandom(&bits, sizeof(bits), 0) != static_cast<ssize_t>(sizeof(bits))) {
    return SystemError("getrandom");
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), "/dk-%016llx", static_cast<unsigned long long>(bits));
  *name = buf;
  return Status::Ok();
}

}  // namespace

Status Segment::map(const std::string& name, int fd, size_t bytes, bool owner,
                    std::shared_ptr<Segment>* out) {
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int saved = errno;
  close(fd);
  if (data == MAP_FAILED) {
    errno = saved;
    if (owner) shm_unlink(name.c_str());
    return SystemError("mmap(" + name + ")");
  }
  out->reset(new Segment(name, data, bytes, owner));
  return Status::Ok();
}

Status Segment::create(size_t bytes, std::shared_ptr<Segment>* out) {
  bytes = alignUp(bytes == 0 ? 1 : bytes, kPage);
  std::string name;
  DK_RETURN_IF_ERROR(randomName(&name));
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return SystemError("shm_open(" + name + ")");
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    Status s = SystemError("ftruncate(" + name + ")");
    close(fd);
    shm_unlink(name.c_str());
    return s;
  }
  return map(name, fd, bytes, /*owner=*/true, out);
}

Status Segment::open(const std::string& name, size_t bytes, std::shared_ptr<Segment>* out) {
  bytes = alignUp(bytes == 0 ? 1 : bytes, kPage);
  const int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) return SystemError("shm_open(" + name + ")");
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes) {
    close(fd);
    return InvalidArgument("shared-memory segment " + name + " has an unexpected size");
  }
  return map(name, fd, bytes, /*owner=*/false, out);
}

Status Segment::unlink() {
  if (!owner_ || unlinked_) return Status::Ok();
  unlinked_ = true;
  if (shm_unlink(name_.c_str()) != 0 && errno != ENOENT)
    return SystemError("shm_unlink(" + name_ + ")");
  return Status::Ok();
}

bool Segment::contains(const void* p, size_t bytes) const {
  const auto base = reinterpret_cast<uintptr_t>(data_);
  const auto addr = reinterpret_cast<uintptr_t>(p);
  return addr >= base && addr - base <= size_ && bytes <= size_ - (addr - base);
}

Segment::~Segment() {
  unlink();
  munmap(data_, size_);
}

}  // namespace dk::shm
