// Paged split-K decode attention over quantized K/V, CUDA, mma.sync: 8-bit codes
// (FP8 e4m3 / e5m2, INT8) or KIVI (K per channel over 32 tokens, V per token over
// 32 channels, 4 or 2 bits, fp16 scale + zero, planar packing).
//
// Compiled at run time (NVRTC) with these macros, set by decode8.py:
//   HEAD_DIM     64, 128 or 256
//   PAGE         tokens per cache block, a multiple of 16 (KIVI: of 32)
//   GROUP        query heads per KV head, 1..8
//   KIVI_BITS    0: 8-bit codes, with K_KIND / V_KIND and K_SCALE / V_SCALE below;
//                4 or 2: KIVI (the K_/V_ macros are unused)
//   K_TOKEN      with KIVI_BITS: 1 = K per token over 32 channels too, like V (int4_per_token,
//                int2_per_token; pages of 16, no KIVI_STEP32), 0 = KIVI's K per channel
//   ROT          with KIVI_BITS (4, or 3: a 2-bit plane then a 1-bit plane, head_dim >= 128): 1 =
//                rotated codebook K and V (turboquant_4bit_nc, turboquant_3bit_nc): codes index a
//                table of levels, one norm per token
//   V_BITS       with ROT: V's code width when it differs from K's (turboquant_k3v4_nc: 3 and 4)
//   K8           with ROT: K in 8 bits, not rotated (turboquant_k8v4: FP8 with K_KIND and a static
//                K_SCALE, the 8-bit path's K map and plain query; V a rotated codebook of V_BITS)
//   KC           with ROT: K centred per channel over 32 tokens before its rotation (rot3_kc,
//                rot4_kc): a mean row per group, pages of 32
//   K_KIND, V_KIND     0 = e4m3, 1 = e5m2, 2 = int8
//   K_SCALE, V_SCALE   0 = static per head f32 [H], 1 = per token f32 [NB, H, PAGE],
//                      2 = per token f16 [NB, H, PAGE], 3 = per block f32 [NB, H]
//   HAS_HP       1: tables may hold high-precision blocks (sinks, recent window)
//   KIVI_EXACT   1: KIVI codes enter the MMAs as exact f16 integers, 0 (default) as subnormals
//   LAZY_RESCALE 1 (default): the accumulators are rescaled only in chunks where a running max moved
//   KIVI_STEP32  1 (what decode8.py compiles): a KIVI group is one ring item and one step (both
//                halves' scores, one softmax, both PV halves); 0 (the macro's default): two 16-token steps
//   MODEL_BF16   1: queries, outputs and hp blocks are bf16; 0: f16
//   NWARPS, NSTAGES, MIN_BLOCKS   launch shape
//
// Grid (split, KV head, sequence).  Each CTA takes one split of the sequence's
// 16-token chunks; warp w takes chunks w, w + NWARPS, ... of it, keeps its own
// online softmax, and the CTA merges its warps at the end into one partial
// (out, lse) per query row, or into the output itself when there is one split.
//
// Memory path: each warp streams its chunks through a private ring of NSTAGES
// shared-memory stages with cp.async (16-byte copies, no registers held by loads
// in flight); rows are padded so that the fragment reads below are free of bank
// conflicts.  A high-precision chunk takes two stages in a row (its K rows, then
// its V rows), so a stage is no larger than a quantized chunk needs, or half an hp one.
//
// Tensor-core layout (mma m16n8k16, f16 in, f32 accumulate), lane l: i = l / 4,
// c = l % 4.  Both products are transposed so that the 16-row A operand is the
// long side (tokens for QK, channels for PV) and the query group sits in the
// 8 columns of N:
//
//   S^T [16 tok, 8 q]  = K  [16 tok, D] . Q^T [D, 8 q]      A = K rows,  B = Q
//   O^T [D, 8 q]      += V^T [D, 16 tok] . P^T [16 tok, 8 q] A = V^T,    B = P^T
//
// Channel orders are chosen so that every lane reads contiguous bytes and no
// data is shuffled:
//   QK, k-step j, A column / B row {2c, 2c+1, 2c+8, 2c+9}  <->  channel QB*c + 4j + {0,1,2,3}
//      (QB = D/4: lane (i, c) reads bytes [QB*c, QB*c + QB) of tokens i and i + 8);
//   PV, m-tile j, A row i / i + 8  <->  channel VB*i + 2j / VB*i + 2j + 1
//      (VB = D/8: lane (i, c) reads bytes [VB*i, VB*i + VB) of tokens 2c, 2c+1, 2c+8, 2c+9).
// The S^T accumulator (tokens i, i+8 x queries 2c, 2c+1 per lane) becomes the
// P^T B fragment (tokens 2c.., query i) with one movmatrix transpose per 8x8 half.
// Per-token K scales multiply S rows, per-token V scales multiply P rows: both
// are the lane's own tokens i and i + 8.
//
// KIVI: the codes enter the MMAs as they are and the scales and zero points move to
// the other operand.  A plane's codes are masked in place (one lop3 per register of two
// codes, `plane`): left where they sit in their byte they are the integers
// code * 2^(BITS m) read as f16 subnormals (times 2^-24; or, with KIVI_EXACT or for an
// f16 model with hp blocks, made exact f16 integers by one more sub).  The 2^(BITS m) of
// plane m goes into the other operand, the 2^-24 into the result:
//   K (per channel c over a 32-token group): S = sum_c code * (q_c s_c) + sum_c z_c q_c.  A warp
//      takes both 16-token chunks of a group in a row; at the group's first chunk it builds the
//      scaled query fragments q_c s_c 2^-(BITS m) (one hmul2 per register) and the zero points'
//      term with KS MMAs of the zero row against the query (exact f32 products), a constant per
//      query that is added to the group's scores.
//   V (per token t over a group of 32 channels): O = sum_t code * (P_t s_tg) + sum_t P_t z_tg.
//      One P^T fragment per channel group (P times the tokens' scale of the group and its plane's
//      2^-(BITS m)), and one MMA of the zero points (rows = groups) against the plain P^T into a
//      small accumulator that the final merge adds to each group's channels.
// Planar packing puts channels j, j + DP, ... (DP = D / (8 / bits)) in one byte, so the channel
// maps differ (KB = DP / 4):
//   QK, k-step s = w * PER + m, A columns {2c, 2c+1} / {2c+8, 2c+9}  <->  channels
//      (x, x + 2) / (x + 1, x + 3) with x = m * DP + KB*c + 4w: bytes 0 and 2, then
//      1 and 3, of the lane's word w, bit plane m;
//   PV, m-tile (u * PER + m) * 2 + e, rows i / i + 8  <->  channels
//      m * DP + 32u + 4i + 2e (+1): byte 2e (2e + 1) of word u of the lane's tokens,
//      so every m-tile lies in one group of 32 channels (group m * NU + u, one plane).
//   Narrow rows (int2 at head_dim 64: DP = 16 bytes, NARROW): PV m-tile m is bit plane m, rows
//      i / i + 8 <->  channels m * DP + 2i (+1): bytes 2i, 2i + 1 of the lane's tokens; planes
//      2g and 2g + 1 lie in channel group g, so P^T is scaled per plane, not per group.
// High-precision chunks use the same maps (their P scaled by 2^-24 when V's codes are subnormal).
//
// K per token (K_TOKEN): each (token, 32-channel group) has its own scale and zero, so they cannot
// move into the query.  The K codes are dequantized in the A fragments instead: a plane's codes
// become exact f16 integers (one lop3 and one sub, the sub's magic number also dividing by the
// plane's 2^(BITS m)), then code * s + z (one fma per register of two).  So that each register's
// two channels share a group, k-step s = u * PER + m maps lane column c to the channels
// m * DP + 16u + 4c .. + 3 (word u of the lane's 16-byte slice, bit plane m); rows are padded
// to DP + 16 bytes so that those word reads are free of bank conflicts.
//
// Rotated codebook (ROT): K and V were rotated (R = H diag(signs), H the orthonormal Hadamard
// transform) and each coordinate stored as the index of its level, with one f16 norm per token:
// k = R^T (norm * levels[code]).  Scores are taken in the rotated domain with the rotated query
// (qr = R q, float32, computed by the launcher); codes become their levels through a table in
// shared memory (two codes a register, KIVI's planar maps); the K norm multiplies S rows and the
// V norm P rows, as per-token scales do.  The quantized chunks' output sums in the rotated domain
// (acc), the hp chunks' (exact K and V, scored with the plain query) in the model's (acch): at the
// end each warp rotates its rows back in shared memory (in-place Hadamard butterflies, then the
// signs) and adds acch, before the warps merge.  3-bit codes: the main plane holds the low 2 bits
// (KIVI's 2-bit maps), a 1-bit plane of D/8 bytes after it the high bit: channel ch's bit is bit
// ch / DH of byte ch % DH (DH = D/8), so a fragment word of the main plane at byte x pairs with the
// high plane's word at byte x % DH, bit 2m + x / DH for plane m.  Centred K (KC): the group's mean
// row (f16 [D]) enters one MMA against the plain query at the group's first chunk, a constant per
// query added to the group's scores, as KIVI's zero points are.

