/* Decode attention read in place from decode-slot rows, on CPU: see slot_kernel.py. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <immintrin.h>

/* exp(x) for x <= 0: 2^(x log2 e) as an integer power (built in the exponent bits) times 2^f,
   f in [0, 1), by a degree-6 polynomial (relative error ~2e-7, as float32's). */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * 1.4426950408889634f;
    float fi = floorf(t);
    float f = t - fi;
    float p = 1.5353362e-4f;
    p = p * f + 1.3398874e-3f;
    p = p * f + 9.6181291e-3f;
    p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022650e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    union { int32_t i; float f; } u;
    u.i = ((int32_t)fi + 127) << 23;
    return p * u.f;
}

/* sc[0..n) <- exp(sc - max); returns 1 / their sum */
static inline float softmax_unnormalised(float *sc, int64_t n) {
    float m = -FLT_MAX;
    for (int64_t j = 0; j < n; j++) m = sc[j] > m ? sc[j] : m;
    float sum = 0.0f;
    #pragma omp simd reduction(+:sum)
    for (int64_t j = 0; j < n; j++) { float e = exp_nonpos(sc[j] - m); sc[j] = e; sum += e; }
    return 1.0f / sum;
}

/* One query row qr[0..D) over keys/values K, V [n, D]: o[0..D) (sc: n floats of scratch). */
typedef void (*row_fn)(const float *qr, const float *K, const float *V, int64_t n, float *o, int64_t D,
                       float scale, float *sc);

__attribute__((target("avx2,fma")))
static void attend_row_avx2(const float *qr, const float *K, const float *V, int64_t n, float *o, int64_t D,
                            float scale, float *sc) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {  /* 4 keys' dot products, summed across lanes together */
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        const float *k0 = K + j * D;
        for (int64_t d = 0; d < D; d += 8) {
            __m256 qv = _mm256_loadu_ps(qr + d);
            a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
            a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + D + d), a1);
            a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 2 * D + d), a2);
            a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 3 * D + d), a3);
        }
        __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
        __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        _mm_storeu_ps(sc + j, _mm_mul_ps(s4, _mm_set1_ps(scale)));
    }
    for (; j < n; j++) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8)
            a = _mm256_fmadd_ps(_mm256_loadu_ps(qr + d), _mm256_loadu_ps(K + j * D + d), a);
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        s = _mm_hadd_ps(s, s);
        s = _mm_hadd_ps(s, s);
        sc[j] = _mm_cvtss_f32(s) * scale;
    }
    const __m256 inv = _mm256_set1_ps(softmax_unnormalised(sc, n));
    for (int64_t d = 0; d < D; d += 32) {  /* up to 32 output lanes at a time: D % 8 == 0 */
        const int64_t w = D - d < 32 ? D - d : 32;
        __m256 o0 = _mm256_setzero_ps(), o1 = o0, o2 = o0, o3 = o0;
        for (int64_t jj = 0; jj < n; jj++) {
            __m256 p = _mm256_set1_ps(sc[jj]);
            const float *vj = V + jj * D + d;
            o0 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj), o0);
            if (w > 8) o1 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 8), o1);
            if (w > 16) o2 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 16), o2);
            if (w > 24) o3 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 24), o3);
        }
        _mm256_storeu_ps(o + d, _mm256_mul_ps(o0, inv));
        if (w > 8) _mm256_storeu_ps(o + d + 8, _mm256_mul_ps(o1, inv));
        if (w > 16) _mm256_storeu_ps(o + d + 16, _mm256_mul_ps(o2, inv));
        if (w > 24) _mm256_storeu_ps(o + d + 24, _mm256_mul_ps(o3, inv));
    }
}

static void attend_row_generic(const float *qr, const float *K, const float *V, int64_t n, float *o, int64_t D,
                               float scale, float *sc) {
    for (int64_t j = 0; j < n; j++) {
        float acc = 0.0f;
        for (int64_t d = 0; d < D; d++) acc += qr[d] * K[j * D + d];
        sc[j] = acc * scale;
    }
    const float inv = softmax_unnormalised(sc, n);
    for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
    for (int64_t j = 0; j < n; j++)
        for (int64_t d = 0; d < D; d++) o[d] += sc[j] * V[j * D + d];
    for (int64_t d = 0; d < D; d++) o[d] *= inv;
}

/* q, out: [H, S, R, D] contiguous (R: the query rows of a sequence, its queries x the heads that
   share a KV head, query-major). k, v: the first sequence's keys / values of KV head 0; head h,
   sequence s, key j lie at h*hs + s*ss + j*D floats. nvis: [S, R / group], the keys each query
   sees (its position + 1). scratch: max(nvis) floats. */
void slot_attention(const float *q, const float *k, const float *v, const int64_t *nvis, float *out,
                    int64_t H, int64_t S, int64_t R, int64_t D, int64_t group, int64_t hs, int64_t ss,
                    float scale, float *scratch) {
    const row_fn attend_row = D % 8 == 0 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
                              ? attend_row_avx2 : attend_row_generic;
    const int64_t Q = R / group;
    for (int64_t h = 0; h < H; h++)
        for (int64_t s = 0; s < S; s++) {
            const int64_t off = h * hs + s * ss, row = (h * S + s) * R * D;
            for (int64_t r = 0; r < R; r++)
                attend_row(q + row + r * D, k + off, v + off, nvis[s * Q + r / group], out + row + r * D, D, scale,
                           scratch);
        }
}
