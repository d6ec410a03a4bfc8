/* The memory side of qsa_attention's decode, without the op: how fast this machine reads the rows a
 * decode step selects, alone and with the op's multiply-adds on every loaded line. Issue 6 asks decode
 * to come within 2x of the copy-bandwidth limit for the selected bytes; this measures what the machine
 * allows for that access pattern, with no PyTorch in the way (see benchmarks/RESULTS.md).
 *
 * Layout and selection as benchmarks/bench_qsa_attention.py decodes: per sequence a token-major K and V
 * pool of `context` cells, each cell 2 KV heads x 256 dims of `elem` bytes; the query selects 512 random
 * groups of 4 adjacent cells plus a tail of 3, read in ascending order. Each line is requested `ahead`
 * cells early with a software prefetch, one request per line consumed (the pattern a hand-written
 * gather does best with on the machines we measured). Threads split the sequences.
 *
 * Each measurement is the median of 9 runs, each run after a 1 GiB read-modify-write flushed the caches
 * and followed by a copy of 512 MiB timed right after it: 'x of the copy' is the run's time over the time
 * the copy bandwidth of that moment (read + write counted, as benchmarks/common.py measures it) needs for
 * the same bytes, the median over runs. Pairing keeps the ratio right on a shared VM whose bandwidth
 * switches between levels for seconds at a time.
 *   sequential read  1 GiB;
 *   gather           the selected rows, summed: the bare read floor of decode;
 *   gather+fma       the same with the op's arithmetic: 8 query heads' fused multiply-adds per 16 values;
 *   fma only (warm)  that arithmetic over the first 64 cells of each pool, in cache.
 *
 *   cc -O3 -march=native -pthread benchmarks/gather_floor.c -o /tmp/gather_floor   (-mcpu=native on arm64)
 *   /tmp/gather_floor [--elem 2|4] [--context 32768] [--sequences 16] [--threads 2] [--ahead 4] [--huge]
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));

enum { kHeads = 8, kGroups = 512, kGroupCells = 4, kTail = 3, kRuns = 9, kLine = 64 };
static const size_t kRowBytesPerElem = 2 * 256; /* Hkv x Dh */

static int g_huge = 0;

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void* alloc(size_t bytes) {
  void* p = NULL;
  if (posix_memalign(&p, 1 << 21, bytes) != 0) {
    fprintf(stderr, "out of memory (%zu bytes)\n", bytes);
    exit(1);
  }
#ifdef MADV_HUGEPAGE
  if (g_huge) madvise(p, bytes, MADV_HUGEPAGE);
#endif
  memset(p, 0x3c, bytes); /* 0x3c3c as bf16 and 0x3c3c3c3c as fp32 are small normal numbers */
  return p;
}

typedef struct Job Job;
typedef void* (*Work)(void*);
struct Job {
  Work work;
  int tid, threads;
  /* copy / read / flush */
  char* src;
  char* dst;
  size_t bytes;
  /* gather */
  const char* k;
  const char* v;
  const int32_t* cells; /* [sequences][count] */
  int sequences, count, ahead, arith, elem;
  size_t row, pool; /* bytes of a cell row; bytes of one sequence's pool */
  v16f sink;
};

static void run_threads(Job* proto, int threads) {
  pthread_t th[256];
  Job jobs[256];
  for (int t = 0; t < threads; ++t) {
    jobs[t] = *proto;
    jobs[t].tid = t;
    jobs[t].threads = threads;
    pthread_create(&th[t], NULL, proto->work, &jobs[t]);
  }
  for (int t = 0; t < threads; ++t) {
    pthread_join(th[t], NULL);
    proto->sink += jobs[t].sink;
  }
}

/* This thread's share of j->bytes, in whole blocks of 4 lines (the step of the copy and read loops). */
static void part(const Job* j, size_t* begin, size_t* end) {
  const size_t block = 4 * kLine, blocks = j->bytes / block;
  *begin = blocks * j->tid / j->threads * block;
  *end = blocks * (j->tid + 1) / j->threads * block;
}

static void* flush_work(void* arg) {
  Job* j = arg;
  size_t b, e;
  part(j, &b, &e);
  for (size_t i = b; i < e; i += kLine) j->dst[i] += 1;
  return NULL;
}

/* A vector loop, as PyTorch's copy_ runs (large memcpy calls may take another path, with streaming stores). */
static void* copy_work(void* arg) {
  Job* j = arg;
  size_t b, e;
  part(j, &b, &e);
  for (size_t i = b; i < e; i += 2 * kLine) {
    v16f x0, x1;
    memcpy(&x0, j->src + i, kLine);
    memcpy(&x1, j->src + i + kLine, kLine);
    __asm__ volatile("" ::: "memory"); /* keeps the loop from being turned back into a memcpy call */
    memcpy(j->dst + i, &x0, kLine);
    memcpy(j->dst + i + kLine, &x1, kLine);
  }
  return NULL;
}

