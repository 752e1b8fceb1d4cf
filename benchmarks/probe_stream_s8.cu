// Timing probe (Session 51): the transposed kernel's streamed W2 tiles at V = 151936, B = 64, alone.
// 132 CTAs of four warpgroups score 18 tiles a step each (7 resident, 11 streamed through one slot a
// warpgroup), with the kernel's wgmmas (2 digits x 8 k-slabs of m64n64k32 s8) and its turns, but no
// base-logit loads, epilogue or exchange. A streamed tile lands in its slot by one of:
//   cpasync  CopyTransposedTile: 8 cp.async of 16 bytes a thread, wait_group and a warpgroup barrier (main)
//   tma      one cp.async.bulk.tensor.5d (one thread, an mbarrier), the tile as [k / 16][n][16] bytes
//   tma2d    16 cp.async.bulk.tensor.2d of 64 rows x 16 bytes (rows in their own order: no TileRow), in
//            case the driver refuses the 5-d map's strides (not in increasing order)
//   bulk     one cp.async.bulk of 16 contiguous KB, as if W2 were stored tile by tile (the copy engine's bound)
//   none     no copy: a streamed round scores its slot as it stands (the loop without streaming)
// and a warpgroup takes its rounds resident first (main) or streamed and resident in turn (v127).
// It sweeps: a spin of 0 or 1000 cycles a tile after its next copy is issued (the epilogue; --epilogue C
// fixes it), a spin of 0 or 10000 cycles between steps (the exchange and e ready; --gap C), and each
// step's base logits (19.4 MB) asked of L2 at its start, as PrefetchBaseLogits does, or not. It first
// checks that the tma layout holds the tile (bytes, and every accumulator of the wgmmas equal to those
// of the cp.async layout).
//   nvcc -std=c++17 -gencode arch=compute_90a,code=sm_90a -O3 -I ffi -I $(python3 -c "import jax.ffi; print(jax.ffi.include_dir())") \
//     benchmarks/probe_stream_s8.cu -o probe_stream && ./probe_stream
#include <cuda.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/walk_transposed.cuh"

using namespace jax_markov;
using namespace jax_markov::walk;

namespace {

constexpr int kVocab = 151936, kBatch = 64, kCtas = 132, kTilesPerCta = 18, kResident = 7, kWarpgroups = 4;
constexpr int kTotalTiles = kVocab / kTransposedTileRows;  // V is a multiple of 64 here: no partial tile
constexpr int kDigitBytes = 2 * 64 * kRank;
constexpr int kSmemBytes = kDigitBytes + 1024 + (kWarpgroups + kResident) * kTransposedTileBytes;
static_assert(kVocab % kTransposedTileRows == 0, "the tma and bulk copies have no partial tile to mask");

enum Copy : int { kCopyCpAsync = 0, kCopyTma = 1, kCopyTma2d = 2, kCopyBulk = 3, kCopyNone = 4 };
const char* const kCopyNames[] = {"cpasync", "tma", "tma2d", "bulk", "none"};
__host__ __device__ constexpr bool UsesMbarrier(int copy) { return copy == kCopyTma || copy == kCopyTma2d || copy == kCopyBulk; }

struct Options {
  long long epilogue = 0, gap = 0;
  int base = 0, steps = 100;
};

// Byte (n, k) of a tile in the tma layout: [k / 16][n][16], so that a core matrix (8 columns n of one
// 16-byte k-column) is 128 contiguous bytes, 1024 bytes between the two k halves of a slab.
__host__ __device__ constexpr int TmaOffset(int n, int k) { return (k / 16) * 1024 + n * 16 + k % 16; }

// One tile, local tile `tile` of W2, by the 5-d map: (k % 16, c, b, a, k / 16) for row 16 b + 2 a + c,
// so that column n = 8 a + 2 b + c holds row TileRow(n), as CopyTransposedTile's order.
__device__ __forceinline__ void TmaTile(const CUtensorMap& map, int tile, int8_t* dst, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5, %6}], [%7];" ::"r"(
          SharedAddress(dst)),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(0), "r"(0), "r"(4 * tile), "r"(0), "r"(0), "r"(SharedAddress(bar))
      : "memory");
}

