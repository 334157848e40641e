/* A stand-in for libmoeep's two low-latency calls, for test_fast.py: it
 * records the arguments and the stream of the last call of each and counts
 * the calls (a dispatch's buffer set is its count's parity, as libmoeep's),
 * and returns -EINVAL once when fail_next is set. */
#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "moeep_ep.h"

int calls, combine_calls;
int fail_next;
struct moeep_ll_dispatch_args last_d;
struct moeep_ll_combine_args last_c;
struct moeep_ll_handle last_h;
void *last_ds, *last_cs;

int moeep_ll_dispatch(struct moeep_ep *ep, const struct moeep_ll_dispatch_args *a,
                      struct moeep_ll_dispatch_result *r, struct moeep_ll_hook *h, cudaStream_t stream) {
        (void)ep;
        (void)h;
        if (fail_next) {
                fail_next = 0;
                return -EINVAL;
        }
        const int set = calls++ & 1;
        last_d = *a;
        last_ds = stream;
        memset(r, 0, sizeof(*r));
        r->handle.set = set;
        r->handle.num_tokens = a->num_tokens;
        return 0;
}

int moeep_ll_combine(struct moeep_ep *ep, const struct moeep_ll_combine_args *a, struct moeep_ll_hook *h,
                     cudaStream_t stream) {
        (void)ep;
        (void)h;
        if (fail_next) {
                fail_next = 0;
                return -EINVAL;
        }
        combine_calls++;
        last_c = *a;
        last_h = *a->handle;
        last_c.handle = &last_h;
        last_cs = stream;
        return 0;
}
