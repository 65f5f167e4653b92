/*
 * No-device libcuda.so.1 for hosts without an NVIDIA driver.
 *
 * SGLang's CUDA kernel package links against libcuda.so.1 and resolves a few
 * driver entry points at import time. On a CPU-only host there is no driver,
 * so the import fails before SGLang can pick its CPU engine. This library
 * answers those entry points with CUDA_ERROR_NO_DEVICE (100), which every
 * caller already handles as "no GPU here". It is only put on the library path
 * when no real driver exists (see sgl_atom/cpu_mode.py).
 */
#define CUDA_ERROR_NO_DEVICE 100

int cuInit(unsigned int flags) { (void)flags; return CUDA_ERROR_NO_DEVICE; }

int cuDriverGetVersion(int *version) {
    if (version) *version = 0;
    return CUDA_ERROR_NO_DEVICE;
}

int cuGetProcAddress(const char *symbol, void **pfn, int version,
                     unsigned long long flags, void *status) {
    (void)symbol; (void)version; (void)flags; (void)status;
    if (pfn) *pfn = 0;
    return CUDA_ERROR_NO_DEVICE;
}

int cuPointerGetAttribute(void *data, int attribute, unsigned long long ptr) {
    (void)data; (void)attribute; (void)ptr;
    return CUDA_ERROR_NO_DEVICE;
}