#ifndef HAS_HP
#define HAS_HP 0
#endif
#ifndef KIVI_BITS
#define KIVI_BITS 0
#endif
#ifndef K_KIND
#define K_KIND 0
#define V_KIND 0
#define K_SCALE 0
#define V_SCALE 0
#endif
#ifndef MODEL_BF16
#define MODEL_BF16 1
#endif
#ifndef K_TOKEN
#define K_TOKEN 0
#endif
#ifndef ROT
#define ROT 0
#endif
// ROT_REG_LUT (the default; 0: the shared table, for A/B probes): 3- and 4-bit codes' levels from registers, not
// the shared table: the codebook is symmetric; 3 bits: its 4 magnitudes are two words, one byte permute picks
// two; 4 bits: the 8 magnitudes' low bytes and high bytes are two words each, byte permutes pick four codes'
#ifndef ROT_REG_LUT
#define ROT_REG_LUT 1
#endif
#ifndef KC
#define KC 0
#endif
#ifndef V_BITS
#define V_BITS KIVI_BITS
#endif
#ifndef K8
#define K8 0
#endif
#ifndef KIVI_EXACT
#define KIVI_EXACT 0
#endif
#ifndef LAZY_RESCALE
#define LAZY_RESCALE 1
#endif
#ifndef KIVI_STEP32
#define KIVI_STEP32 0
#endif
#ifndef NWARPS
#define NWARPS 4
#endif
#ifndef NSTAGES
#define NSTAGES 3
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 3
#endif

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;

#define NEG_INF (-__int_as_float(0x7f800000))

constexpr int D = HEAD_DIM;
constexpr int KS = D / 16;               // QK k-steps = PV m-tiles
constexpr int QB = D / 4;                // bytes of an 8-bit K row that one lane reads
constexpr int VB = D / 8;                // bytes of an 8-bit V row that one lane reads
constexpr int RS = D + 16;               // shared row stride, 8-bit rows
constexpr int RSH = 2 * D + 16;          // shared row stride, high-precision rows
#if KIVI_BITS
constexpr int PBITS = KIVI_BITS == 3 ? 2 : KIVI_BITS;  // a code's bits in the main plane (3: 2 + a high-bit plane)
constexpr int PER = 8 / PBITS;           // codes per byte
constexpr int NLEV = 1 << KIVI_BITS;     // ROT: levels of the codebook
constexpr int DP = D / PER;              // packed bytes per row (of the main plane)
constexpr int DH = KIVI_BITS == 3 ? D / 8 : 0;  // bytes of the high-bit plane a row (3-bit codes)
constexpr int ROWB = DP + DH;            // bytes a row
constexpr int KB = DP / 4;               // bytes of a K row that one lane reads
// V's rows (its own width with ROT and V_BITS; KIVI's V has K's)
constexpr int VPER = 8 / (V_BITS == 3 ? 2 : V_BITS);
constexpr int VDP = D / VPER;
constexpr int VDH = V_BITS == 3 ? D / 8 : 0;
constexpr int VROWB = VDP + VDH;
constexpr int VNLEV = 1 << V_BITS;
// levels from registers (ROT_REG_LUT): 3-bit codes always, 4-bit ones up to head_dim 128 (their four table
// words made head_dim 256 with hp pages spill); K8's K has no codebook
constexpr bool K_REG = ROT && ROT_REG_LUT && !K8 && (KIVI_BITS == 3 || HEAD_DIM <= 128);
constexpr bool V_REG = ROT && ROT_REG_LUT && (V_BITS == 3 || HEAD_DIM <= 128);
constexpr int KW = KB / 4;
constexpr bool NARROW = VDP < 32;        // 16-byte rows (int2 at head_dim 64): one PV m-tile a plane
constexpr int NU = NARROW ? 1 : VDP / 32; // words of a V row that one lane reads (NARROW: a half word)
constexpr int NG = D / 32;               // V channel groups
constexpr int KROWB = K8 ? D : ROWB;     // bytes of a K row (K8: 8-bit codes)
constexpr int RSK = K8 ? RS : K_TOKEN ? (DP == 16 ? 16 : DP + 16)  // conflict-free K fragment reads
                            : (ROWB <= 64 ? ROWB : ROWB + 16);
constexpr int RSV = ((VROWB + 47) / 64) * 64 + 16;    // conflict-free V fragment reads
constexpr int QR = KIVI_STEP32 ? 32 : 16;             // token rows of a quantized item
constexpr int VR_OFF = QR * RSK;                      // V rows
constexpr int KSC_OFF = VR_OFF + QR * RSV;            // K scale row, K zero row of the chunk's group (f16 [D] each)
constexpr int VSC_OFF = KSC_OFF + 4 * D;              // V scales, V zeros (f16 [QR][NG] each)
constexpr int VZ_OFF = VSC_OFF + 2 * NG * QR;
constexpr int Q_STAGE = VZ_OFF + 2 * NG * QR;
static_assert(DP == 16 || DP % 32 == 0, "KIVI: 16 or a multiple of 32 packed bytes per row");
static_assert(VDP == 16 || VDP % 32 == 0, "KIVI: 16 or a multiple of 32 packed bytes per row");
static_assert(!NARROW || KS == VPER, "narrow rows: one PV m-tile a bit plane");
static_assert(V_BITS == KIVI_BITS || ROT, "K and V of different widths: rotated codebooks only");
static_assert(!(K_TOKEN && KIVI_STEP32), "K per token: 16-token items (pages of 16)");
constexpr bool K_SUB = KIVI_EXACT;                              // K codes as exact integers
constexpr bool V_SUB = KIVI_EXACT || (HAS_HP && !MODEL_BF16);   // (f16 P of hp chunks cannot take 2^-24)
constexpr float UNIT = 16777216.f;                              // 2^24: a subnormal code's unit, inverted
constexpr int PAIR = K_TOKEN || (ROT && !KC) ? 1 : 2;  // a warp's chunks come in pairs: both halves of a K group (per channel)
constexpr int ZG = ROT ? 0 : NG;         // V zero-point sums per (warp, query) in the merge
static_assert(!ROT || (!K_TOKEN && !KIVI_STEP32 && !NARROW), "rotated codebook: 16-token items, KIVI's maps");
static_assert((KIVI_BITS != 3 && V_BITS != 3) || (ROT && ROWB % 16 == 0 && VROWB % 16 == 0),
              "3-bit codes: rotated, head_dim >= 128");
static_assert(!KC || ROT, "KC: a rotated codebook's centred K");
static_assert(!K8 || (ROT && !KC && K_SCALE == 0), "K8: FP8 K (static scale) beside a rotated V");
#else
static_assert(!ROT, "ROT needs KIVI_BITS (the codes' planar width)");
constexpr int PAIR = 1;
constexpr int ZG = 0;
constexpr int SC_OFF = 32 * RS;          // K scales (64 bytes), V scales (64 bytes)
constexpr int Q_STAGE = SC_OFF + 128;
#endif
constexpr int KV_BYTES = (HAS_HP && 16 * RSH > Q_STAGE) ? 16 * RSH : Q_STAGE;  // hp: K or V rows
constexpr int BLK_OFF = KV_BYTES;        // the chunk's signed block id
constexpr int STAGE = KV_BYTES + 16;
static_assert(D == 64 || D == 128 || D == 256, "head_dim 64, 128 or 256");
static_assert(PAGE % (KIVI_BITS && !K_TOKEN && (!ROT || KC) ? 32 : 16) == 0, "pages hold whole 16-token chunks (KIVI: 32-token groups)");
static_assert(GROUP >= 1 && GROUP <= 8, "at most 8 query heads per KV head");
static_assert(NSTAGES >= 2, "at least one chunk in flight while one is computed");
static_assert(NWARPS * NSTAGES * STAGE >= NWARPS * 8 * (D + 2 + ZG) * 4, "the merge reuses the rings");

