// Block seal in CUDA: quantize whole [PAGE, D] tiles of K and V (the high-precision copy
// of a cache block, or a prefill chunk's whole blocks) into q blocks, for the formats
// that are sealed per block: KIVI K (scale and zero per channel over 32 tokens), KIVI V
// (per token over 32 channels) and per-block scales (FP8 e4m3 / e5m2, INT8).  Bit for
// bit the reference's arithmetic (kvq.formats.reference.quantize): fp32 values,
// correctly rounded divisions (KIVI codes: a reciprocal product wherever it provably
// rounds the same, see kivi_codes), round-half-even codes, scales rounded to their dtype
// before the codes are computed with them, saturating FP8 conversions.
//
// Compiled at run time (NVRTC) with these macros, set by seal.py:
//   HEAD_DIM, PAGE   tile shape (PAGE a multiple of 32 where a role is KIVI K)
//   MODEL_BF16       1: source tiles are bf16, 0: f16
//   K_FMT, V_FMT     3 = per-block scale, 4 = KIVI K, 5 = KIVI V, 0 = the role is not sealed here
//   K_BITS, V_BITS   KIVI bits (4 or 2); 8 for per-block
//   K_KIND, V_KIND   per-block codes: 0 = e4m3, 1 = e5m2, 2 = int8
//   K_QMAX, V_QMAX   the codes' largest magnitude (float literal)
//   NT               threads per CTA
//
// Grid (tile slots, KV heads, roles): a CTA walks tiles blockIdx.x, + gridDim.x, ... below `n` (a
// decode step's list is padded to the batch with q block -1, and its few real seals come first: a
// grid of the padded length spent most of its CTAs reading a -1).  One CTA quantizes one head's
// tile of one role at a time:
//   KIVI K: a thread per channel keeps its 32 values of a group in registers (min, max,
//           scale, zero, codes); KIVI V: a thread per (token, channel group) reads its 32
//           values as four 16-byte loads; per block: a CTA-wide absmax, then codes.
// KIVI codes go through shared memory [PAGE][D] in channel order and are packed
// planar (channels j, j + DP, ... of a row in one byte) into 32-bit stores.

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

