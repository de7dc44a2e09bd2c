/* A fake NCCL for the CPU tests: the dozen functions dist_kernels loads (csrc/transport/nccl_api.h),
 * over host memory, with every rank a thread of one process.
 *
 * Communicators made from the same unique id form a group. ncclSend copies its bytes into a FIFO
 * of the (group, sender, receiver) triple at once (an eager send, so no step can deadlock);
 * ncclRecv takes the oldest message of its triple, waiting up to 20 s, and fails if the sizes
 * differ. Inside ncclGroupStart/End the receives run at ncclGroupEnd, as NCCL lets a group's calls
 * come in any order. The collectives (ncclAllReduce, ...) exchange every rank's buffer through the
 * same FIFOs and reduce in rank order, for float32, float64, int32 and int64.
 *
 * The tests steer it and read it back through ctypes: fake_set_* inject an asynchronous error, a
 * failing collective and ncclGetLastError's text; fake_abort_count, fake_group_messages and
 * fake_recvs_in report what happened. Build flags: -DVERSION=<code> (required),
 * -DDROP_LAST_ERROR (an NCCL older than 2.13), -DDROP_BROADCAST (a library missing a symbol).
 */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct {
  char internal[128];
} ncclUniqueId;

enum { kSuccess = 0, kSystemError = 2, kInvalidArgument = 4, kInvalidUsage = 5 };
enum { kInt32 = 2, kInt64 = 4, kFloat32 = 7, kFloat64 = 8 };
enum { kSum = 0, kProd = 1, kMax = 2, kMin = 3, kAvg = 4 };
#define MAX_GROUPS 64
#define MAX_PENDING 64
#define RECV_TIMEOUT_S 20

typedef struct Message {
  int group, src, dst;
  size_t bytes;
  char* data;
  struct Message* next;
} Message;

typedef struct {
  int group, rank, nranks;
} Comm;

typedef struct {
  void* buf;
  size_t bytes;
  int peer;
  Comm* comm;
} PendingRecv;

static pthread_mutex_t mutex = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t arrived = PTHREAD_COND_INITIALIZER;
static Message* fifo_head = NULL;
static ncclUniqueId group_ids[MAX_GROUPS];
static int num_groups = 0, next_unique = 1;
static long group_messages[MAX_GROUPS];
/* Receives seen, for fake_recvs_in: (rank, address). */
static struct {
  int rank;
  uintptr_t address;
} recv_log[1 << 16];
static int recv_log_size = 0;

static __thread PendingRecv pending[MAX_PENDING];
static __thread int num_pending = 0, group_depth = 0;

static int fake_async_error = 0, fake_call_result = 0, fake_aborts = 0;
static char fake_last[256] = "";

void fake_set_async_error(int r) { fake_async_error = r; }
void fake_set_call_result(int r) { fake_call_result = r; }
void fake_set_last_error(const char* s) { strncpy(fake_last, s, sizeof(fake_last) - 1); }
int fake_abort_count(void) { return fake_aborts; }
long fake_group_messages(int group) { return group >= 0 && group < MAX_GROUPS ? group_messages[group] : -1; }
int fake_group_of(void* comm) { return ((Comm*)comm)->group; }
void fake_reset_stats(void) {
  pthread_mutex_lock(&mutex);
  memset(group_messages, 0, sizeof(group_messages));
  recv_log_size = 0;
  pthread_mutex_unlock(&mutex);
}
/* Receives of `rank` that landed in [lo, hi). */
long fake_recvs_in(int rank, uintptr_t lo, uintptr_t hi) {
  long n = 0;
  pthread_mutex_lock(&mutex);
  for (int i = 0; i < recv_log_size; ++i) {
    if (recv_log[i].rank == rank && recv_log[i].address >= lo && recv_log[i].address < hi) ++n;
  }
  pthread_mutex_unlock(&mutex);
  return n;
}

int ncclGetVersion(int* v) {
  *v = VERSION;
  return 0;
}
const char* ncclGetErrorString(int r) { return r == 6 ? "fake remote error" : "fake error"; }
#ifndef DROP_LAST_ERROR
const char* ncclGetLastError(void* comm) { return fake_last; }
#endif

