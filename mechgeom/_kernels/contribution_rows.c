/* The element-wise parts of the metric family of docs/definitions.md §2: the per-token value Gram from its products, the
 * output norms, and every metric of a block of query rows in one pass per row.
 *
 * Built on first use by mechgeom/_kernels/build.py (`cc -O3 -shared`, with `-fopenmp` where PyTorch's own OpenMP
 * runtime, libgomp, is loaded: the `omp parallel` regions below then run on PyTorch's thread pool) and called
 * through ctypes by mechgeom/_kernels/fused.py, which computes the products (BLAS matmuls),
 * checks every shape and gives the strides. The formulas are those of
 * mechgeom/analyses/contribution/geometry.py (docs/definitions.md §2), one function each there. `n_threads` <= 1 runs
 * a function on the calling thread; without OpenMP the pragmas are ignored and everything runs there.
 *
 * The file includes itself twice, for float (`_f32`) and double (`_f64`).
 *
 * mg_contribution_rows: arrays are indexed [b, h, i, j] (batch, head, query, key) with element strides
 * st[3s..3s+2] = (b, h, i) for slot s and unit stride along the last axis. Slots (NULL: not wanted / not given):
 *   inputs   0 alpha [b h q k]   1 d1 = (z[i,h] M[h]) . v[j,h] [b h q k]   2 d2 = (o[i] W_O[h]^T) . v[j,h]
 *            3 vt_norm ‖vt[j,h]‖ [b h k]   4 inv_vt [b h k] (1/‖vt‖, 0 where ‖vt‖ = 0)
 *            5 inv_oh 1/‖o[i,h]‖ [b h q] (NaN: zero norm or modified head)   6 inv_ol 1/‖o[i]‖ [b q] (NaN: 0)
 *            7 keep [b h q] (0 for a modified head; NULL = every head kept)
 *            8 gram2 [b h g k]: G_j[h,g] on the diagonal, 2 G_j[h,g] above it (g > h)
 *   outputs  9 value_weighted  10 value_weighted_normalized  11 contribution  12 factor_norm_ratio
 *            13 factor_cos  14 head_share   [b h q k]
 *            15 attention_inter  16 value_weighted_inter  17 value_weighted_normalized_inter
 *            18 contribution_inter   [b q k]
 * Row i gets keys j < i + 1 (causal) or every key; a causal row is written 0 from i + 1 up to Q, or not at
 * all there when `zeroed` (the buffer is known to hold 0 at every key after its query).
 */
#ifndef MG_T
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

/* One 64-byte line of metrics from an L1 row to its tensor with non-temporal (streaming) stores: whole lines
 * bypass the caches and need no read-for-ownership, about 2x the bandwidth of ordinary stores for these
 * outputs, which are larger than the caches and read later, if at all (measured: the row pass at 1x128 to
 * 4x512 on SmolLM2 took 0.5x to 0.9x the time). Where there are none (not x86-64), MG_STREAM is 0 and rows
 * are copied with memcpy. */
#if defined(__AVX512F__)
#define MG_STREAM 1
static inline void line_f32(float *d, const float *s) { _mm512_stream_ps(d, _mm512_loadu_ps(s)); }
static inline void line_f64(double *d, const double *s) { _mm512_stream_pd(d, _mm512_loadu_pd(s)); }
#elif defined(__AVX__)
#define MG_STREAM 1
static inline void line_f32(float *d, const float *s)
{
    _mm256_stream_ps(d, _mm256_loadu_ps(s));
    _mm256_stream_ps(d + 8, _mm256_loadu_ps(s + 8));
}
static inline void line_f64(double *d, const double *s)
{
    _mm256_stream_pd(d, _mm256_loadu_pd(s));
    _mm256_stream_pd(d + 4, _mm256_loadu_pd(s + 4));
}
#elif defined(__SSE2__)
#define MG_STREAM 1
static inline void line_f32(float *d, const float *s)
{
    for (int k = 0; k < 16; k += 4) _mm_stream_ps(d + k, _mm_loadu_ps(s + k));
}
static inline void line_f64(double *d, const double *s)
{
    for (int k = 0; k < 8; k += 2) _mm_stream_pd(d + k, _mm_loadu_pd(s + k));
}
#else
#define MG_STREAM 0
#endif

#define N_SLOTS 19
#define CHUNK 512 /* keys per pass: the temporary rows stay in L1 */
#define MG_CAT2(a, b) a##_##b
#define MG_CAT(a, b) MG_CAT2(a, b)
#define MG_NAME(name) MG_CAT(name, MG_SFX)

/* 64 bytes of T as one value (GCC/Clang vector extensions: one AVX-512 register, two AVX or four SSE ones, or
 * scalars, as the target has) */
typedef float mg_vec_f32 __attribute__((vector_size(64)));
typedef double mg_vec_f64 __attribute__((vector_size(64)));

