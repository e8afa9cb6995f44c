// XLA FFI GPU target of jax-dqpost: launches a CuTe DSL-compiled dQ postprocess kernel on XLA's stream.
//
// The kernel arrives as an attribute of the custom call: an object module produced by
// `cute.compile(...).dump_to_object(kFunctionPrefix)` at lowering time, so compiled executables and
// `jax.export` artifacts carry their own binary. Modules are loaded once per process through the CuTe
// runtime C API (libcute_dsl_runtime.so, shipped by nvidia-cutlass-dsl and opened with dlopen at a path
// given by Python), in the initialize stage, outside any CUDA graph capture; execute only looks the
// loaded function up and enqueues one launch. Nothing here blocks on the stream.
//
// Needs only a C++17 compiler and the XLA FFI headers: no CUDA toolkit at build time.

#include <dlfcn.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// An opaque CUDA stream: XLA hands us its cudaStream_t, we hand it on to the CuTe runtime.
struct CUstream_st;
using CudaStream = CUstream_st*;

namespace {

// The symbol prefix given to dump_to_object() in jax_dqpost/compile.py.
constexpr char kFunctionPrefix[] = "jax_dqpost";

// ------------------------------------------------------------------------------------------------
// The subset of CuteDSLRuntime.h we use, resolved with dlopen/dlsym.
struct CuteModule;
struct CuteFunction;
using CreateFn = int (*)(CuteModule**, const unsigned char*, size_t, const char**, size_t);
using GetFunctionFn = int (*)(CuteFunction**, CuteModule*, const char*);
using RunFn = int (*)(void*, void**, size_t);
using ErrorStringFn = const char* (*)(int);

struct CuteRuntime {
  CreateFn create = nullptr;
  GetFunctionFn get_function = nullptr;
  RunFn run = nullptr;
  ErrorStringFn error_string = nullptr;
};

std::mutex g_mutex;  // guards everything below
CuteRuntime g_runtime;
bool g_runtime_loaded = false;
// fingerprint (sha256 of the module bytes) -> launchable function. Modules live until process exit.
std::unordered_map<std::string, CuteFunction*> g_functions;

std::string RuntimeError(const char* what, int code) {
  std::string msg = std::string(what) + " failed with CuTe runtime error " + std::to_string(code);
  if (g_runtime.error_string != nullptr) msg += std::string(": ") + g_runtime.error_string(code);
  return msg;
}

// Loads (once) the module with this fingerprint and returns its function.
ffi::ErrorOr<CuteFunction*> GetFunction(std::string_view module, std::string_view fingerprint) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_runtime_loaded) {
    return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                                      "jax_dqpost: the CuTe DSL runtime library is not loaded "
                                      "(jax_dqpost._ffi.register() sets it up)"));
  }
  std::string key(fingerprint);
  auto it = g_functions.find(key);
  if (it != g_functions.end()) return it->second;
  if (module.empty()) return ffi::Unexpected(ffi::Error::InvalidArgument("jax_dqpost: empty kernel module"));
  CuteModule* mod = nullptr;
  int err = g_runtime.create(&mod, reinterpret_cast<const unsigned char*>(module.data()), module.size(),
                             nullptr, 0);
  if (err != 0) return ffi::Unexpected(ffi::Error::Internal(RuntimeError("CuteDSLRT_Module_Create_From_Bytes", err)));
  CuteFunction* fn = nullptr;
  err = g_runtime.get_function(&fn, mod, kFunctionPrefix);
  if (err != 0) return ffi::Unexpected(ffi::Error::Internal(RuntimeError("CuteDSLRT_Module_Get_Function", err)));
  g_functions.emplace(std::move(key), fn);
  return fn;
}

bool FitsInt32(int64_t v) { return v >= 0 && v <= std::numeric_limits<int32_t>::max(); }

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// ------------------------------------------------------------------------------------------------
// Initialize stage: load the module before the first execution (and before any graph capture).
ffi::Error Initialize(ffi::Dictionary attrs) {
  auto module = attrs.get<std::string_view>("module");
  auto fingerprint = attrs.get<std::string_view>("fingerprint");
  if (module.has_error()) return module.error();
  if (fingerprint.has_error()) return fingerprint.error();
  auto fn = GetFunction(*module, *fingerprint);
  return fn.has_error() ? fn.error() : ffi::Error::Success();
}