static void* read_work(void* arg) {
  Job* j = arg;
  size_t b, e;
  part(j, &b, &e);
  v16f s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
  for (size_t i = b; i < e; i += 4 * kLine) {
    v16f x0, x1, x2, x3;
    memcpy(&x0, j->src + i, kLine);
    memcpy(&x1, j->src + i + kLine, kLine);
    memcpy(&x2, j->src + i + 2 * kLine, kLine);
    memcpy(&x3, j->src + i + 3 * kLine, kLine);
    s0 += x0, s1 += x1, s2 += x2, s3 += x3;
  }
  j->sink = s0 + s1 + s2 + s3;
  return NULL;
}

/* One line of a cell row: a plain sum, or 8 heads' fused multiply-adds per 16 values (bf16 lines are
 * widened to two vectors first, as the op's portable code does). */
static inline void consume(const char* line, int elem, int arith, v16f* acc, const v16f* q) {
  if (!arith) {
    v16f x;
    memcpy(&x, line, kLine);
    acc[0] += x;
    return;
  }
  if (elem == 4) {
    v16f x;
    memcpy(&x, line, kLine);
    for (int h = 0; h < kHeads; ++h) acc[h] = q[h] * x + acc[h];
  } else {
    v16u w;
    memcpy(&w, line, kLine);
    const v16u odd = w & 0xffff0000u, even = w << 16;
    v16f xo, xe;
    memcpy(&xo, &odd, kLine);
    memcpy(&xe, &even, kLine);
    for (int h = 0; h < kHeads; ++h) acc[h] = q[h] * xe + (q[h] * xo + acc[h]);
  }
}

static void* gather_work(void* arg) {
  Job* j = arg;
  v16f acc[kHeads], q[kHeads];
  for (int h = 0; h < kHeads; ++h) {
    acc[h] = (v16f){0};
    q[h] = (v16f){0} + (0.5f + (float)h);
  }
  for (int s = j->tid; s < j->sequences; s += j->threads) {
    const int32_t* cells = j->cells + (size_t)s * j->count;
    const char* k = j->k + s * j->pool;
    const char* v = j->v + s * j->pool;
    for (int i = 0; i < j->count; ++i) {
      const char* kr = k + cells[i] * j->row;
      const char* vr = v + cells[i] * j->row;
      const int ahead = i + j->ahead < j->count ? i + j->ahead : -1;
      const char* kp = ahead >= 0 ? k + cells[ahead] * j->row : NULL;
      const char* vp = ahead >= 0 ? v + cells[ahead] * j->row : NULL;
      for (size_t o = 0; o < j->row; o += kLine) {
        if (kp) __builtin_prefetch(kp + o, 0, 3);
        consume(kr + o, j->elem, j->arith, acc, q);
      }
      for (size_t o = 0; o < j->row; o += kLine) {
        if (vp) __builtin_prefetch(vp + o, 0, 3);
        consume(vr + o, j->elem, j->arith, acc, q);
      }
    }
  }
  v16f sum = {0};
  for (int h = 0; h < kHeads; ++h) sum += acc[h];
  j->sink = sum;
  return NULL;
}

