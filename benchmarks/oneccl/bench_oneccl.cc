// oneCCL all-reduce timed the way benchmarks/bench_mpi.py --timing each times ours and MPICH,
// so that benchmarks/bench_oneccl.py can print the three side by side.
//
//   mpiexec -n 2 bench_oneccl [-b 8] [-e 64M] [-f 2] [--iter-bytes 256M] [--blocks 5]
//
// Per size (fp32 sum, in place, sizes from -b to -e by -f):
//   1. check: rank r fills x[i] = i % 13 + r; after the all-reduce every element must be
//      (i % 13) * n + n(n-1)/2, exact in fp32; #wrong summed over ranks;
//   2. warm-up: iters / 10 calls (at least one);
//   3. `blocks` timed blocks: a barrier, then `iters` back-to-back calls, a clock read after
//      each (iters = iter_bytes / size, bounded to 5..200: bench_mpi.py's rule);
//   4. each rank's mean, p50 and p99 over all its calls (nearest rank), then the slowest
//      rank's of each (a MAX over ranks of each statistic, as python -m dist_kernels.bench).
// Rank 0 prints one JSON line per size, after a header line naming the library and transport.
// Errors print the rank, the call and the cause, and the program returns 1: never exit().

#include <mpi.h>

#include <oneapi/ccl.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <vector>

namespace {

int g_rank = -1;

#define CHECK_MPI(call)                                                                    \
  do {                                                                                     \
    int rc_ = (call);                                                                      \
    if (rc_ != MPI_SUCCESS) {                                                              \
      char text_[MPI_MAX_ERROR_STRING];                                                    \
      int len_ = 0;                                                                        \
      MPI_Error_string(rc_, text_, &len_);                                                 \
      std::fprintf(stderr, "bench_oneccl rank %d: %s failed: %s\n", g_rank, #call, text_); \
      return false;                                                                        \
    }                                                                                      \
  } while (0)

#define CHECK(ok)   \
  do {              \
    if (!(ok)) {    \
      return false; \
    }               \
  } while (0)

struct Options {
  long min_bytes = 8;
  long max_bytes = 64L << 20;
  long factor = 2;
  long iter_bytes = 256L << 20;
  int blocks = 5;
};

struct Stats {
  double mean_us = 0, p50_us = 0, p99_us = 0;
};

// "64M", "4K", "8": bytes. Returns false (and says why) on anything else.
bool parse_size(const char* text, long* out) {
  char* end = nullptr;
  long value = std::strtol(text, &end, 10);
  long unit = 1;
  if (*end == 'K' || *end == 'k') unit = 1L << 10;
  if (*end == 'M' || *end == 'm') unit = 1L << 20;
  if (*end == 'G' || *end == 'g') unit = 1L << 30;
  if (unit != 1) ++end;
  if (end == text || *end != '\0' || value <= 0) {
    std::fprintf(stderr, "bench_oneccl: not a positive size: '%s'\n", text);
    return false;
  }
  *out = value * unit;
  return true;
}

bool parse_options(int argc, char** argv, Options* opt) {
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "bench_oneccl: %s needs a value\n", flag.c_str());
      return false;
    }
    const char* value = argv[++i];
    long number = 0;
    CHECK(parse_size(value, &number));
    if (flag == "-b") {
      opt->min_bytes = number;
    } else if (flag == "-e") {
      opt->max_bytes = number;
    } else if (flag == "-f") {
      opt->factor = number;
    } else if (flag == "--iter-bytes") {
      opt->iter_bytes = number;
    } else if (flag == "--blocks") {
      opt->blocks = static_cast<int>(number);
    } else {
      std::fprintf(stderr, "bench_oneccl: unknown flag %s\n", flag.c_str());
      return false;
    }
  }
  if (opt->factor < 2) {
    std::fprintf(stderr, "bench_oneccl: -f %ld: the step factor must be >= 2\n", opt->factor);
    return false;
  }
  return true;
}

// bench_mpi.py's iterations(): enough bytes for a steady time, bounded for tiny and huge sizes.
int iterations(long nbytes, long iter_bytes) {
  return static_cast<int>(std::max(5L, std::min(200L, iter_bytes / std::max(nbytes, 1L))));
}

// Nearest rank: a time that was measured, never an interpolation (dist_kernels.bench's rule).
double percentile(std::vector<double> samples, double q) {
  std::sort(samples.begin(), samples.end());
  long index = static_cast<long>(std::ceil(q / 100.0 * samples.size())) - 1;
  return samples[std::max(0L, index)];
}

// Plain memory, 64-byte aligned like a torch CPU tensor's storage.
using Buffer = std::unique_ptr<float[], decltype(&std::free)>;

Buffer allocate(size_t count) {
  size_t bytes = (count * sizeof(float) + 63) / 64 * 64;
  return Buffer(static_cast<float*>(std::aligned_alloc(64, bytes)), &std::free);
}

void all_reduce(float* x, size_t count, const ccl::communicator& comm) {
  ccl::allreduce(x, x, count, ccl::reduction::sum, comm).wait();
}

// Step 1: #wrong summed over ranks after one all-reduce of known small integers.
bool count_wrong(float* x, size_t count, int rank, int n, const ccl::communicator& comm,
                 long* wrong) {
  for (size_t i = 0; i < count; ++i) x[i] = static_cast<float>(i % 13 + rank);
  all_reduce(x, count, comm);
  long mine = 0;
  for (size_t i = 0; i < count; ++i) {
    mine += x[i] != static_cast<float>((i % 13) * n + n * (n - 1) / 2);
  }
  CHECK_MPI(MPI_Allreduce(&mine, wrong, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD));
  return true;
}