__device__ __forceinline__ float to_f32(u16 v) {
#if MODEL_BF16
    return __uint_as_float(u32(v) << 16);
#else
    float f;
    asm("{ .reg .f16 t;\n mov.b16 t, %1;\n cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(v));
    return f;
#endif
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

// Two in-range fp32 values -> two FP8 codes (lo in the low byte), round to nearest even.
template <int KIND>
__device__ __forceinline__ u32 fp8x2(float lo, float hi) {
    u16 r;
    if (KIND == 0) asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    else asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

// [PAGE][D] codes in channel order (shared) -> planar packed rows of DP bytes (global): byte j
// of a row holds the codes of channels j, j + DP, ... in its low bits up.  A code is under
// 2^BITS, so four channels' codes read as one word and shifted by BITS * m stay in their bytes:
// a word of output is PER shared words.
template <int BITS>
__device__ __forceinline__ void pack_store(const u8* codes, u8* data) {
    constexpr int PER = 8 / BITS, DP = D / PER;
    for (int w = threadIdx.x; w < PAGE * DP / 4; w += NT) {
        const int r = (4 * w) / DP, j0 = (4 * w) % DP;
        const u32* row = reinterpret_cast<const u32*>(codes + r * D + j0);
        u32 word = 0;
#pragma unroll
        for (int m = 0; m < PER; ++m) word |= row[m * DP / 4] << (BITS * m);
        *reinterpret_cast<u32*>(data + r * DP + j0) = word;
    }
}

// A KIVI group of 32 values: its f16 scale and zero point stored at `scale` / `zero`; -> (s, z) as
// the codes use them (the scale rounded to f16, 1 where it is 0).
template <int QMAX>
__device__ __forceinline__ void group_params(const float (&x)[32], u16* scale, u16* zero, float& s, float& z) {
    float mn = x[0], mx = x[0];
#pragma unroll
    for (int i = 1; i < 32; ++i) {
        mn = fminf(mn, x[i]);
        mx = fmaxf(mx, x[i]);
    }
    const u16 sc = f32_to_f16(__fdiv_rn(mx - mn, float(QMAX))), zr = f32_to_f16(mn);
    *scale = sc;
    *zero = zr;
    s = safe(f16_to_f32(sc));
    z = f16_to_f32(zr);
}

template <int QMAX>
__device__ __forceinline__ u32 kivi_code(float x, float s, float z) {
    return u32(fminf(fmaxf(rintf(__fdiv_rn(x - z, s)), 0.f), float(QMAX)));
}

// The code of a rounded value k, fminf(fmaxf(k, 0), QMAX) as an integer: cvt saturates a
// negative value to 0 (a large one to 2^32 - 1) and turns NaN into 0, then an integer min.
template <int QMAX>
__device__ __forceinline__ u32 clamp_code(float k) {
    u32 c;
    asm("cvt.rzi.u32.f32 %0, %1;" : "=r"(c) : "f"(k));
    return min(c, u32(QMAX));
}

// The codes of a KIVI group of N values, the same as kivi_code's without a division per value:
// y = fl(fl(x - z) * fl(1 / s)) is within |q| 2^-22.9 of q = (x - z) / s and fl(q) within
// |q| 2^-24, so both round to the same integer wherever y lies farther than max(|y|, 1) 2^-20
// from a half-integer.  Only the half-integers between codes 0 and QMAX decide a clamped code,
// and there max(|y|, 1) <= QMAX + 1: one band for every value (a value farther out that falls
// in it costs only the slow path).  A group with any value that close (about one value in
// 2^19 on real K/V; exact ties among them) is computed again with the correctly rounded
// division.  Per value: sub, mul, round, sub, one compare into the group's predicate, cvt, min.
template <int QMAX, int N>
__device__ __forceinline__ void kivi_codes(const float (&x)[N], float s, float z, u32 (&c)[N]) {
    constexpr float BAND = 0.5f - float(QMAX + 1) * 0x1p-20f;
    const float r = __frcp_rn(s);
    bool near = false;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const float y = __fmul_rn(__fsub_rn(x[i], z), r), k = rintf(y);
        near |= fabsf(__fsub_rn(y, k)) > BAND;
        c[i] = clamp_code<QMAX>(k);
    }
    if (near) {  // unrolled like the loop above: the codes stay in registers
#pragma unroll
        for (int i = 0; i < N; ++i) c[i] = kivi_code<QMAX>(x[i], s, z);
    }
}

// KIVI K: groups of 32 tokens, a scale and zero point per channel (rows of f16 [PAGE / 32][D]).
template <int BITS, int QMAX>
__device__ void seal_kivi_k(const u16* src, i64 s_tok, u8* data, u16* scale, u16* zero, u8* codes) {
    for (int gr = 0; gr < PAGE / 32; ++gr) {
        for (int c = threadIdx.x; c < D; c += NT) {
            float x[32], s, z;
#pragma unroll
            for (int r = 0; r < 32; ++r) x[r] = to_f32(src[(gr * 32 + r) * s_tok + c]);
            group_params<QMAX>(x, scale + gr * D + c, zero + gr * D + c, s, z);
            u32 code[32];
            kivi_codes<QMAX>(x, s, z, code);
#pragma unroll
            for (int r = 0; r < 32; ++r) codes[(gr * 32 + r) * D + c] = u8(code[r]);
        }
    }
    __syncthreads();
    pack_store<BITS>(codes, data);
}

// KIVI V: per token, groups of 32 channels (f16 [PAGE][D / 32] scales and zeros).
template <int BITS, int QMAX>
__device__ void seal_kivi_v(const u16* src, i64 s_tok, u8* data, u16* scale, u16* zero, u8* codes) {
    constexpr int NG = D / 32;
    for (int it = threadIdx.x; it < PAGE * NG; it += NT) {
        const int r = it / NG, g = it % NG;
        const uint4* row = reinterpret_cast<const uint4*>(src + r * s_tok + 32 * g);
        float x[32];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const uint4 v = row[k];
            const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                x[8 * k + 2 * e] = to_f32(u16(w[e] & 0xffffu));
                x[8 * k + 2 * e + 1] = to_f32(u16(w[e] >> 16));
            }
        }
        float s, z;
        group_params<QMAX>(x, scale + r * NG + g, zero + r * NG + g, s, z);
        u32 code[32];
        kivi_codes<QMAX>(x, s, z, code);
#pragma unroll
        for (int i = 0; i < 32; i += 4)
            *reinterpret_cast<u32*>(codes + r * D + 32 * g + i) =
                code[i] | (code[i + 1] << 8) | (code[i + 2] << 16) | (code[i + 3] << 24);
    }
    __syncthreads();
    pack_store<BITS>(codes, data);
}

