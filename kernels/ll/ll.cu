/* The low-latency kernels' one translation unit: nvcc compiles the files of
 * ll/ together, as one module, because its optimizer works across the
 * functions of a module: the proxy helpers that are not inlined (px_ship,
 * px_wait, common/px.cuh) are specialised for the calls it sees, so that
 * compiling each file apart would change the code of the dispatch, combine,
 * relay and clean kernels. Each file includes what it needs and would
 * compile alone. */
#include "ll/shrink.cu"
#include "ll/dispatch.cu"
#include "ll/relay.cu"
#include "ll/combine.cu"
