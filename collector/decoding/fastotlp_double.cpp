/* float.__repr__ without the GIL: the shortest decimal that reads back as the same double (and of
 * those the nearest), from the C++ library's std::to_chars, laid out as Python's repr lays it out.
 *
 * Why: json.dumps writes a float with float.__repr__, and the decoder ran that through Python
 * (PyOS_double_to_string), taking the GIL back for every float of every span from its GIL-free walk.
 * An engine's llm.request span has five; with 4 threads decoding at once, each float's wait for the
 * GIL was a context switch: 2.75 us of CPU a span, 1.68 with this (bench/decode.py; issue 17).
 * Python's repr and to_chars both give the shortest round-trip digits, the nearest among ties
 * (tests/test_fastpath.py compares them over 500,000 doubles and more). */
#include <charconv>
#include <cstdlib>
#include <cstring>

#include "fastotlp_double.h"

#if defined(__cpp_lib_to_chars) && __cpp_lib_to_chars >= 201611L
#define HAVE_DOUBLE_TO_CHARS 1
#endif

extern "C" int double_repr(double v, char *out, size_t cap) {
#ifdef HAVE_DOUBLE_TO_CHARS
    char sci[40];
    std::to_chars_result r = std::to_chars(sci, sci + sizeof sci - 1, v, std::chars_format::scientific);
    if (r.ec != std::errc()) return -1;
    *r.ptr = '\0';
    /* "-d.ddde+XX": the sign, the significant digits, the exponent of the first one. */
    const char *p = sci;
    int negative = *p == '-';
    if (negative) p++;
    char digits[32];
    int n = 0;
    for (; *p && *p != 'e'; p++)
        if (*p != '.') {
            if (n >= (int)sizeof digits) return -1;
            digits[n++] = *p;
        }
    if (*p != 'e' || n == 0) return -1;
    int decpt = (int)std::strtol(p + 1, nullptr, 10) + 1;  /* 0.d1d2... times 10 to the decpt */
    char text[48];
    int at = 0;
    if (negative) text[at++] = '-';
    if (decpt > -4 && decpt <= 16) {  /* Python's repr: positional between 1e-4 and 1e16 */
        if (decpt <= 0) {
            text[at++] = '0';
            text[at++] = '.';
            for (int i = 0; i < -decpt; i++) text[at++] = '0';
            std::memcpy(text + at, digits, n);
            at += n;
        } else if (decpt >= n) {
            std::memcpy(text + at, digits, n);
            at += n;
            for (int i = n; i < decpt; i++) text[at++] = '0';
            text[at++] = '.';
            text[at++] = '0';
        } else {
            std::memcpy(text + at, digits, decpt);
            at += decpt;
            text[at++] = '.';
            std::memcpy(text + at, digits + decpt, n - decpt);
            at += n - decpt;
        }
    } else {  /* d.ddd, "e", the exponent's sign and at least two digits */
        text[at++] = digits[0];
        if (n > 1) {
            text[at++] = '.';
            std::memcpy(text + at, digits + 1, n - 1);
            at += n - 1;
        }
        int exponent = decpt - 1;
        text[at++] = 'e';
        text[at++] = exponent < 0 ? '-' : '+';
        if (exponent < 0) exponent = -exponent;
        char reversed[8];
        int k = 0;
        do {
            reversed[k++] = (char)('0' + exponent % 10);
            exponent /= 10;
        } while (exponent);
        if (k < 2) reversed[k++] = '0';
        while (k) text[at++] = reversed[--k];
    }
    if ((size_t)at > cap) return -1;
    std::memcpy(out, text, at);
    return at;
#else
    (void)v;
    (void)out;
    (void)cap;
    return -1;  /* a C++ library without floating-point to_chars: the caller asks Python */
#endif
}