// Per-block scale: one f32 scale for the head's whole tile, codes FP8 (saturating) or INT8.
template <int KIND, int QMAX>
__device__ void seal_block(const u16* src, i64 s_tok, u8* data, float* scale, float* red) {
    constexpr int Q4 = D / 4;  // 4 channels per thread step: one 32-bit store of codes
    float amax = 0.f;
    for (int e = threadIdx.x; e < PAGE * D; e += NT) amax = fmaxf(amax, fabsf(to_f32(src[(e / D) * s_tok + e % D])));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = amax;
    __syncthreads();
    amax = red[0];
#pragma unroll
    for (int w = 1; w < NT / 32; ++w) amax = fmaxf(amax, red[w]);
    const float sc = __fdiv_rn(amax, float(QMAX));
    if (threadIdx.x == 0) *scale = sc;
    const float s = safe(sc);
    for (int e = threadIdx.x; e < PAGE * Q4; e += NT) {
        const int r = e / Q4, c = 4 * (e % Q4);
        float y[4];
#pragma unroll
        for (int b = 0; b < 4; ++b)
            y[b] = fminf(fmaxf(__fdiv_rn(to_f32(src[r * s_tok + c + b]), s), -float(QMAX)), float(QMAX));
        u32 word;
        if (KIND == 2) {
            word = 0;
#pragma unroll
            for (int b = 0; b < 4; ++b) word |= (u32(int(rintf(y[b]))) & 0xffu) << (8 * b);
        } else {
            word = fp8x2<KIND>(y[0], y[1]) | (fp8x2<KIND>(y[2], y[3]) << 16);
        }
        *reinterpret_cast<u32*>(data + r * D + c) = word;
    }
}

template <int FMT, int BITS, int KIND, int QMAX>
__device__ __forceinline__ void seal_role(const u16* src, i64 s_tok, i64 bh, u8* d, u8* s, u8* z, u8* smem) {
    if constexpr (FMT == 4) {
        constexpr int DP = D * BITS / 8;
        seal_kivi_k<BITS, QMAX>(src, s_tok, d + bh * PAGE * DP, reinterpret_cast<u16*>(s) + bh * (PAGE / 32) * D,
                                reinterpret_cast<u16*>(z) + bh * (PAGE / 32) * D, smem);
    } else if constexpr (FMT == 5) {
        constexpr int DP = D * BITS / 8;
        seal_kivi_v<BITS, QMAX>(src, s_tok, d + bh * PAGE * DP, reinterpret_cast<u16*>(s) + bh * PAGE * (D / 32),
                                reinterpret_cast<u16*>(z) + bh * PAGE * (D / 32), smem);
    } else if constexpr (FMT == 3) {
        seal_block<KIND, QMAX>(src, s_tok, d + bh * PAGE * D, reinterpret_cast<float*>(s) + bh,
                               reinterpret_cast<float*>(smem));
    }
}

extern "C" __global__ void __launch_bounds__(NT) kvq_seal(
    const i64* __restrict__ src_ids, const i64* __restrict__ dst_ids, int s_ids,  // tile i: src_ids[i * s_ids] ...
    const u16* __restrict__ ksrc, const u16* __restrict__ vsrc,                 // ... origin src_ids[i] * s_src
    i64 s_src, i64 s_head, i64 s_tok,
    u8* __restrict__ kd, u8* __restrict__ ks, u8* __restrict__ kz,
    u8* __restrict__ vd, u8* __restrict__ vs, u8* __restrict__ vz, int H, int role0, i64 n) {
    __shared__ __align__(16) u8 smem[PAGE * D];
    const int h = blockIdx.y;
    for (i64 i = blockIdx.x; i < n; i += gridDim.x) {  // the same i in every thread: the syncs below are safe
        const i64 dst = dst_ids[i * s_ids];
        if (dst < 0) continue;  // padding
        const i64 origin = src_ids[i * s_ids] * s_src + h * s_head;
        const i64 bh = dst * H + h;
        if (blockIdx.z + role0 == 0) {
            seal_role<K_FMT, K_BITS, K_KIND, K_QMAX>(ksrc + origin, s_tok, bh, kd, ks, kz, smem);
        } else {
            seal_role<V_FMT, V_BITS, V_KIND, V_QMAX>(vsrc + origin, s_tok, bh, vd, vs, vz, smem);
        }
        __syncthreads();  // the next tile's codes go to the same shared memory
    }
}