int ncclGetUniqueId(ncclUniqueId* id) {
  memset(id, 0, sizeof(*id));
  pthread_mutex_lock(&mutex);
  int unique = next_unique++;
  pthread_mutex_unlock(&mutex);
  memcpy(id->internal, &unique, sizeof(unique));
  return 0;
}

int ncclCommInitRank(void** comm, int nranks, ncclUniqueId id, int rank) {
  pthread_mutex_lock(&mutex);
  int group = 0;
  while (group < num_groups && memcmp(&group_ids[group], &id, sizeof(id)) != 0) ++group;
  if (group == num_groups) {
    if (num_groups == MAX_GROUPS) {
      pthread_mutex_unlock(&mutex);
      return kInvalidUsage;
    }
    group_ids[num_groups++] = id;
  }
  pthread_mutex_unlock(&mutex);
  Comm* c = malloc(sizeof(Comm));
  c->group = group;
  c->rank = rank;
  c->nranks = nranks;
  *comm = c;
  return 0;
}

int ncclCommDestroy(void* comm) {
  free(comm);
  return 0;
}
int ncclCommAbort(void* comm) {
  fake_aborts++;
  free(comm);
  return 0;
}
int ncclCommGetAsyncError(void* comm, int* error) {
  *error = fake_async_error;
  return 0;
}

static void post(Comm* c, int dst, const void* buf, size_t bytes) {
  Message* m = malloc(sizeof(Message));
  m->group = c->group;
  m->src = c->rank;
  m->dst = dst;
  m->bytes = bytes;
  m->data = malloc(bytes ? bytes : 1);
  memcpy(m->data, buf, bytes);
  m->next = NULL;
  pthread_mutex_lock(&mutex);
  Message** tail = &fifo_head;
  while (*tail) tail = &(*tail)->next;
  *tail = m;
  group_messages[c->group]++;
  pthread_cond_broadcast(&arrived);
  pthread_mutex_unlock(&mutex);
}

static int take(Comm* c, int src, void* buf, size_t bytes) {
  struct timespec deadline;
  clock_gettime(CLOCK_REALTIME, &deadline);
  deadline.tv_sec += RECV_TIMEOUT_S;
  pthread_mutex_lock(&mutex);
  for (;;) {
    for (Message** at = &fifo_head; *at; at = &(*at)->next) {
      Message* m = *at;
      if (m->group != c->group || m->src != src || m->dst != c->rank) continue;
      *at = m->next;
      if (recv_log_size < (int)(sizeof(recv_log) / sizeof(recv_log[0]))) {
        recv_log[recv_log_size].rank = c->rank;
        recv_log[recv_log_size++].address = (uintptr_t)buf;
      }
      pthread_mutex_unlock(&mutex);
      int ok = m->bytes == bytes;
      if (ok) memcpy(buf, m->data, bytes);
      else snprintf(fake_last, sizeof(fake_last), "fake: %zu bytes sent, %zu received", m->bytes, bytes);
      free(m->data);
      free(m);
      return ok ? kSuccess : kInvalidUsage;
    }
    if (pthread_cond_timedwait(&arrived, &mutex, &deadline) == ETIMEDOUT) {
      pthread_mutex_unlock(&mutex);
      snprintf(fake_last, sizeof(fake_last), "fake: rank %d waited %d s for rank %d", c->rank,
               RECV_TIMEOUT_S, src);
      return kSystemError;
    }
  }
}

int ncclGroupStart(void) {
  group_depth++;
  return 0;
}
int ncclGroupEnd(void) {
  if (--group_depth > 0) return 0;
  int result = kSuccess;
  for (int i = 0; i < num_pending; ++i) {
    int r = take(pending[i].comm, pending[i].peer, pending[i].buf, pending[i].bytes);
    if (result == kSuccess) result = r;
  }
  num_pending = 0;
  return result;
}

/* count is in bytes for ncclUint8 (1), the only type the transport sends. */
static size_t type_bytes(int type) {
  switch (type) {
    case 0: case 1: return 1;
    case kInt32: case 3: case kFloat32: return 4;
    case kInt64: case 5: case kFloat64: return 8;
    default: return 2;
  }
}

