/* Internal view of an endpoint for moeep-bench's references, which run
 * their own kernels on the same mapped buffers. Not exported from
 * libmoeep.so (links only into programs that link libmoeep statically). */
#ifndef MOEEP_EP_INTERNAL_H
#define MOEEP_EP_INTERNAL_H

#include "kernels.h"
#include "moeep_ep.h"

/* Copies the kernel context of `ep` (mapped buffers of every rank, layout,
 * state) into ret. */
int ep_internal_ctx(const struct moeep_ep *ep, struct moeep_ctx *ret);

#endif