#define MG_T float
#define MG_SFX f32
#define MG_SQRT sqrtf
#define MG_LINE line_f32
#define MG_VEC mg_vec_f32
#include "contribution_rows.c" /* this file, by name: mechgeom._kernels.build compiles it from a folder of its own */
#undef MG_T
#undef MG_SFX
#undef MG_SQRT
#undef MG_LINE
#undef MG_VEC

#define MG_T double
#define MG_SFX f64
#define MG_SQRT sqrt
#define MG_LINE line_f64
#define MG_VEC mg_vec_f64
#include "contribution_rows.c" /* this file, by name: mechgeom._kernels.build compiles it from a folder of its own */

#else /* the functions, for one MG_T */
#define T MG_T

/* dst[0 .. n) = src[0 .. n): whole 64-byte lines of dst with streaming stores, the ends with ordinary ones. */
static inline void MG_NAME(put_row)(T *restrict dst, const T *restrict src, int64_t n)
{
#if MG_STREAM
    const int64_t line = 64 / sizeof(T);
    int64_t j = 0;
    for (; j < n && ((uintptr_t)(dst + j) & 63); j++) dst[j] = src[j];
    for (; j + line <= n; j += line) MG_LINE(dst + j, src + j);
    for (; j < n; j++) dst[j] = src[j];
#else
    memcpy(dst, src, sizeof(T) * n);
#endif
}

