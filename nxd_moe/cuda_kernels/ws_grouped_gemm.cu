// Warp-specialised Hopper (sm_90a) grouped GEMMs of an MoE prefill, over the Triton backend's TileLayout.
//
// gate/up:  out[r, n] = silu(x[row_token[r]] @ Wgu[e][:, n]) * (x[row_token[r]] @ Wgu[e][:, I + n])
//           x (T, H), Wgu (E, H, 2I) with [gate | up] columns, out (R, I); e = tile_expert[r / 128]
// down:     out[r, n] = act[r] @ Wd[e][:, n]        act (R, I) in tile order, Wd (E, I, H), out (R, H)
// bf16 operands, fp32 accumulation, bf16 results; rows whose row_token is -1 (padding) are never written.
//
// One CTA per multiprocessor, persistent over work items (tile of 128 rows, column block), three warpgroups:
// - warpgroup 0 produces: one thread issues the weight tiles by TMA (a CUtensorMap built on the host, 128-byte
//   swizzle) and, for down, the activated rows too; for gate/up all 128 threads gather their tile row (one token
//   each) with cp.async into the same swizzled layout, zero-filling padding rows. It gives its registers up.
// - warpgroups 1 and 2 consume: each owns 64 rows of the tile and issues wgmma.mma_async m64n256k16 straight from
//   shared memory (both operands by matrix descriptor), then runs the epilogue from its registers.
// A STAGES-deep ring of (A, B) buffers is handed over with mbarriers: `full` completes when the TMA bytes
// (expect_tx) and the gathering threads' cp.async arrivals are in, `empty` when both consumers' MMAs that read the
// stage have retired. The producer runs ahead across item boundaries, so the next item's loads overlap this
// item's epilogue.
//
// Shared-memory layouts (what the descriptors describe):
// - A (K-major, 128-byte swizzle): row r of the tile at byte r*128, its 16-byte chunk c at ((c ^ (r % 8)) * 16);
//   8-row groups 1024 bytes apart (stride byte offset); each k16 step starts 32 bytes further.
// - B (MN-major, 128-byte swizzle): 4 boxes of 64 columns x 64 k-rows, each 8 KiB; one k-row is 128 bytes, 8 k-rows
//   1024 bytes (stride byte offset), boxes 8 KiB apart (leading byte offset); each k16 step starts 2048 bytes
//   further. For gate/up the boxes are gate[n0, n0+64), gate[n0+64, ..), up[n0, ..), up[n0+64, ..): one n256 MMA
//   gives a warpgroup its gate columns in accumulator columns 0-127 and the matching up columns in 128-255.

#include <cuda.h>  // CUtensorMap and its enums only: the driver entry point comes through the runtime
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int BLOCK_M = 128;                         // rows per tile: TileLayout.block_m
constexpr int BLOCK_K = 64;                          // 64 bf16 = 128 bytes, one swizzle row
constexpr int BOX_N = 64;                            // weight columns per TMA box
constexpr int BOXES = 4;                             // boxes per stage: 256 MMA columns
constexpr int STAGES = 4;
constexpr int A_BYTES = BLOCK_M * BLOCK_K * 2;       // 16 KiB
constexpr int BOX_BYTES = BLOCK_K * BOX_N * 2;       // 8 KiB
constexpr int STAGE_BYTES = A_BYTES + BOXES * BOX_BYTES;
constexpr int SMEM_BYTES = 1024 + STAGES * STAGE_BYTES + 2 * STAGES * 8;  // 1024: room to align the ring
constexpr int THREADS = 384;
constexpr int PRODUCER_REGISTERS = 40;
constexpr int CONSUMER_REGISTERS = 232;              // 40*128 + 232*256 <= 65536

struct Problem {
  const __nv_bfloat16* x;      // gate/up: (T, H) tokens; down: unused (rows come by TMA)
  __nv_bfloat16* out;          // (R, n_out)
  const int64_t* row_token;    // (R,)
  const int32_t* tile_expert;  // (R / 128,)
  const int32_t* num_tiles;    // (1,) tiles in use, on the device
  int k_dim;                   // H (gate/up) or I (down), a multiple of BLOCK_K
  int n_out;                   // output columns: I (gate/up) or H (down)
  int n_blocks;                // column blocks per tile
  int inter;                   // I: where the up columns start (gate/up)
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}