// The same tile by the 2-d map (k, row): 16 boxes of 16 bytes x 64 rows, box c at byte 1024 c.
__device__ __forceinline__ void Tma2dTile(const CUtensorMap& map, int tile, int8_t* dst, uint64_t* bar) {
#pragma unroll
  for (int c = 0; c < 16; ++c) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
                     SharedAddress(dst + 1024 * c)),
                 "l"(reinterpret_cast<uint64_t>(&map)), "r"(16 * c), "r"(kTransposedTileRows * tile), "r"(SharedAddress(bar))
                 : "memory");
  }
}

__device__ __forceinline__ void Spin(long long cycles) {
  if (cycles <= 0) return;
  const long long until = clock64() + cycles;
  while (clock64() < until) {
  }
}

// A tile's wgmmas (A: the digits, B: `tile` with the layout's strides) and a fold of the sums.
__device__ __forceinline__ int ScoreTile(const int8_t* digits, const int8_t* tile, bool tma_layout, uint64_t* turn, int wg,
                                         int round, int rounds, uint32_t& turns, int lane) {
  int acc[2][32];
  if (wg > 0 || round > 0) MbarrierWait(&turn[wg], turns++ & 1);
  WgmmaFence();
#pragma unroll
  for (int d = 0; d < 2; ++d) {
#pragma unroll
    for (int s = 0; s < kRank / 32; ++s) {
      const uint64_t b = tma_layout ? WgmmaDescriptor(tile + s * 2048, 1024, 128) : WgmmaDescriptor(tile + s * 2048, 128, 256);
      WgmmaS8(acc[d], WgmmaDescriptor(digits + d * 64 * kRank + s * 2048, 128, 256), b, s > 0);
    }
  }
  WgmmaCommit();
  if ((wg < kWarpgroups - 1 || round < rounds - 1) && lane == 0) MbarrierArrive(&turn[(wg + 1) % kWarpgroups]);
  WgmmaWaitGroup<0>();
  int m = 0;
#pragma unroll
  for (int e = 0; e < 32; ++e) m = max(m, acc[1][e] * 256 + acc[0][e]);
  return m;
}