// ---- small PTX wrappers -----------------------------------------------------------------------
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t;\n cvta.to.shared.u64 t, %1;\n cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void cp16(u32 dst, const void* src) {  // dst: a shared-window address
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp4(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

__device__ __forceinline__ float ex2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ u32 pack_f16(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ float half_to_float(u16 h) {
    float f;
    asm("{ .reg .f16 t;\n mov.b16 t, %1;\n cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 float_to_model(float x) {
    u16 r;
#if MODEL_BF16
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
#endif
    return r;
}
__device__ __forceinline__ u32 trans8x8(u32 x) {  // 8x8 b16 matrix fragment, transposed
    u32 r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
    return r;
}
__device__ __forceinline__ void mma_f16(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_hp(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if MODEL_BF16
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    mma_f16(d, a0, a1, a2, a3, b0, b1);
#endif
}

// Four 8-bit codes (bytes 0..3 of x) -> f16x2 (byte 0, byte 1) and (byte 2, byte 3), exactly.
template <int KIND>
__device__ __forceinline__ void cvt4(u32 x, u32& lo, u32& hi) {
    if (KIND == 0) {  // e4m3: the hardware conversion, two codes per instruction
        asm("{ .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h; }"
            : "=r"(lo), "=r"(hi) : "r"(x));
    } else if (KIND == 1) {  // e5m2 is the high byte of an f16
        lo = __byte_perm(x, 0u, 0x1404);
        hi = __byte_perm(x, 0u, 0x3424);
    } else {  // int8: (code ^ 0x80) in the mantissa of 1024.0 is 1152 + code
        const u32 y = x ^ 0x80808080u;
        const u32 l = __byte_perm(y, 0x64646464u, 0x5140), h = __byte_perm(y, 0x64646464u, 0x7362);
        asm("sub.f16x2 %0, %1, %2;" : "=r"(lo) : "r"(l), "r"(0x64806480u));
        asm("sub.f16x2 %0, %1, %2;" : "=r"(hi) : "r"(h), "r"(0x64806480u));
    }
}

// PTX prmt: bytes of (a, b) picked by the selector's nibbles, which callers keep below 8 (bit 3 would
// replicate the byte's sign); unlike __byte_perm, whose contract masks that bit, it costs no extra op.
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

__device__ __forceinline__ u32 hsub2(u32 a, u32 b) {
    u32 r;
    asm("sub.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
    u32 r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
    u32 r;
    asm("mul.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

#if KIVI_BITS
// Bit plane m of bytes 0 and 2 of x as f16x2, left in place: code * 2^(BITS m) as a subnormal
// (times 2^-24), or with SUB as that exact integer.
template <bool SUB>
__device__ __forceinline__ u32 plane(u32 x, int m) {
    constexpr u32 MASK = ((1u << KIVI_BITS) - 1u) * 0x00010001u;
    const u32 y = x & (MASK << (KIVI_BITS * m));
    return SUB ? hsub2(y | 0x64006400u, 0x64006400u) : y;
}
#endif

#if ROT
// The levels (table t) of bit plane m's codes in bytes 0 and 2 of x, f16x2; 3-bit codes (B = 3): x holds
// their low 2 bits, and their high bits sit at bit 2m + hb of bytes 0 and 2 of y (the high plane's word).
template <int B>
__device__ __forceinline__ u32 levels2(const u16* t, u32 x, u32 y, int m, int hb) {
    constexpr int PB = B == 3 ? 2 : B;
    constexpr u32 PM = (1u << PB) - 1u;
    u32 lo = (x >> (PB * m)) & PM, hi = (x >> (16 + PB * m)) & PM;
    if (B == 3) {
        lo |= ((y >> (2 * m + hb)) & 1u) << 2;
        hi |= ((y >> (16 + 2 * m + hb)) & 1u) << 2;
    }
    return u32(t[lo]) | (u32(t[hi]) << 16);
}

// Levels from registers (ROT_REG_LUT).  The codebooks are symmetric (level 2^B - 1 - c = -level c, exactly in
// f16), so a codebook is its 2^(B-1) magnitudes (levels 2^(B-1)...): byte j of (lo0, lo1) is the low byte of
// magnitude j, byte j of (hi0, hi1) its high byte (3 bits: 4 magnitudes, lo1 and hi1 unused).
struct LutR {
    u32 lo0, lo1, hi0, hi1;
};
template <int NL>  // levels: the NL f16 levels, ascending
__device__ __forceinline__ LutR lutr_of(const u16* levels) {
    const u32* w = reinterpret_cast<const u32*>(levels + NL / 2);
    if (NL == 8) return {prmt(w[0], w[1], 0x6420), 0u, prmt(w[0], w[1], 0x7531), 0u};
    return {prmt(w[0], w[1], 0x6420), prmt(w[2], w[3], 0x6420), prmt(w[0], w[1], 0x7531), prmt(w[2], w[3], 0x7531)};
}

// The f16x2 levels of 4 codes given in the nibbles of a code word's field (byte 0's in bits 0-3, byte 1's in
// 8-11, byte 2's in 16-19, byte 3's in 24-27; every nibble below 8) with their signs at bit 7 of sg's bytes
// (order 0, 2, 1, 3): a for the codes of bytes 0 and 2, b for bytes 1 and 3.  The selector gathers the
// nibbles of bytes 0, 2, 1, 3; its upper half is not read.  4 byte permutes for 4 codes.
__device__ __forceinline__ void levels_reg(const LutR& t, u32 f, u32 sg, u32& a, u32& b) {
    const u32 sel = (f & 0x0F0Fu) | ((f >> 12) & 0xFFFFF0F0u);
    const u32 lo = prmt(t.lo0, t.lo1, sel);
    const u32 hi = prmt(t.hi0, t.hi1, sel) | (sg & 0x80808080u);
    a = prmt(lo, hi, 0x5140);
    b = prmt(lo, hi, 0x7362);
}

// A code word prepared once for levels_reg (magnitude indices, signs).  3-bit codes (x: their low 2 bits,
// fields m = 0..3 at bits 2m of each byte; y: the high plane's word, their high bits at bit 2m + hb): a
// code c = low + 4 high reads magnitude low when high is set, else 3 - low negated; n marks the negative
// half at each field's low bit, and j = x ^ n ^ (n << 1) holds the magnitude indices, split into
// fields 0 and 2 (t0) and 1 and 3 (t1) so that each field's nibbles hold one index.  4-bit codes (fields
// m = 0, 1 at bits 4m): magnitude c - 8, or 7 - c in the negative half.  ng: n's bytes reordered (0, 2, 1, 3).
struct CodeWord {
    u32 t0, t1, ng;
};
__device__ __forceinline__ CodeWord prep3(u32 x, u32 y, int hb) {
    const u32 n = ~(y >> hb) & 0x55555555u, j = x ^ n ^ (n << 1);
    return {j & 0x33333333u, (j >> 2) & 0x33333333u, prmt(n, 0u, 0x3120)};
}
__device__ __forceinline__ CodeWord prep4(u32 x) {
    const u32 n = ~(x >> 3) & 0x11111111u;
    return {(x ^ (n * 7u)) & 0x77777777u, 0u, prmt(n, 0u, 0x3120)};
}
// field m's levels of a prepared word (levels_reg's a and b)
template <int B>
__device__ __forceinline__ void levels_field(const LutR& t, const CodeWord& w, int m, u32& a, u32& b) {
    if (B == 3)
        levels_reg(t, ((m & 1) ? w.t1 : w.t0) >> (4 * (m >> 1)), w.ng << (7 - 2 * m), a, b);
    else
        levels_reg(t, w.t0 >> (4 * m), w.ng << (7 - 4 * m), a, b);
}
#endif

// Channel of row `row` (0..7; row + 8 is the next channel) of PV m-tile j.
__device__ __forceinline__ int v_channel(int j, int row) {
#if KIVI_BITS
    if (NARROW) return j * VDP + 2 * row;
    const int e = j & 1, m = (j >> 1) % VPER, u = (j >> 1) / VPER;
    return m * VDP + 32 * u + 4 * row + 2 * e;
#else
    return VB * row + 2 * j;
#endif
}

// First channel of the 4 that QK k-step s of lane column c covers.
__device__ __forceinline__ int k_channel(int s, int c) {
#if KIVI_BITS
    if (K8) return QB * c + 4 * s;
    if (K_TOKEN) return (s % PER) * DP + 16 * (s / PER) + 4 * c;
    return (s % PER) * DP + KB * c + 4 * (s / PER);
#else
    return QB * c + 4 * s;
#endif
}

// The A/B fragment pairs of 4 channels given as two words (x, x+1 | x+2, x+3):
// 8-bit maps pair neighbours, KIVI maps pair (x, x+2) and (x+1, x+3).
__device__ __forceinline__ void pair_words(u32 w0, u32 w1, u32& p0, u32& p1) {
#if KIVI_BITS
    if (K8) {
        p0 = w0;
        p1 = w1;
        return;
    }
    p0 = __byte_perm(w0, w1, 0x5410);
    p1 = __byte_perm(w0, w1, 0x7632);
#else
    p0 = w0;
    p1 = w1;
#endif
}

// cp.async of ROWS (default 16) consecutive rows of ROW_BYTES (a multiple of 16) to shared rows DST_STRIDE apart.
template <int ROW_BYTES, int DST_STRIDE, int ROWS = 16>
__device__ __forceinline__ void copy_rows(u32 dst, const u8* src, int lane) {
    constexpr int PPR = ROW_BYTES / 16;
#pragma unroll
    for (int p = lane; p < ROWS * PPR; p += 32) cp16(dst + (p / PPR) * DST_STRIDE + (p % PPR) * 16, src + 16 * p);
}

template <int NW>
__device__ __forceinline__ void lds(u32* w, const u8* p) {  // NW words from 16-byte (NW = 2: 8-byte) aligned shared memory
    if constexpr (NW == 1) {
        w[0] = *reinterpret_cast<const u32*>(p);
    } else if constexpr (NW == 2) {
        const uint2 v = *reinterpret_cast<const uint2*>(p);
        w[0] = v.x;
        w[1] = v.y;
    } else {
#pragma unroll
        for (int k = 0; k < NW / 4; ++k) {
            const uint4 v = reinterpret_cast<const uint4*>(p)[k];
            w[4 * k] = v.x;
            w[4 * k + 1] = v.y;
            w[4 * k + 2] = v.z;
            w[4 * k + 3] = v.w;
        }
    }
}

// S^T of a chunk's 16 8-bit K rows (stride RS, lane (gi, c): bytes QB*c.. of rows gi, gi + 8) against
// the query fragments qf (k_channel's 8-bit map).
template <int KIND>
__device__ __forceinline__ void scores8(const u8* st, int gi, int c, const u32 (*qf)[2], float* s) {
    u32 r0[KS], r1[KS];
    lds<KS>(r0, st + gi * RS + QB * c);
    lds<KS>(r1, st + (gi + 8) * RS + QB * c);
#pragma unroll
    for (int j = 0; j < KS; ++j) {
        u32 a0, a1, a2, a3;
        cvt4<KIND>(r0[j], a0, a2);
        cvt4<KIND>(r1[j], a1, a3);
        mma_f16(s, a0, a1, a2, a3, qf[j][0], qf[j][1]);
    }
}

// Scale of token `tok` of a chunk (per-token modes), of the chunk (per block) or of the head (static).
template <int MODE>
__device__ __forceinline__ float scale_at(const u8* sc, int tok, float stat) {
    if (MODE == 0) return stat;
    if (MODE == 1) return reinterpret_cast<const float*>(sc)[tok];
    if (MODE == 2) return half_to_float(reinterpret_cast<const u16*>(sc)[tok]);
    return reinterpret_cast<const float*>(sc)[0];
}

// cp.async of a chunk's scales: `lane0` is the first lane used, `base` the block's scales.
// `row`: the chunk's first token row in its block, head * PAGE + poff; `h`: the head.
template <int MODE>
__device__ __forceinline__ void copy_scales(u32 dst, const u8* base, i64 row, int h, int lane, int lane0) {
    if (MODE == 1) {  // 16 f32 = 4 x 16 bytes
        const int k = lane - lane0;
        if (k >= 0 && k < 4) cp16(dst + 16 * k, base + row * 4 + 16 * k);
    } else if (MODE == 2) {  // 16 f16 = 2 x 16 bytes
        const int k = lane - lane0;
        if (k >= 0 && k < 2) cp16(dst + 16 * k, base + row * 2 + 16 * k);
    } else if (MODE == 3) {
        if (lane == lane0) cp4(dst, base + h * 4);
    }
}

extern "C" __global__ void __launch_bounds__(NWARPS * 32, MIN_BLOCKS) kvq_decode8(
    const u16* __restrict__ q, i64 s_qb, i64 s_qh,            // [B, Hq, D] model dtype
    const u8* __restrict__ kd, const u8* __restrict__ vd,     // [NB, H, PAGE, D or DP] codes
    const u8* __restrict__ ks, const u8* __restrict__ vs,     // scales, per K_SCALE / V_SCALE (KIVI: planes)
    const u8* __restrict__ kz, const u8* __restrict__ vz,     // KIVI zero planes (unused for 8-bit)
    // each plane's block stride in bytes (a block's rows, [H, PAGE, ...], are contiguous; a tiered cache's
    // planes are views of its arena, whose blocks are further apart than their bytes); 0 for static scales
    i64 sb_kd, i64 sb_vd, i64 sb_ks, i64 sb_vs, i64 sb_kz, i64 sb_vz,
    const u8* __restrict__ khp, const u8* __restrict__ vhp,   // [NHP, H, PAGE, D] model dtype
    const int* __restrict__ tables, i64 s_tb,                 // [B, max_blocks] signed block ids
    const int* __restrict__ seq_lens,                         // [B]
    float* __restrict__ po, float* __restrict__ plse,         // [B, Hq, ST, D], [B, Hq, ST] (MODE 1, 2)
    u16* __restrict__ out, i64 s_ob, i64 s_oh,                // [B, Hq, D] (MODE 0, 2)
    float qk_scale, int H,
    int split_base, int ST,    // this launch's splits are [split_base, + gridDim.x) of ST partials a row
    // MODE 0: one split, write out; 1: write this launch's partials into po / plse; 2 (one split): po / plse
    // hold ST partials a row from earlier launches (a tiered cache's other tiers): merge them with this
    // launch's result by log-sum-exp and write out (no reduce launch)
    int mode,
    // ROT: the rotated queries (float32 [B, Hq, D] contiguous), K's and V's levels (f16 [2^BITS]),
    // the rotation's signs (float32 [D]); unused otherwise
    const float* __restrict__ qr, const u16* __restrict__ klut, const u16* __restrict__ vlut,
    const float* __restrict__ rsign) {
    extern __shared__ __align__(16) u8 smem[];
    const int sp = blockIdx.x, h = blockIdx.y, b = blockIdx.z, S = gridDim.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gi = lane >> 2, c = lane & 3;
    const int n = seq_lens[b];
    const int nch = (n + 15) >> 4;
    // chunks per split (each sequence splits its own length; KIVI: whole groups)
    const int cps = ((nch + S - 1) / S + PAIR - 1) / PAIR * PAIR;
    const int c0 = sp * cps, c1 = min(c0 + cps, nch);
    // this warp's chunks: units (chunks, KIVI: pairs) warp, warp + NWARPS, ... of the split
    int nw = 0;
    {
        const int len = c1 - c0, units = (len + PAIR - 1) / PAIR;
        if (len > 0 && units > warp) {
            nw = PAIR * ((units - warp + NWARPS - 1) / NWARPS);
            if (PAIR == 2 && (len & 1) && (units - 1) % NWARPS == warp) nw -= 1;  // a half group last
        }
    }
    const u32 cw = c0 + PAIR * warp;  // this warp's first chunk
    auto chunk_of = [&](int k) -> u32 { return cw + PAIR * NWARPS * (u32(k) / PAIR) + u32(k) % PAIR; };
    const int* table = tables + (i64)b * s_tb;
    u8* ring = smem + warp * (NSTAGES * STAGE);
    const u32 ring_s = smem_addr(ring);
#if !KIVI_BITS || K8
    const float ks_static = K_SCALE == 0 ? reinterpret_cast<const float*>(ks)[h] : 1.f;
#endif
#if !KIVI_BITS
    const float vs_static = V_SCALE == 0 ? reinterpret_cast<const float*>(vs)[h] : 1.f;
#endif

#if ROT
    // the levels, K's then V's (f16), after the rings
    u16* lut = reinterpret_cast<u16*>(smem + NWARPS * NSTAGES * STAGE);
    if (threadIdx.x < NLEV + VNLEV) lut[threadIdx.x] = threadIdx.x < NLEV ? klut[threadIdx.x] : vlut[threadIdx.x - NLEV];
    __syncthreads();
    // (ROT_REG_LUT: each codebook's magnitudes in registers; K8's K has none)
    const LutR klr = K_REG ? lutr_of<NLEV>(lut) : LutR{0u, 0u, 0u, 0u};
    const LutR vlr = V_REG ? lutr_of<VNLEV>(lut + NLEV) : LutR{0u, 0u, 0u, 0u};
#endif

    // ---- the query group as B fragments (k_channel's map): qf in f16 for the quantized
    // chunks, qh in the model dtype for the high-precision ones
    u32 qf[KS][2];
#if (HAS_HP && (MODEL_BF16 || (ROT && !K8))) || KC
    u32 qh[KS][2];  // (ROT: the plain query; qf holds the rotated one)
#elif HAS_HP
    u32(&qh)[KS][2] = qf;  // f16 model: the hp chunks use the same fragments
#endif
    {
        const u8* row = reinterpret_cast<const u8*>(q + (i64)b * s_qb + (i64)(h * GROUP + (gi < GROUP ? gi : 0)) * s_qh);
#pragma unroll
        for (int s = 0; s < KS; ++s) {
            const uint2 v = *reinterpret_cast<const uint2*>(row + 2 * k_channel(s, c));
            u32 p0, p1;
            pair_words(gi < GROUP ? v.x : 0u, gi < GROUP ? v.y : 0u, p0, p1);
#if ROT && !K8
            {  // the rotated query, channels (x, x+2) and (x+1, x+3) as KIVI's map pairs them
                const int x = k_channel(s, c);
                const float* r = qr + ((i64)b * (H * GROUP) + h * GROUP + (gi < GROUP ? gi : 0)) * D + x;
                const float4 w = gi < GROUP ? *reinterpret_cast<const float4*>(r) : make_float4(0.f, 0.f, 0.f, 0.f);
                qf[s][0] = pack_f16(w.x, w.z);
                qf[s][1] = pack_f16(w.y, w.w);
            }
#if HAS_HP || KC
            qh[s][0] = p0;
            qh[s][1] = p1;
#endif
#elif MODEL_BF16
            qf[s][0] = pack_f16(__uint_as_float(p0 << 16), __uint_as_float(p0 & 0xffff0000u));
            qf[s][1] = pack_f16(__uint_as_float(p1 << 16), __uint_as_float(p1 & 0xffff0000u));
#if HAS_HP
            qh[s][0] = p0;
            qh[s][1] = p1;
#endif
#else
            qf[s][0] = p0;
            qf[s][1] = p1;
#endif
        }
    }

    // ---- producer: the warp's chunks as items of the ring, in order: a quantized chunk is one item, a
    // high-precision chunk two (its K rows, then its V rows); item i -> stage i % NSTAGES (an empty group
    // past the end)
    int tb = 0, tb_k = -1;       // signed block ids of this warp's chunks 32 * tb_k + lane
    int ik = 0, ih = 0, is = 0;  // next item: chunk ik (hp: half ih) into stage is
    auto issue = [&]() {
        if (ik < nw) {
            if ((ik >> 5) != tb_k) {
                tb_k = ik >> 5;
                const int kk = (ik & ~31) + lane;
                tb = kk < nw ? table[chunk_of(kk) * 16u / PAGE] : 0;
            }
            const int blk = __shfl_sync(0xffffffffu, tb, ik & 31);
            const int poff = chunk_of(ik) * 16u % PAGE;
            const u32 st = ring_s + is * STAGE;
            if (lane == 0) *reinterpret_cast<int*>(ring + is * STAGE + BLK_OFF) = blk;
            if (!HAS_HP || blk >= 0) {
                const int k = ik;
                ik += KIVI_BITS && KIVI_STEP32 ? 2 : 1;
                const i64 bk = blk;
                const i64 row0 = (i64)h * PAGE + poff;  // the chunk's first row in its block
#if KIVI_BITS
                copy_rows<KROWB, RSK, QR>(st, kd + bk * sb_kd + row0 * KROWB, lane);
                copy_rows<VROWB, RSV, QR>(st + VR_OFF, vd + bk * sb_vd + row0 * VROWB, lane);
                // K: the scale and zero rows of the 32-token group (at its first chunk), or per token
                // (K_TOKEN: QR tokens' scales, then their zeros, f16 [QR][NG] each, like V's); V: QR tokens'
                if (ROT) {  // 16 tokens' K norms at KSC_OFF, then their V norms (f16, 32 bytes each; K8: V's)
                    if (lane < 4 && (!K8 || lane >= 2))
                        cp16(st + KSC_OFF + 16 * lane, (lane < 2 ? ks + bk * sb_ks : vs + bk * sb_vs) + row0 * 2 + 16 * (lane & 1));
                    if (KC && (k & 1) == 0) {  // the group's K mean row (f16 [D]) at KSC_OFF + 64
                        const i64 mrow = ((i64)h * (PAGE / 32) + poff / 32) * (2 * D);
#pragma unroll
                        for (int p = lane; p < D / 8; p += 32) cp16(st + KSC_OFF + 64 + 16 * p, kz + bk * sb_kz + mrow + 16 * p);
                    }
                } else if (K_TOKEN) {
#pragma unroll
                    for (int p = lane; p < QR * NG / 4; p += 32) {
                        const int half = p / (QR * NG / 8), col = (p % (QR * NG / 8)) * 16;
                        cp16(st + KSC_OFF + half * 2 * NG * QR + col,
                             (half ? kz + bk * sb_kz : ks + bk * sb_ks) + row0 * (2 * NG) + col);
                    }
                } else if ((k & 1) == 0) {
                    const i64 krow = ((i64)h * (PAGE / 32) + poff / 32) * (2 * D);
#pragma unroll
                    for (int p = lane; p < D / 4; p += 32) {
                        const int half = p / (D / 8), col = (p % (D / 8)) * 16;
                        cp16(st + KSC_OFF + half * 2 * D + col, (half ? kz + bk * sb_kz : ks + bk * sb_ks) + krow + col);
                    }
                }
#pragma unroll
                for (int p = lane; p < (ROT ? 0 : QR * NG / 4); p += 32) {  // 16-byte pieces of the scale rows, then the zeros'
                    const int half = p / (QR * NG / 8), col = (p % (QR * NG / 8)) * 16;
                    cp16(st + VSC_OFF + half * 2 * NG * QR + col,
                         (half ? vz + bk * sb_vz : vs + bk * sb_vs) + row0 * (2 * NG) + col);
                }
#else
                copy_rows<D, RS>(st, kd + bk * sb_kd + row0 * D, lane);
                copy_rows<D, RS>(st + 16 * RS, vd + bk * sb_vd + row0 * D, lane);
                copy_scales<K_SCALE>(st + SC_OFF, ks + bk * sb_ks, row0, h, lane, 0);
                copy_scales<V_SCALE>(st + SC_OFF + 64, vs + bk * sb_vs, row0, h, lane, 4);
#endif
            } else {
#if HAS_HP
                const i64 base = ((i64)((-blk - 1) * H + h) * PAGE + poff) * (2 * D);
                copy_rows<2 * D, RSH>(st, (ih ? vhp : khp) + base, lane);
#endif
                ik += ih;
                ih ^= 1;
            }
        }
        is = is + 1 == NSTAGES ? 0 : is + 1;
        cp_commit();
    };

    float m0 = NEG_INF, m1 = NEG_INF;  // running max of queries 2c, 2c+1 (log2 domain)
    float l0 = 0.f, l1 = 0.f;          // this lane's share of their running sums
    float acc[KS][4];
#pragma unroll
    for (int j = 0; j < KS; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
#if ROT && HAS_HP
    float acch[KS][4];  // the hp chunks' share, in the model's domain (acc sums the rotated one)
#pragma unroll
    for (int j = 0; j < KS; ++j) acch[j][0] = acch[j][1] = acch[j][2] = acch[j][3] = 0.f;
#endif
#if KIVI_BITS
    u32 qs[KS][2];                              // the group's K scales (and planes' 2^-(BITS m)) in the queries
    float zq0 = 0.f, zq1 = 0.f;                 // the group's K zero-point term, queries 2c, 2c+1
    float zacc[4] = {0.f, 0.f, 0.f, 0.f};       // V zero points: group gi (< NG), queries 2c, 2c+1
#endif

#if KIVI_BITS
    // a group's K scales into the query fragments (and the planes' 2^-(BITS m)), its zero points' term
    auto kivi_group = [&](const u8* st) {
        float zt[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < KS; ++j) {
            const int x = k_channel(j, c), m = j % PER;
            u32 sw[2], zw[2], s0, s1, z0, z1;
            lds<2>(sw, st + KSC_OFF + 2 * x);
            lds<2>(zw, st + KSC_OFF + 2 * D + 2 * x);
            pair_words(sw[0], sw[1], s0, s1);
            pair_words(zw[0], zw[1], z0, z1);
            if (m) {  // 2^-(BITS m), exact
                const u32 cm = ((15u - KIVI_BITS * m) << 10) * 0x00010001u;
                s0 = hmul2(s0, cm);
                s1 = hmul2(s1, cm);
            }
            qs[j][0] = hmul2(qf[j][0], s0);
            qs[j][1] = hmul2(qf[j][1], s1);
            mma_f16(zt, z0, z0, z1, z1, qf[j][0], qf[j][1]);  // every row the zero row
        }
        zq0 = zt[0] * qk_scale;
        zq1 = zt[1] * qk_scale;
    };
    // S^T of 16 token rows `kr` (codes straight into the MMAs; unit 2^-24 unless K_SUB)
    auto kivi_scores = [&](const u8* kr, float* s) {
        u32 r0[KW], r1[KW];
        lds<KW>(r0, kr + gi * RSK + KB * c);
        lds<KW>(r1, kr + (gi + 8) * RSK + KB * c);
#pragma unroll
        for (int w = 0; w < KW; ++w) {
            const u32 o0 = r0[w] >> 8, o1 = r1[w] >> 8;
#pragma unroll
            for (int m = 0; m < PER; ++m)
                mma_f16(s, plane<K_SUB>(r0[w], m), plane<K_SUB>(r1[w], m), plane<K_SUB>(o0, m),
                        plane<K_SUB>(o1, m), qs[w * PER + m][0], qs[w * PER + m][1]);
        }
    };
    // K per token (K_TOKEN): S^T of 16 token rows `kr`, their K codes dequantized in the fragments with the
    // tokens' scales and zeros `ksc` (f16 [QR][NG], then the zeros at + 2 NG QR bytes); exact unit
    auto token_scores = [&](const u8* kr, const u8* ksc, float* s) {
        constexpr int NGW = (NG + 1) / 2;
        u32 sa[NGW], sb[NGW], za[NGW], zb[NGW];  // tokens gi (a) and gi + 8 (b), every group
        lds<NGW>(sa, ksc + gi * 2 * NG);
        lds<NGW>(sb, ksc + (gi + 8) * 2 * NG);
        lds<NGW>(za, ksc + 2 * NG * QR + gi * 2 * NG);
        lds<NGW>(zb, ksc + 2 * NG * QR + (gi + 8) * 2 * NG);
        auto bcast = [](const u32* w, int g) { return __byte_perm(w[g / 2], 0u, (g & 1) ? 0x3232 : 0x1010); };
        constexpr u32 MASK = ((1u << KIVI_BITS) - 1u) * 0x00010001u;
#pragma unroll
        for (int u = 0; u < DP / 16; ++u) {
            const u32 w0 = *reinterpret_cast<const u32*>(kr + gi * RSK + 16 * u + 4 * c);
            const u32 w1 = *reinterpret_cast<const u32*>(kr + (gi + 8) * RSK + 16 * u + 4 * c);
            const u32 o0 = w0 >> 8, o1 = w1 >> 8;
#pragma unroll
            for (int m = 0; m < PER; ++m) {
                const int g = (m * DP + 16 * u) / 32;
                // plane m's bits in an f16 of exponent 25 - BITS m: minus that power of two, the code itself
                const u32 magic = ((25u - KIVI_BITS * m) << 10) * 0x00010001u;
                auto deq = [&](u32 x, u32 sc, u32 z) { return hfma2(hsub2((x & (MASK << (KIVI_BITS * m))) | magic, magic), sc, z); };
                const u32 s0 = bcast(sa, g), s1 = bcast(sb, g), z0 = bcast(za, g), z1 = bcast(zb, g);
                mma_f16(s, deq(w0, s0, z0), deq(w1, s1, z1), deq(o0, s0, z0), deq(o1, s1, z1),
                        qf[u * PER + m][0], qf[u * PER + m][1]);
            }
        }
    };
#if ROT
    constexpr int DHW = DH ? DH : 4, VDHW = VDH ? VDH : 4;  // (4-bit codes: no high plane; its reads are dummies)
    // S^T of 16 token rows `kr` in the rotated domain: levels (KIVI's K map) against the rotated query
    auto rot_scores = [&](const u8* kr, float* s) {
        u32 r0[KW], r1[KW];
        lds<KW>(r0, kr + gi * RSK + KB * c);
        lds<KW>(r1, kr + (gi + 8) * RSK + KB * c);
#pragma unroll
        for (int w = 0; w < KW; ++w) {
            const int x = KB * c + 4 * w, hb = x / DHW;  // the high plane's word of these channels, its bit
            const u32 y0 = DH ? *reinterpret_cast<const u32*>(kr + gi * RSK + DP + x % DHW) : 0u;
            const u32 y1 = DH ? *reinterpret_cast<const u32*>(kr + (gi + 8) * RSK + DP + x % DHW) : 0u;
            if constexpr (K_REG) {
                const CodeWord w0 = KIVI_BITS == 3 ? prep3(r0[w], y0, hb) : prep4(r0[w]);
                const CodeWord w1 = KIVI_BITS == 3 ? prep3(r1[w], y1, hb) : prep4(r1[w]);
#pragma unroll
                for (int m = 0; m < PER; ++m) {
                    u32 a0, a1, a2, a3;  // rows gi and gi + 8, codes of bytes 0 and 2 then 1 and 3
                    levels_field<KIVI_BITS>(klr, w0, m, a0, a2);
                    levels_field<KIVI_BITS>(klr, w1, m, a1, a3);
                    mma_f16(s, a0, a1, a2, a3, qf[w * PER + m][0], qf[w * PER + m][1]);
                }
                continue;
            }
            const u32 o0 = r0[w] >> 8, o1 = r1[w] >> 8, p0 = y0 >> 8, p1 = y1 >> 8;
#pragma unroll
            for (int m = 0; m < PER; ++m)
                mma_f16(s, levels2<KIVI_BITS>(lut, r0[w], y0, m, hb), levels2<KIVI_BITS>(lut, r1[w], y1, m, hb),
                        levels2<KIVI_BITS>(lut, o0, p0, m, hb), levels2<KIVI_BITS>(lut, o1, p1, m, hb),
                        qf[w * PER + m][0], qf[w * PER + m][1]);
        }
    };
#if KC
    // the group's mean row against the plain query, times the scores' scale: a constant per query
    auto rot_group = [&](const u8* st) {
        float zt[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < KS; ++j) {
            u32 zw[2], z0, z1;
            lds<2>(zw, st + KSC_OFF + 64 + 2 * k_channel(j, c));
            pair_words(zw[0], zw[1], z0, z1);
#if MODEL_BF16  // the mean in the plain query's bf16 (the rounding of a bf16 model's own K)
            z0 = pack_bf16(half_to_float(u16(z0)), half_to_float(u16(z0 >> 16)));
            z1 = pack_bf16(half_to_float(u16(z1)), half_to_float(u16(z1 >> 16)));
#endif
            mma_hp(zt, z0, z0, z1, z1, qh[j][0], qh[j][1]);  // every row the mean row
        }
        zq0 = zt[0] * qk_scale;
        zq1 = zt[1] * qk_scale;
    };
#endif
    // O^T (rotated) += V^T . P^T over 16 token rows `vr`: levels (KIVI's V map), P already times the V norms
    auto rot_pv = [&](const u8* vr, u32 pb0, u32 pb1) {
        const u16* vl = lut + NLEV;
        u32 v0[NU], v1[NU], v8[NU], v9[NU], h0[NU], h1[NU], h8[NU], h9[NU];
        auto word = [&](int row, int x) { return *reinterpret_cast<const u32*>(vr + row * RSV + x); };
#pragma unroll
        for (int u = 0; u < NU; ++u) {
            const int x = 4 * gi + 32 * u, xh = VDP + x % VDHW;
            v0[u] = word(2 * c, x);
            v1[u] = word(2 * c + 1, x);
            v8[u] = word(2 * c + 8, x);
            v9[u] = word(2 * c + 9, x);
            h0[u] = VDH ? word(2 * c, xh) : 0u;
            h1[u] = VDH ? word(2 * c + 1, xh) : 0u;
            h8[u] = VDH ? word(2 * c + 8, xh) : 0u;
            h9[u] = VDH ? word(2 * c + 9, xh) : 0u;
        }
#pragma unroll
        for (int u = 0; u < NU; ++u) {
            const int hb = (4 * gi + 32 * u) / VDHW;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const u32 sel = (2 * e) | ((2 * e + 1) << 4) | ((2 * e + 4) << 8) | ((2 * e + 5) << 12);
                const u32 tA = __byte_perm(v0[u], v1[u], sel), tB = __byte_perm(v8[u], v9[u], sel);
                const u32 yA = __byte_perm(h0[u], h1[u], sel), yB = __byte_perm(h8[u], h9[u], sel);
                if constexpr (V_REG) {
                    const CodeWord wA = V_BITS == 3 ? prep3(tA, yA, hb) : prep4(tA);
                    const CodeWord wB = V_BITS == 3 ? prep3(tB, yB, hb) : prep4(tB);
#pragma unroll
                    for (int m = 0; m < VPER; ++m) {
                        u32 a0, a1, a2, a3;
                        levels_field<V_BITS>(vlr, wA, m, a0, a1);
                        levels_field<V_BITS>(vlr, wB, m, a2, a3);
                        mma_f16(acc[(u * VPER + m) * 2 + e], a0, a1, a2, a3, pb0, pb1);
                    }
                    continue;
                }
                const u32 oA = tA >> 8, oB = tB >> 8, pA = yA >> 8, pB = yB >> 8;
#pragma unroll
                for (int m = 0; m < VPER; ++m)
                    mma_f16(acc[(u * VPER + m) * 2 + e], levels2<V_BITS>(vl, tA, yA, m, hb),
                            levels2<V_BITS>(vl, oA, pA, m, hb), levels2<V_BITS>(vl, tB, yB, m, hb),
                            levels2<V_BITS>(vl, oB, pB, m, hb), pb0, pb1);
            }
        }
    };
#endif
    // O^T += V^T . P^T over 16 token rows `vr` with their V scales `vsc` and zeros `vzr` ([16][NG] f16);
    // pb0/pb1: the plain P^T fragments (lane: query gi, tokens 2c, 2c+1 | 2c+8, 2c+9)
    auto kivi_pv = [&](const u8* vr, const u8* vsc, const u8* vzr, u32 pb0, u32 pb1) {
        constexpr int NGW = (NG + 1) / 2;
        u32 s0[NGW], s1[NGW], s8[NGW], s9[NGW];  // the V scales of tokens 2c, 2c+1, 2c+8, 2c+9
        lds<NGW>(s0, vsc + (2 * c) * 2 * NG);
        lds<NGW>(s1, vsc + (2 * c + 1) * 2 * NG);
        lds<NGW>(s8, vsc + (2 * c + 8) * 2 * NG);
        lds<NGW>(s9, vsc + (2 * c + 9) * 2 * NG);
        // P^T times the tokens' V scale of channel group g and bit plane m's 2^-(BITS m), f16x2 products
        auto scaled = [&](int g, int m, u32* pb) {
            const u32 hs = (g & 1) ? 0x7632 : 0x5410;
            u32 sA = __byte_perm(s0[g / 2], s1[g / 2], hs), sB = __byte_perm(s8[g / 2], s9[g / 2], hs);
            if (m) {  // 2^-(BITS m), exact
                const u32 cm = ((15u - KIVI_BITS * m) << 10) * 0x00010001u;
                sA = hmul2(sA, cm);
                sB = hmul2(sB, cm);
            }
            pb[0] = hmul2(pb0, sA);
            pb[1] = hmul2(pb1, sB);
        };
        u32 pb[NARROW ? 1 : NG][2];  // per channel group (wider rows), before the zero points as always
        if constexpr (!NARROW) {
#pragma unroll
            for (int g = 0; g < NG; ++g) scaled(g, g / NU, pb[g]);
        }
        {  // zero points: A rows = groups (row gi: group gi's zeros of tokens 2c, 2c+1 | 2c+8, 2c+9)
            const u16* vz16 = reinterpret_cast<const u16*>(vzr);
            u32 za = 0u, zb = 0u;
            if (gi < NG) {
                za = vz16[(2 * c) * NG + gi] | (u32(vz16[(2 * c + 1) * NG + gi]) << 16);
                zb = vz16[(2 * c + 8) * NG + gi] | (u32(vz16[(2 * c + 9) * NG + gi]) << 16);
            }
            mma_f16(zacc, za, 0u, zb, 0u, pb0, pb1);
        }
        if constexpr (NARROW) {  // m-tile m = plane m: bytes 2gi, 2gi + 1 of tokens 2c, 2c+1 | 2c+8, 2c+9
            auto two = [&](int r0, int r1) {
                return u32(*reinterpret_cast<const u16*>(vr + r0 * RSV + 2 * gi)) |
                       (u32(*reinterpret_cast<const u16*>(vr + r1 * RSV + 2 * gi)) << 16);
            };
            const u32 tA = two(2 * c, 2 * c + 1), tB = two(2 * c + 8, 2 * c + 9), oA = tA >> 8, oB = tB >> 8;
#pragma unroll
            for (int m = 0; m < PER; ++m) {
                u32 pm[2];
                scaled(m * DP / 32, m, pm);
                mma_f16(acc[m], plane<V_SUB>(tA, m), plane<V_SUB>(oA, m), plane<V_SUB>(tB, m), plane<V_SUB>(oB, m),
                        pm[0], pm[1]);
            }
        } else {
            u32 v0[NU], v1[NU], v8[NU], v9[NU];
#pragma unroll
            for (int u = 0; u < NU; ++u) {
                const int x = 4 * gi + 32 * u;
                v0[u] = *reinterpret_cast<const u32*>(vr + (2 * c) * RSV + x);
                v1[u] = *reinterpret_cast<const u32*>(vr + (2 * c + 1) * RSV + x);
                v8[u] = *reinterpret_cast<const u32*>(vr + (2 * c + 8) * RSV + x);
                v9[u] = *reinterpret_cast<const u32*>(vr + (2 * c + 9) * RSV + x);
            }
#pragma unroll
            for (int u = 0; u < NU; ++u) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    // bytes 2e, 2e+1 of the two tokens of each pair: [A.2e, A.2e+1, B.2e, B.2e+1]
                    const u32 sel = (2 * e) | ((2 * e + 1) << 4) | ((2 * e + 4) << 8) | ((2 * e + 5) << 12);
                    const u32 tA = __byte_perm(v0[u], v1[u], sel), tB = __byte_perm(v8[u], v9[u], sel);
                    const u32 oA = tA >> 8, oB = tB >> 8;
#pragma unroll
                    for (int m = 0; m < PER; ++m) {
                        const int g = m * NU + u;  // channel group of this m-tile
                        mma_f16(acc[(u * PER + m) * 2 + e], plane<V_SUB>(tA, m), plane<V_SUB>(oA, m),
                                plane<V_SUB>(tB, m), plane<V_SUB>(oB, m), pb[g][0], pb[g][1]);
                    }
                }
            }
        }
    };
#endif

#pragma unroll
    for (int k = 0; k < NSTAGES - 1; ++k) issue();

    int cs = 0;  // stage of the next item to read
    auto next_item = [&]() {  // wait for it; refill the stage read before it
        cp_wait<NSTAGES - 2>();
        __syncwarp();
        issue();
        const u8* st = ring + cs * STAGE;
        cs = cs + 1 == NSTAGES ? 0 : cs + 1;
        return st;
    };
    for (int k = 0; k < nw; ++k) {
        const u8* st = next_item();
        const int t0 = chunk_of(k) * 16;
        const bool ok0 = t0 + gi < n, ok1 = t0 + gi + 8 < n;
        const bool hp = HAS_HP && *reinterpret_cast<const int*>(st + BLK_OFF) < 0;
#if KIVI_BITS && KIVI_STEP32
        if (!hp) {  // a whole 32-token group: both halves' scores, one softmax, both PV halves
            kivi_group(st);
            float sa[4] = {0.f, 0.f, 0.f, 0.f}, sb[4] = {0.f, 0.f, 0.f, 0.f};
            kivi_scores(st, sa);
            kivi_scores(st + 16 * RSK, sb);
            const float fk = K_SUB ? qk_scale : qk_scale * UNIT;
            const bool ok2 = t0 + 16 + gi < n, ok3 = t0 + 24 + gi < n;  // (a half group's second half: none)
            const float x0 = ok0 ? fmaf(sa[0], fk, zq0) : NEG_INF, x1 = ok0 ? fmaf(sa[1], fk, zq1) : NEG_INF;
            const float x2 = ok1 ? fmaf(sa[2], fk, zq0) : NEG_INF, x3 = ok1 ? fmaf(sa[3], fk, zq1) : NEG_INF;
            const float x4 = ok2 ? fmaf(sb[0], fk, zq0) : NEG_INF, x5 = ok2 ? fmaf(sb[1], fk, zq1) : NEG_INF;
            const float x6 = ok3 ? fmaf(sb[2], fk, zq0) : NEG_INF, x7 = ok3 ? fmaf(sb[3], fk, zq1) : NEG_INF;
            float mx0 = fmaxf(fmaxf(x0, x2), fmaxf(x4, x6)), mx1 = fmaxf(fmaxf(x1, x3), fmaxf(x5, x7));
#pragma unroll
            for (int o = 4; o < 32; o <<= 1) {
                mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o));
                mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o));
            }
            const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
            const float al0 = ex2(m0 - mn0), al1 = ex2(m1 - mn1);
            const bool grew = mn0 != m0 || mn1 != m1;
            m0 = mn0;
            m1 = mn1;
            const float p0 = ex2(x0 - mn0), p1 = ex2(x1 - mn1), p2 = ex2(x2 - mn0), p3 = ex2(x3 - mn1);
            const float p4 = ex2(x4 - mn0), p5 = ex2(x5 - mn1), p6 = ex2(x6 - mn0), p7 = ex2(x7 - mn1);
            l0 = l0 * al0 + (p0 + p2) + (p4 + p6);
            l1 = l1 * al1 + (p1 + p3) + (p5 + p7);
            if (!LAZY_RESCALE || __any_sync(0xffffffffu, grew)) {
#pragma unroll
                for (int j = 0; j < KS; ++j) {
                    acc[j][0] *= al0;
                    acc[j][1] *= al1;
                    acc[j][2] *= al0;
                    acc[j][3] *= al1;
                }
                zacc[0] *= al0;
                zacc[1] *= al1;
            }
            kivi_pv(st + VR_OFF, st + VSC_OFF, st + VZ_OFF, trans8x8(pack_f16(p0, p1)), trans8x8(pack_f16(p2, p3)));
            kivi_pv(st + VR_OFF + 16 * RSV, st + VSC_OFF + 32 * NG, st + VZ_OFF + 32 * NG,
                    trans8x8(pack_f16(p4, p5)), trans8x8(pack_f16(p6, p7)));
            ++k;  // the group's second chunk (the loop adds the first)
            continue;
        }
#endif

        // S^T = K . Q^T: s[0..1] token gi, queries 2c, 2c+1; s[2..3] token gi + 8
        float s[4] = {0.f, 0.f, 0.f, 0.f};
        float fk0 = qk_scale, fk1 = qk_scale, fv0 = 1.f, fv1 = 1.f;
#if KIVI_BITS
        float zk0 = 0.f, zk1 = 0.f;  // K zero-point term of queries 2c, 2c+1
#endif
        if (!hp) {
#if KIVI_BITS
            if (ROT) {  // the V norms scale P rows; K: its norms scale S rows, or (K8) a static scale
                const u16* nrm = reinterpret_cast<const u16*>(st + KSC_OFF);
#if K8
                scores8<K_KIND>(st, gi, c, qf, s);  // FP8 K, not rotated: the 8-bit path, the plain query
                fk0 = fk1 = qk_scale * ks_static;
#elif ROT
#if KC
                if ((k & 1) == 0) rot_group(st);  // a group's first chunk: its mean's term
#endif
                rot_scores(st, s);  // against the rotated query
                zk0 = zq0;
                zk1 = zq1;
                fk0 = qk_scale * half_to_float(nrm[gi]);
                fk1 = qk_scale * half_to_float(nrm[gi + 8]);
#endif
                fv0 = half_to_float(nrm[16 + gi]);
                fv1 = half_to_float(nrm[24 + gi]);
            } else if (K_TOKEN) {
                token_scores(st, st + KSC_OFF, s);
            } else {
                if ((k & 1) == 0) kivi_group(st);  // a group's first chunk: its scales into the queries
                kivi_scores(st, s);
                if (!K_SUB) fk0 = fk1 = qk_scale * UNIT;
                zk0 = zq0;
                zk1 = zq1;
            }
#else
            scores8<K_KIND>(st, gi, c, qf, s);
            fk0 *= scale_at<K_SCALE>(st + SC_OFF, gi, ks_static);
            fk1 *= scale_at<K_SCALE>(st + SC_OFF, gi + 8, ks_static);
            fv0 = scale_at<V_SCALE>(st + SC_OFF + 64, gi, vs_static);
            fv1 = scale_at<V_SCALE>(st + SC_OFF + 64, gi + 8, vs_static);
#endif
        } else {
#if HAS_HP
#pragma unroll
            for (int j = 0; j < KS; ++j) {
                const int x = 2 * k_channel(j, c);
                const uint2 w0 = *reinterpret_cast<const uint2*>(st + gi * RSH + x);
                const uint2 w1 = *reinterpret_cast<const uint2*>(st + (gi + 8) * RSH + x);
                u32 a0, a1, a2, a3;
                pair_words(w0.x, w0.y, a0, a2);
                pair_words(w1.x, w1.y, a1, a3);
                mma_hp(s, a0, a1, a2, a3, qh[j][0], qh[j][1]);
            }
#endif
        }

        // online softmax over this chunk's 16 tokens
#if KIVI_BITS
        const float x0 = ok0 ? fmaf(s[0], fk0, zk0) : NEG_INF, x1 = ok0 ? fmaf(s[1], fk0, zk1) : NEG_INF;
        const float x2 = ok1 ? fmaf(s[2], fk1, zk0) : NEG_INF, x3 = ok1 ? fmaf(s[3], fk1, zk1) : NEG_INF;
#else
        const float x0 = ok0 ? s[0] * fk0 : NEG_INF, x1 = ok0 ? s[1] * fk0 : NEG_INF;
        const float x2 = ok1 ? s[2] * fk1 : NEG_INF, x3 = ok1 ? s[3] * fk1 : NEG_INF;
#endif
        float mx0 = fmaxf(x0, x2), mx1 = fmaxf(x1, x3);
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o));
        }
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        const float al0 = ex2(m0 - mn0), al1 = ex2(m1 - mn1);
        const bool grew = mn0 != m0 || mn1 != m1;  // else al0 = al1 = 1 exactly
        m0 = mn0;
        m1 = mn1;
        const float p0 = ex2(x0 - mn0), p1 = ex2(x1 - mn1), p2 = ex2(x2 - mn0), p3 = ex2(x3 - mn1);
        l0 = l0 * al0 + p0 + p2;
        l1 = l1 * al1 + p1 + p3;
        if (!LAZY_RESCALE || __any_sync(0xffffffffu, grew)) {  // the running max moved for some query
#pragma unroll
            for (int j = 0; j < KS; ++j) {
                acc[j][0] *= al0;
                acc[j][1] *= al1;
                acc[j][2] *= al0;
                acc[j][3] *= al1;
            }
#if KIVI_BITS
            zacc[0] *= al0;
            zacc[1] *= al1;
#endif
#if ROT && HAS_HP
#pragma unroll
            for (int j = 0; j < KS; ++j) {
                acch[j][0] *= al0;
                acch[j][1] *= al1;
                acch[j][2] *= al0;
                acch[j][3] *= al1;
            }
#endif
        }

        // O^T += V^T . P^T, P^T from the S^T fragment (8-bit: V's scales folded into P)
        if (!hp) {
            const u32 pb0 = trans8x8(pack_f16(p0 * fv0, p1 * fv0));
            const u32 pb1 = trans8x8(pack_f16(p2 * fv1, p3 * fv1));
#if ROT
            rot_pv(st + VR_OFF, pb0, pb1);
#elif KIVI_BITS
            kivi_pv(st + VR_OFF, st + VSC_OFF, st + VZ_OFF, pb0, pb1);
#else
            u32 v0[VB / 4], v1[VB / 4], v8[VB / 4], v9[VB / 4];
            lds<VB / 4>(v0, st + (16 + 2 * c) * RS + VB * gi);
            lds<VB / 4>(v1, st + (17 + 2 * c) * RS + VB * gi);
            lds<VB / 4>(v8, st + (24 + 2 * c) * RS + VB * gi);
            lds<VB / 4>(v9, st + (25 + 2 * c) * RS + VB * gi);
#pragma unroll
            for (int j = 0; j < KS; ++j) {
                const int w = j >> 1, bb = (j & 1) * 2;
                const u32 sel = bb | ((bb + 4) << 4) | ((bb + 1) << 8) | ((bb + 5) << 12);
                u32 a0, a1, a2, a3;
                cvt4<V_KIND>(__byte_perm(v0[w], v1[w], sel), a0, a1);
                cvt4<V_KIND>(__byte_perm(v8[w], v9[w], sel), a2, a3);
                mma_f16(acc[j], a0, a1, a2, a3, pb0, pb1);
            }
#endif
        } else {
#if HAS_HP
#if MODEL_BF16 && KIVI_BITS
            // in the unit of the quantized chunks' sums (2^-24 with subnormal V codes; exact in bf16)
            constexpr float PU = V_SUB || ROT ? 1.f : 1.f / UNIT;
            const u32 pb0 = trans8x8(pack_bf16(p0 * PU, p1 * PU)), pb1 = trans8x8(pack_bf16(p2 * PU, p3 * PU));
#elif MODEL_BF16
            const u32 pb0 = trans8x8(pack_bf16(p0, p1)), pb1 = trans8x8(pack_bf16(p2, p3));
#else
            const u32 pb0 = trans8x8(pack_f16(p0, p1)), pb1 = trans8x8(pack_f16(p2, p3));
#endif
            const u8* vr = next_item();  // the chunk's V rows
#pragma unroll
            for (int j = 0; j < KS; ++j) {  // channels (x, x+1) of tokens 2c, 2c+1, 2c+8, 2c+9
                const int x = 2 * v_channel(j, gi);
                const u32 w0 = *reinterpret_cast<const u32*>(vr + (2 * c) * RSH + x);
                const u32 w1 = *reinterpret_cast<const u32*>(vr + (2 * c + 1) * RSH + x);
                const u32 w8 = *reinterpret_cast<const u32*>(vr + (2 * c + 8) * RSH + x);
                const u32 w9 = *reinterpret_cast<const u32*>(vr + (2 * c + 9) * RSH + x);
#if ROT
                float* a = acch[j];  // (the model's domain)
#else
                float* a = acc[j];
#endif
                mma_hp(a, __byte_perm(w0, w1, 0x5410), __byte_perm(w0, w1, 0x7632),
                       __byte_perm(w8, w9, 0x5410), __byte_perm(w8, w9, 0x7632), pb0, pb1);
            }
#endif
        }
    }
    cp_wait<0>();