static int cmp_double(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

static double median(double* x) {
  qsort(x, kRuns, sizeof(double), cmp_double);
  return x[kRuns / 2];
}

/* kRuns runs of `job`, each after the flush (unless flush is NULL) and followed by a timed `copy`: the
 * median seconds, and in *ratio the median over runs of seconds / (bytes / the copy bandwidth of that run).
 * Pairing each run with a copy keeps the ratio right on a VM whose bandwidth changes level between runs. */
static double measure(Job* job, int threads, Job* flush, Job* copy, double bytes, double* ratio, double* bw_lo,
                      double* bw_hi) {
  double t[kRuns], q[kRuns];
  for (int r = 0; r < kRuns; ++r) {
    run_threads(flush ? flush : job, threads); /* flushed, or (no flush) warmed by a first run */
    double t0 = now();
    run_threads(job, threads);
    t[r] = now() - t0;
    t0 = now();
    run_threads(copy, threads);
    const double bw = 2.0 * copy->bytes / (now() - t0);
    q[r] = t[r] / (bytes / bw);
    if (bw < *bw_lo) *bw_lo = bw;
    if (bw > *bw_hi) *bw_hi = bw;
  }
  *ratio = median(q);
  return median(t);
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rng(void) { /* splitmix64 */
  uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static int cmp_int(const void* a, const void* b) { return *(const int32_t*)a - *(const int32_t*)b; }

int main(int argc, char** argv) {
  int elem = 2, context = 32768, sequences = 16, threads = 2, ahead = 4;
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    const char* val = i + 1 < argc ? argv[i + 1] : "";
    if (!strcmp(a, "--elem")) elem = atoi(val), ++i;
    else if (!strcmp(a, "--context")) context = atoi(val), ++i;
    else if (!strcmp(a, "--sequences")) sequences = atoi(val), ++i;
    else if (!strcmp(a, "--threads")) threads = atoi(val), ++i;
    else if (!strcmp(a, "--ahead")) ahead = atoi(val), ++i;
    else if (!strcmp(a, "--huge")) g_huge = 1;
    else {
      fprintf(stderr, "unknown argument %s (see the comment at the top of gather_floor.c)\n", a);
      return 2;
    }
  }
  if ((elem != 2 && elem != 4) || context < kGroups * kGroupCells + kTail || sequences < 1 || threads < 1 ||
      threads > 256 || ahead < 0) {
    fprintf(stderr, "bad arguments: --elem 2|4, --context >= %d, --sequences >= 1, --threads 1..256, --ahead >= 0\n",
            kGroups * kGroupCells + kTail);
    return 2;
  }
  const size_t row = kRowBytesPerElem * elem, pool = (size_t)context * row;
  const size_t big = (size_t)1 << 30;
  char* flush_buf = alloc(big);
  Job flush = {.work = flush_work, .dst = flush_buf, .bytes = big};

  /* The copy (512 MiB read + 512 MiB written) that follows every timed run, and a sequential read. */
  char* a = alloc(big);
  char* b = alloc(big / 2);
  Job copy = {.work = copy_work, .src = a, .dst = b, .bytes = big / 2};
  double bw_lo = 1e30, bw_hi = 0, r_seq;
  Job seq = {.work = read_work, .src = a, .bytes = big};
  const double t_seq = measure(&seq, threads, &flush, &copy, big, &r_seq, &bw_lo, &bw_hi);

  /* The selection: 512 distinct random groups of the run's complete groups, then the last 3 cells. */
  const int count = kGroups * kGroupCells + kTail;
  const int groups = (context - kTail) / kGroupCells;
  int32_t* cells = malloc(sizeof(int32_t) * (size_t)sequences * count);
  char* taken = calloc(groups, 1);
  for (int s = 0; s < sequences; ++s) {
    int32_t* c = cells + (size_t)s * count;
    memset(taken, 0, groups);
    int32_t* g = malloc(sizeof(int32_t) * kGroups);
    for (int n = 0; n < kGroups;) {
      const int x = (int)(rng() % groups);
      if (!taken[x]) taken[x] = 1, g[n++] = x;
    }
    qsort(g, kGroups, sizeof(int32_t), cmp_int);
    for (int n = 0; n < kGroups; ++n)
      for (int i = 0; i < kGroupCells; ++i) c[n * kGroupCells + i] = g[n] * kGroupCells + i;
    for (int i = 0; i < kTail; ++i) c[kGroups * kGroupCells + i] = context - kTail + i;
    free(g);
  }
  free(taken);
  char* k = alloc(pool * sequences);
  char* v = alloc(pool * sequences);
  const double selected = 2.0 * row * count * sequences;

  Job gather = {.work = gather_work, .k = k, .v = v, .cells = cells, .sequences = sequences,
                .count = count, .ahead = ahead, .arith = 0, .elem = elem, .row = row, .pool = pool};
  double r_gather, r_fma, r_hot;
  const double t_gather = measure(&gather, threads, &flush, &copy, selected, &r_gather, &bw_lo, &bw_hi);
  gather.arith = 1;
  const double t_fma = measure(&gather, threads, &flush, &copy, selected, &r_fma, &bw_lo, &bw_hi);
  /* In cache: every selected cell folded into the first 64 of its pool. */
  int32_t* hot = malloc(sizeof(int32_t) * (size_t)sequences * count);
  for (size_t i = 0; i < (size_t)sequences * count; ++i) hot[i] = cells[i] % 64;
  Job warm = gather;
  warm.cells = hot;
  const double t_hot = measure(&warm, threads, NULL, &copy, selected, &r_hot, &bw_lo, &bw_hi);

  printf("gather_floor: %s, %d threads, %d sequences x %d cells of %zu B (K and V), context %d, ahead %d, %s pages\n",
         elem == 2 ? "bf16" : "fp32", threads, sequences, count, row, context, ahead,
         g_huge ? "huge (madvise)" : "default");
  printf("copy next to each run: %.1f-%.1f GB/s (read + write counted); selected rows: %.1f MB\n", bw_lo / 1e9,
         bw_hi / 1e9, selected / 1e6);
  printf("%-16s %8.3f ms %6.1f GB/s %5.2fx of the copy\n", "sequential read", t_seq * 1e3, big / t_seq / 1e9, r_seq);
  printf("%-16s %8.3f ms %6.1f GB/s %5.2fx of the copy\n", "gather", t_gather * 1e3, selected / t_gather / 1e9,
         r_gather);
  printf("%-16s %8.3f ms %6.1f GB/s %5.2fx of the copy\n", "gather+fma", t_fma * 1e3, selected / t_fma / 1e9, r_fma);
  printf("%-16s %8.3f ms %6s      %5.2fx of the copy\n", "fma only (warm)", t_hot * 1e3, "-", r_hot);
  float sink = 0;
  for (int i = 0; i < 16; ++i) sink += flush.sink[i] + seq.sink[i] + gather.sink[i] + warm.sink[i];
  return sink == 12345.f; /* keeps the sums live */
}
