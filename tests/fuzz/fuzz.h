/* The entry points libFuzzer calls; every target defines both. */
#ifndef MOEEP_FUZZ_H
#define MOEEP_FUZZ_H

#include <stddef.h>
#include <stdint.h>

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#endif
