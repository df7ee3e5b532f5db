/* CRC32C: carry-less multiplication folding 128-bit lanes, the CPU's CRC32 instruction three
 * streams at a time, or a portable table (the passes of crc32c.h, best first).
 *
 * The CRC32-instruction pass follows Mark Adler's well-known scheme: the crc32 instruction has a
 * latency of three cycles and a throughput of one, so three independent CRCs run over
 * three adjacent blocks and are combined by "shifting" a CRC over a block of zeros (a
 * linear operator, applied through four 256-entry tables). One stream alone would reach a
 * third of the speed.
 */
#include "crc32c.h"

#include <string.h>

#define POLY 0x82f63b78u /* CRC32C, reflected */

/* Slicing-by-8 tables for the portable path. */
static uint32_t table[8][256];
static int ready;
static int best = KVF_CRC32C_TABLE; /* the fastest pass this CPU runs */
static const char *const pass_names[KVF_CRC32C_PASSES] = {"table", "narrow", "wide", "fold"};

static void build_table(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? (c >> 1) ^ POLY : c >> 1;
        table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = table[0][n];
        for (int k = 1; k < 8; k++) {
            c = table[0][c & 0xff] ^ (c >> 8);
            table[k][n] = c;
        }
    }
}

uint32_t kvf_crc32c_table(uint32_t crc, const void *buf, size_t len) {
    const unsigned char *p = buf;
    crc = ~crc;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    while (len && ((uintptr_t)p & 7)) {
        crc = table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
        len--;
    }
    while (len >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= crc;
        crc = table[7][w & 0xff] ^ table[6][(w >> 8) & 0xff] ^ table[5][(w >> 16) & 0xff] ^
              table[4][(w >> 24) & 0xff] ^ table[3][(w >> 32) & 0xff] ^
              table[2][(w >> 40) & 0xff] ^ table[1][(w >> 48) & 0xff] ^ table[0][w >> 56];
        p += 8;
        len -= 8;
    }
#endif
    while (len--)
        crc = table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return ~crc;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVF_HAVE_X86 1
#include <emmintrin.h>
#include <immintrin.h>
#include <nmmintrin.h>

/* Block sizes of the three-way split: LONG for the bulk, SHORT for what is left. */
#define LONG 8192
#define SHORT 256
/* Copies of at least this many bytes store with non-temporal stores (movnti), when
   streams_well() says so: no read-for-ownership of each destination line and no cache
   filled with bytes the caller reads later, if at all, so a large copy with its CRC runs
   faster than memcpy (docs/performance.md). */
#define STREAM_MIN (1u << 20)

static uint32_t shift_long[4][256];
static uint32_t shift_short[4][256];

/* Multiply a 32x32 GF(2) matrix (one column per bit) by a vector. */
static uint32_t gf2_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    while (vec) {
        if (vec & 1)
            sum ^= *mat;
        vec >>= 1;
        mat++;
    }
    return sum;
}

static void gf2_square(uint32_t *square, const uint32_t *mat) {
    for (int n = 0; n < 32; n++)
        square[n] = gf2_times(mat, mat[n]);
}

/* The operator that runs a CRC register over `len` zero bytes (len a power of two). */
static void zeros_operator(uint32_t *even, size_t len) {
    uint32_t odd[32];
    uint32_t row = 1;
    odd[0] = POLY; /* one zero bit */
    for (int n = 1; n < 32; n++) {
        odd[n] = row;
        row <<= 1;
    }
    gf2_square(even, odd); /* two zero bits */
    gf2_square(odd, even); /* four zero bits */
    /* Each square doubles the count: the first below gives one zero byte. */
    for (;;) {
        gf2_square(even, odd);
        len >>= 1;
        if (len == 0)
            return;
        gf2_square(odd, even);
        len >>= 1;
        if (len == 0)
            break;
    }
    memcpy(even, odd, sizeof odd);
}

static void build_shift(uint32_t zeros[4][256], size_t len) {
    uint32_t op[32];
    zeros_operator(op, len);
    for (uint32_t n = 0; n < 256; n++) {
        zeros[0][n] = gf2_times(op, n);
        zeros[1][n] = gf2_times(op, n << 8);
        zeros[2][n] = gf2_times(op, n << 16);
        zeros[3][n] = gf2_times(op, n << 24);
    }
}

