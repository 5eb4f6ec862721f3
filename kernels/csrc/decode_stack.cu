// One-token decode step of a whole Llama decoder stack (one row, bf16) in ONE persistent kernel,
// with the weights streamed into shared memory ahead of the data they multiply.
//
// kernels/decode_stack_cuda.py builds and launches it; kernels/decode_stack.py (Triton) is the
// same step with grid barriers between phases. What this kernel does that Triton cannot express:
//
//   * A producer warp per SM walks the SM's whole weight schedule for the step (its rows of
//     q|k|v, o, gate|up and down, layer after layer) and copies each 16 KB piece into a ring of
//     shared-memory stages with bulk copies (cp.async.bulk, completion on an mbarrier). It waits
//     for a free stage and keeps at most `inflight` copies outstanding (`burst` while its consumers
//     are close behind it; the other stages hold received bytes), never for activations: while
//     the consumers wait for the other SMs (a phase boundary, the attention), the SM's share of
//     the HBM keeps streaming. When the ring is full it asks L2 for the next stages instead
//     (Params::ahead), so that the HBM streams on.
//   * The phases hand their rows over as LL words (see Params): a consumer polls the rows it
//     needs, not a counter and then the rows, so a hand-over costs one round trip to L2, not two.
//     The attention polls only its kv head's q|k|v rows, split 0 of a kv head polls the other
//     splits' partials, the o rows poll the heads, and so on. There are no counters to reset.
//
// Per layer, for every SM (P of them, one block each, all resident):
//   Q  input RMSNorm of the residual (each warp normalises its 1024 columns in registers, the
//      row's sum of squares through shared memory), then its rows of q|k|v       -> qkv (LL)
//   A  (SMs < HKV * NS) one attention item (kv head, split): its first block of cached keys and
//      values copied ahead at the layer's start; RoPE, the own key and value written into the
//      cache, online softmax over the split's keys -> its partial (LL); split 0 merges them
//                                                                                -> attn (LL)
//      (Params::every: every SM with rows of o attends to all the heads, one split, and its o
//      rows start from its own heads in shared memory: no hand-over of the heads)
//   O  its rows of o + the residual                                              -> reso (LL)
//   G  post-attention RMSNorm, its rows of gate and up, SwiGLU                   -> act (LL)
//   D  its rows of down + the residual                                           -> resd (LL)
// then SM 0 writes the final RMSNorm. An SM with no rows of a phase reads nothing for it: its
// rows' readers are what keeps a buffer from being overwritten before every reader has it
// (a buffer's next write depends on every reader of this one, through the phases after it).
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
constexpr int kSamplePolls = 3;  // the sampler's 16-byte loads a thread: V <= MAX_SAMPLE_V (5459) is 683 of them
constexpr int kSeg = kStageElems / kConsumerWarps;  // elements a warp multiplies a stage (1024)
constexpr int kKeys = 32;                            // keys an attention block
constexpr int kMaxParts = 1024;                      // float partial sums a phase (checked by the launcher)
constexpr int kMaxSplits = 12;  // key splits a kv head (checked by the launcher; the merge's loads in registers)
constexpr int kRopeIt = 3;  // rotated (head, pair) items a thread: (nh + nkv) * HD / 2 <= 3 kConsumers (see Att)
constexpr unsigned kSpinLimit = 1u << 20;  // polls (~1 s) before a wait gives up: a bug, flagged

// The phases hand their rows to the SMs that need them as LL words (NCCL's low-latency protocol):
// 8 bytes {data, flag}, written by one 8-byte store, so a reader that sees the flag it expects has
// the data with it. A reader polls the words themselves: one round trip to L2 from the moment the
// data lands, where a counter costs two (the counter, then the data). The flag is the step's
// epoch * L + layer + 1: each buffer is written once a layer, so a stale word never matches
// (a 32-bit flag repeats after 2^32 / L steps, ~270 million at L = 16; every buffer has been
// rewritten by then). data: two bf16 (the row pair 2w, 2w + 1), or one float (the partials).
struct Params {
  const __nv_bfloat16* x;  // [DIM] the step's input row
  __nv_bfloat16* out;      // [DIM] final-norm output
  uint2* reso;             // [DIM / 2] LL: the residual after o
  uint2* qkv;              // [NQKV / 2] LL
  uint2* attn;             // [H HD / 2] LL
  uint2* part;             // [H, NS, HD + 2] LL floats: a split's partial output, then its max and sum
  uint2* resd;             // [DIM / 2] LL: the residual after down
  uint2* act;              // [I / 2] LL
  int* ctl;                // [0] the step's epoch, [1] SMs done with the step, [2] the error flag
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
  int mode;          // 0: the step; probes (wrong results): 1 no polls (the rows read once), 2 also
                     // no arithmetic, 3 no polls and no attention
  int inflight;      // copies in flight at most (the rest of the ring holds landed stages); >= nstages: no cap
  int balance;       // < 0: cdiv(N, P) rows an SM; else per mille fewer rows for the SMs that attend
  int every;         // 1: every SM attends, to all kv heads (one split; see attention()), and starts its
                     // o rows from its own heads: no hand-over of the heads (0: the items of the header)
  int backoff;       // ns a poll sleeps after finding a word not yet written (0: none)
  int keep;          // L2 hints on the weight copies: 0 none; k > 0 every k-th stage of the layers
                     // evict_last (kept in L2 across steps: a stack stepped many times a frame, as
                     // CSM's depth decoder), the rest evict_first; < 0 every stage evict_first (a
                     // stack that must not push the kept stages out)
  int ahead;         // > 0: while the ring is full (the consumers wait on a hand-over), the producer asks
                     // the L2 for up to this many of the stages past the ring (bulk prefetches), so
                     // the HBM keeps streaming through the wait; 0: none
  int burst;         // > inflight: the cap on copies in flight while the consumers are close behind the
                     // stream (they have freed the stage min(2 burst, nstages - 1) back: the SM waits on
                     // bytes, not on a hand-over); `inflight` while they lag (0: inflight always)
  // The step's input gathered in the kernel (an embedding row; null: x is the row): x is then a
  // table [xrows, DIM] and the input its row xidx[0] + xoff (clamped into the table)
  const int64_t* xidx;
  int64_t xoff, xrows;
  // A head after the final norm in the same kernel (null: none): logits[v] = head row v . the
  // final-norm output, for v < V, the rows split over the SMs like any GEMV's and streamed
  // through the ring right behind the last layer's (no kernel boundary, no separate launch)
  const __nv_bfloat16* whead;  // [V, DIM]
  __nv_bfloat16* logits;       // [V]
  int V, nhead;  // nhead: chunks of head rows (see run_layers), the most any SM has (the launcher's)
  // The head's token sampled in the kernel (null tok: none), by the last SM (P - 1), as
  // kernels/sampling.py's small-vocabulary kernel does for bf16 logits: temperature (<= 0:
  // greedy), top-k, Gumbel-max with the counter-based noise of (seed, step[0] + step_add). logits
  // is then the launcher's own row, all 0xFFFF (a bf16 NaN no conversion gives) but where this
  // step's head wrote: the sampling SM polls it, starting as the last rows land (no count of the
  // SMs done before it), copies it to lgout and sets it back to 0xFFFF for the next step.
  const float* s_temp;
  const int64_t *s_topk, *s_seed, *s_step;
  int64_t s_add;
  int64_t* tok;
  __nv_bfloat16* lgout;  // [V] with a token: the logits for the caller (see below), else null
  // A probe's timeline of one step (the timed build only; null: none): per SM, TRACE_W(L, TS) int64
  // (see trace_width): the producer's clock when it had a copy's in-flight room and when it issued
  // the copy, the consumers' (thread 0's) when they asked for a stage's bytes and when they had
  // them, for the step's first TS stages; then per layer kEvents (clock, globaltimer) pairs at the
  // phases' edges (see Ev); then the (clock, globaltimer) of the SM's start and end
  long long* trace;
  int trace_stages;
};

// The trace's events a layer (Params::trace), thread 0's clock after: the residual polled (Q's
// input), q|k|v's rows put, the attention done (the SMs that attend), the heads polled (O's input),
// the residual after o put, it polled (G's input), the activation put, it polled (D's input), the
// residual after down put; q|k|v polled in the attention; split 0's partials polled
enum Ev { kEvQIn, kEvQkvPut, kEvAttDone, kEvOIn, kEvResoPut, kEvGIn, kEvActPut, kEvDIn, kEvResdPut, kEvAttQkv,
          kEvMerge, kEvents };
__host__ __device__ inline int trace_width(int L, int ts) { return 4 * ts + 2 * L * kEvents + 4; }

// The query heads an SM attends with and their kv heads: all of them with Params::every, else the G
// query heads of one kv head (one helper for att_setup and the launch's scratch size)
__host__ __device__ inline int att_heads(const Params& p) { return p.every ? p.H : p.H / p.HKV; }
__host__ __device__ inline int att_kv_heads(const Params& p) { return p.every ? p.HKV : 1; }

// stats[pid * kStats + ...]: cycles the producer waited for free stages, the producer's total,
// cycles the consumers waited for a stage's bytes, polled for the rows before Q (the previous
// layer's down), A (q|k|v), O (the heads), G (o), D (gate|up), in the attention, total, in the
// row loads and norms, stages consumed, in the stages' arithmetic (bytes landed to stage freed),
// in the phase ends (the warps' last stages, row sums, stores), in the attention up to its
// split's partial, polled for the other splits' partials (split 0), waited for the keys copied
// ahead, in the attention's block loop (scores, softmax, p.v), from thread 0's q|k|v to the
// barrier after RoPE (the other threads' rows, RoPE), from the block loop to the partial's stores
constexpr int kStats = 20;

// ---- PTX helpers: mbarriers, bulk copies, LL words

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

