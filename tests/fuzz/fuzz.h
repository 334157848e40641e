/* The entry points libFuzzer calls (every target defines both), and the
 * reader of an input that the targets decoding it field by field share. */
#ifndef MOEEP_FUZZ_H
#define MOEEP_FUZZ_H

#include <stddef.h>
#include <stdint.h>

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* The input, consumed front to back; reads past its end give zeros. */
struct input {
        const uint8_t *p;
        size_t left;
};

static inline uint8_t take8(struct input *in) {
        if (in->left == 0)
                return 0;
        in->left--;
        return *in->p++;
}

static inline uint32_t take32(struct input *in) {
        uint32_t v = 0;

        for (int i = 0; i < 4; i++)
                v |= (uint32_t)take8(in) << (8 * i);
        return v;
}

static inline uint64_t take64(struct input *in) {
        return take32(in) | (uint64_t)take32(in) << 32;
}

/* The next n bytes of the input, as they are, at *ret: n is first reduced
 * modulo max + 1 when larger than max, then to what is left. Returns n. */
static inline size_t take_span(struct input *in, size_t n, size_t max, const uint8_t **ret) {
        if (n > max)
                n %= max + 1;
        if (n > in->left)
                n = in->left;
        *ret = in->p;
        in->p += n;
        in->left -= n;
        return n;
}

#endif
