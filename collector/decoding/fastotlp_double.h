/* float.__repr__ without the GIL (fastotlp_double.cpp). */
#ifndef FASTOTLP_DOUBLE_H
#define FASTOTLP_DOUBLE_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* repr(v) of a finite double into out (no terminating NUL): its length, or -1 where this build's C++
 * library cannot give the shortest digits, or the text does not fit in cap bytes. */
int double_repr(double v, char *out, size_t cap);

#ifdef __cplusplus
}
#endif

#endif