// Whether the phase `parity` of the mbarrier has completed, without waiting
__device__ __forceinline__ bool mbar_test(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred P1;\n"
      " mbarrier.test_wait.parity.shared::cta.b64 P1, [%1], %2;\n"
      " selp.u32 %0, 1, 0, P1;\n}"
      : "=r"(done)
      : "r"(smem_u32(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// The bytes at src asked into L2 (no shared memory, no completion to wait for)
__device__ __forceinline__ void bulk_prefetch_l2(const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}

// The same copy with an L2 eviction priority (a createpolicy value)
__device__ __forceinline__ void bulk_copy_hint(void* dst, const void* src, uint32_t bytes, uint64_t* bar, uint64_t pol) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
          smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar)), "l"(pol)
      : "memory");
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// LL words: one 8-byte store; loads of one word or two (each 8-byte half is single-copy atomic)
__device__ __forceinline__ void st_ll(uint2* p, uint32_t data, uint32_t flag) {
  asm volatile("st.volatile.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(data), "r"(flag) : "memory");
}

__device__ __forceinline__ uint2 ld_ll(const uint2* p) {
  uint2 v;
  asm volatile("ld.volatile.global.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_bf_volatile(__nv_bfloat16* p, float v) {  // (rounded to nearest even)
  const unsigned short h = __bfloat16_as_ushort(__float2bfloat16(v));
  asm volatile("st.volatile.global.u16 [%0], %1;" ::"l"(p), "h"(h) : "memory");
}

__device__ __forceinline__ uint4 ld_ll2(const uint2* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ uint32_t pack_bf2(float a, float b) {  // a at the lower address
  __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ float bf_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ float bf_at(uint32_t w, int half) { return half ? bf_hi(w) : bf_lo(w); }

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

// ---- the sampler's noise: engines/sampling.py's counter-based hash, bit for bit

__device__ __forceinline__ uint32_t hash32(uint32_t x) {  // lowbias32
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

__device__ __forceinline__ uint32_t row_key(int64_t seed, int64_t step) {  // the seed and step folded in
  const uint64_t s = (uint64_t)seed, t = (uint64_t)step;
  uint32_t key = hash32((uint32_t)s);
  key = hash32(key ^ (uint32_t)(s >> 32) ^ 0x9E3779B9u);
  key = hash32(key ^ (uint32_t)t);
  return hash32(key ^ (uint32_t)(t >> 32) ^ 0x85EBCA6Bu);
}

__device__ __forceinline__ float gumbel(uint32_t key, int v) {  // Gumbel(0, 1) of vocab index v
  uint32_t h = hash32(key ^ hash32((uint32_t)v + 0x27D4EB2Fu));
  h = hash32(h ^ 0x165667B1u);
  const float u = ((float)(h >> 8) + 0.5f) * (1.0f / 16777216.0f);
  return -logf(-logf(u));  // (libdevice's accurate logf, as the Triton sampler and torch use)
}

// Floats of the xs region: the final norm's row, and the attention's scratch (see Att; its output
// is staged in it too). No room for an intermediate row: nothing has used one since the act rows
// went out as LL words, and at 1B shapes its 24 KB are worth one and a half ring stages.
// nh: the query heads an SM attends with, nkv: their kv heads (Params::every: all; else one kv head's)
__host__ __device__ inline int xs_floats(int dim, int nh, int nkv, int hd) {
  int att = nh * hd + 2 * hd + 2 * nkv * hd + nh * kKeys + 8 * ((nh + 7) / 8) * 4 +
            (nkv * (kKeys * (hd + 8) + kKeys * hd) + 2 * hd) / 2;
  return dim > att ? dim : att;
}

// ---- the weight schedule, walked identically by the producer and the consumers

struct Slice {  // rows [row0, row0 + n) of a weight [N, K]
  const __nv_bfloat16* w;
  int row0, n, K, rps, nst;  // rps: rows a stage; nst: stages (worked out once: a division)
  int rw = 0, seg = 0, segs = 0;  // a consumer warp's row in each stage and segment of it (Consumer::seat)
  __device__ int stages() const { return nst; }
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

__device__ __forceinline__ int2 row_range(int N, int pid, int P, int nitem, int balance) {  // {row0, n}
  if (balance < 0) {
    int r = (N + P - 1) / P;
    r += r & 1;  // (rows go out in LL words of two: every SM's rows start even)
    const int row0 = min(N, pid * r);
    return make_int2(row0, max(0, min(r, N - row0)));
  }
  const int row0 = (int)(row_start(N, pid, P, nitem, balance) & ~1LL);
  return make_int2(row0, (int)(row_start(N, pid + 1, P, nitem, balance) & ~1LL) - row0);
}

// The SM's rows [row0, row0 + n) of weight k (0 q|k|v, 1 o, 2 gate, 3 up, 4 down, 5 the head): the same every
// layer, so worked out once a step (the 64-bit divisions) into shared memory, where the producer's
// walk and the consumers' phases read them.
struct alignas(8) Rows {  // (the ring's mbarriers follow it)
  int row0[6], n[6], nst[6];
};

__device__ __forceinline__ void fill_rows(const Params& p, int pid, int P, int k, Rows* r) {  // thread k < 6: weight k
  const int nqkv = (p.H + 2 * p.HKV) * p.HD, hhd = p.H * p.HD;
  const int N = k == 0 ? nqkv : k == 1 || k == 4 ? p.DIM : k == 5 ? (p.whead ? p.V : 0) : p.I;
  const int K = k == 1 ? hhd : k == 4 ? p.I : p.DIM;
  const int2 rows = row_range(N, pid, P, p.HKV * p.NS, p.balance);
  const int rps = kStageElems / K;
  r->row0[k] = rows.x;
  r->n[k] = rows.y;
  r->nst[k] = (rows.y + rps - 1) / rps;
}

// The SM's slice k of layer l (gate and up stages alternate)
__device__ __forceinline__ Slice layer_slice(const Params& p, const Rows* r, int l, int k) {
  const int nqkv = (p.H + 2 * p.HKV) * p.HD, hhd = p.H * p.HD;
  const __nv_bfloat16* w;
  int K;
  if (k == 0) {
    w = p.wqkv + (int64_t)l * nqkv * p.DIM;
    K = p.DIM;
  } else if (k == 1) {
    w = p.wo + (int64_t)l * p.DIM * hhd;
    K = hhd;
  } else if (k == 4) {
    w = p.wd + (int64_t)l * p.DIM * p.I;
    K = p.I;
  } else if (k == 5) {  // (the head: once, after the last layer)
    w = p.whead;
    K = p.DIM;
  } else {
    w = p.wgu + ((int64_t)l * 2 + (k - 2)) * p.I * p.DIM;
    K = p.DIM;
  }
  return Slice{w, r->row0[k], r->n[k], K, kStageElems / K, r->nst[k]};
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
__device__ __forceinline__ uint32_t now() {  // (32 bits: one register; differences wrap safely)
  if constexpr (kTimed) return (uint32_t)clock();
  return 0;
}

__device__ __forceinline__ long long gtimer() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
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
// its q|k|v stages, o, gate and up alternating, then down; after the last layer the head's (if any).
struct Walk {
  const Params& p;
  const Rows* r;
  int l = 0, ph = 0, i = 0;  // ph: 0 q|k|v, 1 o, 2 gate|up, 3 down; l == L: the head
  Slice c;                   // the phase's slice (gate's in phase 2: up's rows and stride follow)
  __device__ Walk(const Params& p_, const Rows* r_) : p(p_), r(r_) { c = layer_slice(p, r, 0, 0); }
  // the next stage's source and bytes; false past the step's last stage
  __device__ bool next(const __nv_bfloat16*& src, uint32_t& bytes) {
    while (l <= p.L) {
      const int k = ph == 2 ? i >> 1 : i;
      if (k < c.stages()) {
        // (gate and up: the same rows and K, up's rows p.I * K elements after gate's)
        src = c.src(k) + (ph == 2 && (i & 1) ? (int64_t)p.I * c.K : 0);
        bytes = (uint32_t)c.rows(k) * c.K * 2;
        ++i;
        return true;
      }
      i = 0;
      if (l == p.L || ++ph == 4) {
        ph = 0;
        ++l;
      }
      if (l <= p.L) c = layer_slice(p, r, l, l == p.L ? 5 : ph == 3 ? 4 : ph);  // (no head: 0 stages)
    }
    return false;
  }
};

// Params::ahead: while the slot of the stage about to be copied (g) is not free (the ring full: the
// consumers wait on a hand-over), stage g and the stages after it are asked into L2, p.ahead of
// them at most, each once; their copies then come from L2 as the consumers free slots. `pre` is
// a second walk of the schedule and ga the stages it has passed (its next is stage ga).
__device__ __forceinline__ void prefetch_while_full(const Params& p, uint64_t* empty, uint32_t parity, Walk& pre,
                                                 uint32_t& ga, uint32_t g) {
  const __nv_bfloat16* src;
  uint32_t bytes;
  for (;; ++ga) {  // (one call site of Walk::next: the code stays small)
    if (ga >= g && (ga >= g + (uint32_t)p.ahead || mbar_test(empty, parity))) return;
    if (!pre.next(src, bytes)) return;
    if (ga >= g) bulk_prefetch_l2(src, bytes);
  }
}

template <bool kTimed>
__device__ void produce(const Params& p, const Ring& ring, const Rows* rows, int pid) {
  // one lane issues every copy; g counts the step's stages
  uint32_t g = 0, gb = 0;  // gb: the copies seen landed (stage `back`)
  RingPos at, back, lag;  // the stage to fill; the oldest copy not seen landed; stage g - near (Params::burst)
  const uint32_t near = (uint32_t)min(2 * p.burst, ring.n - 1);
  const uint32_t t_start = now<kTimed>();
  long long waited = 0;
  Walk walk(p, rows);
  Walk pre = walk;  // pre, ga: the L2 prefetches' walk (Params::ahead)
  const __nv_bfloat16* src;
  uint32_t bytes, ga = 0;
  uint64_t keep_pol = 0, pass_pol = 0;  // (Params::keep)
  if (p.keep != 0) {
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(keep_pol));
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pass_pol));
  }
  while (walk.next(src, bytes)) {
    uint32_t t0 = now<kTimed>();
    // Little's law: every SM with its whole ring in flight fills the memory system's queues,
    // and every read on the critical path (the attention's, the polls) waits behind them.
    // Enough copies stay in flight to keep the HBM busy; the other stages hold landed bytes,
    // so a consumer that stalls does not stall the stream. Params::burst: more of them while
    // the consumers wait on bytes (they have freed stage g - near), not on another SM.
    uint32_t cap = (uint32_t)p.inflight;
    if (p.burst > p.inflight && (g < near || mbar_test(&ring.empty[lag.slot], lag.par))) cap = (uint32_t)p.burst;
    if (g >= near) lag.advance(ring.n);
    // (at most the ring: g's slot is free only after stage g - n, in the same slot, has landed and
    // been consumed, so waiting for that copy costs nothing the slot's wait below would not; and
    // `back` never falls more than the ring behind, where its parity would alias once the cap
    // drops again: a cap of 13 copies on a 13-stage ring, then 2, hung a step)
    cap = min(cap, (uint32_t)ring.n);
    for (; g - gb >= cap; ++gb) {
      mbar_wait(&ring.full[back.slot], back.par);
      back.advance(ring.n);
    }
    long long* tr = kTimed && p.trace && g < (uint32_t)p.trace_stages
        ? p.trace + (int64_t)pid * trace_width(p.L, p.trace_stages) + g : nullptr;
    if (kTimed && tr) tr[0] = clock64();
    if (p.ahead > 0 && !mbar_test(&ring.empty[at.slot], at.par ^ 1))
      prefetch_while_full(p, &ring.empty[at.slot], at.par ^ 1, pre, ga, g);
    mbar_wait(&ring.empty[at.slot], at.par ^ 1);
    waited += now<kTimed>() - t0;
    mbar_expect_tx(&ring.full[at.slot], bytes);
    if (p.keep == 0) {
      bulk_copy(ring.buf + (size_t)at.slot * kStageElems, src, bytes, &ring.full[at.slot]);
    } else {  // (the same stages every step: g counts from the step's first; the head's never kept)
      const bool kept = p.keep > 0 && walk.l < p.L && g % (uint32_t)p.keep == 0;
      bulk_copy_hint(ring.buf + (size_t)at.slot * kStageElems, src, bytes, &ring.full[at.slot], kept ? keep_pol : pass_pol);
    }
    if (kTimed && tr) tr[p.trace_stages] = clock64();
    at.advance(ring.n);
    ++g;
  }
  if (kTimed) {
    p.stats[pid * kStats + 0] = waited;
    p.stats[pid * kStats + 1] = now<kTimed>() - t_start;
  }
}

// After a poll that found a word not yet written: false once the poll limit is reached (flagged
// in ctl[2], and `broken` set: the thread waits no more); sleeps Params::backoff ns first (fewer
// polls in flight across the SMs). Consumer::retry and poll_into's loop.
__device__ __forceinline__ bool retry_poll(const Params& p, uint32_t n, bool& broken) {
  if (n > kSpinLimit) {
    atomicOr(p.ctl + 2, 1);
    broken = true;
    return false;
  }
  if (p.backoff > 0) __nanosleep(p.backoff);
  return true;
}

// 1024 or 2048 bf16 of a row handed over as LL words, polled by every consumer thread (thread t its
// 16-byte pieces t, t + 256: K / 1024 of them) until each carries `flag`, then put in sw (K / 2
// words) for the block: Consumer::load_x_ll_shared. Out of line: three polls a layer call it.
// Returns `broken` (a poll that timed out: flagged, it waits no more; see Consumer::retry).
__device__ __noinline__ bool poll_into(const Params& p, const uint2* src, int K, uint32_t flag, int tid, uint32_t* sw,
                                       bool broken) {
  const int nv = K / (4 * kConsumers);  // (1 or 2)
  uint4 v[2];
  for (uint32_t n = 0, ok = 0;; ++n) {
#pragma unroll
    for (int k = 0; k < 2; ++k)
      if (k < nv && !(ok >> k & 1)) v[k] = ld_ll2(src + 2 * (tid + k * kConsumers));
#pragma unroll
    for (int k = 0; k < 2; ++k)
      if (k >= nv || (v[k].y == flag && v[k].w == flag)) ok |= 1u << k;
    if (ok == 3u || p.mode != 0 || broken) break;  // (Consumer::polling())
    if (!retry_poll(p, n, broken)) break;
  }
  consumers_sync();  // (every thread is done with the phase before's partial sums in sw)
#pragma unroll
  for (int k = 0; k < 2; ++k)
    if (k < nv) *reinterpret_cast<uint2*>(sw + 2 * (tid + k * kConsumers)) = make_uint2(v[k].x, v[k].z);
  consumers_sync();
  return broken;
}

template <bool kTimed>
struct Consumer {
  const Params& p;
  Ring ring;
  float* xs;     // the attention's scratch (Att) and the final norm's row (float32)
  float* parts;  // [kMaxParts] per-warp partial sums of the phase's rows
  float* red;    // [kConsumerWarps] block reductions (the norms' sums of squares)
  long long* st;  // [kStats] thread 0's cycle counts (stats), in shared memory
  const Rows* rows;  // the SM's rows of each weight (shared memory)
  int tid, warp, lane, pid, P;
  RingPos at;  // the next stage to consume, as the producer's walk
  uint32_t want = 0;    // the LL flag of this step's current layer
  int pos0 = 0, slot0 = 0;  // the step's position and cache slot (read once)
  bool broken = false;  // a poll of this thread's timed out (flagged): it waits no more
  int gc = 0;           // stages consumed this step (the trace's index)
  long long* trc = nullptr;  // thread 0's row of Params::trace (the timed build), else null

  __device__ void ev(int l, int e) {  // a trace event of layer l (Ev)
    if (kTimed && trc && l < p.L) {
      long long* r = trc + 4 * p.trace_stages + 2 * (l * kEvents + e);
      r[0] = clock64();
      r[1] = gtimer();
    }
  }

  __device__ void tally(int i, uint32_t v) {
    if (kTimed && tid == 0) st[i] += v;
  }

  __device__ bool polling() const { return p.mode == 0 && !broken; }  // (probe modes: one read)

  __device__ bool retry(uint32_t n) { return retry_poll(p, n, broken); }  // (see retry_poll)

  // The warp's piece of a GEMV's input row (as load_x) from LL words, polled until every word
  // carries `flag`: the lane's 8 columns a j are 4 words, two 16-byte loads. (The activation's
  // poll: down's K = I, where each warp has its own columns; the rows every SM waits for whole, the
  // residual and the heads, come through load_x_ll_shared.)
  __device__ void load_x_ll(const uint2* src, int K, uint32_t flag, float (&xr)[32]) {
    const int col0 = (warp * kSeg) % K;
    uint4 v[8];
    for (uint32_t n = 0, ok = 0;; ++n) {
#pragma unroll
      for (int k = 0; k < 8; ++k)
        if (!(ok >> k & 1)) v[k] = ld_ll2(src + (col0 + (k >> 1) * 256 + lane * 8) / 2 + (k & 1) * 2);
#pragma unroll
      for (int k = 0; k < 8; ++k)
        if (v[k].y == flag && v[k].w == flag) ok |= 1u << k;
      if (ok == 0xffu || !polling()) break;
      if (!retry(n)) break;
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      xr[k * 4 + 0] = bf_lo(v[k].x);
      xr[k * 4 + 1] = bf_hi(v[k].x);
      xr[k * 4 + 2] = bf_lo(v[k].z);
      xr[k * 4 + 3] = bf_hi(v[k].z);
    }
  }

  // load_x_ll for a row every SM waits for whole (the residual, K = DIM; the heads, K = H HD): its
  // words polled by all the SM's threads, each its own share (poll_into), in rounds of 2048 columns
  // through `parts` (free between phases: the phase before has summed its rows), then each warp
  // reads its piece from there. With load_x_ll's polls, 2 to 4 warps an SM poll the same L2 lines
  // (K <= 4096: the warps share columns), 128 SMs at once: the first timeline (H100, bench/results/
  // s23a) saw the residual and the heads land ~2.4-3.2 µs after their last writer, the activation
  // (down's input, each warp its own columns) ~0.9 µs. The caller puts a barrier between the warps'
  // reads of `parts` here and the phase's partial sums there.
  __device__ __forceinline__ void load_x_ll_shared(const uint2* src, int K, uint32_t flag, float (&xr)[32]) {
    const uint32_t* sw = reinterpret_cast<const uint32_t*>(parts);
    const int col0 = (warp * kSeg) % K;
#pragma unroll 1
    for (int c0 = 0; c0 < K; c0 += 2 * kMaxParts) {
      const int kc = min(2 * kMaxParts, K - c0);
      broken = poll_into(p, src + c0 / 2, kc, flag, tid, reinterpret_cast<uint32_t*>(parts), broken);
      if (col0 < c0 || col0 >= c0 + kc) continue;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint4 w = *reinterpret_cast<const uint4*>(sw + (col0 - c0 + j * 256 + lane * 8) / 2);
        xr[j * 8 + 0] = bf_lo(w.x);
        xr[j * 8 + 1] = bf_hi(w.x);
        xr[j * 8 + 2] = bf_lo(w.y);
        xr[j * 8 + 3] = bf_hi(w.y);
        xr[j * 8 + 4] = bf_lo(w.z);
        xr[j * 8 + 5] = bf_hi(w.z);
        xr[j * 8 + 6] = bf_lo(w.w);
        xr[j * 8 + 7] = bf_hi(w.w);
      }
    }
  }

  // xs = RMSNorm(the row in LL words) * w with rmsnorm's roundings (the final norm, on SM 0)
  __device__ void norm_into_xs(const uint2* src, const __nv_bfloat16* w) {
    float ss = 0.f;
    for (int k = tid; k < p.DIM / 2; k += kConsumers) {
      uint2 v = ld_ll(src + k);
      for (uint32_t n = 0; v.y != want && polling() && retry(n); ++n) v = ld_ll(src + k);
      const float a = bf_lo(v.x), b = bf_hi(v.x);
      xs[2 * k] = a;
      xs[2 * k + 1] = b;
      ss += a * a + b * b;
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

  // rows [s.row0, s.row0 + s.n) (row0 and n even) as LL words of pairs: value(r) is row r's
  template <class F>
  __device__ void put_rows(uint2* dst, const Slice& s, F value) {
    for (int w = tid; 2 * w < s.n; w += kConsumers) st_ll(dst + s.row0 / 2 + w, pack_bf2(value(2 * w), value(2 * w + 1)), want);
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

  // load_x's piece from float32 values in shared memory (the heads, with Params::every)
  __device__ void load_x_smem(const float* src, int K, float (&xr)[32]) const {
    const int col0 = (warp * kSeg) % K;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float4 a = *reinterpret_cast<const float4*>(src + col0 + j * 256 + lane * 8);
      const float4 b = *reinterpret_cast<const float4*>(src + col0 + j * 256 + lane * 8 + 4);
      xr[j * 8 + 0] = a.x;
      xr[j * 8 + 1] = a.y;
      xr[j * 8 + 2] = a.z;
      xr[j * 8 + 3] = a.w;
      xr[j * 8 + 4] = b.x;
      xr[j * 8 + 5] = b.y;
      xr[j * 8 + 6] = b.z;
      xr[j * 8 + 7] = b.w;
    }
  }

  // xr = RMSNorm(xr) * wr on the warp's piece (rmsnorm's roundings; wr: the norm weight's piece,
  // loaded before the row); the row's sum of squares from the warps whose pieces tile it
  // (warps 0 .. K / kSeg - 1)
  __device__ void norm_x(const float (&wr)[32], int K, float (&xr)[32]) {
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < 32; ++i) ss = fmaf(xr[i], xr[i], ss);
    ss = warp_sum(ss);
    if (lane == 0) red[warp] = ss;
    consumers_sync();
    float tot = 0.f;
#pragma unroll
    for (int i = 0; i < kConsumerWarps; ++i)  // (K / kSeg <= 8 warps' sums, in order)
      if (i < K / kSeg) tot += red[i];
    const float rstd = rsqrtf(tot / K + p.eps);
#pragma unroll
    for (int i = 0; i < 32; ++i) xr[i] = bf(bf(xr[i] * rstd) * wr[i]);
  }

  // the SM's slice k of layer l, seated (see layer_slice)
  __device__ Slice sl(int l, int k) const {
    Slice s = layer_slice(p, rows, l, k);
    seat(s);
    return s;
  }

  // The warp's place in the slice's stages: every stage puts its kSeg elements at the same row
  // and columns in front of it (once a layer, not a stage: runtime divisions)
  __device__ void seat(Slice& s) const {
    const int e0 = warp * kSeg;
    s.rw = e0 / s.K;
    s.seg = (e0 % s.K) / kSeg;
    s.segs = s.K / kSeg;
  }

  // Stage i of slice s times the warp's x piece: the lane's part of the warp's partial (0 where the
  // warp has no row in the stage). The stage's slot is freed before the lanes' parts are summed.
  __device__ float stage_lanes(const Slice& s, int i, const float (&xr)[32]) {
    const int slot = at.slot;
    uint32_t t0 = now<kTimed>();
    long long* tr = kTimed && trc && gc < p.trace_stages ? trc + gc : nullptr;
    if (kTimed) ++gc;
    if (kTimed && tr) tr[2 * p.trace_stages] = clock64();
    mbar_wait(&ring.full[at.slot], at.par);
    at.advance(ring.n);
    if (kTimed && tr) tr[3 * p.trace_stages] = clock64();
    uint32_t t1 = now<kTimed>();
    tally(2, t1 - t0);
    tally(11, 1);
    float acc0 = 0.f, acc1 = 0.f;
    if (s.rw < s.rows(i) && p.mode != 2) {  // (probe mode 2: the weights stream, nothing multiplies them)
      const __nv_bfloat16* wst = ring.buf + (size_t)slot * kStageElems + warp * kSeg;
      uint4 u[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) u[q] = *reinterpret_cast<const uint4*>(wst + q * 256 + lane * 8);
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
    }
    __syncwarp();  // (every lane's reads of the slot are done: the FMAs used them)
    if (lane == 0) mbar_arrive(&ring.empty[slot]);
    tally(12, now<kTimed>() - t1);
    return acc0 + acc1;
  }

  // the warp's partial of stage i of slice s, where it has a row there, into parts[base + row * segs + seg]
  __device__ void put_part(const Slice& s, int i, int base, float v) {
    if (s.rw < s.rows(i) && p.mode != 2) parts[base + (i * s.rps + s.rw) * s.segs + s.seg] = v;
  }

  // Two stages' lane parts (va of a's stage i, vb of b's stage j) summed across the warp together:
  // the first shuffle (lanes 16 apart) leaves a's pair sums in lanes 0..15 and b's in 16..31, four
  // more finish both: 5 shuffles for two partials, in warp_sum's tree (the same sums bit for bit).
  __device__ void put_pair(const Slice& a, int i, int base_a, float va, const Slice& b, int j, int base_b, float vb) {
    const bool lo = lane < 16;
    float v = (lo ? va : vb) + __shfl_xor_sync(0xffffffffu, lo ? vb : va, 16);
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) put_part(a, i, base_a, v);
    if (lane == 16) put_part(b, j, base_b, v);
  }

  __device__ void slice_stages(const Slice& s, int base, const float (&xr)[32]) {
    const int n = s.stages();  // (a local: the stages' asm clobbers memory, s is re-read past them)
    float held = 0.f;          // an even stage's lane part, summed with the odd stage after it
    for (int i = 0; i < n; ++i) {
      const float v = stage_lanes(s, i, xr);
      if (i & 1) {
        put_pair(s, i - 1, base, held, s, i, base, v);
      } else if (i == n - 1) {
        const float t = warp_sum(v);
        if (lane == 0) put_part(s, i, base, t);
      } else {
        held = v;
      }
    }
  }

  // the (seated) slice's rows, each the sum of its segments' partials (after the stages and a sync)
  __device__ float row_sum(const Slice& s, int base, int r) const {
    // (segs is 1, 2, 4 or 8: the loads are issued together, the sum in segment order)
    const float* q = parts + base + r * s.segs;
    float a = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j < s.segs) a += q[j];
    return a;
  }

  // An attention item (kv head, split) and its scratch in xs: q [nh, HD], [2 HD] unused (the
  // angle rows in float32 until 99ed833; kept so the layout is the one timed), own k and v
  // [nkv, HD] each, p [nh, kKeys], alpha and the softmax sums [32], keys [nkv, kKeys, HD + 8] and
  // values [nkv, kKeys, HD] (bf16), the cos/sin rows as bf16 [2 HD] (copied ahead). nh = G query
  // heads of nkv = 1 kv head (kvh); with Params::every, all H of all HKV (kvh 0, one split).
  // The item's head gh (< nh) is query head kvh * G + gh, of kv head kvh + gh / G.
  struct Att {
    int kvh, sp, length, chunk, lo, hi, nh, nkv;
    int64_t pos, slot, cbase;
    float *qs, *kn, *vn, *pb, *al;
    __nv_bfloat16 *kb, *vb, *csb;
  };

  // The thread's four adjacent outputs (head gh, dims d .. d + 3) of the item's G x HD output
  // (G * HD <= 1024: one quad a thread covers it): false past the last quad. A quad's values are
  // one 8-byte load a key and two LL words of the heads.
  __device__ bool own_dims(int G, int HD, int& gh, int& d) const {
    const int e = 4 * tid;
    gh = e / HD;
    d = e % HD;
    return e < G * HD;
  }

  __device__ Att att_setup(int l, int item) const {
    Att a;
    const int HD = p.HD, NS = p.NS;
    a.nh = att_heads(p);
    a.nkv = att_kv_heads(p);
    a.kvh = p.every ? 0 : item / NS;
    a.sp = p.every ? 0 : item % NS;
    a.pos = pos0;  // (read once at the step's start: a global load here is a round trip on the chain)
    a.slot = slot0;
    a.length = (int)(a.pos + 1 < p.TMAX ? a.pos + 1 : p.TMAX);
    a.chunk = (a.length + NS - 1) / NS;
    a.lo = a.sp * a.chunk;
    a.hi = min(a.lo + a.chunk, a.length);
    a.cbase = l * p.sk_l + a.slot * p.sk_s + a.kvh * p.sk_h;
    a.qs = xs;
    a.kn = a.qs + a.nh * HD + 2 * HD;
    a.vn = a.kn + a.nkv * HD;
    a.pb = a.vn + a.nkv * HD;
    a.al = a.pb + a.nh * kKeys;
    a.kb = reinterpret_cast<__nv_bfloat16*>(a.al + 8 * ((a.nh + 7) / 8) * 4);  // 16-byte aligned
    a.vb = a.kb + a.nkv * kKeys * (HD + 8);
    a.csb = a.vb + a.nkv * kKeys * HD;
    return a;
  }

  // The item's first block of keys and values that earlier steps wrote (positions < pos) and its
  // angle rows, copied into shared memory asynchronously a layer ahead (layer 0's at the step's
  // start): under the weight stream an HBM read waits microseconds, and none of these depends on
  // this step's q|k|v. Rows from pos on are zeroed (the own row is put in during RoPE).
  __device__ void att_prefetch(const Att& a) {
    if (a.lo >= a.hi) return;
    const int HD = p.HD, kstride = HD + 8, cpr = HD / 8;
#pragma unroll 1
    for (int h = 0; h < a.nkv; ++h) {
#pragma unroll 1
      for (int e = tid; e < kKeys * cpr; e += kConsumers) {
        const int j = e / cpr, c = (e % cpr) * 8;
        __nv_bfloat16 *kd = a.kb + (h * kKeys + j) * kstride + c, *vd = a.vb + (h * kKeys + j) * HD + c;
        const int64_t n = a.lo + j, at = a.cbase + h * p.sk_h + n * p.sk_t + c;
        if (n < a.hi && n < a.pos) {
          cp_async16(kd, p.kc + at);
          cp_async16(vd, p.vc + at);
        } else {
          *reinterpret_cast<uint4*>(kd) = make_uint4(0, 0, 0, 0);
          *reinterpret_cast<uint4*>(vd) = make_uint4(0, 0, 0, 0);
        }
      }
    }
#pragma unroll 1
    for (int e = tid; e < 2 * cpr; e += kConsumers) {
      const __nv_bfloat16* src = (e < cpr ? p.cos : p.sin) + a.pos * p.s_tab + (e % cpr) * 8;
      cp_async16(a.csb + e * 8, src);
    }
    cp_async_commit();
  }

  // The SM's attention item (kv head, split) of layer l: one an SM (the launcher checks HKV * NS <= P).
  // With Params::every, every SM's item is all the heads (see Att), and the heads' output stays in
  // the SM's shared memory (Att::qs, the o rows' input) instead of going out as LL words.
  __device__ void attention(int l, int item) {
    const uint32_t ta = now<kTimed>();
    const Att a = att_setup(l, item);
    cp_async_wait_all();  // (made visible to the other threads by the next block barrier)
    tally(16, now<kTimed>() - ta);
    const int HD = p.HD, HALF = HD / 2, G = p.H / p.HKV, NS = p.NS, nh = a.nh, nkv = a.nkv;
    const int kvh = a.kvh, sp = a.sp, length = a.length, chunk = a.chunk, lo = a.lo, hi = a.hi;
    const int64_t pos = a.pos;
    const int kstride = HD + 8;  // the key block's row stride (16-byte rows, no bank conflicts)
    float *qs = a.qs, *kn = a.kn, *vn = a.vn, *pb = a.pb, *al = a.al;
    __nv_bfloat16 *kb = a.kb, *vb = a.vb;
    const int64_t cbase = a.cbase;
    bool on = lo < hi;
    if (on) {
      consumers_sync();  // every thread's copies landed (the angle rows among them); before the
                         // poll, so that the rows' arrival is not followed by a barrier for them
      // q|k|v polled as LL words (the SMs that hold the head's rows write them): every load issued
      // before the first use, one round trip to L2 from the moment the rows land
      uint2 wa[kRopeIt], wb[kRopeIt], wv = make_uint2(0, want);
      int oa[kRopeIt];
#pragma unroll
      for (int it = 0; it < kRopeIt; ++it) {
        const int e = tid + it * kConsumers, g2 = e / HALF, d = e % HALF;  // (g2 >= nh: kv head g2 - nh's key)
        oa[it] = (g2 < nh ? (kvh * G + g2) * HD : (p.H + kvh + g2 - nh) * HD) + d;
        wa[it] = wb[it] = make_uint2(0, want);
      }
      const int ov = (p.H + p.HKV + kvh) * HD + tid;
      const uint32_t tq = now<kTimed>();
      for (uint32_t n = 0, ok = 0;; ++n) {
#pragma unroll
        for (int it = 0; it < kRopeIt; ++it) {
          if (tid + it * kConsumers < (nh + nkv) * HALF && !(ok >> it & 1)) {
            wa[it] = ld_ll(p.qkv + oa[it] / 2);
            wb[it] = ld_ll(p.qkv + (oa[it] + HALF) / 2);
          }
        }
        if (tid < nkv * HD && !(ok >> kRopeIt & 1)) wv = ld_ll(p.qkv + ov / 2);
#pragma unroll
        for (int it = 0; it < kRopeIt; ++it)
          if (wa[it].y == want && wb[it].y == want) ok |= 1u << it;
        if (wv.y == want) ok |= 1u << kRopeIt;
        if (ok == (2u << kRopeIt) - 1 || !polling()) break;
        if (!retry(n)) break;
      }
      const uint32_t tr = now<kTimed>();
      tally(4, tr - tq);
      ev(l, kEvAttQkv);
      float qa[kRopeIt], qb[kRopeIt];
#pragma unroll
      for (int it = 0; it < kRopeIt; ++it) {
        qa[it] = bf_at(wa[it].x, oa[it] & 1);
        qb[it] = bf_at(wb[it].x, (oa[it] + HALF) & 1);
      }
      const float vd = bf_at(wv.x, ov & 1);
      // The own key and value go straight into the copied block's row when it holds them (no
      // separate pass over the block, no barrier for it).
      const bool own_first = pos >= lo && pos < min(hi, lo + kKeys);
      const int orow = (int)(pos - lo);
      // q of the G heads and (in the split that holds it) the own key, rotated as the rotary kernel does
#pragma unroll
      for (int it = 0; it < kRopeIt; ++it) {
        const int e = tid + it * kConsumers, g2 = e / HALF, d = e % HALF;
        if (e >= (nh + nkv) * HALF) break;
        const float xa = qa[it], xb = qb[it];
        const __nv_bfloat16 *ct = a.csb, *sn_ = a.csb + HD;  // (the angle rows, copied ahead)
        const float c0 = __bfloat162float(ct[d]), c1 = __bfloat162float(ct[d + HALF]);
        const float s0 = __bfloat162float(sn_[d]), s1 = __bfloat162float(sn_[d + HALF]);
        float o1 = bf(bf(xa * c0) - bf(xb * s0));
        float o2 = bf(bf(xb * c1) + bf(xa * s1));
        if (g2 < nh) {
          qs[g2 * HD + d] = o1;
          qs[g2 * HD + d + HALF] = o2;
        } else {
          const int h = g2 - nh;
          kn[h * HD + d] = o1;
          kn[h * HD + d + HALF] = o2;
          if (own_first) {
            __nv_bfloat16* kr = kb + (h * kKeys + orow) * kstride;
            kr[d] = __float2bfloat16(o1);
            kr[d + HALF] = __float2bfloat16(o2);
          }
        }
      }
      if (tid < nkv * HD) {  // (thread tid: kv head tid / HD's dim tid % HD)
        vn[tid] = vd;
        if (own_first) vb[((tid / HD) * kKeys + orow) * HD + tid % HD] = __float2bfloat16(vd);
      }
      consumers_sync();
      tally(18, now<kTimed>() - tr);
      if (pos >= lo && pos < hi && (!p.every || pid == 0)) {  // this split holds the step's own key:
                                                                 // into the cache (every: SM 0 writes it)
#pragma unroll 1
        for (int h = 0; h < nkv; ++h)
#pragma unroll 1
          for (int d = tid; d < HD; d += kConsumers) {
            const int64_t at = cbase + h * p.sk_h + pos * p.sk_t + d;
            p.kc[at] = __float2bfloat16(kn[h * HD + d]);
            p.vc[at] = __float2bfloat16(vn[h * HD + d]);
          }
      }
      float m_i = -INFINITY, l_i = 0.f;  // warp g's head (lanes agree)
      float4 o = make_float4(0.f, 0.f, 0.f, 0.f);  // the thread's quad (own_dims)
      float* ls = al + 8;  // the heads' softmax sums so far (al's region holds 32 floats)
      const uint32_t tb = now<kTimed>();
      for (int start = lo; start < hi; start += kKeys) {
        // the block's keys and values: the first block was copied ahead (its own row, if any, put
        // in during RoPE: see own_first); later ones from the cache, the own row from kn, vn
        const bool copied = start == lo;
        for (int h = 0; h < nkv && !copied; ++h)
        for (int e = tid; e < kKeys * (HD / 8); e += kConsumers) {
          const int j = e / (HD / 8), c = (e % (HD / 8)) * 8;
          int n = start + j;
          uint4 ku = make_uint4(0, 0, 0, 0), vu = make_uint4(0, 0, 0, 0);
          if (n < hi && n != pos) {
            ku = __ldcg(reinterpret_cast<const uint4*>(p.kc + cbase + h * p.sk_h + n * p.sk_t + c));
            vu = __ldcg(reinterpret_cast<const uint4*>(p.vc + cbase + h * p.sk_h + n * p.sk_t + c));
          } else if (n == pos) {
            __nv_bfloat162* kh = reinterpret_cast<__nv_bfloat162*>(&ku);
            __nv_bfloat162* vh = reinterpret_cast<__nv_bfloat162*>(&vu);
            const float *kr = kn + h * HD + c, *vr = vn + h * HD + c;
#pragma unroll
            for (int t = 0; t < 4; ++t) {
              kh[t] = __floats2bfloat162_rn(kr[2 * t], kr[2 * t + 1]);
              vh[t] = __floats2bfloat162_rn(vr[2 * t], vr[2 * t + 1]);
            }
          }
          *reinterpret_cast<uint4*>(kb + (h * kKeys + j) * kstride + c) = ku;
          *reinterpret_cast<uint4*>(vb + (h * kKeys + j) * HD + c) = vu;
        }
        if (!copied) consumers_sync();
        for (int gh = warp; gh < nh; gh += kConsumerWarps) {  // warp gh: head gh, lane j: key j
          const __nv_bfloat16* kr = kb + (gh / G * kKeys + lane) * kstride;
          // eight sums a lane, one for each column of an 8-column piece: a chain of HD / 8 FMAs,
          // not HD (the dot product's order is then (columns mod 8), then a tree of the eight)
          float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll 4  // (HD is 16..128 in 16s: a turn's loads issued together)
          for (int c = 0; c < HD; c += 8) {
            uint4 u = *reinterpret_cast<const uint4*>(kr + c);
            const float4 q0 = *reinterpret_cast<const float4*>(qs + gh * HD + c);  // (a broadcast)
            const float4 q1 = *reinterpret_cast<const float4*>(qs + gh * HD + c + 4);
            const float qv[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
            const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
            for (int t = 0; t < 4; ++t) {
              float2 f = __bfloat1622float2(h[t]);
              acc[2 * t] = fmaf(qv[2 * t], f.x, acc[2 * t]);
              acc[2 * t + 1] = fmaf(qv[2 * t + 1], f.y, acc[2 * t + 1]);
            }
          }
          float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
          s = start + lane < hi ? s * p.qk_scale : -INFINITY;
          float m_new = fmaxf(m_i, warp_max(s));
          float alpha = exp2f(m_i - m_new);
          float pr = exp2f(s - m_new);
          l_i = l_i * alpha + warp_sum(pr);
          m_i = m_new;
          pb[gh * kKeys + lane] = bf(pr);
          if (lane == 0) {
            al[gh] = alpha;
            ls[gh] = l_i;  // (read after the loop: the barrier below orders it)
          }
        }
        consumers_sync();
        {
          int gh, d;
          if (own_dims(nh, HD, gh, d)) {
            const float alpha = al[gh];
            const __nv_bfloat16* vh = vb + gh / G * kKeys * HD + d;
            // the even keys' and the odd keys' sums apart (chains of kKeys / 2), the quad's four
            // dims side by side: eight chains a thread, one 8-byte load a key
            float a[4] = {o.x * alpha, o.y * alpha, o.z * alpha, o.w * alpha}, b[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4  // (four turns' loads issued together; one at a time, 8 round trips to shared memory)
            for (int j = 0; j < kKeys; j += 4) {
              const float4 pj = *reinterpret_cast<const float4*>(pb + gh * kKeys + j);
              const float pv[4] = {pj.x, pj.y, pj.z, pj.w};
#pragma unroll
              for (int i = 0; i < 4; ++i) {
                const uint2 u = *reinterpret_cast<const uint2*>(vh + (j + i) * HD);
                const float2 v0 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
                const float2 v1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
                float* acc = i % 2 == 0 ? a : b;
                acc[0] = fmaf(pv[i], v0.x, acc[0]);
                acc[1] = fmaf(pv[i], v0.y, acc[1]);
                acc[2] = fmaf(pv[i], v1.x, acc[2]);
                acc[3] = fmaf(pv[i], v1.y, acc[3]);
              }
            }
            o = make_float4(a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3]);
          }
        }
        consumers_sync();
      }
      const uint32_t te = now<kTimed>();
      tally(17, te - tb);
      // the split's partial (LL floats, its max and sum after it), or with one split the heads'
      // output straight from the thread's sums (ls: the block loop's last barrier made it visible)
      const int prow = (kvh * G) * NS + sp;  // + gh * NS: the head's row of partials
      if (NS > 1 && warp < nh && lane == 0) {
        uint2* r = p.part + (int64_t)(prow + warp * NS) * (HD + 2) + HD;
        st_ll(r, __float_as_uint(m_i), want);
        st_ll(r + 1, __float_as_uint(l_i), want);
      }
      int gh, d;
      if (own_dims(nh, HD, gh, d)) {
        if (NS == 1) {
          const float den = ls[gh], dv = den > 0.f ? den : 1.f;
          if (p.every) {  // (the o rows' input: as the LL words' bf16 pairs would give it)
            qs[gh * HD + d] = bf(o.x / dv);
            qs[gh * HD + d + 1] = bf(o.y / dv);
            qs[gh * HD + d + 2] = bf(o.z / dv);
            qs[gh * HD + d + 3] = bf(o.w / dv);
          } else {
            uint2* r = p.attn + (kvh * G * HD + gh * HD + d) / 2;
            st_ll(r, pack_bf2(o.x / dv, o.y / dv), want);
            st_ll(r + 1, pack_bf2(o.z / dv, o.w / dv), want);
          }
        } else {
          uint2* r = p.part + (int64_t)(prow + gh * NS) * (HD + 2) + d;
          st_ll(r, __float_as_uint(o.x), want);
          st_ll(r + 1, __float_as_uint(o.y), want);
          st_ll(r + 2, __float_as_uint(o.z), want);
          st_ll(r + 3, __float_as_uint(o.w), want);
        }
      }
      tally(19, now<kTimed>() - te);
    }
    if (NS == 1) {
      if (p.every) consumers_sync();  // (the heads in qs, for every warp's o rows)
      tally(14, now<kTimed>() - ta);
      return;
    }
    tally(14, now<kTimed>() - ta);
    if (sp != 0) return;
    const uint32_t tm = now<kTimed>();
    // Split 0 merges the kv head's partials, polled as LL words: the splits' (max, sum) pairs
    // into shared memory (pb: G * kKeys >= G * kMaxSplits * 2 floats, the keys' p are used), the
    // thread's partials into registers; every load in flight at once.
    const int used = min(NS, (length + chunk - 1) / chunk);  // the splits with keys (split 0 has)
    float* mls = pb;
    for (int e0 = 0; e0 < G * HD; e0 += kConsumers) {
      const int e = e0 + tid, gh = e / HD, d = e % HD;
      const uint2* prt = p.part + (int64_t)((kvh * G + gh) * NS) * (HD + 2) + d;
      const bool mine = e < G * HD, lead = e0 == 0 && tid < G * used;
      const int h2 = tid / max(used, 1), s3 = tid % max(used, 1);
      const uint2* mlw = p.part + (int64_t)((kvh * G + h2) * NS + s3) * (HD + 2) + HD;
      uint2 pw[kMaxSplits], wm = make_uint2(0, want), wl = make_uint2(0, want);
#pragma unroll
      for (int s2 = 0; s2 < kMaxSplits; ++s2) pw[s2] = make_uint2(0, want);
      for (uint32_t n = 0, ok = 0;; ++n) {
#pragma unroll
        for (int s2 = 0; s2 < kMaxSplits; ++s2)
          if (mine && s2 < used && !(ok >> s2 & 1)) pw[s2] = ld_ll(prt + (int64_t)s2 * (HD + 2));
        if (lead && !(ok >> kMaxSplits & 1)) {
          wm = ld_ll(mlw);
          wl = ld_ll(mlw + 1);
        }
#pragma unroll
        for (int s2 = 0; s2 < kMaxSplits; ++s2)
          if (pw[s2].y == want) ok |= 1u << s2;
        if (wm.y == want && wl.y == want) ok |= 1u << kMaxSplits;
        if (ok == (2u << kMaxSplits) - 1 || !polling()) break;
        if (!retry(n)) break;
      }
      if (lead) {
        mls[(h2 * kMaxSplits + s3) * 2] = __uint_as_float(wm.x);
        mls[(h2 * kMaxSplits + s3) * 2 + 1] = __uint_as_float(wl.x);
      }
      if (e0 == 0) {
        consumers_sync();
        tally(15, now<kTimed>() - tm);
        ev(l, kEvMerge);
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
          num = fmaf(__uint_as_float(pw[s2].x), w, num);
        }
      }
      qs[e] = num / (den > 0.f ? den : 1.f);
    }
    put_heads(kvh);
  }

  // the kv head's G heads of output (float, staged in Att::qs: the start of xs) as LL words of
  // bf16 pairs
  __device__ void put_heads(int kvh) {
    const int n = p.H / p.HKV * p.HD;
    consumers_sync();
#pragma unroll 1
    for (int w = tid; w < n / 2; w += kConsumers) st_ll(p.attn + kvh * n / 2 + w, pack_bf2(xs[2 * w], xs[2 * w + 1]), want);
  }

  // The residual's rows 2 tid, 2 tid + 1 of slice s (o or down: the same rows) plus their sums,
  // handed over at dst and kept in resid; from_x: the residual is still the step's input row
  __device__ void add_residual(uint2* dst, const Slice& s, bool from_x, float2& resid) {
    if (2 * tid >= s.n) return;
    const int r = 2 * tid;
    const __nv_bfloat16* x = from_x ? x_in() : nullptr;
    const float b0 = from_x ? __bfloat162float(x[s.row0 + r]) : resid.x;
    const float b1 = from_x ? __bfloat162float(x[s.row0 + r + 1]) : resid.y;
    resid = make_float2(bf(bf(row_sum(s, 0, r)) + b0), bf(bf(row_sum(s, 0, r + 1)) + b1));
    st_ll(dst + s.row0 / 2 + tid, pack_bf2(resid.x, resid.y), want);
  }

  // the step's input row: p.x, or with p.xidx its row of the table p.x (read where layer 0 uses it:
  // a register pair kept for the whole step made the compiler spill)
  __device__ const __nv_bfloat16* x_in() const {
    if (!p.xidx) return p.x;
    return p.x + min(max(__ldcg(p.xidx) + p.xoff, (int64_t)0), p.xrows - 1) * p.DIM;
  }

  // rows of the head a chunk (see run_layers): whole stages whose partial sums fit `parts`
  // (decode_stack_cuda.head_chunks is the same arithmetic)
  __device__ int head_rows() const {
    const int rps = kStageElems / p.DIM;
    return kMaxParts / (p.DIM / kSeg) / rps * rps;
  }

  __device__ void run() {
    uint32_t t_start = now<kTimed>();
    long long* cal = nullptr;  // the trace's (clock, globaltimer) at the start and the end
    if (kTimed && p.trace && tid == 0) {
      trc = p.trace + (int64_t)pid * trace_width(p.L, p.trace_stages);
      cal = trc + trace_width(p.L, p.trace_stages) - 4;
      cal[0] = clock64();
      cal[1] = gtimer();
    }
    run_layers();
    if (kTimed && cal) {
      cal[2] = clock64();
      cal[3] = gtimer();
    }
    if (kTimed && tid == 0) {
      st[9] = now<kTimed>() - t_start;
      for (int i = 2; i < kStats; ++i) p.stats[pid * kStats + i] = st[i];
    }
  }

  __device__ void run_layers() {
    const int hhd = p.H * p.HD;
    const int nitem = p.HKV * p.NS;
    // the step's epoch: every SM reads it here, and the last SM to finish advances it (below)
    const uint32_t epoch = *reinterpret_cast<volatile uint32_t*>(p.ctl);
    pos0 = (int)p.pos[0];
    slot0 = (int)p.slots[0];
    // thread r's register copies of the residual's rows 2r, 2r + 1 of the SM's o/down rows (at
    // most 2 kConsumers rows an SM: the launcher checks), so the phase ends do not read them back
    float2 resid = make_float2(0.f, 0.f);
    // After the last layer, the head (if any) in p.nhead chunks of rows whose partial sums fit
    // `parts` (whole stages; the launcher's bound, a parameter: a loop bound in a register spilled):
    // each chunk is Q's steps again, with the final norm's weight
    for (int l = 0; l < p.L + p.nhead; ++l) {
      const bool head = l >= p.L;
      want = epoch * (uint32_t)p.L + (uint32_t)min(l, p.L) + 1u;  // (a head chunk polls the last layer's down)
      const __nv_bfloat16* nw = head ? p.fnorm : p.nrm + (int64_t)l * 2 * p.DIM;
      // (probe modes 2 and 3 skip the attention.) With Params::every, the SMs with o rows attend:
      // q|k|v's readers must be SMs whose rows the next layer's q|k|v waits for (through o, gate|up
      // and down), or a slow reader could find the next layer's words; SM 0 (which has o rows)
      // writes the cache.
      const bool attends = (p.every ? rows->n[1] > 0 : pid < nitem) && p.mode < 2;
      if (attends && l == 0) att_prefetch(att_setup(0, pid));  // (later layers': after the attention before)
      // Q (an SM with no rows of a phase reads nothing of it: a row it waited for could already
      // be the next layer's)
      float xr[32], wr[32];
      Slice sq = sl(l, head ? 5 : 0);
      if (head) {
        const int r0 = (l - p.L) * head_rows();
        sq.row0 += r0;
        sq.n = max(0, min(head_rows(), sq.n - r0));
        sq.nst = (sq.n + sq.rps - 1) / sq.rps;
      }
      if (sq.n > 0) {
        load_x(nw, p.DIM, wr);  // (no earlier kernel or phase writes the weights: before the rows)
        uint32_t t0 = now<kTimed>();
        if (l == 0) {
          load_x(x_in(), p.DIM, xr);
        } else {
          load_x_ll_shared(p.resd, p.DIM, want - 1u, xr);  // (the previous layer's down)
        }
        uint32_t tn = now<kTimed>();
        tally(3, tn - t0);
        ev(l, kEvQIn);
        norm_x(wr, p.DIM, xr);
        tally(10, now<kTimed>() - tn);
      }
      slice_stages(sq, 0, xr);
      uint32_t te = now<kTimed>();
      consumers_sync();
      if (head) {  // the chunk's logits (then its partial sums are free for the next chunk's), stores
                   // the sampling SM may poll (see sample_token)
#pragma unroll 1
        for (int r = tid; r < sq.n; r += kConsumers) st_bf_volatile(p.logits + sq.row0 + r, row_sum(sq, 0, r));
        consumers_sync();
        tally(13, now<kTimed>() - te);
        continue;
      }
      put_rows(p.qkv, sq, [&](int r) { return row_sum(sq, 0, r); });
      tally(13, now<kTimed>() - te);
      ev(l, kEvQkvPut);
      // A
      if (attends) {
        uint32_t t0 = now<kTimed>();
        attention(l, pid);
        ev(l, kEvAttDone);
        // the next layer's first block of keys, copied ahead a whole layer before its attention
        // (its rows are earlier steps'; this layer's attention is done with the buffer)
        if (l + 1 < p.L) att_prefetch(att_setup(l + 1, pid));
        tally(8, now<kTimed>() - t0);
      }
      // O
      const Slice so = sl(l, 1);
      if (so.n > 0) {
        uint32_t t0 = now<kTimed>();
        if (p.every) {
          load_x_smem(xs, hhd, xr);  // (the SM's own heads: attention() ended at a barrier)
        } else {
          load_x_ll_shared(p.attn, hhd, want, xr);
          // (every warp has its piece out of `parts` before o's partial sums go there; q|k|v and
          // gate|up have the norm's barrier between the two)
          consumers_sync();
        }
        tally(5, now<kTimed>() - t0);
        ev(l, kEvOIn);
      }
      slice_stages(so, 0, xr);
      te = now<kTimed>();
      consumers_sync();
      add_residual(p.reso, so, l == 0, resid);
      tally(13, now<kTimed>() - te);
      ev(l, kEvResoPut);
      // G
      const Slice sg = sl(l, 2), su = sl(l, 3);
      if (sg.n > 0) {
        load_x(nw + p.DIM, p.DIM, wr);
        uint32_t t0 = now<kTimed>();
        load_x_ll_shared(p.reso, p.DIM, want, xr);
        uint32_t tn = now<kTimed>();
        tally(6, tn - t0);
        ev(l, kEvGIn);
        norm_x(wr, p.DIM, xr);
        tally(10, now<kTimed>() - tn);
      }
      const int up = sg.n * (p.DIM / kSeg);
      const int ng = sg.stages();
      for (int i = 0; i < ng; ++i) {
        const float vg = stage_lanes(sg, i, xr);
        put_pair(sg, i, 0, vg, su, i, up, stage_lanes(su, i, xr));
      }
      te = now<kTimed>();
      consumers_sync();
      put_rows(p.act, sg, [&](int r) {
        float gv = bf(row_sum(sg, 0, r));
        float sv = bf(gv / (1.f + __expf(-gv)));
        return sv * bf(row_sum(su, up, r));
      });
      tally(13, now<kTimed>() - te);
      ev(l, kEvActPut);
      // D
      if (l == p.L - 1) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
      const Slice sd = sl(l, 4);
      if (sd.n > 0) {
        uint32_t t0 = now<kTimed>();
        load_x_ll(p.act, p.I, want, xr);
        tally(7, now<kTimed>() - t0);
        ev(l, kEvDIn);
      }
      slice_stages(sd, 0, xr);
      te = now<kTimed>();
      consumers_sync();
      add_residual(p.resd, sd, false, resid);
      tally(13, now<kTimed>() - te);
      ev(l, kEvResdPut);
    }
    want = epoch * (uint32_t)p.L + (uint32_t)p.L;  // (the last layer's flag: the head's chunks moved it on)
    if (pid == 0) {  // the final norm of the last layer's residual rows
      norm_into_xs(p.resd, p.fnorm);
#pragma unroll 1
      for (int k = tid; k < p.DIM; k += kConsumers) p.out[k] = __float2bfloat16(xs[k]);
    }
#ifndef REALTIME_STACK_NO_SAMPLER  // (a build without it: the test of the layer loop's code size)
    if (p.tok && pid == P - 1) sample_token();
#endif
    // The last SM done advances the epoch: every SM has read it by then, and the next step (the
    // next kernel, after this one completes) sees it.
    consumers_sync();
    if (tid == 0 && atom_acq_rel_add(p.ctl + 1, 1) == P - 1) {
      p.ctl[1] = 0;
      p.ctl[0] = (int)(epoch + 1u);
    }
  }

  // The sampler's block reductions: 16 words of the row table, which nothing reads after the
  // step's last stage (the `red` pointer kept live to the step's end spilled)
  __device__ int* sample_red() const {
    static_assert(sizeof(Rows) >= 2 * kConsumerWarps * sizeof(int), "the sampler's scratch");
    return const_cast<int*>(reinterpret_cast<const int*>(rows));
  }

  // The head's token (Params::tok) from the logits every SM writes, on the last SM (P - 1): the
  // Triton small-vocabulary sampler's steps for bf16 logits (16-bit order keys, the k-th largest
  // by bisection, ties at it kept lowest index first, Gumbel-max over the kept, argmax's first
  // index). The row goes into the ring's memory, free once the step's stages are consumed: its
  // order keys at the ring's start, its scaled logits after them; each thread holds a contiguous
  // run of it, so index order is thread order. This runs on the chain of every step that samples
  // (a CSM depth pass), so it takes few round trips. The rows are polled as the SMs write them (one
  // round trip from the last one landing; until 347c73a every SM fenced its stores and counted
  // itself done, and the last one to count read the row, with 9 dependent loads a thread until
  // 29eeab6).
  // The bisection takes two bits a round at one barrier (8 rounds; there were 16 at two).
  __device__ void sample_token() {
    const int V = p.V;
    // (the ring's start worked out from xs, which follows it: ring.buf kept live to here spilled)
    uint16_t* kv = reinterpret_cast<uint16_t*>(reinterpret_cast<unsigned char*>(xs) - (size_t)p.nstages * kStageBytes);
    float* xv = reinterpret_cast<float*>(kv + ((V + 7) & ~7));  // (16-byte aligned; the launcher's bound)
    {  // the raw bf16 row into kv and lgout, polled as the head's SMs write it (rows still 0xFFFF
       // have not landed), 8 rows a 16-byte load, every load in flight at once; then set back
      const int nq = (V + 7) / 8;
      uint4 r[kSamplePolls];
      uint32_t ok = 0;
#pragma unroll
      for (int j = 0; j < kSamplePolls; ++j) {
        r[j] = make_uint4(0, 0, 0, 0);
        if (tid + j * kConsumers >= nq) ok |= 1u << j;
      }
      const uint2* src = reinterpret_cast<const uint2*>(p.logits);  // (the launcher's row: 16-byte aligned)
      for (uint32_t n = 0;; ++n) {
#pragma unroll
        for (int j = 0; j < kSamplePolls; ++j)
          if (!(ok >> j & 1)) r[j] = ld_ll2(src + 2 * (tid + j * kConsumers));
#pragma unroll
        for (int j = 0; j < kSamplePolls; ++j) {
          const int rows = V - 8 * (tid + j * kConsumers);  // (rows past V: no matter)
          uint32_t miss = 0;  // bit i: row 8 q + i still 0xFFFF
          const uint32_t w4[4] = {r[j].x, r[j].y, r[j].z, r[j].w};
#pragma unroll
          for (int t = 0; t < 4; ++t) {
            const uint32_t e = __vcmpeq2(w4[t], 0xFFFFFFFFu);  // 0xFFFF in each half that is
            miss |= ((e & 1u) | (e >> 15 & 2u)) << (2 * t);
          }
          if (rows < 8) miss &= (1u << max(rows, 0)) - 1u;
          if (!miss) ok |= 1u << j;
        }
        if (ok == (1u << kSamplePolls) - 1 || !polling()) break;
        if (!retry(n)) break;
      }
#pragma unroll
      for (int j = 0; j < kSamplePolls; ++j) {
        const int q = tid + j * kConsumers, v = 8 * q;
        if (q >= nq) break;
        reinterpret_cast<uint4*>(kv)[q] = r[j];  // (kv has room to a multiple of 8)
        reinterpret_cast<uint4*>(p.logits)[q] = make_uint4(~0u, ~0u, ~0u, ~0u);  // (the next step polls it)
        if (v + 8 <= V) {
          reinterpret_cast<uint4*>(p.lgout)[q] = r[j];  // (lgout: 16-byte aligned, the launcher's)
        } else {
#pragma unroll 1
          for (int t = 0; v + t < V; ++t) p.lgout[v + t] = reinterpret_cast<const __nv_bfloat16*>(kv)[v + t];
        }
      }
    }
    consumers_sync();
    const float t_in = *p.s_temp;
    const bool greedy = t_in <= 0.f;
    const float temp = greedy ? 1.f : t_in;
    const int64_t k = *p.s_topk;
    const bool topk_on = k > 0 && k < V && temp > 0.f && !greedy;
    const int c = (V + kConsumers - 1) / kConsumers;
    const int v0 = min(V, tid * c), v1 = min(V, v0 + c);
#pragma unroll 1
    for (int v = v0; v < v1; ++v) {  // (in place: the thread's own run)
      const uint32_t bits = kv[v];
      xv[v] = __fdiv_rn(__uint_as_float(bits << 16), temp);
      kv[v] = (uint16_t)(bits ^ ((bits >> 15) ? 0xFFFFu : 0x8000u));
    }
    uint32_t thr = 0;
    int krem = (int)min(k, (int64_t)V);
    if (topk_on) {
      // The k-th largest key: the largest t with #(key >= t) >= k, two bits a round. A round counts
      // the keys >= thr + j 2^b for j = 1, 2, 3 (two counts in one word: V < 2^16) and keeps the
      // largest j whose count is still >= k. `above` counts the keys at or past the interval's
      // end, thr + 4 2^b (none at first): after the last round, the keys > thr.
      int* sums = reinterpret_cast<int*>(xs);  // [2][warps][2]: a round's sums, two buffers so that
      int above = 0;                           // one barrier a round keeps a buffer's readers ahead
#pragma unroll 1
      for (int b = 14, i = 0; b >= 0; b -= 2, ++i) {
        const uint32_t c1 = thr | (1u << b), c2 = thr | (2u << b), c3 = thr | (3u << b);
        int w0 = 0, w1 = 0;
#pragma unroll 1
        for (int v = v0; v < v1; ++v) {
          const uint32_t kk = kv[v];
          w0 += (kk >= c1) | ((kk >= c2) << 16);
          w1 += kk >= c3;
        }
        w0 = __reduce_add_sync(0xffffffffu, w0);
        w1 = __reduce_add_sync(0xffffffffu, w1);
        int* buf = sums + (i & 1) * 2 * kConsumerWarps;
        if (lane == 0) {
          buf[2 * warp] = w0;
          buf[2 * warp + 1] = w1;
        }
        consumers_sync();
        w0 = w1 = 0;
#pragma unroll
        for (int q = 0; q < kConsumerWarps; ++q) {
          w0 += buf[2 * q];
          w1 += buf[2 * q + 1];
        }
        const int n1 = w0 & 0xffff, n2 = w0 >> 16, n3 = w1;
        const uint32_t j = n3 >= krem ? 3u : n2 >= krem ? 2u : n1 >= krem ? 1u : 0u;
        above = j == 3 ? above : j == 2 ? n3 : j == 1 ? n2 : n1;
        thr |= j << b;
      }
      krem -= above;
    }
    int* r = sample_red();
    float* rb = reinterpret_cast<float*>(r + kConsumerWarps);
    int rank = 0;
    if (topk_on) {  // keys equal to the threshold before this thread's run (an exclusive scan over the
                    // threads; the row table was last read before the row's barrier)
      int eq = 0;
#pragma unroll 1
      for (int v = v0; v < v1; ++v) eq += kv[v] == thr;
      int inc = eq;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += y;
      }
      if (lane == 31) r[warp] = inc;
      consumers_sync();
      rank = inc - eq;
      for (int i = 0; i < warp; ++i) rank += r[i];
    }
    const uint32_t key = greedy ? 0u : row_key(*p.s_seed, *p.s_step + p.s_add);
    float best = -INFINITY;
    int bi = V;
#pragma unroll 1
    for (int v = v0; v < v1; v += 2) {  // two rows a turn: their draws' chains side by side
      const bool two = v + 1 < v1;
      const uint32_t ka = kv[v], kb = two ? kv[v + 1] : 0u;
      bool keepa = !topk_on || ka > thr;  // (the ties' ranks in index order)
      if (topk_on && ka == thr) keepa = rank++ < krem;
      bool keepb = two && (!topk_on || kb > thr);
      if (two && topk_on && kb == thr) keepb = rank++ < krem;
      float va = xv[v], vb = two ? xv[v + 1] : -INFINITY;
      if (!greedy) {
        const float ga = gumbel(key, v), gb = gumbel(key, v + 1);
        va = keepa ? va + ga : -INFINITY;
        vb = keepb ? vb + gb : -INFINITY;
      }
      if (va > best || bi == V) {  // (the first index of the largest; -inf rows: the first index)
        best = va;
        bi = v;
      }
      if (vb > best) {
        best = vb;
        bi = v + 1;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {  // (the larger value; on a tie, the lower index)
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ob > best || (ob == best && oi < bi)) {
        best = ob;
        bi = oi;
      }
    }
    consumers_sync();
    if (lane == 0) {
      rb[warp] = best;
      r[warp] = bi;
    }
    consumers_sync();
    if (tid == 0) {
      float b = rb[0];
      int i0 = r[0];
      for (int w = 1; w < kConsumerWarps; ++w)
        if (rb[w] > b || (rb[w] == b && r[w] < i0)) {
          b = rb[w];
          i0 = r[w];
        }
      *p.tok = i0 < V ? i0 : 0;
    }
  }
};

template <bool kTimed>
__global__ void __launch_bounds__(kThreads, 1) stack_kernel(const __grid_constant__ Params p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int pid = blockIdx.x, P = gridDim.x;
  const int xsf = xs_floats(p.DIM, att_heads(p), att_kv_heads(p), p.HD);
  Ring ring;
  ring.n = p.nstages;
  ring.buf = reinterpret_cast<__nv_bfloat16*>(smem);
  float* xs = reinterpret_cast<float*>(smem + (size_t)ring.n * kStageBytes);
  float* parts = xs + (xsf + 3) / 4 * 4;
  float* red = parts + kMaxParts;
  long long* st = reinterpret_cast<long long*>(red + kConsumerWarps + 8);  // (8-byte aligned)
  if (kTimed && tid == 0)
    for (int i = 0; i < kStats; ++i) st[i] = 0;
  Rows* rows = reinterpret_cast<Rows*>(st + kStats);
  ring.full = reinterpret_cast<uint64_t*>(rows + 1);
  ring.empty = ring.full + ring.n;
  if (tid < 6) fill_rows(p, pid, P, tid, rows);
  if (tid == 0) {
    for (int i = 0; i < ring.n; ++i) {
      mbar_init(&ring.full[i], 1);
      mbar_init(&ring.empty[i], kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == kConsumerWarps) {  // the producer: weights only, which no earlier kernel writes
    if (lane == 0) produce<kTimed>(p, ring, rows, pid);
    return;
  }
  asm volatile("griddepcontrol.wait;" ::: "memory");  // the kernel before has finished (x, pos, caches)
  Consumer<kTimed> c{p, ring, xs, parts, red, st, rows, tid, warp, lane, pid, P};
  c.run();
}

}  // namespace

extern "C" {

// Shared memory a block needs beside its ring of stages.
int realtime_stack_fixed_smem(int dim, int nh, int nkv, int hd) {
  return (xs_floats(dim, nh, nkv, hd) + 3) / 4 * 16 + kMaxParts * 4 + (kConsumerWarps + 8) * 4 + kStats * 8 +
         (int)sizeof(Rows);
}

int realtime_stack_stage_bytes() { return kStageBytes; }
int realtime_stack_max_parts() { return kMaxParts; }
int realtime_stack_threads() { return kThreads; }

// a: pointers and int64 strides (see Params, in order; then stats or 0; then xidx or 0, xoff, xrows,
// whead or 0, logits; then s_temp, s_topk, s_seed, s_step, s_add, tok or 0, lgout or 0; then trace or 0),
// f: eps and qk_scale, n: the int fields (L, DIM, H, HKV, HD, I, TMAX, NS, nstages, mode, inflight,
// balance, backoff, V, nhead, every, keep, ahead, burst, trace_stages). Returns a cudaError_t.
int realtime_stack_launch(const int64_t* a, const float* f, const int* n, int grid, int smem, void* stream, int pdl) {
  Params p;
  p.x = reinterpret_cast<const __nv_bfloat16*>(a[0]);
  p.out = reinterpret_cast<__nv_bfloat16*>(a[1]);
  p.reso = reinterpret_cast<uint2*>(a[2]);
  p.qkv = reinterpret_cast<uint2*>(a[3]);
  p.attn = reinterpret_cast<uint2*>(a[4]);
  p.part = reinterpret_cast<uint2*>(a[5]);
  p.resd = reinterpret_cast<uint2*>(a[6]);
  p.act = reinterpret_cast<uint2*>(a[7]);
  p.ctl = reinterpret_cast<int*>(a[8]);
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
  p.backoff = n[12];
  p.xidx = reinterpret_cast<const int64_t*>(a[27]);
  p.xoff = a[28];
  p.xrows = a[29];
  p.whead = reinterpret_cast<const __nv_bfloat16*>(a[30]);
  p.logits = reinterpret_cast<__nv_bfloat16*>(a[31]);
  p.V = n[13];
  p.nhead = n[14];
  p.every = n[15];
  p.keep = n[16];
  p.ahead = n[17];
  p.burst = n[18];
  p.s_temp = reinterpret_cast<const float*>(a[32]);
  p.s_topk = reinterpret_cast<const int64_t*>(a[33]);
  p.s_seed = reinterpret_cast<const int64_t*>(a[34]);
  p.s_step = reinterpret_cast<const int64_t*>(a[35]);
  p.s_add = a[36];
  p.tok = reinterpret_cast<int64_t*>(a[37]);
  p.lgout = reinterpret_cast<__nv_bfloat16*>(a[38]);
  p.trace = reinterpret_cast<long long*>(a[39]);
  p.trace_stages = n[19];
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

// The L2 set aside for evict_last (persisting) lines on `device`: min(bytes, the GPU's most); returns
// the bytes set, or -(cudaError_t) on an error.
long long realtime_stack_persist_l2(int device, long long bytes) {
  int most = 0;
  cudaError_t e = cudaDeviceGetAttribute(&most, cudaDevAttrMaxPersistingL2CacheSize, device);
  if (e != cudaSuccess) return -(long long)e;
  int prev = -1;
  if (cudaGetDevice(&prev) != cudaSuccess || (prev != device && cudaSetDevice(device) != cudaSuccess)) return -1;
  const size_t want = (size_t)(bytes < most ? (bytes > 0 ? bytes : 0) : most);
  e = cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, want);
  size_t got = 0;
  if (e == cudaSuccess) e = cudaDeviceGetLimit(&got, cudaLimitPersistingL2CacheSize);
  if (prev != device) cudaSetDevice(prev);
  return e == cudaSuccess ? (long long)got : -(long long)e;
}

const char* realtime_stack_error_string(int e) { return cudaGetErrorString(static_cast<cudaError_t>(e)); }

}  // extern "C"
