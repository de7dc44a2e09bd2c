#include "transport/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "transport/shm_layout.h"

namespace dk::shm {

namespace {

constexpr size_t kMaxTagChars = 32;

// DK_SHM_TAG, checked: letters, digits and '_' only (it goes into a file name), or empty.
Status nameTag(std::string* tag) {
  const char* env = std::getenv("DK_SHM_TAG");
  *tag = env == nullptr ? "" : env;
  const bool valid = std::all_of(tag->begin(), tag->end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
  });
  if (!valid || tag->size() > kMaxTagChars) {
    return InvalidArgument("DK_SHM_TAG must be at most " + std::to_string(kMaxTagChars) +
                           " letters, digits or '_', got '" + *tag + "'");
  }
  return Status::Ok();
}

// "/dk-<16 hex>", or "/dk-<tag>-<16 hex>" when DK_SHM_TAG is set: runs that share a host
// (two test suites, two jobs) tell their segments apart by the tag.
Status randomName(std::string* name) {
  std::string tag;
  DK_RETURN_IF_ERROR(nameTag(&tag));
  uint64_t bits = 0;
  if (getrandom(&bits, sizeof(bits), 0) != static_cast<ssize_t>(sizeof(bits))) {
    return SystemError("getrandom");
  }
  char hex[24];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(bits));
  *name = "/dk-" + (tag.empty() ? "" : tag + "-") + hex;
  return Status::Ok();
}

// "24.0 MiB (25165824 bytes)": the rounded size for a person, the exact one for a search.
std::string describeBytes(unsigned long long bytes) {
  const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 5) {
    value /= 1024;
    ++unit;
  }
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.1f %s (%llu bytes)", value, units[unit], bytes);
  return buf;
}

// Why a segment could not be reserved, with what /dev/shm has left and what to do about it.
Status reserveError(const std::string& name, size_t bytes, int err) {
  std::string message = "cannot reserve " + describeBytes(bytes) + " for segment " + name +
                        ": posix_fallocate: " + std::strerror(err);
  struct statvfs fs;
  if (statvfs("/dev/shm", &fs) == 0) {
    message += " (/dev/shm has " +
               describeBytes(static_cast<unsigned long long>(fs.f_bavail) * fs.f_frsize) +
               " free of " +
               describeBytes(static_cast<unsigned long long>(fs.f_blocks) * fs.f_frsize) + ")";
  }
  if (err == ENOSPC || err == EFBIG) {
    message +=
        ". Free space in /dev/shm (stale files, other jobs) or enlarge it: "
        "`mount -o remount,size=<size> /dev/shm` on a host, `docker run --shm-size=<size>` (or "
        "--ipc=host) in Docker, a Memory-medium emptyDir at /dev/shm in Kubernetes";
  }
  return Status(Code::kSystemError, message);
}

// Gives the segment its size with every page reserved now. ftruncate alone makes a sparse
// file: tmpfs then allocates pages on first touch, and a full /dev/shm kills the process with
// SIGBUS in the middle of a collective instead of failing here. posix_fallocate returns the
// error number (it does not set errno); a signal can interrupt a large reservation (EINTR).
Status reserve(const std::string& name, int fd, size_t bytes) {
  int err;
  do {
    err = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  } while (err == EINTR);
  if (err == 0) return Status::Ok();
  return reserveError(name, bytes, err);
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
  if (Status s = reserve(name, fd, bytes); !s.ok()) {
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