/* Every metric of one row i of one text b: the keys j < kend (see above), then the keys up to zend set to 0. */
static void MG_NAME(row)(int64_t b, int64_t i, int64_t H, int64_t kend, int64_t zend, T *const *p_,
                         const int64_t *st)
{
    const T nan_ = (T)NAN, inv_h = (T)1 / (T)H;
    const int want_vwi = p_[16] || p_[17];
    T tmp[6][CHUNK], zero[CHUNK], att[CHUNK], ci[CHUNK], sq[CHUNK];
    memset(zero, 0, sizeof(zero));
    const T iol = p_[6] ? p_[6][b * st[18] + i * st[20]] : (T)0, s2 = iol * iol;
    T *dst_i[4]; /* attention_inter, vw_inter, vwn_inter, c_inter rows */
    for (int s = 0; s < 4; s++)
        dst_i[s] = p_[15 + s] ? p_[15 + s] + b * st[3 * (15 + s)] + i * st[3 * (15 + s) + 2] : 0;
    /* the inter-head value norm's rows: alpha of the kept heads and their Gram entries G_j[x,y] (y >= x) */
    const int64_t n_pairs = want_vwi ? H * (H + 1) / 2 : 1;
    const T *ax[n_pairs], *ay[n_pairs], *gk[n_pairs];
    int64_t np = 0;
    if (want_vwi) {
        int64_t kept[H > 0 ? H : 1], nk = 0;
        for (int64_t h = 0; h < H; h++)
            if (!p_[7] || p_[7][b * st[21] + h * st[22] + i * st[23]] != (T)0) kept[nk++] = h;
        for (int64_t x = 0; x < nk; x++)
            for (int64_t y = x; y < nk; y++, np++) {
                ax[np] = p_[0] + b * st[0] + kept[x] * st[1] + i * st[2];
                ay[np] = p_[0] + b * st[0] + kept[y] * st[1] + i * st[2];
                gk[np] = p_[8] + b * st[24] + kept[x] * st[25] + kept[y] * st[26];
            }
    }
    for (int64_t j0 = 0; j0 < kend; j0 += CHUNK) {
        const int64_t n = kend - j0 < CHUNK ? kend - j0 : CHUNK;
        memset(att, 0, sizeof(T) * n);
        memset(ci, 0, sizeof(T) * n);
        for (int64_t h = 0; h < H; h++) {
            const T *restrict a = p_[0] + b * st[0] + h * st[1] + i * st[2] + j0;
            const T *restrict vn = p_[3] ? p_[3] + b * st[9] + h * st[10] + j0 : zero;
            const T *restrict d1 = p_[1] ? p_[1] + b * st[3] + h * st[4] + i * st[5] + j0 : zero;
            const T *restrict ivt = p_[4] ? p_[4] + b * st[12] + h * st[13] + j0 : zero;
            const T *restrict d2 = p_[2] ? p_[2] + b * st[6] + h * st[7] + i * st[8] + j0 : zero;
            const T ioh = p_[5] ? p_[5][b * st[15] + h * st[16] + i * st[17]] : (T)0;
            const T kp = p_[7] ? p_[7][b * st[21] + h * st[22] + i * st[23]] : (T)1;
            const T m = kp == (T)0 ? nan_ : (T)1; /* value_weighted: NaN for a modified head */
            const T f = s2 * kp;                  /* head share: 0 for a modified head */
            T *restrict o_vw = tmp[0], *restrict o_vwn = tmp[1], *restrict o_c = tmp[2];
            T *restrict o_r = tmp[3], *restrict o_cos = tmp[4], *restrict o_sh = tmp[5];
#pragma omp simd /* the rows never overlap (13 pointers: too many for GCC's run-time alias checks) */
            for (int64_t j = 0; j < n; j++) {
                const T aj = a[j], vj = vn[j];
                const T ratio = vj * ioh;            /* ‖vt‖ / ‖o_h‖ */
                const T vwn = aj * ratio;            /* alpha ‖vt‖ / ‖o_h‖ */
                const T cos_ = d1[j] * ioh * ivt[j]; /* d1 / (‖o_h‖ ‖vt‖) */
                const T share = aj * (d2[j] * f);    /* alpha d2 / ‖o‖² */
                o_vw[j] = aj * vj * m;               /* alpha ‖vt‖ */
                o_r[j] = ratio;
                o_vwn[j] = vwn;
                o_cos[j] = cos_;
                o_c[j] = vwn * cos_; /* c = (alpha ‖vt‖ / ‖o_h‖) cos */
                o_sh[j] = share;
                ci[j] += share;
                att[j] += aj;
            }
            for (int s = 0; s < 6; s++) /* the rows, computed in L1, to the wanted outputs */
                if (p_[9 + s])
                    MG_NAME(put_row)(p_[9 + s] + b * st[3 * (9 + s)] + h * st[3 * (9 + s) + 1] +
                                         i * st[3 * (9 + s) + 2] + j0,
                                     tmp[s], n);
        }
        if (want_vwi) { /* sq[j] = sum_{x <= y} (2) G_j[x,y] alpha_x alpha_y, kept heads */
            const int64_t lanes = (int64_t)(sizeof(MG_VEC) / sizeof(T));
            int64_t j = 0;
            for (; j + lanes <= n; j += lanes) { /* one vector of keys, its sum in a register over every pair */
                MG_VEC acc = {0}, g, x, y;
                for (int64_t pr = 0; pr < np; pr++) {
                    memcpy(&g, gk[pr] + j0 + j, sizeof g);
                    memcpy(&x, ax[pr] + j0 + j, sizeof x);
                    memcpy(&y, ay[pr] + j0 + j, sizeof y);
                    acc += g * (x * y);
                }
                memcpy(sq + j, &acc, sizeof acc);
            }
            for (; j < n; j++) {
                T s = 0;
                for (int64_t pr = 0; pr < np; pr++) s += gk[pr][j0 + j] * (ax[pr][j0 + j] * ay[pr][j0 + j]);
                sq[j] = s;
            }
        }
        if (p_[15]) {
            for (int64_t j = 0; j < n; j++) att[j] *= inv_h;
            MG_NAME(put_row)(dst_i[0] + j0, att, n);
        }
        if (want_vwi) {
            for (int64_t j = 0; j < n; j++) sq[j] = MG_SQRT(sq[j] > (T)0 ? sq[j] : (T)0);
            if (p_[16]) MG_NAME(put_row)(dst_i[1] + j0, sq, n);
            if (p_[17]) {
                for (int64_t j = 0; j < n; j++) sq[j] *= iol;
                MG_NAME(put_row)(dst_i[2] + j0, sq, n);
            }
        }
        if (p_[18]) MG_NAME(put_row)(dst_i[3] + j0, ci, n);
    }
    for (int64_t j0 = kend; j0 < zend; j0 += CHUNK) { /* not sources: key > query (streamed like the rest) */
        const int64_t n = zend - j0 < CHUNK ? zend - j0 : CHUNK;
        for (int s = 9; s < 15; s++)
            if (p_[s])
                for (int64_t h = 0; h < H; h++)
                    MG_NAME(put_row)(p_[s] + b * st[3 * s] + h * st[3 * s + 1] + i * st[3 * s + 2] + j0, zero, n);
        for (int s = 0; s < 4; s++)
            if (dst_i[s]) MG_NAME(put_row)(dst_i[s] + j0, zero, n);
    }
#if MG_STREAM
    _mm_sfence(); /* this thread's streaming stores are visible before the row is done */
#endif
}

/* The rows q0 .. q1 - 1 of every text, shared among n_threads threads (rows dealt out in turn: causal rows
 * grow with i). */
void MG_NAME(mg_contribution_rows)(int64_t B, int64_t H, int64_t Q, int64_t q0, int64_t q1, int causal,
                                   int zeroed, int n_threads, void **ptr, const int64_t *st)
{
    T *p_[N_SLOTS];
    for (int s = 0; s < N_SLOTS; s++) p_[s] = (T *)ptr[s];
    (void)n_threads; /* without OpenMP */
#pragma omp parallel for collapse(2) schedule(static, 1) num_threads(n_threads) if (n_threads > 1)
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = q0; i < q1; i++)
            MG_NAME(row)(b, i, H, causal ? i + 1 : Q, causal ? (zeroed ? i + 1 : Q) : Q, p_, st);
}

