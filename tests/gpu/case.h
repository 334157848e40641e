/* The failure macros of a GPU test case (suite.h's run_case), for
 * ep_normal_test.c and ep_ll_test.c. Test code. */
#ifndef MOEEP_TEST_CASE_H
#define MOEEP_TEST_CASE_H

#include <stdio.h>

/* Inside run_case, whose `msg` they fill and whose cleanup label is `out`:
 * FAIL(fmt, ...) records the failure and goes to out; CK(call) fails with
 * the CUDA error of a cuda* call, MK(call) with moeep_ep_error(ep) when a
 * moeep call returns -errno. */
#define FAIL(...)                                \
        do {                                     \
                snprintf(msg, 200, __VA_ARGS__); \
                goto out;                        \
        } while (0)
#define CK(call)                                                       \
        do {                                                           \
                cudaError_t e_ = (call);                               \
                if (e_ != cudaSuccess)                                 \
                        FAIL("%s: %s", #call, cudaGetErrorString(e_)); \
        } while (0)
#define MK(call)                                                   \
        do {                                                       \
                int r_ = (call);                                   \
                if (r_ < 0)                                        \
                        FAIL("%s: %s", #call, moeep_ep_error(ep)); \
        } while (0)

#endif
