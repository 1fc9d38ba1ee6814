// Block seal in CUDA: quantize whole [PAGE, D] tiles of K and V (the high-precision copy
// of a cache block, or a prefill chunk's whole blocks) into q blocks, for the formats
// that are sealed per block: KIVI K (scale and zero per channel over 32 tokens), KIVI V
// (per token over 32 channels) and per-block scales (FP8 e4m3 / e5m2, INT8).  Bit for
// bit the reference's arithmetic (kvq.formats.reference.quantize): fp32 values,
// correctly rounded divisions (KIVI codes: a reciprocal product and one fma correction, which
// gives the correctly rounded quotient, see kivi_code), round-half-even codes, scales rounded to their dtype
// before the codes are computed with them, saturating FP8 conversions.
//
// Compiled at run time (NVRTC) with these macros, set by seal.py:
//   HEAD_DIM, PAGE   tile shape (PAGE a multiple of 32 where a role is KIVI)
//   MODEL_BF16       1: source tiles are bf16, 0: f16
//   K_FMT, V_FMT     3 = per-block scale, 4 = KIVI K, 5 = KIVI V, 0 = the role is not sealed here
//   K_BITS, V_BITS   KIVI bits (4 or 2); 8 for per-block
//   K_KIND, V_KIND   per-block codes: 0 = e4m3, 1 = e5m2, 2 = int8
//   K_QMAX, V_QMAX   the codes' largest magnitude (float literal)
//   NT               threads per CTA (a multiple of 32)
//
// Grid (tile slots, KV heads, roles): a CTA walks tiles blockIdx.x, + gridDim.x, ... below `n` (a
// decode step's list is padded to the batch with q block -1, and its few real seals come first: a
// grid of the padded length spent most of its CTAs reading a -1; a prefill's launch has a CTA per
// tile: many small CTAs, 8 per SM, overlap one another's loads and compute best).
//
// KIVI: a CTA's tiles are cut into chunks of 32 rows (a K group; 32 V rows) and each chunk into D
// "slots" of 16 source words (32 values); thread t takes the slots t, t + NT, ... of the CTA's
// chunks in order, and loads the next slot's words (registers) before it computes the current one.
// No CTA-wide barrier: the threads that exchange data are lanes of one warp.  The codes are the
// low bits of fl(y + 1.5 * 2^23) (no cvt / rint: conversions issue at 1/8 of the fp32 rate), min and
// max are taken on packed bf16x2 / f16x2 words, and the quotients come from the reciprocal with one
// fma correction, no division and no branch (kivi_code).
//   KIVI K: a slot is a channel pair (2p, 2p + 1) and its planar partners (+ DP, ...: exactly the
//     channels of output bytes 2p, 2p + 1) over every TS-th token of the group; the TS lanes of a
//     pair reduce min / max with shuffles, each lane computes one channel's scale and zero and
//     shares them; the codes of a token's two output bytes are packed in registers and stored as
//     one u16.
//   KIVI V: a slot is a (token, 32-channel group), read as four 16-byte loads; its 32 codes go to
//     the warp's shared memory in channel order, and after a __syncwarp each lane packs its row's
//     planar bytes [4 * BITS * g, + 4 * BITS) from them (one 16- or 8-byte store).
//   Per block: a CTA per tile: a CTA-wide absmax, then codes.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;

#ifndef NT
#define NT 128
#endif
#ifndef MODEL_BF16
#define MODEL_BF16 1
#endif

constexpr int D = HEAD_DIM;
constexpr u32 FULL = 0xffffffffu;
static_assert(NT % 32 == 0, "NT: whole warps");