static inline uint32_t shift(uint32_t zeros[4][256], uint32_t crc) {
    return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^ zeros[2][(crc >> 16) & 0xff] ^
           zeros[3][crc >> 24];
}

/* One byte copied and checksummed: loaded once, so the byte checksummed is the byte stored
   even while another writer changes the source. */
static inline unsigned char load8(const unsigned char *p) {
    return __atomic_load_n(p, __ATOMIC_RELAXED);
}

static inline uint64_t load64(const unsigned char *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

__attribute__((target("sse4.2"))) static uint32_t crc32c_hw(uint32_t crc, const void *buf,
                                                              size_t len) {
    const unsigned char *next = buf;
    uint64_t crc0 = crc ^ 0xffffffffu;

    while (len && ((uintptr_t)next & 7)) {
        crc0 = _mm_crc32_u8((uint32_t)crc0, *next++);
        len--;
    }
    while (len >= 3 * LONG) {
        uint64_t crc1 = 0, crc2 = 0;
        const unsigned char *end = next + LONG;
        do {
            crc0 = _mm_crc32_u64(crc0, load64(next));
            crc1 = _mm_crc32_u64(crc1, load64(next + LONG));
            crc2 = _mm_crc32_u64(crc2, load64(next + 2 * LONG));
            next += 8;
        } while (next < end);
        crc0 = shift(shift_long, (uint32_t)crc0) ^ (uint32_t)crc1;
        crc0 = shift(shift_long, (uint32_t)crc0) ^ (uint32_t)crc2;
        next += 2 * LONG;
        len -= 3 * LONG;
    }
    while (len >= 3 * SHORT) {
        uint64_t crc1 = 0, crc2 = 0;
        const unsigned char *end = next + SHORT;
        do {
            crc0 = _mm_crc32_u64(crc0, load64(next));
            crc1 = _mm_crc32_u64(crc1, load64(next + SHORT));
            crc2 = _mm_crc32_u64(crc2, load64(next + 2 * SHORT));
            next += 8;
        } while (next < end);
        crc0 = shift(shift_short, (uint32_t)crc0) ^ (uint32_t)crc1;
        crc0 = shift(shift_short, (uint32_t)crc0) ^ (uint32_t)crc2;
        next += 2 * SHORT;
        len -= 3 * SHORT;
    }
    while (len >= 8) {
        crc0 = _mm_crc32_u64(crc0, load64(next));
        next += 8;
        len -= 8;
    }
    while (len--)
        crc0 = _mm_crc32_u8((uint32_t)crc0, *next++);
    return (uint32_t)crc0 ^ 0xffffffffu;
}

/* Whether non-temporal stores to `out` are safe for speed while loading from `next`. A load
   whose address matches a recent store's modulo 4 KiB waits for that store ("4K
   aliasing"); a non-temporal store lingers in a write-combining buffer until its line is
   whole, so when the destination runs a little ahead of the source modulo 4 KiB every load
   waits on a half-filled line: a destination a little ahead of the source makes
   non-temporal stores far slower than plain ones, one far enough ahead makes them faster
   (docs/performance.md). So streaming only where the destination is 8-byte aligned and
   level with the source or at least 256 bytes ahead of it. That covers most gets: records
   sit in 64-byte-aligned slots, so their payloads fall at every multiple of 64 modulo
   4 KiB. */
static int streams_well(const unsigned char *out, const unsigned char *next) {
    uintptr_t ahead = ((uintptr_t)out - (uintptr_t)next) & 4095;
    return ((uintptr_t)out & 7) == 0 && (ahead == 0 || ahead >= 256);
}

/* The end of a copy with its CRC: the last bytes, one at a time, then the fence that orders
   a non-temporal copy's stores before any later store. */
__attribute__((target("sse4.2"))) static inline uint32_t copy_crc32c_end(unsigned char *out,
                                                                         const unsigned char *next,
                                                                         size_t len, uint64_t crc0,
                                                                         int streamed) {
    while (len--) {
        unsigned char byte = load8(next++);
        crc0 = _mm_crc32_u8((uint32_t)crc0, byte);
        *out++ = byte;
    }
    if (streamed)
        _mm_sfence();
    return (uint32_t)crc0 ^ 0xffffffffu;
}

/* crc32c_hw's loop, storing each word it loads: the copy and the CRC in one pass over the
   bytes, at the CRC instruction's throughput (far above memory bandwidth), so a copy that
   checksums costs about what the copy costs. The CRC is of the very bytes stored. */
__attribute__((target("sse4.2"))) static uint32_t copy_crc32c_hw(void *dest, const void *src,
                                                                   size_t len, uint32_t crc) {
    const unsigned char *next = src;
    unsigned char *out = dest;
    uint64_t crc0 = crc ^ 0xffffffffu;

    while (len && ((uintptr_t)next & 7)) {
        unsigned char byte = load8(next++);
        crc0 = _mm_crc32_u8((uint32_t)crc0, byte);
        *out++ = byte;
        len--;
    }
    int stream_out = len >= STREAM_MIN && streams_well(out, next);
    while (len >= 3 * LONG) {
        uint64_t crc1 = 0, crc2 = 0;
        const unsigned char *end = next + LONG;
        do {
            uint64_t a = load64(next), b = load64(next + LONG), c = load64(next + 2 * LONG);
            crc0 = _mm_crc32_u64(crc0, a);
            crc1 = _mm_crc32_u64(crc1, b);
            crc2 = _mm_crc32_u64(crc2, c);
            if (stream_out) {
                _mm_stream_si64((long long *)out, (long long)a);
                _mm_stream_si64((long long *)(out + LONG), (long long)b);
                _mm_stream_si64((long long *)(out + 2 * LONG), (long long)c);
            } else {
                memcpy(out, &a, 8);
                memcpy(out + LONG, &b, 8);
                memcpy(out + 2 * LONG, &c, 8);
            }
            next += 8;
            out += 8;
        } while (next < end);
        crc0 = shift(shift_long, (uint32_t)crc0) ^ (uint32_t)crc1;
        crc0 = shift(shift_long, (uint32_t)crc0) ^ (uint32_t)crc2;
        next += 2 * LONG;
        out += 2 * LONG;
        len -= 3 * LONG;
    }
    while (len >= 8) {
        uint64_t a = load64(next);
        crc0 = _mm_crc32_u64(crc0, a);
        memcpy(out, &a, 8);
        next += 8;
        out += 8;
        len -= 8;
    }
    return copy_crc32c_end(out, next, len, crc0, stream_out);
}

/* Four words of a 32-byte register into a CRC: the CRC of the very bytes the register
   holds, which are the bytes stored, even if the source changes meanwhile. */
__attribute__((target("avx2,sse4.2"))) static inline uint64_t crc32c_256(uint64_t crc,
                                                                          __m256i v) {
    __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
    crc = _mm_crc32_u64(crc, (uint64_t)_mm_cvtsi128_si64(lo));
    crc = _mm_crc32_u64(crc, (uint64_t)_mm_extract_epi64(lo, 1));
    crc = _mm_crc32_u64(crc, (uint64_t)_mm_cvtsi128_si64(hi));
    return _mm_crc32_u64(crc, (uint64_t)_mm_extract_epi64(hi, 1));
}

/* copy_crc32c_hw's pass with 32-byte loads and stores (AVX2), the destination aligned to 32
   bytes first. Why: 8-byte stores, plain or non-temporal, hold the copy below memcpy where
   a get lays its records out (payloads at 64-byte steps); 32-byte stores bring it to
   memcpy's speed, checksum included, wherever the destination sits against the source
   modulo 4 KiB (docs/performance.md). Non-temporal from STREAM_MIN except within 256 bytes
   either side of level with the source modulo 4 KiB, where plain 32-byte stores are faster
   (4K aliasing, as for streams_well). */
__attribute__((target("avx2,sse4.2"))) static uint32_t copy_crc32c_wide(void *dest,
                                                                         const void *src,
                                                                         size_t len,
                                                                         uint32_t crc) {
    const unsigned char *next = src;
    unsigned char *out = dest;
    uint64_t crc0 = crc ^ 0xffffffffu;

    while (len && ((uintptr_t)out & 31)) {
        unsigned char byte = load8(next++);
        crc0 = _mm_crc32_u8((uint32_t)crc0, byte);
        *out++ = byte;
        len--;
    }
    uintptr_t ahead = ((uintptr_t)out - (uintptr_t)next) & 4095;
    int stream_out = len >= STREAM_MIN && (ahead == 0 || (ahead >= 256 && ahead <= 4096 - 256));
    while (len >= 3 * LONG) {
        uint64_t crc1 = 0, crc2 = 0;
        const unsigned char *end = next + LONG;
        do {
            __m256i a = _mm256_loadu_si256((const __m256i *)next);
            __m256i b = _mm256_loadu_si256((const __m256i *)(next + LONG));
            __m256i c = _mm256_loadu_si256((const __m256i *)(next + 2 * LONG));
            crc0 = crc32c_256(crc0, a);
            crc1 = crc32c_256(crc1, b);
            crc2 = crc32c_256(crc2, c);
            if (stream_out) {
                _mm256_stream_si256((__m256i *)out, a);
                _mm256_stream_si256((__m256i *)(out + LONG), b);
                _mm256_stream_si256((__m256i *)(out + 2 * LONG), c);
            } else {
                _mm256_store_si256((__m256i *)out, a);
                _mm256_store_si256((__m256i *)(out + LONG), b);
                _mm256_store_si256((__m256i *)(out + 2 * LONG), c);
            }
            next += 32;
            out += 32;
        } while (next < end);
        crc0 = shift(shift_long, (uint32_t)crc0) ^ (uint32_t)crc1;
        crc0 = shift(shift_long, (uint32_t)crc0) ^ (uint32_t)crc2;
        next += 2 * LONG;
        out += 2 * LONG;
        len -= 3 * LONG;
    }
    while (len >= 32) {
        __m256i a = _mm256_loadu_si256((const __m256i *)next);
        crc0 = crc32c_256(crc0, a);
        _mm256_store_si256((__m256i *)out, a);
        next += 32;
        out += 32;
        len -= 32;
    }
    return copy_crc32c_end(out, next, len, crc0, stream_out);
}

/* -- folding ---------------------------------------------------------------------------------
 *
 * Why: the CRC32 instruction takes 8 bytes a cycle at best, and a copy that feeds it every
 * word it stores runs well below memcpy on a host whose memcpy is fast, the loop's CRC
 * chains holding back how many loads are in flight (docs/performance.md). Folding, after Intel's "Fast CRC Computation for Generic Polynomials Using
 * PCLMULQDQ": a CRC is linear, so a 128-bit lane of the message can be carried forward over
 * D bits by two carry-less products with the constants x^(D+32) and x^(D-32) mod P and xored
 * into the lane found D bits later. Eight lanes (four 32-byte registers) fold 128 bytes at a
 * time with no chain longer than one product; what is left is folded down to one lane,
 * whose CRC the CRC32 instruction takes. A copy with its CRC then runs faster than memcpy
 * (docs/performance.md); 64-byte registers (AVX-512) were no faster, so this needs only
 * AVX2.
 * The CRC is still of the very bytes stored: each register is stored and then folded.
 * Needs AVX2 and VPCLMULQDQ: Intel since Ice Lake (and Alder Lake's cores), AMD since Zen 3. */
#define FOLD_TARGET __attribute__((target("avx2,vpclmulqdq,pclmul,sse4.2")))
/* Below this many bytes a CRC without a copy takes the three-stream pass: folding's set-up
   and final reduction cost more than they save. */
#define FOLD_MIN 512

/* Per distance D in bytes, the two fold constants: x^(8D+32) and x^(8D-32) mod P, each
   bit-reflected and shifted left once (a carry-less product of reflected operands lands one
   bit low). The low quadword of a lane, the earlier bits, takes the longer shift. */
static uint64_t fold_128[2], fold_32[2], fold_16[2];

static uint64_t x_power_reflected(unsigned n) {
    uint32_t r = 0x80000000u; /* x^0, reflected */
    while (n--)
        r = (r >> 1) ^ ((r & 1) ? POLY : 0);
    return (uint64_t)r << 1;
}

static void build_fold(uint64_t k[2], unsigned bytes) {
    k[0] = x_power_reflected(8 * bytes + 32);
    k[1] = x_power_reflected(8 * bytes - 32);
}

FOLD_TARGET static inline __m256i fold2(__m256i lanes, __m256i k, __m256i next) {
    __m256i early = _mm256_clmulepi64_epi128(lanes, k, 0x00);
    __m256i late = _mm256_clmulepi64_epi128(lanes, k, 0x11);
    return _mm256_xor_si256(_mm256_xor_si256(early, late), next);
}

FOLD_TARGET static inline __m128i fold1(__m128i lane, __m128i k, __m128i next) {
    __m128i early = _mm_clmulepi64_si128(lane, k, 0x00);
    __m128i late = _mm_clmulepi64_si128(lane, k, 0x11);
    return _mm_xor_si128(_mm_xor_si128(early, late), next);
}

FOLD_TARGET static inline __attribute__((always_inline)) void
fold_store(unsigned char *out, __m256i v, int stream) {
    if (stream)
        _mm256_stream_si256((__m256i *)out, v);
    else
        _mm256_store_si256((__m256i *)out, v);
}

FOLD_TARGET static inline __m256i load256(const unsigned char *p) {
    return _mm256_loadu_si256((const __m256i *)p);
}

/* The next 128 bytes of the message as four registers; a copy stores them at `out` first. */
FOLD_TARGET static inline __attribute__((always_inline)) void
take128(const unsigned char *next, unsigned char *out, int copy, int stream, __m256i *r0,
        __m256i *r1, __m256i *r2, __m256i *r3) {
    *r0 = load256(next);
    *r1 = load256(next + 32);
    *r2 = load256(next + 64);
    *r3 = load256(next + 96);
    if (copy) {
        fold_store(out, *r0, stream);
        fold_store(out + 32, *r1, stream);
        fold_store(out + 64, *r2, stream);
        fold_store(out + 96, *r3, stream);
    }
}

/* The CRC (copy: and the copy) of len bytes, `copy` and `stream` constant in each caller so
   each is compiled on its own. The CRC register runs un-inverted inside (crc0); a register
   state is xored into the next four bytes' lane, as a CRC's initial value is. */
FOLD_TARGET static inline __attribute__((always_inline)) uint32_t
fold_pass(unsigned char *out, const unsigned char *next, size_t len, uint32_t crc, int copy,
          int stream) {
    uint64_t crc0 = crc ^ 0xffffffffu;
    /* Align what the 32-byte accesses need aligned: the stores of a copy (non-temporal
       stores must be), else the loads. */
    while (len && ((uintptr_t)(copy ? out : next) & 31)) {
        unsigned char byte = load8(next++);
        crc0 = _mm_crc32_u8((uint32_t)crc0, byte);
        if (copy)
            *out++ = byte;
        len--;
    }
    if (len >= 128) {
        const __m256i k128 =
            _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)fold_128));
        const __m256i k32 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)fold_32));
        const __m128i k16 = _mm_loadu_si128((const __m128i *)fold_16);
        __m256i a0, a1, a2, a3, b0, b1, b2, b3;
        take128(next, out, copy, stream, &a0, &a1, &a2, &a3);
        a0 = _mm256_xor_si256(a0, _mm256_castsi128_si256(_mm_cvtsi32_si128((int)crc0)));
        next += 128;
        if (copy)
            out += 128;
        len -= 128;
        while (len >= 128) {
            take128(next, out, copy, stream, &b0, &b1, &b2, &b3);
            a0 = fold2(a0, k128, b0);
            a1 = fold2(a1, k128, b1);
            a2 = fold2(a2, k128, b2);
            a3 = fold2(a3, k128, b3);
            next += 128;
            if (copy)
                out += 128;
            len -= 128;
        }
        a1 = fold2(a0, k32, a1);
        a2 = fold2(a1, k32, a2);
        a3 = fold2(a2, k32, a3);
        while (len >= 32) {
            __m256i b = load256(next);
            if (copy) {
                fold_store(out, b, stream);
                out += 32;
            }
            a3 = fold2(a3, k32, b);
            next += 32;
            len -= 32;
        }
        __m128i lane = fold1(_mm256_castsi256_si128(a3), k16, _mm256_extracti128_si256(a3, 1));
        /* The lane stands for everything so far: its CRC from a zero register goes on. */
        crc0 = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(lane));
        crc0 = _mm_crc32_u64(crc0, (uint64_t)_mm_extract_epi64(lane, 1));
    }
    while (len >= 8) {
        uint64_t w = load64(next);
        crc0 = _mm_crc32_u64(crc0, w);
        if (copy) {
            memcpy(out, &w, 8);
            out += 8;
        }
        next += 8;
        len -= 8;
    }
    while (len--) {
        unsigned char byte = load8(next++);
        crc0 = _mm_crc32_u8((uint32_t)crc0, byte);
        if (copy)
            *out++ = byte;
    }
    if (stream)
        _mm_sfence();
    return (uint32_t)crc0 ^ 0xffffffffu;
}