// Steps 2-4: the slowest rank's mean, p50 and p99 per call, in microseconds.
bool time_calls(float* x, size_t count, int iters, int blocks, const ccl::communicator& comm,
                Stats* out) {
  using clock = std::chrono::steady_clock;
  for (int i = 0; i < std::max(1, iters / 10); ++i) all_reduce(x, count, comm);
  std::vector<double> each;
  double total = 0;
  for (int b = 0; b < blocks; ++b) {
    CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
    auto start = clock::now(), last = start;
    for (int i = 0; i < iters; ++i) {
      all_reduce(x, count, comm);
      auto now = clock::now();
      each.push_back(std::chrono::duration<double, std::micro>(now - last).count());
      last = now;
    }
    total += std::chrono::duration<double, std::micro>(last - start).count();
  }
  double mine[3] = {total / each.size(), percentile(each, 50), percentile(each, 99)};
  double slowest[3];
  CHECK_MPI(MPI_Allreduce(mine, slowest, 3, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD));
  *out = {slowest[0], slowest[1], slowest[2]};
  return true;
}

bool run_sizes(const Options& opt, int rank, int n, const ccl::communicator& comm) {
  for (long s = std::max(opt.min_bytes, 4L); s <= opt.max_bytes; s *= opt.factor) {
    size_t count = static_cast<size_t>(s / 4);
    Buffer x = allocate(count);
    if (!x) {
      std::fprintf(stderr, "bench_oneccl rank %d: cannot allocate %ld bytes\n", rank, s);
      return false;
    }
    long wrong = 0;
    CHECK(count_wrong(x.get(), count, rank, n, comm, &wrong));
    int iters = iterations(s, opt.iter_bytes);
    Stats stats;
    CHECK(time_calls(x.get(), count, iters, opt.blocks, comm, &stats));
    if (rank == 0) {
      std::printf(
          "{\"size\": %zu, \"count\": %zu, \"iters\": %d, \"blocks\": %d, \"mean_us\": %.3f, "
          "\"p50_us\": %.3f, \"p99_us\": %.3f, \"wrong\": %ld}\n",
          count * 4, count, iters, opt.blocks, stats.mean_us, stats.p50_us, stats.p99_us, wrong);
      std::fflush(stdout);
    }
  }
  return true;
}

// The main key-value store lives on rank 0; MPI carries its address to the others.
bool make_communicator(int rank, int n, std::unique_ptr<ccl::communicator>* comm) {
  ccl::shared_ptr_class<ccl::kvs> kvs;
  ccl::kvs::address_type address;
  if (rank == 0) {
    kvs = ccl::create_main_kvs();
    address = kvs->get_address();
  }
  CHECK_MPI(
      MPI_Bcast(address.data(), static_cast<int>(address.size()), MPI_BYTE, 0, MPI_COMM_WORLD));
  if (rank != 0) kvs = ccl::create_kvs(address);
  comm->reset(new ccl::communicator(ccl::create_communicator(n, rank, kvs)));
  return true;
}

bool print_header(int n) {
  ccl::library_version v = ccl::get_library_version();
  char mpi_version[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  CHECK_MPI(MPI_Get_library_version(mpi_version, &len));
  std::string mpi_name(mpi_version, std::min(len, 40));
  std::replace(mpi_name.begin(), mpi_name.end(), '"', '\'');
  std::replace(mpi_name.begin(), mpi_name.end(), '\n', ' ');
  const char* atl = std::getenv("CCL_ATL_TRANSPORT");
  std::printf(
      "{\"impl\": \"oneccl\", \"version\": \"%s\", \"mpi\": \"%s\", \"atl\": \"%s\", "
      "\"world_size\": %d}\n",
      v.full, mpi_name.c_str(), atl ? atl : "ofi (default)", n);
  return true;
}

// Everything between MPI_Init_thread and MPI_Finalize; oneCCL's objects die inside it, before
// MPI is finalized (oneCCL warns otherwise). oneCCL reports failures as exceptions: caught here.
bool run(const Options& opt) {
  int n = 0;
  CHECK_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &g_rank));
  CHECK_MPI(MPI_Comm_size(MPI_COMM_WORLD, &n));
  try {
    ccl::init();
    std::unique_ptr<ccl::communicator> comm;
    CHECK(make_communicator(g_rank, n, &comm));
    if (g_rank == 0) CHECK(print_header(n));
    return run_sizes(opt, g_rank, n, *comm);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_oneccl rank %d: oneCCL failed: %s\n", g_rank, e.what());
    return false;
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  if (!parse_options(argc, argv, &opt)) return 2;
  // oneCCL's MPI transport asks for MPI_THREAD_MULTIPLE and warns if it gets less.
  int provided = 0;
  if (MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS) {
    std::fprintf(stderr, "bench_oneccl: MPI_Init_thread failed\n");
    return 1;
  }
  bool ok = run(opt);
  if (!ok) {
    MPI_Abort(MPI_COMM_WORLD, 1);  // the peer may wait in a collective: end it too
    return 1;
  }
  return MPI_Finalize() == MPI_SUCCESS ? 0 : 1;
}