template <int COPY, bool ALTERNATE>
__global__ void __launch_bounds__(128 * kWarpgroups, 1)
    StreamProbe(const __grid_constant__ CUtensorMap map, const __grid_constant__ CUtensorMap map2d, const int8_t* w2, const uint16_t* base, Options o, int* sink) {
  extern __shared__ __align__(1024) unsigned char probe_smem[];
  int8_t* digits = reinterpret_cast<int8_t*>(probe_smem);
  uint64_t* bars = reinterpret_cast<uint64_t*>(probe_smem + kDigitBytes);  // turn[4], full[4]
  uint64_t* turn = bars;
  uint64_t* full = bars + kWarpgroups;
  int8_t* ring = digits + kDigitBytes + 1024;
  int8_t* resident = ring + kWarpgroups * kTransposedTileBytes;
  const int tid = threadIdx.x, lane = tid & 31, wg = tid >> 7, u = tid & 127;
  const int first_tile = blockIdx.x * kTilesPerCta;
  const int my_tiles = max(0, min(kTilesPerCta, kTotalTiles - first_tile));
  const int n_resident = min(kResident, my_tiles);
  const int rounds = (my_tiles + kWarpgroups - 1) / kWarpgroups;
  const int my_rounds = my_tiles > wg ? (my_tiles - 1 - wg) / kWarpgroups + 1 : 0;
  const int my_resident = n_resident > wg ? (n_resident - 1 - wg) / kWarpgroups + 1 : 0;
  // Which of this warpgroup's rounds are resident (bit r), main's order or v127's (streamed first,
  // then in turn while both are left).
  uint32_t resident_rounds = 0;
  for (int r = 0, alternate = 2 * min(my_resident, my_rounds - my_resident); r < my_rounds; ++r) {
    const bool is_resident = ALTERNATE ? (r < alternate ? (r & 1) != 0 : my_resident > my_rounds - my_resident) : r < my_resident;
    if (is_resident) resident_rounds |= 1u << r;
  }
  // This warpgroup's streamed rounds (bits), the first of them, and the next one after round r in a
  // step (-1: none; the step after starts again from the first).
  const uint32_t streamed_rounds = ~resident_rounds & (my_rounds < 32 ? (1u << my_rounds) - 1 : ~0u);
  const int first_streamed = __ffs(streamed_rounds) - 1;
  const auto NextStreamed = [&](int r) { return __ffs(streamed_rounds & (~1u << r)) - 1; };
  const auto TileOf = [&](int r) { return first_tile + wg + kWarpgroups * r; };
  int8_t* slot = ring + wg * kTransposedTileBytes;
  const auto CopyStreamed = [&](int r) {
    if constexpr (COPY == kCopyCpAsync) {
      CopyTransposedTile(w2, kVocab, TileOf(r) * kTransposedTileRows, slot, u);
      CpAsyncCommit();
    } else if constexpr (UsesMbarrier(COPY)) {
      if (u == 0) {
        MbarrierArriveExpectTx(&full[wg], kTransposedTileBytes);
        if constexpr (COPY == kCopyTma) {
          TmaTile(map, TileOf(r), slot, &full[wg]);
        } else if constexpr (COPY == kCopyTma2d) {
          Tma2dTile(map2d, TileOf(r), slot, &full[wg]);
        } else {
          BulkCopyToShared(slot, w2 + size_t(TileOf(r)) * kTransposedTileBytes, kTransposedTileBytes, &full[wg]);
        }
      }
    }
  };

  if (tid < kWarpgroups) {
    MbarrierInit(&turn[tid], 4);
    MbarrierInit(&full[tid], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  for (int i = tid; i < kDigitBytes / 4; i += blockDim.x) reinterpret_cast<uint32_t*>(digits)[i] = 0x01030507u * (1 + i % 5);
  for (int r = 0, slot_index = 0; r < my_rounds; ++r) {
    if (resident_rounds >> r & 1u) {
      CopyTransposedTile(w2, kVocab, TileOf(r) * kTransposedTileRows, resident + size_t(wg + kWarpgroups * slot_index++) * kTransposedTileBytes, u);
    }
  }
  CpAsyncCommit();
  if (first_streamed >= 0) CopyStreamed(first_streamed);
  CpAsyncWaitPending(COPY == kCopyCpAsync && first_streamed >= 0 ? 1 : 0);
  FenceSharedForAsyncProxy();
  __syncthreads();

  uint32_t turns = 0, landed = 0;
  int total = 0;
  for (int k = 0; k < o.steps; ++k) {
    if (o.base) {  // this CTA's rows of every request's step-k base logits, a 128-byte line at a time
      const uint16_t* step_base = base + size_t(k % 7) * kVocab;
      for (int i = tid; i < kBatch * kTilesPerCta; i += blockDim.x) {
        const int b = i / kTilesPerCta, line = i % kTilesPerCta;
        const uint16_t* p = step_base + size_t(b) * 7 * kVocab + size_t(first_tile) * 64 + line * 64;
        if (first_tile * 64 + line * 64 < kVocab) asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
      }
    }
    Spin(o.gap);
    __syncthreads();
    for (int r = 0, slot_index = 0; r < my_rounds; ++r) {
      const bool is_streamed = !(resident_rounds >> r & 1u);
      const int8_t* tile = is_streamed ? slot : resident + size_t(wg + kWarpgroups * slot_index++) * kTransposedTileBytes;
      if (is_streamed) {
        if constexpr (COPY == kCopyCpAsync) {
          CpAsyncWaitPending(0);
          FenceSharedForAsyncProxy();
          asm volatile("bar.sync %0, 128;" ::"r"(1 + wg) : "memory");
        } else if constexpr (UsesMbarrier(COPY)) {
          MbarrierWait(&full[wg], landed++ & 1);
        }
      }
      total += ScoreTile(digits, tile, is_streamed && UsesMbarrier(COPY), turn, wg, r, rounds, turns, lane);
      if (is_streamed) {
        asm volatile("bar.sync %0, 128;" ::"r"(1 + wg) : "memory");
        const int next = NextStreamed(r);
        if (next >= 0) {
          CopyStreamed(next);
        } else if (k + 1 < o.steps) {
          CopyStreamed(first_streamed);
        }
      }
      Spin(o.epilogue);
    }
    if (wg + (rounds - 1) * kWarpgroups >= my_tiles && rounds > 0) {  // no tile in the last round: pass the turn on
      if (wg > 0 || rounds > 1) MbarrierWait(&turn[wg], turns++ & 1);
      if (wg < kWarpgroups - 1 && lane == 0) MbarrierArrive(&turn[wg + 1]);
    }
  }
  CpAsyncWaitPending(0);
  sink[blockIdx.x * blockDim.x + tid] = total;
}

// One warpgroup: tile `tile` by cp.async (TransposedOffset) and by the map (TmaOffset); counts bytes that
// differ from W2 and accumulators of the two layouts' wgmmas that differ (A: pseudo-random digits).
__global__ void __launch_bounds__(128, 1) CheckTma(const __grid_constant__ CUtensorMap map, const int8_t* w2, int tile, int* errors) {
  extern __shared__ __align__(1024) unsigned char probe_smem[];
  int8_t* a = reinterpret_cast<int8_t*>(probe_smem);
  int8_t* old_tile = a + 64 * kRank;
  int8_t* new_tile = old_tile + kTransposedTileBytes;
  uint64_t* bar = reinterpret_cast<uint64_t*>(new_tile + kTransposedTileBytes);
  const int u = threadIdx.x;
  if (u == 0) {
    MbarrierInit(bar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  for (int i = u; i < 64 * kRank; i += 128) a[i] = int8_t((i * 2654435761u) >> 24);
  CopyTransposedTile(w2, kVocab, tile * kTransposedTileRows, old_tile, u);
  CpAsyncCommit();
  if (u == 0) {
    MbarrierArriveExpectTx(bar, kTransposedTileBytes);
    TmaTile(map, tile, new_tile, bar);
  }
  CpAsyncWaitPending(0);
  MbarrierWait(bar, 0);
  FenceSharedForAsyncProxy();
  __syncthreads();
  int bad = 0;
  for (int i = u; i < 64 * kRank; i += 128) {
    const int n = i / kRank, k = i % kRank;
    const int8_t want = w2[size_t(tile * kTransposedTileRows + TileRow(n)) * kRank + k];
    bad += old_tile[TransposedOffset(n, k)] != want;
    bad += (new_tile[TmaOffset(n, k)] != want) << 16;
  }
  int acc_old[32], acc_new[32];
  WgmmaFence();
#pragma unroll
  for (int s = 0; s < kRank / 32; ++s) {
    WgmmaS8(acc_old, WgmmaDescriptor(a + s * 2048, 128, 256), WgmmaDescriptor(old_tile + s * 2048, 128, 256), s > 0);
  }
#pragma unroll
  for (int s = 0; s < kRank / 32; ++s) {
    WgmmaS8(acc_new, WgmmaDescriptor(a + s * 2048, 128, 256), WgmmaDescriptor(new_tile + s * 2048, 1024, 128), s > 0);
  }
  WgmmaCommit();
  WgmmaWaitGroup<0>();
  int differ = 0, nonzero = 0;
#pragma unroll
  for (int e = 0; e < 32; ++e) {
    differ += acc_old[e] != acc_new[e];
    nonzero += acc_old[e] != 0;
  }
  atomicAdd(&errors[0], bad & 0xFFFF);
  atomicAdd(&errors[1], bad >> 16);
  atomicAdd(&errors[2], differ);
  atomicAdd(&errors[3], nonzero);
}

#define CHECK(x)                                                                             \
  do {                                                                                       \
    cudaError_t e_ = (x);                                                                    \
    if (e_ != cudaSuccess) {                                                                 \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*, const cuuint64_t*,
                                 const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The 5-d map of TmaTile over W2 [V][256] int8: dims (k % 16, c, b, a, k / 16), byte strides 256 (c),
// 4096 (b: 16 rows, over all tiles), 512 (a), 16 (k / 16); the box one whole tile. TWO_D: Tma2dTile's
// map, dims (k, row), box 16 x 64. Returns whether the driver took it.
bool MakeMap(int8_t* w2, bool two_d, CUtensorMap* map) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found;
  CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
  if (fn == nullptr || found != cudaDriverEntryPointSuccess) {
    std::fprintf(stderr, "cuTensorMapEncodeTiled not found\n");
    std::exit(1);
  }
  const cuuint64_t dims5[5] = {16, 2, cuuint64_t(4) * kTotalTiles, 8, 16}, strides5[4] = {256, 4096, 512, 16};
  const cuuint64_t dims2[2] = {kRank, kVocab}, strides2[1] = {kRank};
  const cuuint32_t box5[5] = {16, 2, 4, 8, 16}, box2[2] = {16, kTransposedTileRows}, unit[5] = {1, 1, 1, 1, 1};
  const CUresult r = reinterpret_cast<EncodeTiled>(fn)(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, two_d ? 2 : 5, w2, two_d ? dims2 : dims5,
                                                       two_d ? strides2 : strides5, two_d ? box2 : box5, unit,
                                                       CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                                                       CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  std::printf("cuTensorMapEncodeTiled (%s): %d\n", two_d ? "2-d, box 16 x 64" : "5-d, strides 256, 4096, 512, 16", int(r));
  return r == CUDA_SUCCESS;
}

template <int COPY, bool ALTERNATE>
float TimeProbe(const CUtensorMap& map, const CUtensorMap& map2d, const int8_t* w2, const uint16_t* base, const Options& o, int* sink, int launches) {
  const auto kernel = StreamProbe<COPY, ALTERNATE>;
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  std::vector<float> us;
  for (int i = 0; i <= launches; ++i) {  // launch 0 warms up
    CHECK(cudaEventRecord(start));
    kernel<<<kCtas, 128 * kWarpgroups, kSmemBytes>>>(map, map2d, w2, base, o, sink);
    CHECK(cudaEventRecord(stop));
    CHECK(cudaEventSynchronize(stop));
    CHECK(cudaGetLastError());
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (i > 0) us.push_back(1000.0f * ms / o.steps);
  }
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

template <int COPY>
void Row(const CUtensorMap& map, const CUtensorMap& map2d, const int8_t* w2, const uint16_t* base, const Options& o, int* sink, int launches) {
  const float main_order = TimeProbe<COPY, false>(map, map2d, w2, base, o, sink, launches);
  const float alternate = TimeProbe<COPY, true>(map, map2d, w2, base, o, sink, launches);
  // Streamed bytes a step over the grid: every CTA's tiles past its resident ones.
  const double bytes = double(kTotalTiles - kCtas * kResident) * kTransposedTileBytes;
  std::printf("| %s | %lld | %lld | %s | %.2f | %.2f | %.0f | %.0f |\n", kCopyNames[COPY], o.epilogue, o.gap, o.base ? "yes" : "no",
              main_order, alternate, bytes / main_order / 1e3, bytes / alternate / 1e3);
}

}  // namespace

int main(int argc, char** argv) {
  int launches = 7;
  std::vector<long long> epilogues = {0, 1000}, gaps = {0, 10000};  // 10000 cycles: about the exchange and e ready at 64 requests
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--launches" && i + 1 < argc) launches = std::atoi(argv[++i]);
    else if (arg == "--epilogue" && i + 1 < argc) epilogues = {std::atoll(argv[++i])};
    else if (arg == "--gap" && i + 1 < argc) gaps = {std::atoll(argv[++i])};
    else {
      std::fprintf(stderr, "usage: %s [--launches N] [--epilogue CYCLES] [--gap CYCLES]\n", argv[0]);
      return 2;
    }
  }
  cudaDeviceProp props;
  CHECK(cudaGetDeviceProperties(&props, 0));
  int khz = 0;
  CHECK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
  std::printf("GPU: %s, %d SMs, %d kHz\n", props.name, props.multiProcessorCount, khz);
  if (props.multiProcessorCount < kCtas) {
    std::fprintf(stderr, "needs %d SMs\n", kCtas);
    return 1;
  }
  std::vector<int8_t> host(size_t(kVocab) * kRank);
  std::mt19937 rng(51);
  for (auto& x : host) x = int8_t(rng() % 255 - 127);
  int8_t* w2 = nullptr;
  uint16_t* base = nullptr;
  int* sink = nullptr;
  int* errors = nullptr;
  CHECK(cudaMalloc(&w2, host.size()));
  CHECK(cudaMemcpy(w2, host.data(), host.size(), cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&base, size_t(kBatch) * 7 * kVocab * 2));
  CHECK(cudaMemset(base, 0, size_t(kBatch) * 7 * kVocab * 2));
  CHECK(cudaMalloc(&sink, kCtas * 128 * kWarpgroups * sizeof(int)));
  CHECK(cudaMalloc(&errors, 4 * sizeof(int)));
  CUtensorMap map, map2d;
  const bool tma = MakeMap(w2, false, &map), tma2d = MakeMap(w2, true, &map2d);

  const int check_smem = 64 * kRank + 2 * kTransposedTileBytes + 64;
  CHECK(cudaFuncSetAttribute(CheckTma, cudaFuncAttributeMaxDynamicSharedMemorySize, check_smem));
  for (int tile : {0, 1, 37, kTotalTiles / 2, kTotalTiles - 1}) {
    if (!tma) break;
    CHECK(cudaMemset(errors, 0, 4 * sizeof(int)));
    CheckTma<<<1, 128, check_smem>>>(map, w2, tile, errors);
    CHECK(cudaDeviceSynchronize());
    int e[4];
    CHECK(cudaMemcpy(e, errors, sizeof(e), cudaMemcpyDeviceToHost));
    std::printf("check tile %d: cp.async bytes wrong %d, tma bytes wrong %d, accumulators differing %d (of %d nonzero)\n", tile,
                e[0], e[1], e[2], e[3]);
  }

  std::printf("\nus a step (median of %d launches of 100 steps); GB/s: streamed W2 bytes a step over that\n\n", launches);
  std::printf("| copy | epilogue cycles | gap cycles | base to L2 | main order us | v127 order us | main GB/s | v127 GB/s |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  for (int b : {0, 1}) {
    for (long long gap : gaps) {
      for (long long epilogue : epilogues) {
        Options o;
        o.base = b;
        o.gap = gap;
        o.epilogue = epilogue;
        Row<kCopyCpAsync>(map, map2d, w2, base, o, sink, launches);
        if (tma) Row<kCopyTma>(map, map2d, w2, base, o, sink, launches);
        if (tma2d) Row<kCopyTma2d>(map, map2d, w2, base, o, sink, launches);
        Row<kCopyBulk>(map, map2d, w2, base, o, sink, launches);
        Row<kCopyNone>(map, map2d, w2, base, o, sink, launches);
      }
    }
  }
  return 0;
}