FOLD_TARGET static uint32_t crc32c_fold(uint32_t crc, const void *buf, size_t len) {
    return fold_pass(NULL, buf, len, crc, 0, 0);
}

/* Non-temporal stores under the same rule as copy_crc32c_wide's, judged once the
   destination is 32-byte aligned (the first 31 bytes or fewer take plain stores). */
FOLD_TARGET static uint32_t copy_crc32c_fold(void *dest, const void *src, size_t len,
                                             uint32_t crc) {
    size_t head = (size_t)(-(uintptr_t)dest & 31);
    uintptr_t ahead = ((uintptr_t)dest - (uintptr_t)src) & 4095;
    if (len >= STREAM_MIN + head && (ahead == 0 || (ahead >= 256 && ahead <= 4096 - 256)))
        return fold_pass(dest, src, len, crc, 1, 1);
    return fold_pass(dest, src, len, crc, 1, 0);
}
#endif

uint32_t kvf_crc32c_with(int pass, uint32_t crc, const void *buf, size_t len) {
#ifdef KVF_HAVE_X86
    if (pass == KVF_CRC32C_FOLD && len >= FOLD_MIN)
        return crc32c_fold(crc, buf, len);
    if (pass >= KVF_CRC32C_NARROW)
        return crc32c_hw(crc, buf, len);
#endif
    (void)pass;
    return kvf_crc32c_table(crc, buf, len);
}

