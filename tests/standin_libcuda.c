/* A stand-in libcuda.so.1 for deviceless cuDNN compiles (thunder_cudnn_safe.aot), TESTS ONLY.
 *
 * cuDNN 9.19's runtime-compiled SDPA engines dlopen libcuda.so.1 (and dlsym the names below)
 * before NVRTC compiles their kernel; with no driver they refuse every graph. cuDNN 9.27's
 * libcudnn_engines_runtime_compiled.so.9 also links six driver symbols directly (the cuModule*
 * and cuTensorMapEncode* ones below, and cuGetErrorString): without them that sublibrary fails to
 * load and every plan fails with CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED. This library
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
/* Linked directly by cuDNN 9.27 (nm -D --undefined-only): success and dummy handles, nothing is loaded. */
CUresult cuModuleLoadData(void **module, const void *image) { (void)image; *module = handles + 16; return 0; }
CUresult cuModuleGetFunction(void **fn, void *module, const char *name) { (void)module; (void)name; *fn = handles + 24; return 0; }
CUresult cuModuleUnload(void *module) { (void)module; return 0; }
/* The 128-byte CUtensorMap is left as the caller passed it: no kernel ever reads it here. */
CUresult cuTensorMapEncodeTiled(void *map, int dtype, unsigned rank, void *addr, const void *dims, const void *strides,
                                const void *box, const void *elem_strides, int interleave, int swizzle, int l2, int fill) {
  (void)map; (void)dtype; (void)rank; (void)addr; (void)dims; (void)strides; (void)box; (void)elem_strides;
  (void)interleave; (void)swizzle; (void)l2; (void)fill;
  return 0;
}
CUresult cuTensorMapEncodeIm2col(void *map, int dtype, unsigned rank, void *addr, const void *dims, const void *strides,
                                 const int *lower, const int *upper, unsigned channels, unsigned pixels,
                                 const void *elem_strides, int interleave, int swizzle, int l2, int fill) {
  (void)map; (void)dtype; (void)rank; (void)addr; (void)dims; (void)strides; (void)lower; (void)upper; (void)channels;
  (void)pixels; (void)elem_strides; (void)interleave; (void)swizzle; (void)l2; (void)fill;
  return 0;
}
CUresult cuThreadExchangeStreamCaptureMode(int *mode) { (void)mode; return 0; }
CUresult cuGetExportTable(const void **table, const void *id) { (void)table; (void)id; return NOT_SUPPORTED; }

static const struct { const char *name; void *fn; } known[] = {
  {"cuInit", (void *)cuInit}, {"cuDriverGetVersion", (void *)cuDriverGetVersion},
  {"cuDeviceGetCount", (void *)cuDeviceGetCount}, {"cuDeviceGet", (void *)cuDeviceGet},
  {"cuGetErrorName", (void *)cuGetErrorName}, {"cuGetErrorString", (void *)cuGetErrorString},
  {"cuLibraryLoadData", (void *)cuLibraryLoadData}, {"cuLibraryGetKernel", (void *)cuLibraryGetKernel},
  {"cuLibraryUnload", (void *)cuLibraryUnload},
  {"cuModuleLoadData", (void *)cuModuleLoadData}, {"cuModuleGetFunction", (void *)cuModuleGetFunction},
  {"cuModuleUnload", (void *)cuModuleUnload}, {"cuTensorMapEncodeTiled", (void *)cuTensorMapEncodeTiled},
  {"cuTensorMapEncodeIm2col", (void *)cuTensorMapEncodeIm2col},
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
