// Paged decode attention over 8-bit K/V (FP8 e4m3 / e5m2, INT8), CUDA, mma.sync.
//
// Compiled at run time (NVRTC) with these macros set by decode8.py:
//   HEAD_DIM (128), PAGE (multiple of 16), GROUP (query heads per KV head, <= 8),
//   K_KIND / V_KIND  (0 = e4m3, 1 = e5m2, 2 = int8),
//   K_SCALE / V_SCALE (0 = static per head fp32 [H], 1 = per token fp32 [NB,H,PAGE],
//                      2 = per token fp16 [NB,H,PAGE], 3 = per block fp32 [NB,H])
//
// One CTA of 4 warps per (split, KV head, sequence); each warp walks its own
// 16-token tiles of the split and writes its own partial (out, lse), so the
// split-K reduce merges 4 * num_splits partials per query row.
//
// Tensor-core layout (m16n8k16, f16 in, f32 accumulate), lane l: g = l / 4, c = l % 4.
// Queries are the 16 A rows (GROUP real, the rest zero).  K and V are converted
// from 8 bits to f16 in registers, straight into the B fragments, by choosing the
// channel order of each k-step so that every lane reads contiguous bytes:
//   QK, k-step j, fragment slot s (0..3) of lane (g, c)  <->  channel 32c + 4j + s,
//     lane (g, c) reads 32 bytes of token g of each 8-token half tile;
//   PV, n8-tile i, column g  <->  channel 16g + i,
//     lane (g, c) reads 16 bytes [16g, 16g+16) of tokens 2c, 2c+1, 2c+8, 2c+9.
// Q is loaded in the QK order and outputs are stored through the PV order.

#ifndef MIN_BLOCKS
#define MIN_BLOCKS 2  // CTAs per SM the register allocation must allow (3 spills a little)
#endif

typedef unsigned int u32;
typedef unsigned short u16;

#define NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ u32 pack_half2(float lo, float hi) {
    u32 r;
    asm("{ .reg .f16 a, b;\n cvt.rn.f16.f32 a, %1;\n cvt.rn.f16.f32 b, %2;\n mov.b32 %0, {a, b}; }"
        : "=r"(r) : "f"(lo), "f"(hi));
    return r;
}

// two 8-bit codes (low byte first, in the low 16 bits of x) -> f16x2
template <int KIND>
__device__ __forceinline__ u32 cvt2(u32 x) {
    u32 r;
    if (KIND == 0) {
        asm("{ .reg .b16 t;\n cvt.u16.u32 t, %1;\n cvt.rn.f16x2.e4m3x2 %0, t; }" : "=r"(r) : "r"(x));
    } else if (KIND == 1) {
        asm("{ .reg .b16 t;\n cvt.u16.u32 t, %1;\n cvt.rn.f16x2.e5m2x2 %0, t; }" : "=r"(r) : "r"(x));
    } else {
        // int8 pair -> f16x2 exactly: put (code ^ 0x80) in the mantissa of 1024.0 and subtract 1152
        u32 t = __byte_perm(x, 0x64646464u, 0x5140) ^ 0x00800080u;  // bytes b0,0x64,b1,0x64
        asm("sub.f16x2 %0, %1, %2;" : "=r"(r) : "r"(t), "r"(0x64806480u));
    }
    return r;
}