// The two values of a source word (low half: the lower channel / earlier element).
__device__ __forceinline__ float lo_f32(u32 w) {
#if MODEL_BF16
    return __uint_as_float(w << 16);
#else
    float f;
    asm("{ .reg .f16 a, b;\n mov.b32 {a, b}, %1;\n cvt.f32.f16 %0, a; }" : "=f"(f) : "r"(w));
    return f;
#endif
}
__device__ __forceinline__ float hi_f32(u32 w) {
#if MODEL_BF16
    return __uint_as_float(w & 0xffff0000u);
#else
    float f;
    asm("{ .reg .f16 a, b;\n mov.b32 {a, b}, %1;\n cvt.f32.f16 %0, b; }" : "=f"(f) : "r"(w));
    return f;
#endif
}
__device__ __forceinline__ float to_f32(u16 v) { return lo_f32(v); }
// Elementwise min / max of two source words: exact (the fp32 min / max of the converted values;
// like fminf, a NaN loses to a number).
#if MODEL_BF16
#define PAIR_TYPE "bf16x2"
#else
#define PAIR_TYPE "f16x2"
#endif
__device__ __forceinline__ u32 min2(u32 a, u32 b) {
    u32 r;
    asm("min." PAIR_TYPE " %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
__device__ __forceinline__ u32 max2(u32 a, u32 b) {
    u32 r;
    asm("max." PAIR_TYPE " %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
__device__ __forceinline__ u16 f32_to_f16(float x) {
    u16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("{ .reg .f16 t;\n mov.b16 t, %1;\n cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ float safe(float s) { return s == 0.f ? 1.f : s; }
// Correctly rounded x / y and x * y with subnormal operands and results kept (no .ftz).
__device__ __forceinline__ float div_exact(float x, float y) {
    float r;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(y));
    return r;
}
__device__ __forceinline__ float mul_exact(float x, float y) {
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(y));
    return r;
}

// Two in-range fp32 values -> two FP8 codes (lo in the low byte), round to nearest even.
template <int KIND>
__device__ __forceinline__ u32 fp8x2(float lo, float hi) {
    u16 r;
    if (KIND == 0) asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    else asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

// ---------------------------------------------------------------------------------------------
// KIVI arithmetic.  A group's f16 scale and zero from its fp32 min and max; (s, z) as the codes
// use them: the scale rounded to f16 (1 where it is 0), the zero rounded to f16.
struct Group {
    u16 sc, zr;
    float s, z;
};
template <int QMAX>
__device__ __forceinline__ Group group_of(float mn, float mx) {
    Group g;
    g.sc = f32_to_f16(__fdiv_rn(mx - mn, float(QMAX)));
    g.zr = f32_to_f16(mn);
    g.s = safe(f16_to_f32(g.sc));
    g.z = f16_to_f32(g.zr);
    return g;
}

// A code as the low bits of a float's bit pattern: for 0 <= y <= QMAX, fl(y + 1.5 * 2^23) is
// 1.5 * 2^23 + rint(y) (its ulp is 1; a tie goes to the even sum, whose parity is rint's since
// 1.5 * 2^23 is even), so the code sits in the low bits and 0 above them up to bit 22.
constexpr float MAGIC = 12582912.0f;

// The reference's code of x, clamp(rint(fl(fl(x - z) / s)), 0, QMAX), without a division:
// q0 = fl(d r) with r = fl(1 / s) lies within two ulps of d / s, so the remainder d - q0 s is a
// float and one fma gives it exactly, and the correction fl(q0 + rem r) is the correctly rounded
// quotient fl(d / s) (Markstein's theorem for a correctly rounded reciprocal; checked in float32 on
// the host over every f16 scale and constructed ties, tests/test_seal_rounding.py).  Clamping
// before rounding gives the same integer (the bounds are integers); NaN gives 0 (fmaxf takes the
// 0), and so does an infinite scale (the remainder is NaN), where the division gives 0 too: a group
// holding an infinity has one.  Per value: sub, mul, 2 fma, 2 min/max, add (the code).
template <int QMAX>
__device__ __forceinline__ u32 kivi_code(float x, float s, float z, float r) {
    const float d = __fsub_rn(x, z), q0 = __fmul_rn(d, r);
    const float q = __fmaf_rn(__fmaf_rn(-q0, s, d), r, q0);
    return __float_as_uint(__fadd_rn(fminf(fmaxf(q, 0.f), float(QMAX)), MAGIC));
}

// Four codes (low bytes of a, b, c, d) -> one word of byte codes, a in the low byte.
__device__ __forceinline__ u32 bytes4(u32 a, u32 b, u32 c, u32 d) {
    return __byte_perm(__byte_perm(a, b, 0x0040), __byte_perm(c, d, 0x0040), 0x5410);
}

// ---------------------------------------------------------------------------------------------
// KIVI K: groups of 32 tokens, a scale and zero point per channel (rows of f16 [PAGE / 32][D]).
// Slot (p, ts): channels 2p + e + m * DP (e < 2, m < PER: item k = 2m + e) of the tokens
// ts + TS * j (j < TPT).  TS = 2 * PER lanes share a pair, and lane ts computes item ts's scale.
template <int BITS, int QMAX>
struct KivK {
    static constexpr int PER = 8 / BITS, DP = D / PER, TS = 2 * PER, TPT = 32 / TS, NW = TPT * PER;

    // src: the chunk's first row
    static __device__ __forceinline__ void load(const u16* src, int s_tok, int slot, u32 (&w)[NW]) {
        static_assert(D % 32 == 0 && PAGE % 32 == 0, "KIVI K: D and PAGE multiples of 32");
        const u32* q = reinterpret_cast<const u32*>(src + (slot % TS) * s_tok + 2 * (slot / TS));
        const int st = TS * s_tok / 2;  // words between a thread's rows (s_tok is even)
#pragma unroll
        for (int j = 0; j < TPT; ++j)
#pragma unroll
            for (int m = 0; m < PER; ++m) w[j * PER + m] = __ldg(q + j * st + m * (DP / 2));
    }

    // data: the chunk's first packed row; scale / zero: the chunk's row of D
    static __device__ __forceinline__ void run(const u32 (&w)[NW], int slot, u8* data, u16* scale, u16* zero, u32*) {
        const int p = slot / TS, ts = slot % TS;
        // per item (mn, -mx) as one packed word: lane-wise min reduces both
        u32 it[TS];
#pragma unroll
        for (int m = 0; m < PER; ++m) {
            u32 mn = w[m], mx = w[m];
#pragma unroll
            for (int j = 1; j < TPT; ++j) {
                mn = min2(mn, w[j * PER + m]);
                mx = max2(mx, w[j * PER + m]);
            }
            mx ^= 0x80008000u;  // negation: exact
            it[2 * m] = __byte_perm(mn, mx, 0x5410);
            it[2 * m + 1] = __byte_perm(mn, mx, 0x7632);
        }
        // reduce-scatter over the TS lanes: after the round of bit b a lane keeps the half of its
        // items whose index has its lane's bit b; in the end item ts, reduced over the pair's tokens
#pragma unroll
        for (int b = TS / 2; b >= 1; b /= 2) {
            const bool up = ts & b;
#pragma unroll
            for (int j = 0; j < b; ++j) {
                const u32 send = up ? it[j] : it[j + b], keep = up ? it[j + b] : it[j];
                it[j] = min2(keep, __shfl_xor_sync(FULL, send, b));
            }
        }
        const int c = 2 * p + (ts & 1) + (ts >> 1) * DP;
        const Group g = group_of<QMAX>(lo_f32(it[0]), -hi_f32(it[0]));
        scale[c] = g.sc;
        zero[c] = g.zr;
        const u32 sz = u32(g.sc) | (u32(g.zr) << 16);
        const float r = __frcp_rn(g.s);
        // layer by layer (items 2m, 2m + 1 shared by lanes 2m, 2m + 1): the codes of output bytes
        // 2p, 2p + 1 at bits BITS * m, a row's two bytes in out[j]
        u32 out[TPT];
#pragma unroll
        for (int j = 0; j < TPT; ++j) out[j] = 0;
#pragma unroll
        for (int m = 0; m < PER; ++m) {
            const u32 sz0 = __shfl_sync(FULL, sz, 2 * m, TS), sz1 = __shfl_sync(FULL, sz, 2 * m + 1, TS);
            const float z0 = f16_to_f32(u16(sz0 >> 16)), s0 = safe(f16_to_f32(u16(sz0)));
            const float z1 = f16_to_f32(u16(sz1 >> 16)), s1 = safe(f16_to_f32(u16(sz1)));
            const float r0 = __shfl_sync(FULL, r, 2 * m, TS), r1 = __shfl_sync(FULL, r, 2 * m + 1, TS);
#pragma unroll
            for (int j = 0; j < TPT; ++j) {
                const u32 w0 = w[j * PER + m];
                out[j] |= __byte_perm(kivi_code<QMAX>(lo_f32(w0), s0, z0, r0), kivi_code<QMAX>(hi_f32(w0), s1, z1, r1),
                                      0x0040) << (BITS * m);
            }
        }
#pragma unroll
        for (int j = 0; j < TPT; ++j) *reinterpret_cast<u16*>(data + (ts + TS * j) * DP + 2 * p) = u16(out[j]);
    }
};

// KIVI V: per token, groups of 32 channels (f16 [PAGE][D / 32] scales and zeros).  Slot (row, g):
// channels 32g ... 32g + 31 of the row; the NG = D / 32 slots of a row are adjacent lanes.
template <int BITS, int QMAX>
struct KivV {
    static constexpr int PER = 8 / BITS, DP = D / PER, NG = D / 32, NW = 16;

    static __device__ __forceinline__ void load(const u16* src, int s_tok, int slot, u32 (&w)[NW]) {
        static_assert(D % 32 == 0 && PAGE % 32 == 0 && 32 % NG == 0, "KIVI V: D and PAGE multiples of 32, D <= 1024");
        const uint4* q = reinterpret_cast<const uint4*>(src + (slot / NG) * s_tok + 32 * (slot % NG));
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const uint4 v = __ldg(q + k);
            w[4 * k] = v.x;
            w[4 * k + 1] = v.y;
            w[4 * k + 2] = v.z;
            w[4 * k + 3] = v.w;
        }
    }

    // wsm: the warp's shared words, [32 / NG rows][D byte codes]
    static __device__ __forceinline__ void run(const u32 (&w)[NW], int slot, u8* data, u16* scale, u16* zero,
                                               u32* wsm) {
        const int row = slot / NG, g = slot % NG;
        u32 mn = w[0], mx = w[0];
#pragma unroll
        for (int k = 1; k < NW; ++k) {
            mn = min2(mn, w[k]);
            mx = max2(mx, w[k]);
        }
        const Group gp = group_of<QMAX>(fminf(lo_f32(mn), hi_f32(mn)), fmaxf(lo_f32(mx), hi_f32(mx)));
        scale[slot] = gp.sc;  // slot = row * NG + g
        zero[slot] = gp.zr;
        const float r = __frcp_rn(gp.s);
        u32 c[8];  // byte codes of channels 4k ... 4k + 3 of the group
#pragma unroll
        for (int k = 0; k < 8; ++k)
            c[k] = bytes4(kivi_code<QMAX>(lo_f32(w[2 * k]), gp.s, gp.z, r),
                          kivi_code<QMAX>(hi_f32(w[2 * k]), gp.s, gp.z, r),
                          kivi_code<QMAX>(lo_f32(w[2 * k + 1]), gp.s, gp.z, r),
                          kivi_code<QMAX>(hi_f32(w[2 * k + 1]), gp.s, gp.z, r));
        // the row's codes in channel order: word u holds channels 4u ... 4u + 3; planar layer m of the
        // output is words m * DP / 4 ...: output word v = sum over m of word (m * DP / 4 + v) << BITS * m
        u32* rsm = wsm + ((slot % 32) / NG) * (D / 4);
        reinterpret_cast<uint4*>(rsm + 8 * g)[0] = make_uint4(c[0], c[1], c[2], c[3]);
        reinterpret_cast<uint4*>(rsm + 8 * g)[1] = make_uint4(c[4], c[5], c[6], c[7]);
        __syncwarp();
        u32 o[BITS];  // this lane's output words BITS * g ... (4 * BITS bytes)
#pragma unroll
        for (int j = 0; j < BITS; ++j) o[j] = 0;
#pragma unroll
        for (int m = 0; m < PER; ++m) {
            const u32* l = rsm + m * (DP / 4) + BITS * g;
            u32 v[BITS];
            if constexpr (BITS == 4) {
                const uint4 q = *reinterpret_cast<const uint4*>(l);
                v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
            } else {
                const uint2 q = *reinterpret_cast<const uint2*>(l);
                v[0] = q.x, v[1] = q.y;
            }
#pragma unroll
            for (int j = 0; j < BITS; ++j) o[j] |= v[j] << (BITS * m);
        }
        __syncwarp();  // the words are read before the next slot's codes overwrite them
        u8* out = data + row * DP + 4 * BITS * g;
        if constexpr (BITS == 4) *reinterpret_cast<uint4*>(out) = make_uint4(o[0], o[1], o[2], o[3]);
        else *reinterpret_cast<uint2*>(out) = make_uint2(o[0], o[1]);
    }
};

// A CTA's KIVI chunks: tiles blockIdx.x, + gridDim.x, ... below n, each PAGE / 32 chunks of 32 rows,
// each D slots; thread t takes the slots t, t + NT, ... (a warp's 32 slots are in one chunk).  The
// next slot's words are loaded before the current slot is computed.
template <class R>
__device__ __forceinline__ void walk_kivi(const i64* src_ids, const i64* dst_ids, int s_ids, const u16* src, i64 s_src,
                                          i64 s_head, int s_tok, u8* d, u16* sc, u16* zr, int H, i64 n, u32* smem) {
    constexpr u32 GPT = PAGE / 32, DP = R::DP;
    const int h = blockIdx.y;
    const u32 items = u32((n - 1 - blockIdx.x) / gridDim.x + 1) * GPT * D;
    u32* wsm = smem + (threadIdx.x / 32) * 8 * 32;  // KivV: 32 / NG rows of D / 4 words
    src += h * s_head;
    u32 f = threadIdx.x;
    if (f >= items) return;
    // the tile of slot f, its q block (-1: padding) and its chunk's first source row
    auto locate = [&](u32 f, i64& dst) -> const u16* {
        const i64 i = blockIdx.x + i64(f / (GPT * D)) * gridDim.x;
        dst = dst_ids[i * s_ids];
        return src + src_ids[i * s_ids] * s_src + int((f / D) % GPT) * 32 * s_tok;
    };
    i64 dst;
    const u16* p = locate(f, dst);
    u32 w[R::NW], wn[R::NW];
    if (dst >= 0) R::load(p, s_tok, f % D, w);
    for (;;) {
        const u32 fn = f + NT;
        i64 dstn = -1;
        if (fn < items) {
            p = locate(fn, dstn);
            if (dstn >= 0) R::load(p, s_tok, fn % D, wn);
        }
        if (dst >= 0) {
            const u32 gr = (f / D) % GPT;
            const i64 bh = dst * H + h;
            const i64 so = (bh * GPT + gr) * D;  // K: row gr of [PAGE / 32][D]; V: rows 32gr.. of [PAGE][D / 32]
            R::run(w, f % D, d + (bh * PAGE + 32 * gr) * DP, sc + so, zr + so, wsm);
        }
        if (fn >= items) break;
        f = fn;
        dst = dstn;
#pragma unroll
        for (int k = 0; k < R::NW; ++k) w[k] = wn[k];
    }
}

// Per-block scale: one f32 scale for the head's whole [PAGE, D] tile, codes FP8 (saturating) or
// INT8.  Each thread keeps its 16-byte chunks of the tile in registers (one read of the source):
// the absmax from packed |x| words, then the codes, eight to an 8-byte store.  Quotients as
// kivi_code's (the reciprocal with one fma correction), the scale and values first multiplied by
// 2^64 where the scale lies below 2^-64 (the reciprocal of a subnormal scale overflows; exact).
template <int KIND, int QMAX>
__device__ void seal_block(const u16* src, i64 s_tok, u8* data, float* scale, u32* red) {
    constexpr int CPR = D / 8, NCH = PAGE * CPR, PER = (NCH + NT - 1) / NT;
    static_assert(D % 8 == 0, "per block: D a multiple of 8");
    uint4 w[PER];
    u32 m = 0;  // |x| bit patterns' maxima, low and high halves (the order of magnitudes; a NaN wins)
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int c = threadIdx.x + j * NT;
        if (NCH % NT == 0 || c < NCH) {
            w[j] = *reinterpret_cast<const uint4*>(src + (c / CPR) * s_tok + 8 * (c % CPR));
            m = __vmaxu2(__vmaxu2(m, w[j].x & 0x7fff7fffu), __vmaxu2(w[j].y & 0x7fff7fffu,
                                                                     __vmaxu2(w[j].z & 0x7fff7fffu, w[j].w & 0x7fff7fffu)));
        }
    }
    m = max(m & 0xffffu, m >> 16);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(FULL, m, o));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
    __syncthreads();
    m = red[0];
#pragma unroll
    for (int i = 1; i < NT / 32; ++i) m = max(m, red[i]);
    // f32 arithmetic in PTX without .ftz below: CuPy compiles with -ftz=true, which would flush a
    // subnormal scale (and the values of an all-subnormal tile) to zero
    const float sc = div_exact(lo_f32(m), float(QMAX));
    if (threadIdx.x == 0) *scale = sc;
    const float s0 = (__float_as_uint(sc) << 1) == 0 ? 1.f : sc;  // safe(sc), by bits
    const float k = (__float_as_uint(s0) & 0x7fffffffu) < 0x1f800000u ? 1.8446744073709552e19f : 1.f;  // 2^-64
    const float s = mul_exact(s0, k), r = __frcp_rn(s);
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int c = threadIdx.x + j * NT;
        if (NCH % NT == 0 || c < NCH) {
            const u32 in[4] = {w[j].x, w[j].y, w[j].z, w[j].w};
            float y[8];
#pragma unroll
            for (int b = 0; b < 8; ++b) {
                const float x = mul_exact(b & 1 ? hi_f32(in[b >> 1]) : lo_f32(in[b >> 1]), k);
                const float q0 = __fmul_rn(x, r);
                const float q = r == 0.f ? q0 : __fmaf_rn(__fmaf_rn(-q0, s, x), r, q0);
                y[b] = fminf(fmaxf(q, -float(QMAX)), float(QMAX));
            }
            uint2 out;
            if (KIND == 2) {
                u32 v[8];
#pragma unroll
                for (int b = 0; b < 8; ++b) v[b] = u32(int(rintf(y[b])));
                out.x = bytes4(v[0], v[1], v[2], v[3]);
                out.y = bytes4(v[4], v[5], v[6], v[7]);
            } else {
                out.x = fp8x2<KIND>(y[0], y[1]) | (fp8x2<KIND>(y[2], y[3]) << 16);
                out.y = fp8x2<KIND>(y[4], y[5]) | (fp8x2<KIND>(y[6], y[7]) << 16);
            }
            *reinterpret_cast<uint2*>(data + (c / CPR) * D + 8 * (c % CPR)) = out;
        }
    }
}

template <int FMT, int BITS, int KIND, int QMAX>
__device__ __forceinline__ void seal_role(const i64* src_ids, const i64* dst_ids, int s_ids, const u16* src, i64 s_src,
                                          i64 s_head, i64 s_tok, u8* d, u8* s, u8* z, int H, i64 n, u32* smem) {
    if constexpr (FMT == 4) {
        walk_kivi<KivK<BITS, QMAX>>(src_ids, dst_ids, s_ids, src, s_src, s_head, int(s_tok), d, reinterpret_cast<u16*>(s),
                                    reinterpret_cast<u16*>(z), H, n, smem);
    } else if constexpr (FMT == 5) {
        walk_kivi<KivV<BITS, QMAX>>(src_ids, dst_ids, s_ids, src, s_src, s_head, int(s_tok), d, reinterpret_cast<u16*>(s),
                                    reinterpret_cast<u16*>(z), H, n, smem);
    } else if constexpr (FMT == 3) {
        const int h = blockIdx.y;
        for (i64 i = blockIdx.x; i < n; i += gridDim.x) {  // the same i in every thread: the syncs are safe
            const i64 dst = dst_ids[i * s_ids];
            if (dst < 0) continue;  // padding
            const i64 bh = dst * H + h;
            seal_block<KIND, QMAX>(src + src_ids[i * s_ids] * s_src + h * s_head, s_tok, d + bh * PAGE * D,
                                   reinterpret_cast<float*>(s) + bh, smem);
            __syncthreads();  // red is read before the next tile's absmax overwrites it
        }
    }
}

extern "C" __global__ void __launch_bounds__(NT, 8) kvq_seal(
    const i64* __restrict__ src_ids, const i64* __restrict__ dst_ids, int s_ids,  // tile i: src_ids[i * s_ids] ...
    const u16* __restrict__ ksrc, const u16* __restrict__ vsrc,                 // ... origin src_ids[i] * s_src
    i64 s_src, i64 s_head, i64 s_tok,
    u8* __restrict__ kd, u8* __restrict__ ks, u8* __restrict__ kz,
    u8* __restrict__ vd, u8* __restrict__ vs, u8* __restrict__ vz, int H, int role0, i64 n) {
    __shared__ __align__(16) u32 smem[NT * 8];  // KIVI V: a warp's 32 rows' codes; per block: the absmax
    if (blockIdx.z + role0 == 0) {
        seal_role<K_FMT, K_BITS, K_KIND, K_QMAX>(src_ids, dst_ids, s_ids, ksrc, s_src, s_head, s_tok, kd, ks, kz, H,
                                                 n, smem);
    } else {
        seal_role<V_FMT, V_BITS, V_KIND, V_QMAX>(src_ids, dst_ids, s_ids, vsrc, s_src, s_head, s_tok, vd, vs, vz, H,
                                                 n, smem);
    }
}
