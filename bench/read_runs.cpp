// What one or two cores read from memory when the bytes come as runs of a few KB, some of them skipped: the access
// pattern of SparseLinear's kept rows (plugins/ort/src/sparse_linear_qrows.cpp). bench/read_runs.py builds and runs
// it; see there.
//
//   read_runs MiB RUN_BYTES SKIP THREADS INTERLEAVE REPEATS
//
// A buffer of MiB MiB (2 MB-aligned, transparent huge pages asked for, every byte written once) cut into runs of
// RUN_BYTES; each run skipped with probability SKIP (seeded); the kept runs split into THREADS equal parts, each
// thread reading its part INTERLEAVE runs at a time, 64 bytes from each in turn, prefetching (into L2) the same
// line of the next INTERLEAVE runs. Prints the best of REPEATS passes as GB/s of kept bytes.
#include <immintrin.h>
#include <sys/mman.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

namespace {

uint8_t* buffer = nullptr;
std::vector<int64_t> kept;
volatile int64_t sink = 0;

void read_part(size_t i0, size_t i1, int64_t run, int interleave) {
  __m512i acc = _mm512_setzero_si512();
  for (size_t i = i0; i + interleave <= i1; i += interleave)
    for (int64_t o = 0; o < run; o += 64)
      for (int r = 0; r < interleave; ++r) {
        acc = _mm512_xor_si512(acc, _mm512_loadu_si512(buffer + kept[i + r] * run + o));
        if (i + interleave + r < i1)
          _mm_prefetch(reinterpret_cast<const char*>(buffer + kept[i + interleave + r] * run + o), _MM_HINT_T1);
      }
  sink = sink + _mm512_reduce_add_epi64(acc);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: read_runs MiB RUN_BYTES SKIP THREADS INTERLEAVE REPEATS\n");
    return 2;
  }
  const size_t bytes = static_cast<size_t>(std::atoll(argv[1])) << 20;
  const int64_t run = std::atoll(argv[2]);
  const double skip = std::atof(argv[3]);
  const int threads = std::atoi(argv[4]), interleave = std::atoi(argv[5]), repeats = std::atoi(argv[6]);
  if (run < 64 || run % 64 || bytes < static_cast<size_t>(run) || threads < 1 || interleave < 1 || repeats < 1 ||
      !(skip >= 0.0 && skip < 1.0)) {
    std::fprintf(stderr, "read_runs: bad arguments\n");
    return 2;
  }
  buffer = static_cast<uint8_t*>(std::aligned_alloc(1 << 21, (bytes + (1 << 21) - 1) >> 21 << 21));
  if (buffer == nullptr) {
    std::fprintf(stderr, "read_runs: cannot allocate %zu bytes\n", bytes);
    return 2;
  }
  madvise(buffer, bytes, MADV_HUGEPAGE);
  std::memset(buffer, 1, bytes);
  std::mt19937 gen(1);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int64_t i = 0; i < static_cast<int64_t>(bytes) / run; ++i)
    if (u(gen) >= skip) kept.push_back(i);
  double best = 0.0;
  for (int rep = 0; rep < repeats; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back(read_part, kept.size() * t / threads, kept.size() * (t + 1) / threads, run, interleave);
    for (auto& th : pool) th.join();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double rate = static_cast<double>(kept.size()) * static_cast<double>(run) / s / 1e9;
    best = rate > best ? rate : best;
  }
  std::printf("%.2f\n", best);
  return 0;
}