int ncclSend(const void* buf, size_t count, int type, int peer, void* comm, void* stream) {
  post(comm, peer, buf, count * type_bytes(type));
  return 0;
}
int ncclRecv(void* buf, size_t count, int type, int peer, void* comm, void* stream) {
  size_t bytes = count * type_bytes(type);
  if (group_depth == 0) return take(comm, peer, buf, bytes);
  if (num_pending == MAX_PENDING) return kInvalidUsage;
  pending[num_pending++] = (PendingRecv){buf, bytes, peer, comm};
  return 0;
}

/* acc[i] = op(acc[i], x[i]) for one element type. */
#define REDUCE_LOOP(T)                                       \
  for (size_t i = 0; i < count; ++i) {                      \
    T a = ((T*)acc)[i], b = ((const T*)x)[i];               \
    ((T*)acc)[i] = op == kProd ? a * b                      \
                   : op == kMax ? (a > b ? a : b)           \
                   : op == kMin ? (a < b ? a : b) : a + b;  \
  }
static int reduce_into(void* acc, const void* x, size_t count, int type, int op) {
  switch (type) {
    case kInt32: REDUCE_LOOP(int32_t) break;
    case kInt64: REDUCE_LOOP(int64_t) break;
    case kFloat32: REDUCE_LOOP(float) break;
    case kFloat64: REDUCE_LOOP(double) break;
    default: return kInvalidArgument;
  }
  return kSuccess;
}
static void divide(void* acc, size_t count, int type, int n) {
  for (size_t i = 0; i < count; ++i) {
    if (type == kFloat32) ((float*)acc)[i] /= n;
    if (type == kFloat64) ((double*)acc)[i] /= n;
    if (type == kInt32) ((int32_t*)acc)[i] /= n;
    if (type == kInt64) ((int64_t*)acc)[i] /= n;
  }
}

/* Every rank's `bytes` from send, in rank order, into all (n * bytes). */
static int gather_all(Comm* c, const void* send, size_t bytes, char* all) {
  for (int r = 0; r < c->nranks; ++r) {
    if (r != c->rank) post(c, r, send, bytes);
  }
  for (int r = 0; r < c->nranks; ++r) {
    int e = r == c->rank ? (memcpy(all + r * bytes, send, bytes), 0) : take(c, r, all + r * bytes, bytes);
    if (e) return e;
  }
  return kSuccess;
}

/* The reduction of every rank's `count` elements at send + offset, in rank order, into out. */
static int reduce_all(Comm* c, const void* send, size_t count, int type, int op, void* out) {
  size_t bytes = count * type_bytes(type);
  char* all = malloc(c->nranks * bytes + 1);
  int e = gather_all(c, send, bytes, all);
  if (!e) {
    memcpy(out, all, bytes);
    for (int r = 1; r < c->nranks && !e; ++r) e = reduce_into(out, all + r * bytes, count, type, op);
    if (!e && op == kAvg) divide(out, count, type, c->nranks);
  }
  free(all);
  return e;
}

int ncclAllReduce(const void* send, void* recv, size_t count, int type, int op, void* comm, void* stream) {
  if (fake_call_result) return fake_call_result;
  return reduce_all(comm, send, count, type, op, recv);
}

int ncclReduceScatter(const void* send, void* recv, size_t count, int type, int op, void* comm, void* stream) {
  Comm* c = comm;
  size_t bytes = count * type_bytes(type);
  char* full = malloc(c->nranks * bytes + 1);
  int e = reduce_all(c, send, count * c->nranks, type, op, full);
  if (!e) memcpy(recv, full + c->rank * bytes, bytes);
  free(full);
  return e;
}

int ncclAllGather(const void* send, void* recv, size_t count, int type, void* comm, void* stream) {
  size_t bytes = count * type_bytes(type);
  char* copy = malloc(bytes + 1);
  memcpy(copy, send, bytes); /* send may lie inside recv (in place) */
  int e = gather_all(comm, copy, bytes, recv);
  free(copy);
  return e;
}

#ifndef DROP_BROADCAST
int ncclBroadcast(const void* send, void* recv, size_t count, int type, int root, void* comm, void* stream) {
  Comm* c = comm;
  size_t bytes = count * type_bytes(type);
  if (c->rank == root) {
    for (int r = 0; r < c->nranks; ++r) {
      if (r != root) post(c, r, send, bytes);
    }
    if (recv != send) memcpy(recv, send, bytes);
    return kSuccess;
  }
  return take(c, root, recv, bytes);
}
#endif
