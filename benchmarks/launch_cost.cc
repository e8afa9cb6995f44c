// Host cost of one launch of our kernel, without XLA: python -m benchmarks.launch_cost builds and runs this.
//
//   launch_cost RUNTIME MODULE N BYTES... -- EXTENTS...
//
// The module (an object of kernel_cache, with a buffer of each of BYTES) launched N times through the CuTe runtime's
// entry (CuteDSLRT_Function_Run, as ffi/dqpost_ffi.cc calls it), then an empty kernel N times through
// cuLaunchKernel: host microseconds per launch of each, and the stream's microseconds per launch.
#include <cuda.h>
#include <dlfcn.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

struct CuteModule;
struct CuteFunction;
using CreateFn = int (*)(CuteModule**, const unsigned char*, size_t, const char**, size_t);
using GetFunctionFn = int (*)(CuteFunction**, CuteModule*, const char*);
using RunFn = int (*)(void*, void**, size_t);

#define CHECK(x)                                              \
  do {                                                          \
    CUresult r = (x);                                           \
    if (r != CUDA_SUCCESS) {                                    \
      std::printf("%s failed: %d\n", #x, r);                    \
      std::exit(1);                                             \
    }                                                           \
  } while (0)

static double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int main(int argc, char** argv) {
  if (argc < 5) { std::printf("usage: launch_cost RUNTIME MODULE N BYTES0 BYTES1 ... -- EXTENTS...\n"); return 2; }
  const char* runtime = argv[1];
  std::ifstream f(argv[2], std::ios::binary);
  std::vector<unsigned char> module((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const int n = std::atoi(argv[3]);
  std::vector<size_t> bytes;
  std::vector<int32_t> extents;
  int i = 4;
  for (; i < argc && std::string(argv[i]) != "--"; ++i) bytes.push_back(std::strtoull(argv[i], nullptr, 10));
  for (++i; i < argc; ++i) extents.push_back(std::atoi(argv[i]));

  CHECK(cuInit(0));
  CUdevice dev; CHECK(cuDeviceGet(&dev, 0));
  CUcontext ctx; CHECK(cuDevicePrimaryCtxRetain(&ctx, dev)); CHECK(cuCtxSetCurrent(ctx));
  CUstream stream; CHECK(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
  std::vector<CUdeviceptr> ptrs(bytes.size());
  for (size_t k = 0; k < bytes.size(); ++k) {
    CHECK(cuMemAlloc(&ptrs[k], bytes[k] ? bytes[k] : 16));
    CHECK(cuMemsetD8(ptrs[k], 0, bytes[k] ? bytes[k] : 16));
  }
  void* h = dlopen(runtime, RTLD_NOW | RTLD_LOCAL);
  if (!h) { std::printf("dlopen: %s\n", dlerror()); return 1; }
  auto create = reinterpret_cast<CreateFn>(dlsym(h, "CuteDSLRT_Module_Create_From_Bytes"));
  auto get = reinterpret_cast<GetFunctionFn>(dlsym(h, "CuteDSLRT_Module_Get_Function"));
  auto run = reinterpret_cast<RunFn>(dlsym(h, "CuteDSLRT_Function_Run"));
  CuteModule* mod = nullptr; CuteFunction* fn = nullptr;
  if (create(&mod, module.data(), module.size(), nullptr, 0) || get(&fn, mod, "jax_dqpost")) {
    std::printf("cannot load the module\n"); return 1;
  }
  std::vector<void*> call;
  for (auto& p : ptrs) call.push_back(&p);
  for (auto& e : extents) call.push_back(&e);
  int32_t ret = 0;
  call.push_back(&stream);
  call.push_back(&ret);
  CUevent a, b; CHECK(cuEventCreate(&a, 0)); CHECK(cuEventCreate(&b, 0));
  for (int k = 0; k < 100; ++k) run(fn, call.data(), call.size());
  CHECK(cuStreamSynchronize(stream));
  CHECK(cuEventRecord(a, stream));
  double t0 = now_us();
  int failed = 0;
  for (int k = 0; k < n; ++k) failed |= run(fn, call.data(), call.size());
  double host = (now_us() - t0) / n;
  CHECK(cuEventRecord(b, stream));
  CHECK(cuEventSynchronize(b));
  float ms = 0; CHECK(cuEventElapsedTime(&ms, a, b));
  // device_us: the stream's time for the N launches over N (at most the kernel's time when the host keeps ahead)
  std::printf("cute_runtime_run host_us %.3f device_us %.3f ret %d failed %d\n", host, ms * 1e3 / n, ret, failed);

  const char* ptx = ".version 7.0\n.target sm_80\n.address_size 64\n.visible .entry empty() { ret; }\n";
  CUmodule m; CHECK(cuModuleLoadData(&m, ptx));
  CUfunction empty; CHECK(cuModuleGetFunction(&empty, m, "empty"));
  for (int k = 0; k < 100; ++k) CHECK(cuLaunchKernel(empty, 1, 1, 1, 32, 1, 1, 0, stream, nullptr, nullptr));
  CHECK(cuStreamSynchronize(stream));
  CHECK(cuEventRecord(a, stream));
  t0 = now_us();
  for (int k = 0; k < n; ++k) CHECK(cuLaunchKernel(empty, 1, 1, 1, 32, 1, 1, 0, stream, nullptr, nullptr));
  host = (now_us() - t0) / n;
  CHECK(cuEventRecord(b, stream));
  CHECK(cuEventSynchronize(b));
  CHECK(cuEventElapsedTime(&ms, a, b));
  std::printf("cuLaunchKernel_empty host_us %.3f device_us %.3f\n", host, ms * 1e3 / n);
  return 0;
}