__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
}

__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
      ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2,
                                            uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];"
      ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

// 16 bytes global -> shared; src_bytes 0 writes zeros (padding rows).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// Arrives on `bar` once this thread's earlier cp.async copies have landed (counted in the barrier's init count).
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

// Shared-memory matrix descriptor, 128-byte swizzle: start, leading and stride byte offsets in 16-byte units.
__device__ __forceinline__ uint64_t matrix_descriptor(uint32_t addr, uint32_t leading, uint32_t stride) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>((leading & 0x3FFFF) >> 4) << 16) |
         (static_cast<uint64_t>((stride & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

// d (64 x 256 fp32, 128 per thread) += A (64 x 16, K-major) @ B (16 x 256, MN-major); accumulate = 0 overwrites.
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t a, uint64_t b, uint32_t accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7,"
      "%8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23,"
      "%24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39,"
      "%40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55,"
      "%56, %57, %58, %59, %60, %61, %62, %63,"
      "%64, %65, %66, %67, %68, %69, %70, %71,"
      "%72, %73, %74, %75, %76, %77, %78, %79,"
      "%80, %81, %82, %83, %84, %85, %86, %87,"
      "%88, %89, %90, %91, %92, %93, %94, %95,"
      "%96, %97, %98, %99, %100, %101, %102, %103,"
      "%104, %105, %106, %107, %108, %109, %110, %111,"
      "%112, %113, %114, %115, %116, %117, %118, %119,"
      "%120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, p, 1, 1, 0, 1;\n}\n"  // scale A, scale B = 1; A K-major (0), B MN-major (1)
#define D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
              "+f"(d[i + 6]), "+f"(d[i + 7])
      : D8(0), D8(8), D8(16), D8(24), D8(32), D8(40), D8(48), D8(56),
        D8(64), D8(72), D8(80), D8(88), D8(96), D8(104), D8(112), D8(120)
#undef D8
      : "l"(a), "l"(b), "r"(accumulate));
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Keeps the accumulator's registers from being read or reordered across wgmma's asynchronous writes.
__device__ __forceinline__ void fence_accumulator(float (&d)[128]) {
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

__device__ __forceinline__ float silu(float v) { return v / (1.0f + __expf(-v)); }

template <bool GATE_UP>
__global__ void __launch_bounds__(THREADS, 1)
    ws_grouped_gemm_kernel(const __grid_constant__ CUtensorMap weight_map,
                           const __grid_constant__ CUtensorMap rows_map, const Problem p) {
  extern __shared__ uint8_t smem_raw[];
  // 128-byte swizzle repeats every 1024 bytes; the descriptors and TMA assume 1024-byte aligned tiles.
  const uint32_t ring = (smem_addr(smem_raw) + 1023) & ~1023u;
  const uint32_t full_bar = ring + STAGES * STAGE_BYTES;
  const uint32_t empty_bar = full_bar + STAGES * 8;
  const int warpgroup = threadIdx.x / 128;
  const int lane_in_group = threadIdx.x % 128;

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      // gate/up: the TMA thread's expect_tx arrival plus one cp.async arrival per gathering thread.
      mbarrier_init(full_bar + 8 * s, GATE_UP ? 1 + 128 : 1);
      mbarrier_init(empty_bar + 8 * s, 2);  // one arrival per consumer warpgroup
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  const int num_items = *p.num_tiles * p.n_blocks;
  const int k_steps = p.k_dim / BLOCK_K;

  if (warpgroup == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(PRODUCER_REGISTERS));
    if (!GATE_UP && lane_in_group != 0) return;  // down: one thread issues every copy
    int stage = 0;
    uint32_t phase = 0;
    for (int item = blockIdx.x; item < num_items; item += gridDim.x) {
      const int tile = item / p.n_blocks;
      const int n0 = (item % p.n_blocks) * (GATE_UP ? 2 * BOX_N : BOXES * BOX_N);
      const int expert = p.tile_expert[tile];
      const __nv_bfloat16* src = nullptr;
      uint32_t src_bytes = 0;
      if (GATE_UP) {
        const int64_t token = p.row_token[static_cast<int64_t>(tile) * BLOCK_M + lane_in_group];
        src = p.x + (token >= 0 ? token : 0) * static_cast<int64_t>(p.k_dim);
        src_bytes = token >= 0 ? 16 : 0;
      }
      for (int k = 0; k < k_steps; ++k) {
        const uint32_t full = full_bar + 8 * stage;
        mbarrier_wait(empty_bar + 8 * stage, phase ^ 1);  // a fresh barrier passes parity 1 at once
        const uint32_t a_tile = ring + stage * STAGE_BYTES;
        const uint32_t b_tile = a_tile + A_BYTES;
        const int k0 = k * BLOCK_K;
        if (lane_in_group == 0) {
          mbarrier_arrive_expect_tx(full, GATE_UP ? BOXES * BOX_BYTES : A_BYTES + BOXES * BOX_BYTES);
          if (GATE_UP) {
            tma_load_3d(b_tile, &weight_map, n0, k0, expert, full);
            tma_load_3d(b_tile + BOX_BYTES, &weight_map, n0 + BOX_N, k0, expert, full);
            tma_load_3d(b_tile + 2 * BOX_BYTES, &weight_map, p.inter + n0, k0, expert, full);
            tma_load_3d(b_tile + 3 * BOX_BYTES, &weight_map, p.inter + n0 + BOX_N, k0, expert, full);
          } else {
            tma_load_2d(a_tile, &rows_map, k0, tile * BLOCK_M, full);
#pragma unroll
            for (int b = 0; b < BOXES; ++b) tma_load_3d(b_tile + b * BOX_BYTES, &weight_map, n0 + b * BOX_N, k0,
                                                        expert, full);
          }
        }
        if (GATE_UP) {
          const uint32_t row = a_tile + lane_in_group * 128;
#pragma unroll
          for (int c = 0; c < 8; ++c) cp_async_16(row + ((c ^ (lane_in_group & 7)) << 4), src + k0 + c * 8, src_bytes);
          cp_async_arrive(full);
        }
        if (++stage == STAGES) {
          stage = 0;
          phase ^= 1;
        }
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(CONSUMER_REGISTERS));
  const int consumer = warpgroup - 1;  // rows [64 * consumer, 64 * consumer + 64) of each tile
  const int warp = lane_in_group / 32;
  const int lane = lane_in_group % 32;
  float acc[128];
  int stage = 0;
  uint32_t phase = 0;
  for (int item = blockIdx.x; item < num_items; item += gridDim.x) {
    const int tile = item / p.n_blocks;
    const int n0 = (item % p.n_blocks) * (GATE_UP ? 2 * BOX_N : BOXES * BOX_N);
    int previous = -1;
    for (int k = 0; k < k_steps; ++k) {
      mbarrier_wait(full_bar + 8 * stage, phase);
      // The gathered rows were written by cp.async (generic proxy); wgmma reads through the async proxy.
      if (GATE_UP) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      const uint32_t a_tile = ring + stage * STAGE_BYTES + consumer * 64 * 128;
      const uint32_t b_tile = ring + stage * STAGE_BYTES + A_BYTES;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BLOCK_K / 16; ++kk) {
        wgmma_m64n256k16(acc, matrix_descriptor(a_tile + kk * 32, 16, 1024),
                         matrix_descriptor(b_tile + kk * 2048, BOX_BYTES, 1024), (k > 0 || kk > 0) ? 1u : 0u);
      }
      wgmma_commit();
      // The previous stage's MMAs have retired once at most this stage's group is pending: hand it back.
      wgmma_wait<1>();
      fence_accumulator(acc);
      if (previous >= 0 && lane_in_group == 0) mbarrier_arrive(empty_bar + 8 * previous);
      previous = stage;
      if (++stage == STAGES) {
        stage = 0;
        phase ^= 1;
      }
    }
    wgmma_wait<0>();
    fence_accumulator(acc);
    if (previous >= 0 && lane_in_group == 0) mbarrier_arrive(empty_bar + 8 * previous);

    // Accumulator fragment of m64nN: d[4j + 2h + c] is row 16*warp + lane/4 + 8h, column 8j + 2*(lane%4) + c.
    const int64_t row0 = static_cast<int64_t>(tile) * BLOCK_M + consumer * 64 + warp * 16 + lane / 4;
    const bool real[2] = {p.row_token[row0] >= 0, p.row_token[row0 + 8] >= 0};
    constexpr int OUT_CHUNKS = GATE_UP ? 16 : 32;  // 8-column chunks written: 128 activated or 256 output columns
#pragma unroll
    for (int j = 0; j < OUT_CHUNKS; ++j) {
      const int col = n0 + 8 * j + 2 * (lane % 4);
      if (col >= p.n_out) continue;  // n_out is even: col + 1 is in range too
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (!real[h]) continue;
        float v0 = acc[4 * j + 2 * h], v1 = acc[4 * j + 2 * h + 1];
        if (GATE_UP) {
          v0 = silu(v0) * acc[64 + 4 * j + 2 * h];
          v1 = silu(v1) * acc[64 + 4 * j + 2 * h + 1];
        }
        *reinterpret_cast<__nv_bfloat162*>(p.out + (row0 + 8 * h) * p.n_out + col) = __floats2bfloat162_rn(v0, v1);
      }
    }
  }
}

typedef CUresult (*EncodeTiled)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// Error codes of the launch functions besides cudaError_t values (all positive).
constexpr int NO_ENCODER = -1;   // cuTensorMapEncodeTiled not found through the runtime
constexpr int BAD_MAP = -2;      // the driver refused a tensor map (alignment, sizes)
constexpr int BAD_SHAPE = -3;    // sizes the kernel does not handle

EncodeTiled encoder() {
  static EncodeTiled fn = nullptr;
  if (!fn) {
    void* entry = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &entry, 12000, cudaEnableDefault, &found) ==
            cudaSuccess && found == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<EncodeTiled>(entry);
  }
  return fn;
}

// (E, K, N) row-major weights as boxes of 64 columns x 64 k-rows of one expert.
int weight_map(CUtensorMap* map, const void* weights, int experts, int k_dim, int n_dim) {
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(n_dim), static_cast<cuuint64_t>(k_dim),
                              static_cast<cuuint64_t>(experts)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(n_dim) * 2, static_cast<cuuint64_t>(k_dim) * n_dim * 2};
  const cuuint32_t box[3] = {BOX_N, BLOCK_K, 1};
  const cuuint32_t unit[3] = {1, 1, 1};
  return encoder()(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(weights), dims, strides, box, unit,
                   CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                   CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS ? 0 : BAD_MAP;
}

// (R, K) row-major rows as boxes of 64 columns x 128 rows.
int rows_map(CUtensorMap* map, const void* rows, int64_t num_rows, int k_dim) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(k_dim), static_cast<cuuint64_t>(num_rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(k_dim) * 2};
  const cuuint32_t box[2] = {BLOCK_K, BLOCK_M};
  const cuuint32_t unit[2] = {1, 1};
  return encoder()(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(rows), dims, strides, box, unit,
                   CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                   CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS ? 0 : BAD_MAP;
}

// The shared-memory limit is raised once per device, on the first launch there: a CUDA-graph capture (which may
// refuse calls that are not stream work) then finds it set by the warm-up launch before it.
template <bool GATE_UP>
int launch(const CUtensorMap& weights, const CUtensorMap& rows, const Problem& p, int64_t num_rows, int num_sms,
           int device, cudaStream_t stream) {
  constexpr int MAX_DEVICES = 64;
  static bool configured[MAX_DEVICES] = {};
  if (device < 0 || device >= MAX_DEVICES) return cudaErrorInvalidDevice;
  if (!configured[device]) {
    const cudaError_t error = cudaFuncSetAttribute(ws_grouped_gemm_kernel<GATE_UP>,
                                                   cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
    if (error != cudaSuccess) return error;
    configured[device] = true;
  }
  const int64_t worst_items = (num_rows / BLOCK_M) * p.n_blocks;  // the device-side count is at most this
  const int grid = static_cast<int>(worst_items < num_sms ? worst_items : num_sms);
  if (grid == 0) return 0;
  ws_grouped_gemm_kernel<GATE_UP><<<grid, THREADS, SMEM_BYTES, stream>>>(weights, rows, p);
  return cudaGetLastError();
}

}  // namespace

// The library links its own (static) CUDA runtime: each entry point first makes the caller's device current in it.
extern "C" {

// x (T, H), gate_up_proj (E, H, 2I), out (R, I); row_token (R,) int64, tile_expert (R/128,) int32, num_tiles (1,)
// int32. H and I multiples of 64, R a multiple of 128. Returns 0, a cudaError_t, or a negative code above.
int nxd_ws_gate_up(const void* x, const void* gate_up_proj, void* out, const void* row_token,
                   const void* tile_expert, const void* num_tiles, int64_t num_rows, int hidden, int inter,
                   int num_experts, int num_sms, int device, void* stream) {
  if (hidden % BLOCK_K || inter % BOX_N || num_rows % BLOCK_M) return BAD_SHAPE;
  if (const cudaError_t error = cudaSetDevice(device)) return error;
  if (!encoder()) return NO_ENCODER;
  CUtensorMap weights;
  if (int error = weight_map(&weights, gate_up_proj, num_experts, hidden, 2 * inter)) return error;
  const Problem p{static_cast<const __nv_bfloat16*>(x), static_cast<__nv_bfloat16*>(out),
                  static_cast<const int64_t*>(row_token), static_cast<const int32_t*>(tile_expert),
                  static_cast<const int32_t*>(num_tiles), hidden, inter, (inter + 2 * BOX_N - 1) / (2 * BOX_N), inter};
  return launch<true>(weights, weights, p, num_rows, num_sms, device, static_cast<cudaStream_t>(stream));
}

// activated (R, I) in tile order, down_proj (E, I, H), out (R, H); I a multiple of 64, H of 8.
int nxd_ws_down(const void* activated, const void* down_proj, void* out, const void* row_token,
                const void* tile_expert, const void* num_tiles, int64_t num_rows, int inter, int hidden,
                int num_experts, int num_sms, int device, void* stream) {
  if (inter % BLOCK_K || hidden % 8 || num_rows % BLOCK_M) return BAD_SHAPE;
  if (const cudaError_t error = cudaSetDevice(device)) return error;
  if (!encoder()) return NO_ENCODER;
  CUtensorMap weights, rows;
  if (int error = weight_map(&weights, down_proj, num_experts, inter, hidden)) return error;
  if (int error = rows_map(&rows, activated, num_rows, inter)) return error;
  const Problem p{nullptr, static_cast<__nv_bfloat16*>(out), static_cast<const int64_t*>(row_token),
                  static_cast<const int32_t*>(tile_expert), static_cast<const int32_t*>(num_tiles), inter, hidden,
                  (hidden + BOXES * BOX_N - 1) / (BOXES * BOX_N), inter};
  return launch<false>(weights, rows, p, num_rows, num_sms, device, static_cast<cudaStream_t>(stream));
}

const char* nxd_ws_error_string(int code) {
  switch (code) {
    case NO_ENCODER: return "cuTensorMapEncodeTiled is not available through the CUDA runtime";
    case BAD_MAP: return "cuTensorMapEncodeTiled refused a tensor map (16-byte aligned base and strides needed)";
    case BAD_SHAPE: return "unsupported sizes (H, I multiples of 64; R a multiple of 128)";
    default: return cudaGetErrorString(static_cast<cudaError_t>(code));
  }
}

}  // extern "C"
