// One-token decode step of a whole Llama decoder stack (one row, bf16) in ONE persistent kernel,
// with the weights streamed into shared memory ahead of the data they multiply.
//
// kernels/decode_stack_cuda.py builds and launches it; kernels/decode_stack.py (Triton) is the
// same step with grid barriers between phases. What this kernel does that Triton cannot express:
//
//   * A producer warp per SM walks the SM's whole weight schedule for the step (its rows of
//     q|k|v, o, gate|up and down, layer after layer) and copies each 16 KB piece into a ring of
//     shared-memory stages with bulk copies (cp.async.bulk, completion on an mbarrier). It waits
//     for a free stage and keeps at most `inflight` copies outstanding (the other stages hold
//     received bytes), never for activations: while the consumers wait for the other SMs (a
//     phase boundary, the attention), the SM's share of the HBM keeps streaming.
//   * The phases wait on counters, one per (layer, phase), that only the SMs whose results a
//     phase needs have to reach; the attention waits for q|k|v, the o rows for the 8 merged
//     heads, and so on. The counters reset themselves at the end of the step.
//
// Per layer, for every SM (P of them, one block each, all resident):
//   Q  input RMSNorm of the residual (each warp normalises its 1024 columns in registers, the
//      row's sum of squares through shared memory), then its rows of q|k|v
//                                                               -> qkv scratch; counter Q += 1
//   A  (SMs < HKV * NS) one attention item (kv head, split): its first block of cached keys and
//      values copied ahead at the layer's start; RoPE, the own key and value written into the
//      cache, online softmax over the split's keys; the last split of a kv head to finish
//      merges the partials                                      -> attn; counter A += 1 a kv head
//   O  its rows of o + the residual                             -> res;  counter O += 1
//   G  post-attention RMSNorm, its rows of gate and up, SwiGLU  -> act;  counter G += 1
//   D  its rows of down + the residual                          -> res;  counter D += 1
// then SM 0 writes the final RMSNorm.
//
// Numerics are the layer-by-layer kernels' roundings (as in decode_stack.py): float32 sums,
// products rounded to bf16 before the residual add, the residual rounded, RMSNorm's
// (x * rstd) rounded before the weight, RoPE's products rounded, p rounded to bf16 before p.v.
// Summation orders differ, so results agree within bf16 rounding, not bit for bit.
//
// Two builds: stack_kernel<false> is the step; stack_kernel<true> also counts cycles per SM
// (Params::stats, for bench/stack_probe.py), which costs the step time.

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int kConsumerWarps = 8;
constexpr int kConsumers = kConsumerWarps * 32;
constexpr int kThreads = kConsumers + 32;  // + the producer warp
constexpr int kStageBytes = 16384;
constexpr int kStageElems = kStageBytes / 2;
constexpr int kSeg = kStageElems / kConsumerWarps;  // elements a warp multiplies a stage (1024)
constexpr int kKeys = 32;                            // keys an attention block
constexpr int kPhases = 5;
constexpr int kMaxParts = 1024;                      // float partial sums a phase (checked by the launcher)
constexpr int kMaxSplits = 16;                       // key splits a kv head (checked by the launcher)
constexpr int kRopeIt = 3;  // rotated (head, pair) items a thread: (G + 1) * HD / 2 <= 9 * 64 over kConsumers
constexpr unsigned kSpinLimit = 1u << 22;  // polls (~3 s) before a wait gives up: a bug, flagged

struct Params {
  const __nv_bfloat16* x;  // [DIM] the step's input row
  __nv_bfloat16* out;      // [DIM] final-norm output
  __nv_bfloat16* res;      // [DIM] residual scratch
  __nv_bfloat16* qkv;      // [NQKV]
  __nv_bfloat16* attn;     // [H HD]
  float* part;             // [H, NS, HD]
  float* ml;               // [H, NS, 2]
  __nv_bfloat16* act;      // [I]
  int* cnt;                // [L * kPhases + L * HKV] counters (zero between steps), then [1] the error flag
  const __nv_bfloat16* wqkv;  // [L, NQKV, DIM]
  const __nv_bfloat16* wo;    // [L, DIM, H HD]
  const __nv_bfloat16* wgu;   // [L, 2 I, DIM]: gate rows, then up rows
  const __nv_bfloat16* wd;    // [L, DIM, I]
  const __nv_bfloat16* nrm;   // [L, 2, DIM]
  const __nv_bfloat16* fnorm; // [DIM]
  __nv_bfloat16* kc;          // [L, S, HKV, TMAX, HD] (strides below, elements)
  __nv_bfloat16* vc;
  const __nv_bfloat16* cos;   // [*, HD] by position
  const __nv_bfloat16* sin;
  const int64_t* pos;         // [1]
  const int64_t* slots;       // [1]
  float eps, qk_scale;        // qk_scale includes log2(e)
  int64_t sk_l, sk_s, sk_h, sk_t, s_tab;
  int L, DIM, H, HKV, HD, I, TMAX, NS, nstages;
  long long* stats;  // [P, kStats] SM-cycle counts (a probe's diagnosis), or null
  int mode;          // 0: the step; probes (wrong results): 1 no counter waits, 2 also no arithmetic,
                     // 3 no counter waits and no attention
  int inflight;      // copies in flight at most (the rest of the ring holds landed stages); >= nstages: no cap
  int balance;       // < 0: cdiv(N, P) rows an SM; else per mille fewer rows for the SMs that attend
};