uint32_t kvf_copy_crc32c_with(int pass, void *dest, const void *src, size_t len, uint32_t crc) {
#ifdef KVF_HAVE_X86
    switch (pass) {
    case KVF_CRC32C_FOLD:
        return copy_crc32c_fold(dest, src, len, crc);
    case KVF_CRC32C_WIDE:
        return copy_crc32c_wide(dest, src, len, crc);
    case KVF_CRC32C_NARROW:
        return copy_crc32c_hw(dest, src, len, crc);
    default:
        break;
    }
#endif
    (void)pass;
    /* Two passes: the CRC is read back from what landed (a source rewritten meanwhile must
       not be vouched for). copy_many takes its own two-pass path on such CPUs. */
    memcpy(dest, src, len);
    return kvf_crc32c_table(crc, dest, len);
}

uint32_t kvf_copy_crc32c(void *dest, const void *src, size_t len, uint32_t crc) {
    return kvf_copy_crc32c_with(best, dest, src, len, crc);
}

uint32_t kvf_crc32c(uint32_t crc, const void *buf, size_t len) {
    return kvf_crc32c_with(best, crc, buf, len);
}

void kvf_crc32c_init(void) {
    if (ready)
        return;
    build_table();
#ifdef KVF_HAVE_X86
    build_shift(shift_long, LONG);
    build_shift(shift_short, SHORT);
    build_fold(fold_128, 128);
    build_fold(fold_32, 32);
    build_fold(fold_16, 16);
    __builtin_cpu_init();
    /* Each pass needs what the one before it needs. GCC's check for AVX2 includes the OS's
       saving of the 32-byte registers (XCR0). */
    if (__builtin_cpu_supports("sse4.2")) {
        best = KVF_CRC32C_NARROW;
        if (__builtin_cpu_supports("avx2")) {
            best = KVF_CRC32C_WIDE;
            if (__builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("pclmul"))
                best = KVF_CRC32C_FOLD;
        }
    }
#endif
    ready = 1;
}

int kvf_crc32c_best(void) { return best; }

int kvf_crc32c_hardware(void) { return best >= KVF_CRC32C_NARROW; }

const char *kvf_crc32c_pass_name(int pass) {
    return pass >= 0 && pass < KVF_CRC32C_PASSES ? pass_names[pass] : NULL;
}