__device__ __forceinline__ void mma16816(float* d, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint4 ldg16(const unsigned char* p) {
    uint4 r;
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

__device__ __forceinline__ float bf16_to_float(u16 h) { return __uint_as_float(((u32)h) << 16); }

template <int MODE>
__device__ __forceinline__ float load_scale(const void* s, long blk, int head, int off, int H) {
    if (MODE == 0) return ((const float*)s)[head];
    if (MODE == 1) return ((const float*)s)[(blk * H + head) * PAGE + off];
    if (MODE == 2) {
        u16 v = ((const u16*)s)[(blk * H + head) * PAGE + off];
        float f;
        asm("{ .reg .f16 h;\n mov.b16 h, %1;\n cvt.f32.f16 %0, h; }" : "=f"(f) : "h"(v));
        return f;
    }
    return ((const float*)s)[blk * H + head];
}

__device__ __forceinline__ u32 word(const uint4& v, int i) {
    return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// One warp's 16-token tile: 32 bytes of K for tokens g and 8 + g, 16 bytes of V
// ([16g, 16g+16)) for tokens 2c, 2c+1, 2c+8, 2c+9; a 16-token tile never crosses a page.
struct Tile {
    uint4 k0a, k0b, k1a, k1b, v0, v1, v8, v9;
    float ks[4], vs[4];  // scales of this lane's tokens 2c, 2c+1, 2c+8, 2c+9
};

__device__ __forceinline__ void load_tile(Tile& T, const unsigned char* kd, const unsigned char* vd,
                                          const void* ks, const void* vs,
                                          const int* table, int t0, int h, int H, int g, int c) {
    constexpr int D = HEAD_DIM;
    const int poff = t0 % PAGE;
    const long blk = table[t0 / PAGE];
    const long base = ((blk * H + h) * PAGE + poff) * (long)D;
    T.k0a = ldg16(kd + base + (long)g * D + 32 * c);
    T.k0b = ldg16(kd + base + (long)g * D + 32 * c + 16);
    T.k1a = ldg16(kd + base + (long)(8 + g) * D + 32 * c);
    T.k1b = ldg16(kd + base + (long)(8 + g) * D + 32 * c + 16);
    T.v0 = ldg16(vd + base + (long)(2 * c) * D + 16 * g);
    T.v1 = ldg16(vd + base + (long)(2 * c + 1) * D + 16 * g);
    T.v8 = ldg16(vd + base + (long)(2 * c + 8) * D + 16 * g);
    T.v9 = ldg16(vd + base + (long)(2 * c + 9) * D + 16 * g);
    const int tk[4] = {2 * c, 2 * c + 1, 8 + 2 * c, 9 + 2 * c};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        T.ks[e] = load_scale<K_SCALE>(ks, blk, h, poff + tk[e], H);
        T.vs[e] = load_scale<V_SCALE>(vs, blk, h, poff + tk[e], H);
    }
}

extern "C" __global__ void __launch_bounds__(128, MIN_BLOCKS) kvq_decode8(
    const u16* __restrict__ q, long s_qb, long s_qh,            // [B, Hq, D] bf16
    const unsigned char* __restrict__ kd, const unsigned char* __restrict__ vd,  // [NB, H, PAGE, D]
    const void* __restrict__ ks, const void* __restrict__ vs,   // scales (see K_SCALE / V_SCALE)
    const int* __restrict__ tables, long s_tb,                  // [B, max_blocks]
    const int* __restrict__ seq_lens,                           // [B]
    float* __restrict__ po, float* __restrict__ plse,           // [B, Hq, 4 * S, D], [B, Hq, 4 * S]
    int tokens_per_split, float qk_scale, int H) {
    constexpr int D = HEAD_DIM;
    constexpr int KSTEPS = D / 16;  // QK k-steps of 16 channels
    constexpr int NT = D / 8;       // PV n8-tiles
    const int sp = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, c = lane % 4;
    const int S = gridDim.x;
    const int n = seq_lens[b];
    const int start = sp * tokens_per_split;
    const int end = min(start + tokens_per_split, n);

    // A fragments of the query rows g (real if g < GROUP); rows g + 8 are padding (zero).
    u32 qa[KSTEPS][2];
    {
        const bool real = g < GROUP;
        const u16* qrow = q + (long)b * s_qb + (long)(h * GROUP + (real ? g : 0)) * s_qh + 32 * c;
#pragma unroll
        for (int j = 0; j < KSTEPS; ++j) {
            // channels 32c + 4j + {0,1} and {2,3}
            float f0 = real ? bf16_to_float(qrow[4 * j + 0]) : 0.f;
            float f1 = real ? bf16_to_float(qrow[4 * j + 1]) : 0.f;
            float f2 = real ? bf16_to_float(qrow[4 * j + 2]) : 0.f;
            float f3 = real ? bf16_to_float(qrow[4 * j + 3]) : 0.f;
            qa[j][0] = pack_half2(f0, f1);
            qa[j][1] = pack_half2(f2, f3);
        }
    }
    static_assert(D == 128, "decode8: head_dim 128 only (each lane reads 32 of the 128 channels)");

    float acc[NT][4];
#pragma unroll
    for (int i = 0; i < NT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    float m_row = NEG_INF, l_row = 0.f;  // for row g (rows g + 8 are padding)

    const int* table = tables + (long)b * s_tb;
    Tile cur, nxt;
    int t0 = start + 16 * warp;
    if (t0 < end) load_tile(cur, kd, vd, ks, vs, table, t0, h, H, g, c);
    for (; t0 < end; t0 += 64) {
        // issue the next tile's loads before computing this one (register double buffer)
        if (t0 + 64 < end) load_tile(nxt, kd, vd, ks, vs, table, t0 + 64, h, H, g, c);

        // scores of the two 8-token halves: s[half][0..1] = row g, tokens 2c, 2c+1
        float s0[4] = {0.f, 0.f, 0.f, 0.f}, s1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < KSTEPS; ++j) {
            // k-step j uses bytes 4j..4j+3 of this lane's 32 bytes of each token
            const u32 w0 = word(j < 4 ? cur.k0a : cur.k0b, j % 4);
            const u32 w1 = word(j < 4 ? cur.k1a : cur.k1b, j % 4);
            const u32 a[4] = {qa[j][0], 0u, qa[j][1], 0u};
            mma16816(s0, a, cvt2<K_KIND>(w0), cvt2<K_KIND>(w0 >> 16));
            mma16816(s1, a, cvt2<K_KIND>(w1), cvt2<K_KIND>(w1 >> 16));
        }
        // per-token scales: this lane's score columns are tokens 2c, 2c+1 (+8)
        const int tk[4] = {2 * c, 2 * c + 1, 8 + 2 * c, 9 + 2 * c};
        const float* sc = cur.ks;
        const float* pv_scale = cur.vs;
        float sv[4] = {s0[0], s0[1], s1[0], s1[1]};
        float tmax = NEG_INF;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            sv[e] = (t0 + tk[e] < end) ? sv[e] * sc[e] * qk_scale : NEG_INF;
            tmax = fmaxf(tmax, sv[e]);
        }
        tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
        tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
        const float m_new = fmaxf(m_row, tmax);
        const float alpha = exp2f(m_row - m_new);  // m_row = -inf at first: alpha = 0
        float p[4], psum = 0.f;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            p[e] = exp2f(sv[e] - m_new);
            psum += p[e];
        }
        psum += __shfl_xor_sync(0xffffffffu, psum, 1);
        psum += __shfl_xor_sync(0xffffffffu, psum, 2);
        l_row = l_row * alpha + psum;
        m_row = m_new;
        // P as the A operand (row g: tokens 2c, 2c+1 | 2c+8, 2c+9), V's per-token scale folded in
        const u32 pa[4] = {pack_half2(p[0] * pv_scale[0], p[1] * pv_scale[1]), 0u,
                           pack_half2(p[2] * pv_scale[2], p[3] * pv_scale[3]), 0u};
#pragma unroll
        for (int i = 0; i < NT; ++i) {
            acc[i][0] *= alpha;
            acc[i][1] *= alpha;
            // byte i of the 16 loaded bytes of tokens (2c, 2c+1) and (2c+8, 2c+9)
            const u32 w0 = word(cur.v0, i / 4), w1 = word(cur.v1, i / 4);
            const u32 w8 = word(cur.v8, i / 4), w9 = word(cur.v9, i / 4);
            const u32 sel = (i % 4) | ((4 + i % 4) << 4);
            mma16816(acc[i], pa, cvt2<V_KIND>(__byte_perm(w0, w1, sel)), cvt2<V_KIND>(__byte_perm(w8, w9, sel)));
        }
        cur = nxt;
    }

    // This warp's partial for row g: acc[i][e] is channel 16 * (2c + e) + i.
    if (g < GROUP) {
        const int hq = h * GROUP + g;
        const long row = ((long)b * H * GROUP + hq) * (4 * S) + (long)sp * 4 + warp;
        const float inv = l_row > 0.f ? 1.f / l_row : 0.f;
        float* out = po + row * D;
#pragma unroll
        for (int i = 0; i < NT; ++i) {
            out[16 * (2 * c) + i] = acc[i][0] * inv;
            out[16 * (2 * c + 1) + i] = acc[i][1] * inv;
        }
        if (c == 0) plse[row] = l_row > 0.f ? m_row + log2f(l_row) : NEG_INF;
    }
}