// stats[pid * kStats + ...]: cycles the producer waited for free stages, the producer's total,
// cycles the consumers waited for a stage's bytes, waited at the counters before Q (the previous
// layer's down), A (q|k|v), O (the heads), G (o), D (gate|up), in the attention, total, in the
// row loads and norms, stages consumed, in the stages' arithmetic (bytes landed to stage freed),
// in the phase ends (the warps' last stages, row sums, stores, signals)
constexpr int kStats = 16;

// ---- PTX helpers: mbarriers, bulk copies, acquire/release counters

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred P1;\n"
      "WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      " @!P1 bra WAIT_%=;\n}" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void red_release_add(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ int atom_acq_rel_add(int* p, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

__device__ __forceinline__ void consumers_sync() {  // the consumer warps only (the producer runs on)
  asm volatile("bar.sync 1, %0;" ::"n"(kConsumers) : "memory");
}

__device__ __forceinline__ float bf(float v) { return __bfloat162float(__float2bfloat16(v)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Floats of the xs region: the final norm's row, and the attention's scratch (see Att)
__host__ __device__ inline int xs_floats(int dim, int hhd, int inter, int g, int hd) {
  int att = g * hd + 4 * hd + g * kKeys + 8 * ((g + 7) / 8) * 4 + (kKeys * (hd + 8) + kKeys * hd + 2 * hd) / 2;
  int n = dim > hhd ? dim : hhd;
  n = n > inter ? n : inter;
  return n > att ? n : att;
}

// ---- the weight schedule, walked identically by the producer and the consumers

struct Slice {  // rows [row0, row0 + n) of a weight [N, K]
  const __nv_bfloat16* w;
  int row0, n, K, rps;  // rps: rows a stage
  int rw = 0, seg = 0, segs = 0;  // a consumer warp's row in each stage and segment of it (Consumer::seat)
  __device__ int stages() const { return n > 0 ? (n + rps - 1) / rps : 0; }
  __device__ const __nv_bfloat16* src(int s) const { return w + (int64_t)(row0 + s * rps) * K; }
  __device__ int rows(int s) const { return min(rps, n - s * rps); }
};

// Rows [row0, row0 + n) of N for SM pid. balance < 0: cdiv(N, P) rows each (the last SMs may get
// fewer or none). balance >= 0: rows by weight, 1000 an SM less balance per mille for the SMs that
// also attend (pid < nitem), each SM's start the floor of its weight's prefix share.
__device__ __forceinline__ int64_t row_start(int N, int pid, int P, int nitem, int balance) {
  const int64_t total = 1000LL * P - (int64_t)balance * min(nitem, P);
  return (int64_t)N * (1000LL * pid - (int64_t)balance * min(pid, nitem)) / total;
}

__device__ __forceinline__ Slice slice(const __nv_bfloat16* w, int N, int K, int pid, int P, int nitem, int balance) {
  if (balance < 0) {
    int r = (N + P - 1) / P;
    int row0 = pid * r;
    int n = max(0, min(r, N - row0));
    return Slice{w, row0, n, K, kStageElems / K};
  }
  int row0 = (int)row_start(N, pid, P, nitem, balance);
  int n = (int)row_start(N, pid + 1, P, nitem, balance) - row0;
  return Slice{w, row0, n, K, kStageElems / K};
}

// The SM's slices of layer l: 0 q|k|v, 1 o, 2 gate, 3 up (gate and up stages alternate), 4 down.
__device__ __forceinline__ void layer_slices(const Params& p, int l, int pid, int P, Slice* s) {
  int nqkv = (p.H + 2 * p.HKV) * p.HD, hhd = p.H * p.HD;
  const int ni = p.HKV * p.NS, b = p.balance;
  s[0] = slice(p.wqkv + (int64_t)l * nqkv * p.DIM, nqkv, p.DIM, pid, P, ni, b);
  s[1] = slice(p.wo + (int64_t)l * p.DIM * hhd, p.DIM, hhd, pid, P, ni, b);
  const __nv_bfloat16* g = p.wgu + (int64_t)l * 2 * p.I * p.DIM;
  s[2] = slice(g, p.I, p.DIM, pid, P, ni, b);
  s[3] = slice(g + (int64_t)p.I * p.DIM, p.I, p.DIM, pid, P, ni, b);
  s[4] = slice(p.wd + (int64_t)l * p.DIM * p.I, p.DIM, p.I, pid, P, ni, b);
}

struct Ring {
  __nv_bfloat16* buf;  // nstages x kStageElems
  uint64_t* full;
  uint64_t* empty;
  int n;
};

// Cycle counter reads only in the timed build (stats). The builds timed from cc89010 to 8dab025
// read the clock on every stage; the first build, without them, was ~5 % faster against the
// layer path timed in the same call.
template <bool kTimed>
__device__ __forceinline__ long long now() {
  if constexpr (kTimed) return clock64();
  return 0;
}

// A position in the ring: stage slot and the parity of its use (no division on the hot path)
struct RingPos {
  int slot = 0;
  uint32_t par = 0;
  __device__ void advance(int n) {
    if (++slot == n) {
      slot = 0;
      par ^= 1;
    }
  }
};

// The SM's weight schedule for the step, one stage at a time, in the consumers' order: per layer
// its q|k|v stages, o, gate and up alternating, then down.
struct Walk {
  const Params& p;
  int pid, P;
  int l = 0, ph = 0, i = 0;  // ph: 0 q|k|v, 1 o, 2 gate|up, 3 down
  Slice s[5];
  __device__ Walk(const Params& p_, int pid_, int P_) : p(p_), pid(pid_), P(P_) { layer_slices(p, 0, pid, P, s); }
  // the next stage's source and bytes; false past the step's last stage
  __device__ bool next(const __nv_bfloat16*& src, uint32_t& bytes) {
    while (l < p.L) {
      // (named picks, not s[k] with a runtime k: that would put s in local memory)
      const Slice c = ph == 0 ? s[0] : ph == 1 ? s[1] : ph == 3 ? s[4] : (i & 1) ? s[3] : s[2];
      const int k = ph == 2 ? i >> 1 : i;
      if (k < c.stages()) {
        src = c.src(k);
        bytes = (uint32_t)c.rows(k) * c.K * 2;
        ++i;
        return true;
      }
      i = 0;
      if (++ph == 4) {
        ph = 0;
        if (++l < p.L) layer_slices(p, l, pid, P, s);
      }
    }
    return false;
  }
};

template <bool kTimed>
__device__ void produce(const Params& p, const Ring& ring, int pid, int P) {
  // one lane issues every copy; g counts the step's stages
  uint32_t g = 0;
  RingPos at, back;  // the stage to fill; the stage `inflight` copies back
  long long t_start = now<kTimed>(), waited = 0;
  Walk walk(p, pid, P);
  const __nv_bfloat16* src;
  uint32_t bytes;
  while (walk.next(src, bytes)) {
    long long t0 = now<kTimed>();
    if (g >= (uint32_t)p.inflight && p.inflight < ring.n) {
      // Little's law: every SM with its whole ring in flight fills the memory system's queues,
      // and every read on the critical path (the attention's, the counters') waits behind them.
      // Enough copies stay in flight to keep the HBM busy; the other stages hold landed bytes,
      // so a consumer that stalls does not stall the stream.
      mbar_wait(&ring.full[back.slot], back.par);
      back.advance(ring.n);
    }
    mbar_wait(&ring.empty[at.slot], at.par ^ 1);
    waited += now<kTimed>() - t0;
    mbar_expect_tx(&ring.full[at.slot], bytes);
    bulk_copy(ring.buf + (size_t)at.slot * kStageElems, src, bytes, &ring.full[at.slot]);
    at.advance(ring.n);
    ++g;
  }
  if (kTimed) {
    p.stats[pid * kStats + 0] = waited;
    p.stats[pid * kStats + 1] = now<kTimed>() - t_start;
  }
}

template <bool kTimed>
struct Consumer {
  const Params& p;
  Ring ring;
  float* xs;     // the attention's scratch (Att) and the final norm's row (float32)
  float* parts;  // [kMaxParts] per-warp partial sums of the phase's rows
  float* red;    // [kConsumerWarps] block reductions (the norms' sums of squares)
  int* flag;
  int tid, warp, lane, pid, P;
  RingPos at;  // the next stage to consume, as the producer's walk
  long long st[kStats] = {};  // thread 0's cycle counts (stats)

  __device__ void wait_count(const int* c, int target, int kind) {
    long long t0 = now<kTimed>();
    if (tid == 0 && p.mode == 0) {
      unsigned n = 0;
      while (ld_acquire(c) < target) {
        if (++n > kSpinLimit) {
          atomicOr(p.cnt + p.L * kPhases + p.L * p.HKV, 1);
          break;
        }
      }
    }
    consumers_sync();
    st[3 + kind] += now<kTimed>() - t0;
  }

  // After every consumer's stores: the block barrier orders them before thread 0's release add
  // (the same pattern as the Triton stack's barrier), one instruction instead of a fence and an add.
  __device__ void signal(int* c) {
    consumers_sync();
    if (tid == 0) red_release_add(c, 1);
  }

  // xs = RMSNorm(src) * w with rmsnorm's roundings; src written by other SMs (read through L2)
  __device__ void norm_into_xs(const __nv_bfloat16* src, const __nv_bfloat16* w) {
    float ss = 0.f;
    for (int k = tid; k < p.DIM; k += kConsumers) {
      float v = __bfloat162float(__ldcg(src + k));
      xs[k] = v;
      ss += v * v;
    }
    ss = warp_sum(ss);
    if (lane == 0) red[warp] = ss;
    consumers_sync();
    float tot = 0.f;
#pragma unroll
    for (int i = 0; i < kConsumerWarps; ++i) tot += red[i];
    float rstd = rsqrtf(tot / p.DIM + p.eps);
    for (int k = tid; k < p.DIM; k += kConsumers) xs[k] = bf(bf(xs[k] * rstd) * __bfloat162float(w[k]));
    consumers_sync();
  }

  // The warp's piece of a GEMV's input row, in registers for the whole phase: every stage puts
  // the same 1024 columns (from (warp * kSeg) % K) in front of a warp. Lane holds the columns
  // col0 + j * 256 + lane * 8 + t as xr[j * 8 + t] (j < 4, t < 8), as stage() reads the weights.
  __device__ void load_x(const __nv_bfloat16* src, int K, float (&xr)[32]) const {
    const int col0 = (warp * kSeg) % K;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint4 u = __ldcg(reinterpret_cast<const uint4*>(src + col0 + j * 256 + lane * 8));
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        float2 f = __bfloat1622float2(h[t]);
        xr[j * 8 + 2 * t] = f.x;
        xr[j * 8 + 2 * t + 1] = f.y;
      }
    }
  }

  // xr = RMSNorm(src) * wr on the warp's piece (rmsnorm's roundings; wr: the norm weight's piece,
  // loaded before the wait that src needs); the row's sum of squares from the warps whose pieces
  // tile it (warps 0 .. K / kSeg - 1)
  __device__ void norm_x(const __nv_bfloat16* src, const float (&wr)[32], int K, float (&xr)[32]) {
    load_x(src, K, xr);
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < 32; ++i) ss = fmaf(xr[i], xr[i], ss);
    ss = warp_sum(ss);
    if (lane == 0) red[warp] = ss;
    consumers_sync();
    float tot = 0.f;
    for (int i = 0; i < K / kSeg; ++i) tot += red[i];
    const float rstd = rsqrtf(tot / K + p.eps);
#pragma unroll
    for (int i = 0; i < 32; ++i) xr[i] = bf(bf(xr[i] * rstd) * wr[i]);
  }

  // The warp's place in the slice's stages: every stage puts its kSeg elements at the same row
  // and columns in front of it (once a layer, not a stage: runtime divisions)
  __device__ void seat(Slice& s) const {
    const int e0 = warp * kSeg;
    s.rw = e0 / s.K;
    s.seg = (e0 % s.K) / kSeg;
    s.segs = s.K / kSeg;
  }

  // Multiply stage i of slice s by the warp's x piece; the warp's partial goes to
  // parts[base + row * segs + seg]. (Two stages at a time, two reductions in flight, was slower:
  // 934 against 878 us a 1B step on the H100, the consumers holding two slots.)
  __device__ void stage(const Slice& s, int i, int base, const float (&xr)[32]) {
    const int slot = at.slot;
    long long t0 = now<kTimed>();
    mbar_wait(&ring.full[at.slot], at.par);
    at.advance(ring.n);
    long long t1 = now<kTimed>();
    st[2] += t1 - t0;
    st[11] += 1;
    if (s.rw < s.rows(i) && p.mode != 2) {  // (probe mode 2: the weights stream, nothing multiplies them)
      const __nv_bfloat16* wst = ring.buf + (size_t)slot * kStageElems + warp * kSeg;
      uint4 u[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) u[q] = *reinterpret_cast<const uint4*>(wst + q * 256 + lane * 8);
      float acc0 = 0.f, acc1 = 0.f;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u[q]);
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          float2 f = __bfloat1622float2(h[t]);
          acc0 = fmaf(f.x, xr[q * 8 + 2 * t], acc0);
          acc1 = fmaf(f.y, xr[q * 8 + 2 * t + 1], acc1);
        }
      }
      const float acc = warp_sum(acc0 + acc1);
      if (lane == 0) parts[base + (i * s.rps + s.rw) * s.segs + s.seg] = acc;
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&ring.empty[slot]);
    st[12] += now<kTimed>() - t1;
  }

  __device__ void slice_stages(const Slice& s, int base, const float (&xr)[32]) {
    for (int i = 0; i < s.stages(); ++i) stage(s, i, base, xr);
  }

  // the slice's rows, each the sum of its segments' partials (after the stages and a sync)
  __device__ float row_sum(const Slice& s, int base, int r) const {
    int segs = s.K / kSeg;
    float a = 0.f;
    for (int j = 0; j < segs; ++j) a += parts[base + r * segs + j];
    return a;
  }

  // An attention item (kv head, split) and its scratch in xs: q [G, HD], cos/sin rows [2 HD], own
  // k and v [2 HD], p [G, kKeys], alpha [G], keys [kKeys, HD + 8] and values [kKeys, HD] (bf16),
  // the cos/sin rows as bf16 [2 HD] (copied ahead)
  struct Att {
    int kvh, sp, length, chunk, lo, hi;
    int64_t pos, slot, cbase;
    float *qs, *cs, *sn, *kn, *vn, *pb, *al;
    __nv_bfloat16 *kb, *vb, *csb;
  };

  // The thread's t-th (head, dim) pair of the item's G x HD output (the pairs tid, tid + 256, ...;
  // o[t] accumulates it): false past the last pair.
  __device__ bool own_pair(int t, int G, int HD, int& gh, int& d) const {
    const int e = tid + t * kConsumers;
    gh = e / HD;
    d = e % HD;
    return e < G * HD;
  }

  __device__ Att att_setup(int l, int item) const {
    Att a;
    const int HD = p.HD, G = p.H / p.HKV, NS = p.NS;
    a.kvh = item / NS;
    a.sp = item % NS;
    a.pos = p.pos[0];
    a.slot = p.slots[0];
    a.length = (int)(a.pos + 1 < p.TMAX ? a.pos + 1 : p.TMAX);
    a.chunk = (a.length + NS - 1) / NS;
    a.lo = a.sp * a.chunk;
    a.hi = min(a.lo + a.chunk, a.length);
    a.cbase = l * p.sk_l + a.slot * p.sk_s + a.kvh * p.sk_h;
    a.qs = xs;
    a.cs = a.qs + G * HD;
    a.sn = a.cs + HD;
    a.kn = a.sn + HD;
    a.vn = a.kn + HD;
    a.pb = a.vn + HD;
    a.al = a.pb + G * kKeys;
    a.kb = reinterpret_cast<__nv_bfloat16*>(a.al + 8 * ((G + 7) / 8) * 4);  // 16-byte aligned
    a.vb = a.kb + kKeys * (HD + 8);
    a.csb = a.vb + kKeys * HD;
    return a;
  }

  // The item's first block of keys and values that earlier steps wrote (positions < pos) and its
  // angle rows, copied into shared memory asynchronously at the layer's start: under the weight
  // stream an HBM read waits microseconds, and none of these depends on this layer's q|k|v.
  // Rows from pos on are zeroed (the own row is put in after q|k|v).
  __device__ void att_prefetch(const Att& a) {
    if (a.lo >= a.hi) return;
    const int HD = p.HD, kstride = HD + 8, cpr = HD / 8;
    for (int e = tid; e < kKeys * cpr; e += kConsumers) {
      int j = e / cpr, c = (e % cpr) * 8;
      int64_t n = a.lo + j;
      if (n < a.hi && n < a.pos) {
        cp_async16(a.kb + j * kstride + c, p.kc + a.cbase + n * p.sk_t + c);
        cp_async16(a.vb + j * HD + c, p.vc + a.cbase + n * p.sk_t + c);
      } else {
        *reinterpret_cast<uint4*>(a.kb + j * kstride + c) = make_uint4(0, 0, 0, 0);
        *reinterpret_cast<uint4*>(a.vb + j * HD + c) = make_uint4(0, 0, 0, 0);
      }
    }
    for (int e = tid; e < 2 * cpr; e += kConsumers) {
      const __nv_bfloat16* src = (e < cpr ? p.cos : p.sin) + a.pos * p.s_tab + (e % cpr) * 8;
      cp_async16(a.csb + e * 8, src);
    }
    cp_async_commit();
  }

  __device__ void attention(int l, int item, bool pre) {
    const Att a = att_setup(l, item);
    if (pre) cp_async_wait_all();  // (made visible to the other threads by the next block barrier)
    const int HD = p.HD, HALF = HD / 2, G = p.H / p.HKV, NS = p.NS;
    const int kvh = a.kvh, sp = a.sp, length = a.length, chunk = a.chunk, lo = a.lo, hi = a.hi;
    const int64_t pos = a.pos;
    const int kstride = HD + 8;  // the key block's row stride (16-byte rows, no bank conflicts)
    float *qs = a.qs, *cs = a.cs, *sn = a.sn, *kn = a.kn, *vn = a.vn, *pb = a.pb, *al = a.al;
    __nv_bfloat16 *kb = a.kb, *vb = a.vb;
    const int64_t cbase = a.cbase;
    const __nv_bfloat16* qkv = p.qkv;
    bool on = lo < hi;
    if (on) {
      // q|k|v: every load issued before the first use (one round trip to L2 under the stream)
      float qa[kRopeIt], qb[kRopeIt];
#pragma unroll
      for (int it = 0; it < kRopeIt; ++it) {
        const int e = tid + it * kConsumers, g2 = e / HALF, d = e % HALF;
        qa[it] = qb[it] = 0.f;
        if (e < (G + 1) * HALF) {
          const __nv_bfloat16* src = g2 < G ? qkv + (kvh * G + g2) * HD : qkv + (p.H + kvh) * HD;
          qa[it] = __bfloat162float(__ldcg(src + d));
          qb[it] = __bfloat162float(__ldcg(src + d + HALF));
        }
      }
      const float vd = tid < HD ? __bfloat162float(__ldcg(qkv + (p.H + p.HKV + kvh) * HD + tid)) : 0.f;
      if (pre) consumers_sync();  // every thread's copies landed
      for (int d = tid; d < HD; d += kConsumers) {
        cs[d] = __bfloat162float(pre ? a.csb[d] : p.cos[pos * p.s_tab + d]);
        sn[d] = __bfloat162float(pre ? a.csb[HD + d] : p.sin[pos * p.s_tab + d]);
      }
      consumers_sync();
      // q of the G heads and (in the split that holds it) the own key, rotated as the rotary kernel does
#pragma unroll
      for (int it = 0; it < kRopeIt; ++it) {
        const int e = tid + it * kConsumers, g2 = e / HALF, d = e % HALF;
        if (e >= (G + 1) * HALF) break;
        const float a = qa[it], b = qb[it];
        float o1 = bf(bf(a * cs[d]) - bf(b * sn[d]));
        float o2 = bf(bf(b * cs[d + HALF]) + bf(a * sn[d + HALF]));
        if (g2 < G) {
          qs[g2 * HD + d] = o1;
          qs[g2 * HD + d + HALF] = o2;
        } else {
          kn[d] = o1;
          kn[d + HALF] = o2;
        }
      }
      if (tid < HD) vn[tid] = vd;
      consumers_sync();
      if (pos >= lo && pos < hi) {  // this split holds the step's own key: into the cache
        for (int d = tid; d < HD; d += kConsumers) {
          p.kc[cbase + pos * p.sk_t + d] = __float2bfloat16(kn[d]);
          p.vc[cbase + pos * p.sk_t + d] = __float2bfloat16(vn[d]);
        }
      }
      float m_i = -INFINITY, l_i = 0.f;  // warp g's head (lanes agree)
      float o[4] = {0.f, 0.f, 0.f, 0.f};  // thread's (head, dim) pairs tid, tid + 256, ...
      for (int start = lo; start < hi; start += kKeys) {
        // the block's keys and values: from the cache, the own one from registers (the first
        // block, copied ahead, lacks only the own row)
        const bool copied = pre && start == lo;
        for (int e = tid; e < kKeys * (HD / 8); e += kConsumers) {
          int j = e / (HD / 8), c = (e % (HD / 8)) * 8;
          int n = start + j;
          if (copied && n != pos) continue;
          uint4 ku = make_uint4(0, 0, 0, 0), vu = make_uint4(0, 0, 0, 0);
          if (n < hi && n != pos) {
            ku = __ldcg(reinterpret_cast<const uint4*>(p.kc + cbase + n * p.sk_t + c));
            vu = __ldcg(reinterpret_cast<const uint4*>(p.vc + cbase + n * p.sk_t + c));
          } else if (n == pos) {
            __nv_bfloat162* kh = reinterpret_cast<__nv_bfloat162*>(&ku);
            __nv_bfloat162* vh = reinterpret_cast<__nv_bfloat162*>(&vu);
#pragma unroll
            for (int t = 0; t < 4; ++t) {
              kh[t] = __floats2bfloat162_rn(kn[c + 2 * t], kn[c + 2 * t + 1]);
              vh[t] = __floats2bfloat162_rn(vn[c + 2 * t], vn[c + 2 * t + 1]);
            }
          }
          *reinterpret_cast<uint4*>(kb + j * kstride + c) = ku;
          *reinterpret_cast<uint4*>(vb + j * HD + c) = vu;
        }
        consumers_sync();
        for (int gh = warp; gh < G; gh += kConsumerWarps) {  // warp gh: head gh, lane j: key j
          const __nv_bfloat16* kr = kb + lane * kstride;
          float s = 0.f;
          for (int c = 0; c < HD; c += 8) {
            uint4 u = *reinterpret_cast<const uint4*>(kr + c);
            const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
            for (int t = 0; t < 4; ++t) {
              float2 f = __bfloat1622float2(h[t]);
              s = fmaf(qs[gh * HD + c + 2 * t], f.x, s);
              s = fmaf(qs[gh * HD + c + 2 * t + 1], f.y, s);
            }
          }
          s = start + lane < hi ? s * p.qk_scale : -INFINITY;
          float m_new = fmaxf(m_i, warp_max(s));
          float alpha = exp2f(m_i - m_new);
          float pr = exp2f(s - m_new);
          l_i = l_i * alpha + warp_sum(pr);
          m_i = m_new;
          pb[gh * kKeys + lane] = bf(pr);
          if (lane == 0) al[gh] = alpha;
        }
        consumers_sync();
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          int gh, d;
          if (!own_pair(t, G, HD, gh, d)) break;
          float a = o[t] * al[gh];
          for (int j = 0; j < kKeys; ++j) a = fmaf(pb[gh * kKeys + j], __bfloat162float(vb[j * HD + d]), a);
          o[t] = a;
        }
        consumers_sync();
      }
      // the split's partial (or, with one split, the output)
      if (warp < G && lane == 0) {
        int row = (kvh * G + warp) * NS + sp;
        p.ml[row * 2] = m_i;
        p.ml[row * 2 + 1] = l_i;
        al[warp] = l_i;
      }
      consumers_sync();
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        int gh, d;
        if (!own_pair(t, G, HD, gh, d)) break;
        if (NS == 1) {
          float den = al[gh];
          p.attn[(kvh * G + gh) * HD + d] = __float2bfloat16(o[t] / (den > 0.f ? den : 1.f));
        } else {
          p.part[((kvh * G + gh) * NS + sp) * HD + d] = o[t];
        }
      }
    }
    if (NS == 1) {
      signal(p.cnt + l * kPhases + 1);
      return;
    }
    // the last split of the kv head to arrive merges the partials
    consumers_sync();
    if (tid == 0) *flag = atom_acq_rel_add(p.cnt + p.L * kPhases + l * p.HKV + kvh, 1) == NS - 1;
    consumers_sync();
    if (!*flag) return;
    // Every load of the merge issued at once (one round trip to L2, not two): the splits' (max,
    // sum) pairs into shared memory (pb, G * kKeys >= G * kMaxSplits * 2 floats: the keys' p are
    // used), the thread's partials into registers.
    const int used = min(NS, (length + chunk - 1) / chunk);  // the splits with keys
    float* mls = pb;
    for (int e0 = 0; e0 < G * HD; e0 += kConsumers) {
      const int e = e0 + tid, gh = e / HD, d = e % HD, row0 = (kvh * G + gh) * NS;
      const bool mine = e < G * HD;
      float part[kMaxSplits];
#pragma unroll
      for (int s2 = 0; s2 < kMaxSplits; ++s2)
        part[s2] = mine && s2 < used ? __ldcg(p.part + (row0 + s2) * HD + d) : 0.f;
      if (e0 == 0) {
        if (tid < G * used) {
          const int h2 = tid / used, s2 = tid % used, r = (kvh * G + h2) * NS + s2;
          mls[(h2 * kMaxSplits + s2) * 2] = __ldcg(p.ml + r * 2);
          mls[(h2 * kMaxSplits + s2) * 2 + 1] = __ldcg(p.ml + r * 2 + 1);
        }
        consumers_sync();
      }
      if (!mine) continue;
      const float* mh = mls + gh * kMaxSplits * 2;
      float mx = -INFINITY;
      for (int s2 = 0; s2 < used; ++s2) mx = fmaxf(mx, mh[s2 * 2]);
      float den = 0.f, num = 0.f;
#pragma unroll
      for (int s2 = 0; s2 < kMaxSplits; ++s2) {
        if (s2 < used) {
          float w = exp2f(mh[s2 * 2] - mx);
          den = fmaf(mh[s2 * 2 + 1], w, den);
          num = fmaf(part[s2], w, num);
        }
      }
      p.attn[(kvh * G + gh) * HD + d] = __float2bfloat16(num / (den > 0.f ? den : 1.f));
    }
    signal(p.cnt + l * kPhases + 1);
  }

  __device__ void run() {
    long long t_start = now<kTimed>();
    run_layers();
    if (kTimed && tid == 0) {
      st[9] = now<kTimed>() - t_start;
      for (int i = 2; i < kStats; ++i) p.stats[pid * kStats + i] = st[i];
    }
  }

  __device__ void run_layers() {
    const int hhd = p.H * p.HD;
    const int nitem = p.HKV * p.NS;
    int* cnt = p.cnt;
    // thread r's register copy of the residual's row r of the SM's o/down rows (at most
    // kConsumers rows an SM: the launcher checks), so the phase ends do not read it back
    float resid = 0.f;
    for (int l = 0; l < p.L; ++l) {
      Slice s[5];
      layer_slices(p, l, pid, P, s);
#pragma unroll
      for (int k = 0; k < 5; ++k) seat(s[k]);
      const __nv_bfloat16* src = l == 0 ? p.x : p.res;
      const __nv_bfloat16* nw = p.nrm + (int64_t)l * 2 * p.DIM;
      const bool attends = pid < nitem && p.mode < 2;  // (probe modes 2 and 3 skip the attention)
      if (attends) att_prefetch(att_setup(l, pid));
      // Q
      float xr[32], wr[32];
      load_x(nw, p.DIM, wr);  // (no earlier kernel or phase writes the weights: before the wait)
      if (l > 0) wait_count(cnt + (l - 1) * kPhases + 4, P, 0);
      long long tn = now<kTimed>();
      norm_x(src, wr, p.DIM, xr);
      st[10] += now<kTimed>() - tn;
      slice_stages(s[0], 0, xr);
      long long te = now<kTimed>();
      consumers_sync();
      for (int r = tid; r < s[0].n; r += kConsumers) p.qkv[s[0].row0 + r] = __float2bfloat16(row_sum(s[0], 0, r));
      signal(cnt + l * kPhases + 0);
      st[13] += now<kTimed>() - te;
      // A
      if (attends) {
        wait_count(cnt + l * kPhases + 0, P, 1);
        long long t0 = now<kTimed>();
        for (int item = pid; item < nitem; item += P) attention(l, item, item == pid);
        st[8] += now<kTimed>() - t0;
      }
      // O
      wait_count(cnt + l * kPhases + 1, p.HKV, 2);
      tn = now<kTimed>();
      load_x(p.attn, hhd, xr);
      st[10] += now<kTimed>() - tn;
      slice_stages(s[1], 0, xr);
      te = now<kTimed>();
      consumers_sync();
      if (tid < s[1].n) {  // the o and down rows are the same rows: thread r keeps row r's residual
        float base = l == 0 ? __bfloat162float(p.x[s[1].row0 + tid]) : resid;
        __nv_bfloat16 y = __float2bfloat16(bf(row_sum(s[1], 0, tid)) + base);
        p.res[s[1].row0 + tid] = y;
        resid = __bfloat162float(y);
      }
      signal(cnt + l * kPhases + 2);
      st[13] += now<kTimed>() - te;
      // G
      load_x(nw + p.DIM, p.DIM, wr);
      wait_count(cnt + l * kPhases + 2, P, 3);
      tn = now<kTimed>();
      norm_x(p.res, wr, p.DIM, xr);
      st[10] += now<kTimed>() - tn;
      const int up = s[2].n * (p.DIM / kSeg);
      for (int i = 0; i < s[2].stages(); ++i) {
        stage(s[2], i, 0, xr);
        stage(s[3], i, up, xr);
      }
      te = now<kTimed>();
      consumers_sync();
      for (int r = tid; r < s[2].n; r += kConsumers) {
        float gv = bf(row_sum(s[2], 0, r));
        float sv = bf(gv / (1.f + __expf(-gv)));
        p.act[s[2].row0 + r] = __float2bfloat16(sv * bf(row_sum(s[3], up, r)));
      }
      signal(cnt + l * kPhases + 3);
      st[13] += now<kTimed>() - te;
      // D
      wait_count(cnt + l * kPhases + 3, P, 4);
      if (l == p.L - 1) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
      tn = now<kTimed>();
      load_x(p.act, p.I, xr);
      st[10] += now<kTimed>() - tn;
      slice_stages(s[4], 0, xr);
      te = now<kTimed>();
      consumers_sync();
      if (tid < s[4].n) {
        __nv_bfloat16 y = __float2bfloat16(bf(row_sum(s[4], 0, tid)) + resid);
        p.res[s[4].row0 + tid] = y;
        resid = __bfloat162float(y);
      }
      signal(cnt + l * kPhases + 4);
      st[13] += now<kTimed>() - te;
    }
    if (pid == 0) {  // the final norm; then every SM is past its last wait: reset the counters
      wait_count(cnt + (p.L - 1) * kPhases + 4, P, 0);
      norm_into_xs(p.res, p.fnorm);
      for (int k = tid; k < p.DIM; k += kConsumers) p.out[k] = __float2bfloat16(xs[k]);
      for (int k = tid; k < p.L * (kPhases + p.HKV); k += kConsumers) cnt[k] = 0;
    }
  }
};