#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, o);
        l1 += __shfl_xor_sync(0xffffffffu, l1, o);
    }

    // ---- merge the warps: ms/ls [NWARPS][8], os [NWARPS][8][D] (KIVI: zs [NWARPS][8][NG]) over the idle rings
    __syncthreads();
    float* ms = reinterpret_cast<float*>(smem);
    float* ls = ms + NWARPS * 8;
    float* os = ls + NWARPS * 8;
    float* zs = os + NWARPS * 8 * D;  // KIVI: V zero-point sums [NWARPS][8][NG]
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const int qq = 2 * c + e;
        if (qq < GROUP) {
            float* dst = os + (warp * 8 + qq) * D;
#if KIVI_BITS
            constexpr float VU = V_SUB || ROT ? 1.f : UNIT;
            if (!ROT && gi < NG) zs[(warp * 8 + qq) * NG + gi] = zacc[e];
#else
            constexpr float VU = 1.f;
#endif
#pragma unroll
            for (int j = 0; j < KS; ++j) {
                const int ch = v_channel(j, gi);
                dst[ch] = acc[j][e] * VU;
                dst[ch + 1] = acc[j][2 + e] * VU;
            }
            if (gi == 0) {
                ms[warp * 8 + qq] = e ? m1 : m0;
                ls[warp * 8 + qq] = e ? l1 : l0;
            }
        }
    }