// Execute stage: validate the buffers against the kernel's contract, then enqueue one launch.
ffi::Error Execute(CudaStream stream,
                   ffi::Buffer<ffi::F32> acc,        // (B, H, Sr * tile_hdim) fp32 accumulator
                   ffi::Buffer<ffi::F32> scale,      // () softmax scale, in device memory
                   ffi::Result<ffi::AnyBuffer> dq,   // (B, S, H, D) bf16/fp16
                   std::string_view module,          // CuTe object module (bytes)
                   std::string_view fingerprint,     // sha256 of module, the load-cache key
                   std::string_view dtype,           // "bf16" or "f16": the type compiled into module
                   int64_t tile_m,                   // rows per accumulator tile
                   int64_t tile_hdim) {              // padded head dim compiled into module
  const auto acc_dims = acc.dimensions();
  const auto dq_dims = dq->dimensions();
  if (acc_dims.size() != 3) return ffi::Error::InvalidArgument("jax_dqpost: dq_accum must have rank 3");
  if (dq_dims.size() != 4) return ffi::Error::InvalidArgument("jax_dqpost: dq must have rank 4");
  if (scale.element_count() != 1) return ffi::Error::InvalidArgument("jax_dqpost: scale must be a scalar");
  const ffi::DataType want = dtype == "bf16" ? ffi::DataType::BF16
                             : dtype == "f16" ? ffi::DataType::F16
                                              : ffi::DataType::INVALID;
  if (want == ffi::DataType::INVALID || dq->element_type() != want) {
    return ffi::Error::InvalidArgument("jax_dqpost: dq element type does not match the compiled kernel");
  }
  const int64_t batch = dq_dims[0], seqlen = dq_dims[1], heads = dq_dims[2], head_dim = dq_dims[3];
  if (tile_m <= 0 || tile_hdim <= 0) return ffi::Error::InvalidArgument("jax_dqpost: bad tile attributes");
  if (acc_dims[0] != batch || acc_dims[1] != heads) {
    return ffi::Error::InvalidArgument("jax_dqpost: dq_accum and dq disagree on batch or heads");
  }
  if (head_dim % 8 != 0 || head_dim > tile_hdim) {
    return ffi::Error::InvalidArgument("jax_dqpost: head_dim must be a multiple of 8 and <= tile_hdim");
  }
  const int64_t num_m_blocks = (seqlen + tile_m - 1) / tile_m;
  if (acc_dims[2] != num_m_blocks * tile_m * tile_hdim) {
    return ffi::Error::InvalidArgument("jax_dqpost: dq_accum's last dim is not ceil(S/tile_m)*tile_m*tile_hdim");
  }
  if (!FitsInt32(batch) || !FitsInt32(seqlen) || !FitsInt32(heads) || !FitsInt32(heads * head_dim) ||
      batch > 65535 || heads > 65535) {
    return ffi::Error::InvalidArgument("jax_dqpost: batch/heads must be <= 65535 and seqlen, heads*head_dim < 2^31");
  }
  if (!Aligned16(acc.untyped_data()) || !Aligned16(dq->untyped_data()) ) {
    return ffi::Error::InvalidArgument("jax_dqpost: dq_accum and dq must be 16-byte aligned");
  }
  if (batch == 0 || heads == 0 || seqlen == 0 || head_dim == 0) return ffi::Error::Success();  // no work

  auto fn = GetFunction(module, fingerprint);
  if (fn.has_error()) return fn.error();

  // One pointer per argument of the @cute.jit entry point, in order, then the int32 return code:
  // (acc_ptr, dq_ptr, scale_ptr, batch, heads, seqlen, head_dim, stream) -> ret.
  void* acc_ptr = acc.untyped_data();
  void* dq_ptr = dq->untyped_data();
  void* scale_ptr = scale.untyped_data();
  int32_t b = static_cast<int32_t>(batch), h = static_cast<int32_t>(heads);
  int32_t s = static_cast<int32_t>(seqlen), d = static_cast<int32_t>(head_dim);
  CudaStream st = stream;
  int32_t ret = 0;
  void* args[] = {&acc_ptr, &dq_ptr, &scale_ptr, &b, &h, &s, &d, &st, &ret};
  const int err = g_runtime.run(*fn, args, sizeof(args) / sizeof(args[0]));
  if (err != 0) return ffi::Error::Internal(RuntimeError("CuteDSLRT_Function_Run", err));
  if (ret != 0) {
    return ffi::Error::Internal("jax_dqpost: kernel launch failed with CUDA error " + std::to_string(ret));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDqpostInitialize, Initialize,
                              ffi::Ffi::BindInitialize().Attrs<ffi::Dictionary>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDqpostExecute, Execute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CudaStream>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // dq_accum
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale
                                  .Ret<ffi::AnyBuffer>()         // dq
                                  .Attr<std::string_view>("module")
                                  .Attr<std::string_view>("fingerprint")
                                  .Attr<std::string_view>("dtype")
                                  .Attr<int64_t>("tile_m")
                                  .Attr<int64_t>("tile_hdim"),
                              {ffi::Traits::kCmdBufferCompatible});

// Called once from Python (ctypes) with the path of libcute_dsl_runtime.so. Returns 0 on success,
// else writes a message into err (size errlen) and returns -1. Idempotent.
extern "C" int jax_dqpost_load_runtime(const char* path, char* err, size_t errlen) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_runtime_loaded) return 0;
  auto fail = [&](const std::string& msg) {
    if (err != nullptr && errlen > 0) {
      const size_t n = msg.size() < errlen - 1 ? msg.size() : errlen - 1;
      msg.copy(err, n);
      err[n] = '\0';
    }
    return -1;
  };
  void* handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) return fail(std::string("dlopen failed: ") + dlerror());
  CuteRuntime rt;
  rt.create = reinterpret_cast<CreateFn>(dlsym(handle, "CuteDSLRT_Module_Create_From_Bytes"));
  rt.get_function = reinterpret_cast<GetFunctionFn>(dlsym(handle, "CuteDSLRT_Module_Get_Function"));
  rt.run = reinterpret_cast<RunFn>(dlsym(handle, "CuteDSLRT_Function_Run"));
  rt.error_string = reinterpret_cast<ErrorStringFn>(dlsym(handle, "CuteDSLRT_GetErrorString"));
  if (rt.create == nullptr || rt.get_function == nullptr || rt.run == nullptr) {
    return fail(std::string("missing CuteDSLRT_* symbols in ") + path);
  }
  g_runtime = rt;
  g_runtime_loaded = true;
  return 0;
}