template <bool kTimed>
__global__ void __launch_bounds__(kThreads, 1) stack_kernel(const __grid_constant__ Params p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int pid = blockIdx.x, P = gridDim.x;
  const int xsf = xs_floats(p.DIM, p.H * p.HD, p.I, p.H / p.HKV, p.HD);
  Ring ring;
  ring.n = p.nstages;
  ring.buf = reinterpret_cast<__nv_bfloat16*>(smem);
  float* xs = reinterpret_cast<float*>(smem + (size_t)ring.n * kStageBytes);
  float* parts = xs + (xsf + 3) / 4 * 4;
  float* red = parts + kMaxParts;
  int* flag = reinterpret_cast<int*>(red + kConsumerWarps + 8);
  ring.full = reinterpret_cast<uint64_t*>(flag + 2);
  ring.empty = ring.full + ring.n;
  if (tid == 0) {
    for (int i = 0; i < ring.n; ++i) {
      mbar_init(&ring.full[i], 1);
      mbar_init(&ring.empty[i], kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == kConsumerWarps) {  // the producer: weights only, which no earlier kernel writes
    if (lane == 0) produce<kTimed>(p, ring, pid, P);
    return;
  }
  asm volatile("griddepcontrol.wait;" ::: "memory");  // the kernel before has finished (x, pos, caches)
  Consumer<kTimed> c{p, ring, xs, parts, red, flag, tid, warp, lane, pid, P};
  c.run();
}

}  // namespace

extern "C" {

// Shared memory a block needs beside its ring of stages.
int realtime_stack_fixed_smem(int dim, int hhd, int inter, int g, int hd) {
  return (xs_floats(dim, hhd, inter, g, hd) + 3) / 4 * 16 + kMaxParts * 4 + (kConsumerWarps + 8) * 4 + 8;
}

int realtime_stack_stage_bytes() { return kStageBytes; }
int realtime_stack_max_parts() { return kMaxParts; }
int realtime_stack_threads() { return kThreads; }

// a: pointers and int64 strides (see Params, in order; then stats or 0), f: eps and qk_scale, n:
// the int fields (L, DIM, H, HKV, HD, I, TMAX, NS, nstages, mode, inflight, balance). Returns a
// cudaError_t.
int realtime_stack_launch(const int64_t* a, const float* f, const int* n, int grid, int smem, void* stream, int pdl) {
  Params p;
  p.x = reinterpret_cast<const __nv_bfloat16*>(a[0]);
  p.out = reinterpret_cast<__nv_bfloat16*>(a[1]);
  p.res = reinterpret_cast<__nv_bfloat16*>(a[2]);
  p.qkv = reinterpret_cast<__nv_bfloat16*>(a[3]);
  p.attn = reinterpret_cast<__nv_bfloat16*>(a[4]);
  p.part = reinterpret_cast<float*>(a[5]);
  p.ml = reinterpret_cast<float*>(a[6]);
  p.act = reinterpret_cast<__nv_bfloat16*>(a[7]);
  p.cnt = reinterpret_cast<int*>(a[8]);
  p.wqkv = reinterpret_cast<const __nv_bfloat16*>(a[9]);
  p.wo = reinterpret_cast<const __nv_bfloat16*>(a[10]);
  p.wgu = reinterpret_cast<const __nv_bfloat16*>(a[11]);
  p.wd = reinterpret_cast<const __nv_bfloat16*>(a[12]);
  p.nrm = reinterpret_cast<const __nv_bfloat16*>(a[13]);
  p.fnorm = reinterpret_cast<const __nv_bfloat16*>(a[14]);
  p.kc = reinterpret_cast<__nv_bfloat16*>(a[15]);
  p.vc = reinterpret_cast<__nv_bfloat16*>(a[16]);
  p.cos = reinterpret_cast<const __nv_bfloat16*>(a[17]);
  p.sin = reinterpret_cast<const __nv_bfloat16*>(a[18]);
  p.pos = reinterpret_cast<const int64_t*>(a[19]);
  p.slots = reinterpret_cast<const int64_t*>(a[20]);
  p.sk_l = a[21];
  p.sk_s = a[22];
  p.sk_h = a[23];
  p.sk_t = a[24];
  p.s_tab = a[25];
  p.eps = f[0];
  p.qk_scale = f[1];
  p.L = n[0];
  p.DIM = n[1];
  p.H = n[2];
  p.HKV = n[3];
  p.HD = n[4];
  p.I = n[5];
  p.TMAX = n[6];
  p.NS = n[7];
  p.nstages = n[8];
  p.stats = reinterpret_cast<long long*>(a[26]);
  p.mode = n[9];
  p.inflight = n[10];
  p.balance = n[11];
  static int smem_set[2] = {-1, -1};  // the attribute is set once per build and size (not on every launch)
  const bool timed = p.stats != nullptr;
  cudaError_t e;
  if (smem != smem_set[timed]) {
    e = cudaFuncSetAttribute(timed ? stack_kernel<true> : stack_kernel<false>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return (int)e;
    smem_set[timed] = smem;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  e = timed ? cudaLaunchKernelEx(&cfg, stack_kernel<true>, p) : cudaLaunchKernelEx(&cfg, stack_kernel<false>, p);
  return (int)e;
}

// How many blocks of the kernel fit on one SM with this shared memory (0: none).
int realtime_stack_blocks_per_sm(int smem) {
  int nb = 0;
  if (cudaFuncSetAttribute(stack_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) return -1;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, stack_kernel<false>, kThreads, smem) != cudaSuccess) return -1;
  return nb;
}

const char* realtime_stack_error_string(int e) { return cudaGetErrorString(static_cast<cudaError_t>(e)); }

}  // extern "C"