/* mg_value_gram: the per-token Gram matrix G_j[h,g] = v[j,h] M[h,:,g,:] v[j,g] (G symmetric) from the products
 * y[h,t,r,:] = v[t,h] M[h,:,(h+r)%H,:] (r = 0 .. R-1) of a chunk of n tokens t0 .. t0+n-1 (batch and position
 * flattened, t = b K + k): G_j[h,(h+r)%H] = y[h,t,r,:] . v[t,(h+r)%H]. vh is [H, B K, D] (head-major values).
 * Writes vt_norm [B H K] = sqrt(max(G_j[h,h], 0)) and inv_vt [B H K] (1/vt_norm, 0 where it is 0), and, when
 * gram2 [B H H K] is given (R = H // 2 + 1), G_j[h,h] on its diagonal and 2 G_j[h,g] at [min(h,g), max(h,g)].
 * An even H meets r = H / 2 from both heads of a pair: only the smaller head writes it. */
void MG_NAME(mg_value_gram)(int64_t H, int64_t R, int64_t D, int64_t K, int64_t BK, int64_t t0, int64_t n,
                            const T *y, const T *vh, T *gram2, T *vt_norm, T *inv_vt, int n_threads)
{
    (void)n_threads; /* without OpenMP */
#pragma omp parallel for collapse(2) schedule(static) num_threads(n_threads) if (n_threads > 1)
    for (int64_t h = 0; h < H; h++)
        for (int64_t t = 0; t < n; t++) {
            const int64_t tok = t0 + t, b = tok / K, k = tok % K;
            for (int64_t r = 0; r < R; r++) {
                const int64_t g = (h + r) % H;
                if (r > 0 && 2 * r == H && g < h) continue;
                const T *restrict yy = y + ((h * n + t) * R + r) * D;
                const T *restrict vv = vh + (g * BK + tok) * D;
                T s = 0;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < D; d++) s += yy[d] * vv[d];
                if (r == 0) {
                    const T nrm = MG_SQRT(s > (T)0 ? s : (T)0);
                    vt_norm[(b * H + h) * K + k] = nrm;
                    inv_vt[(b * H + h) * K + k] = nrm == (T)0 ? (T)0 : (T)1 / nrm;
                    if (gram2) gram2[((b * H + h) * H + h) * K + k] = s;
                } else if (gram2) {
                    const int64_t lo = h < g ? h : g, hi = h < g ? g : h;
                    gram2[((b * H + lo) * H + hi) * K + k] = 2 * s;
                }
            }
        }
}

/* mg_out_norms: 1/‖o[i,h]‖ and 1/‖o[i]‖ from ‖o[i,h]‖² = z[i,h] . hu[h,i] (hu = z M[h]) and
 * ‖o[i]‖² = sum_h z[i,h] . lu[i,h] (lu = o[i] W_O[h]^T); NaN where a norm is 0. z is [B, Q, H, D] with element
 * strides (zb, zq, zh) and unit stride along D; hu is [H, B Q, D] (head-major), lu [B Q, H, D] (token-major);
 * either may be NULL (its output is then not written). inv_oh is [B H Q], inv_ol [B Q]. */
void MG_NAME(mg_out_norms)(int64_t B, int64_t H, int64_t Q, int64_t D, const T *z, int64_t zb, int64_t zq,
                           int64_t zh, const T *hu, const T *lu, T *inv_oh, T *inv_ol)
{
    const T nan_ = (T)NAN;
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < Q; i++) {
            T layer = 0;
            for (int64_t h = 0; h < H; h++) {
                const T *restrict zz = z + b * zb + i * zq + h * zh;
                const int64_t row = (h * B + b) * Q + i;
                if (hu) {
                    const T *restrict u = hu + row * D;
                    T s = 0;
#pragma omp simd reduction(+ : s)
                    for (int64_t d = 0; d < D; d++) s += zz[d] * u[d];
                    const T nrm = MG_SQRT(s > (T)0 ? s : (T)0);
                    inv_oh[(b * H + h) * Q + i] = nrm == (T)0 ? nan_ : (T)1 / nrm;
                }
                if (lu) {
                    const T *restrict u = lu + ((b * Q + i) * H + h) * D;
                    T s = 0;
#pragma omp simd reduction(+ : s)
                    for (int64_t d = 0; d < D; d++) s += zz[d] * u[d];
                    layer += s;
                }
            }
            if (lu) {
                const T nrm = MG_SQRT(layer > (T)0 ? layer : (T)0);
                inv_ol[b * Q + i] = nrm == (T)0 ? nan_ : (T)1 / nrm;
            }
        }
}
#undef T
#endif
