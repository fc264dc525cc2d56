/* A stand-in libcuda.so.1 for deviceless cuDNN compiles (thunder_cudnn_safe.aot), TESTS ONLY.
 *
 * cuDNN 9.19's runtime-compiled SDPA engines dlopen libcuda.so.1 (and dlsym the names below)
 * before NVRTC compiles their kernel; with no driver they refuse every graph. This library
 * loads nothing and runs nothing: it answers the version/device queries, hands back dummy
 * library/kernel handles, and returns CUDA_ERROR_NOT_SUPPORTED (801) for everything else.
 * It is compiled at test time and loaded only by aot's child process (LD_LIBRARY_PATH).
 */
#include <string.h>

typedef int CUresult;
#define NOT_SUPPORTED 801
static char handles[64];
static CUresult not_supported(void) { return NOT_SUPPORTED; }

CUresult cuInit(unsigned flags) { (void)flags; return 0; }
CUresult cuDriverGetVersion(int *v) { *v = 13000; return 0; }
CUresult cuDeviceGetCount(int *n) { *n = 1; return 0; }
CUresult cuDeviceGet(int *dev, int ordinal) { *dev = ordinal; return 0; }
CUresult cuGetErrorName(CUresult e, const char **s) { (void)e; *s = "CUDA_ERROR_NOT_SUPPORTED"; return 0; }
CUresult cuGetErrorString(CUresult e, const char **s) { (void)e; *s = "not supported by the stand-in libcuda"; return 0; }
CUresult cuLibraryLoadData(void **lib, const void *code, void *jit_opts, void *jit_vals, unsigned n_jit,
                           void *lib_opts, void *lib_vals, unsigned n_lib) {
  (void)code; (void)jit_opts; (void)jit_vals; (void)n_jit; (void)lib_opts; (void)lib_vals; (void)n_lib;
  *lib = handles;
  return 0;
}
CUresult cuLibraryGetKernel(void **kernel, void *lib, const char *name) { (void)lib; (void)name; *kernel = handles + 8; return 0; }
CUresult cuLibraryUnload(void *lib) { (void)lib; return 0; }
CUresult cuThreadExchangeStreamCaptureMode(int *mode) { (void)mode; return 0; }
CUresult cuGetExportTable(const void **table, const void *id) { (void)table; (void)id; return NOT_SUPPORTED; }

static const struct { const char *name; void *fn; } known[] = {
  {"cuInit", (void *)cuInit}, {"cuDriverGetVersion", (void *)cuDriverGetVersion},
  {"cuDeviceGetCount", (void *)cuDeviceGetCount}, {"cuDeviceGet", (void *)cuDeviceGet},
  {"cuGetErrorName", (void *)cuGetErrorName}, {"cuGetErrorString", (void *)cuGetErrorString},
  {"cuLibraryLoadData", (void *)cuLibraryLoadData}, {"cuLibraryGetKernel", (void *)cuLibraryGetKernel},
  {"cuLibraryUnload", (void *)cuLibraryUnload},
  {"cuThreadExchangeStreamCaptureMode", (void *)cuThreadExchangeStreamCaptureMode},
};

CUresult cuGetProcAddress_v2(const char *symbol, void **fn, int version, unsigned long long flags, int *status) {
  (void)version; (void)flags;
  *fn = (void *)not_supported;
  for (unsigned i = 0; i < sizeof known / sizeof *known; i++)
    if (!strcmp(symbol, known[i].name)) *fn = known[i].fn;
  if (status) *status = 1; /* CU_GET_PROC_ADDRESS_SUCCESS */
  return 0;
}
CUresult cuGetProcAddress(const char *symbol, void **fn, int version, unsigned long long flags) {
  return cuGetProcAddress_v2(symbol, fn, version, flags, 0);
}

/* Looked up directly with dlsym by libcudnn (it logs "Could not load symbol" for a missing one). */
#define UNSUPPORTED(name) CUresult name(void) { return NOT_SUPPORTED; }
UNSUPPORTED(cuCtxGetCurrent) UNSUPPORTED(cuCtxGetLimit) UNSUPPORTED(cuCtxPopCurrent) UNSUPPORTED(cuCtxPushCurrent)
UNSUPPORTED(cuKernelGetAttribute) UNSUPPORTED(cuKernelSetAttribute) UNSUPPORTED(cuLaunchCooperativeKernel)
UNSUPPORTED(cuLaunchKernel) UNSUPPORTED(cuLaunchKernelEx) UNSUPPORTED(cuLibraryLoadFromFile) UNSUPPORTED(cuLinkAddData)
UNSUPPORTED(cuLinkComplete) UNSUPPORTED(cuLinkCreate) UNSUPPORTED(cuLinkDestroy)
UNSUPPORTED(cuOccupancyMaxPotentialClusterSize) UNSUPPORTED(cuStreamGetCtx)