#if ROT
    // back from the rotated domain: this warp's query rows (the first GROUP of its 8) get H (in-place
    // butterflies), then the signs and 1/sqrt(D) (R^T = diag(signs) H), then the hp chunks' share
    __syncwarp();
    {
        float* rows = os + warp * 8 * D;
        for (int hh = 1; hh < D; hh <<= 1) {
            for (int p = lane; p < GROUP * D / 2; p += 32) {
                const int r = p / (D / 2), k = p % (D / 2);
                float* x = rows + r * D + (k / hh) * 2 * hh + (k % hh);
                const float a = x[0], bb = x[hh];
                x[0] = a + bb;
                x[hh] = a - bb;
            }
            __syncwarp();
        }
        const float inv = rsqrtf(float(D));
        for (int p = lane; p < GROUP * D; p += 32) rows[p] *= rsign[p % D] * inv;
        __syncwarp();
#if HAS_HP
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int qq = 2 * c + e;
            if (qq < GROUP) {
#pragma unroll
                for (int j = 0; j < KS; ++j) {
                    const int ch = v_channel(j, gi);
                    rows[qq * D + ch] += acch[j][e];
                    rows[qq * D + ch + 1] += acch[j][2 + e];
                }
            }
        }
#endif
    }
#endif
    __syncthreads();
    const int Hq = H * GROUP;
    for (int e = threadIdx.x; e < GROUP * D; e += NWARPS * 32) {
        const int qq = e / D, ch = e % D;
        float M = NEG_INF;
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) M = fmaxf(M, ms[w * 8 + qq]);
        float L = 0.f, O = 0.f;
        if (M != NEG_INF) {
#pragma unroll
            for (int w = 0; w < NWARPS; ++w) {
                const float f = ex2(ms[w * 8 + qq] - M);
                L += ls[w * 8 + qq] * f;
#if KIVI_BITS && !ROT
                O += (os[(w * 8 + qq) * D + ch] + zs[(w * 8 + qq) * NG + ch / 32]) * f;
#else
                O += os[(w * 8 + qq) * D + ch] * f;
#endif
            }
        }
        const float o = L > 0.f ? O / L : 0.f;
        const int hq = h * GROUP + qq;
        if (mode == 2) {
            const i64 row0 = ((i64)b * Hq + hq) * ST;
            const float lse = L > 0.f ? M + __log2f(L) : NEG_INF;
            float mm = lse;
            for (int s = 0; s < ST; ++s) mm = fmaxf(mm, plse[row0 + s]);
            float acc = 0.f, wsum = 0.f;
            if (mm != NEG_INF) {
                wsum = lse != NEG_INF ? ex2(lse - mm) : 0.f;
                acc = o * wsum;
                for (int s = 0; s < ST; ++s) {
                    const float ls_ = plse[row0 + s];
                    const float w = ls_ != NEG_INF ? ex2(ls_ - mm) : 0.f;
                    acc += po[(row0 + s) * D + ch] * w;
                    wsum += w;
                }
            }
            out[(i64)b * s_ob + (i64)hq * s_oh + ch] = float_to_model(wsum > 0.f ? acc / wsum : 0.f);
        } else if (mode == 0) {
            out[(i64)b * s_ob + (i64)hq * s_oh + ch] = float_to_model(o);
        } else {
            const i64 row = ((i64)b * Hq + hq) * ST + split_base + sp;
            po[row * D + ch] = o;
            if (ch == 0) plse[row] = L > 0.f ? M + __log2f(L) : NEG_INF;
        }
    }
}
