// XLA FFI GPU target of jax-dqpost: launches a CuTe DSL-compiled postprocess kernel on XLA's stream.
//
// The kernel arrives as an attribute of the custom call: an object module produced by
// `cute.compile(...).dump_to_object(kFunctionPrefix)` at lowering time, so compiled executables and
// `jax.export` artifacts carry their own binary. Modules are loaded once per process through the CuTe
// runtime C API (libcute_dsl_runtime.so, shipped by nvidia-cutlass-dsl): Python gives its path when it registers
// the target (at `import jax_dqpost` where jax has a CUDA plugin, else at the first lowering), and the first instance
// to need it opens it with dlopen, so that a process that never runs the kernel never opens the runtime, and one that
// cannot open it gets the cause as the call's error.
// Each custom call instance resolves its function once, in the instantiate stage (outside
// any CUDA graph capture), into its own FFI state; execute takes it from there (no lock, no lookup) and
// enqueues one launch. Nothing here blocks on the stream.
//
// The handler is exported twice: plain, and marked command-buffer compatible (suffix `Capturable`),
// which lets XLA record the launch into its command buffers by stream capture. jax_dqpost/_primitive/ffi.py
// registers the capturable one unless asked not to (JAX_DQPOST_COMMAND_BUFFERS=0; docs/design.md, "CUDA graphs").
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

// The symbol prefix given to dump_to_object() in jax_dqpost/_kernel/cache.py.
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
std::string g_runtime_path;     // set by jax_dqpost_set_runtime, opened at the first need
std::string g_runtime_problem;  // why there is no runtime to open (set by Python, or a failed dlopen)
// fingerprint (sha256 of the module bytes) -> launchable function. Modules live until process exit.
std::unordered_map<std::string, CuteFunction*> g_functions;

std::string RuntimeError(const char* what, int code) {
  std::string msg = std::string(what) + " failed with CuTe runtime error " + std::to_string(code);
  if (g_runtime.error_string != nullptr) msg += std::string(": ") + g_runtime.error_string(code);
  return msg;
}

// Opens the runtime at g_runtime_path (once; callers hold g_mutex). An empty string on success, else why not.
std::string LoadRuntime() {
  if (g_runtime_loaded) return "";
  if (!g_runtime_problem.empty()) return g_runtime_problem;
  if (g_runtime_path.empty()) {
    return "jax_dqpost: no CuTe DSL runtime library was given to the handler (import jax_dqpost registers it)";
  }
  void* handle = dlopen(g_runtime_path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    g_runtime_problem = "jax_dqpost: cannot load the CuTe DSL runtime " + g_runtime_path + ": dlopen failed: " +
                        dlerror();
    return g_runtime_problem;
  }
  CuteRuntime rt;
  rt.create = reinterpret_cast<CreateFn>(dlsym(handle, "CuteDSLRT_Module_Create_From_Bytes"));
  rt.get_function = reinterpret_cast<GetFunctionFn>(dlsym(handle, "CuteDSLRT_Module_Get_Function"));
  rt.run = reinterpret_cast<RunFn>(dlsym(handle, "CuteDSLRT_Function_Run"));
  rt.error_string = reinterpret_cast<ErrorStringFn>(dlsym(handle, "CuteDSLRT_GetErrorString"));
  if (rt.create == nullptr || rt.get_function == nullptr || rt.run == nullptr) {
    g_runtime_problem = "jax_dqpost: missing CuteDSLRT_* symbols in " + g_runtime_path;
    return g_runtime_problem;
  }
  g_runtime = rt;
  g_runtime_loaded = true;
  return "";
}

// Loads (once) the module with this fingerprint and returns its function.
ffi::ErrorOr<CuteFunction*> GetFunction(std::string_view module, std::string_view fingerprint) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (std::string problem = LoadRuntime(); !problem.empty()) {
    return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kFailedPrecondition, problem));
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
// The per-instance state: the loaded function of the instance's module (owned by the process-wide cache).
struct LoadedKernel {
  static ffi::TypeId id;
  CuteFunction* fn = nullptr;
};
ffi::TypeId LoadedKernel::id = {};
const XLA_FFI_TypeInfo kLoadedKernelTypeInfo = ffi::MakeTypeInfo<LoadedKernel>();

// Instantiate stage: load the module (once per process) and keep its function in this instance's state.
ffi::ErrorOr<std::unique_ptr<LoadedKernel>> Instantiate(ffi::Dictionary attrs) {
  auto module = attrs.get<std::string_view>("module");
  auto fingerprint = attrs.get<std::string_view>("fingerprint");
  if (module.has_error()) return ffi::Unexpected(module.error());
  if (fingerprint.has_error()) return ffi::Unexpected(fingerprint.error());
  auto fn = GetFunction(*module, *fingerprint);
  if (fn.has_error()) return ffi::Unexpected(fn.error());
  auto state = std::make_unique<LoadedKernel>();
  state->fn = *fn;
  return state;
}

bool FitsExtents(ffi::Span<const int64_t> extents, int32_t* out) {
  for (size_t i = 0; i < extents.size(); ++i) {
    if (!FitsInt32(extents[i])) return false;
    out[i] = static_cast<int32_t>(extents[i]);
  }
  return true;
}

constexpr int64_t kExtentsPerPart = 5;  // abi.EXTENTS
constexpr int64_t kMaxParts = 3;        // abi.PARTS
constexpr size_t kMaxBuffers = 16;      // more than any call has (abi.pointers: at most 13)

// ------------------------------------------------------------------------------------------------
// The call's buffers, as jax_dqpost/_kernel/abi.py's BUFFERS table orders them: each one's role, which gives its
// element types and ranks. A call has 1 part (dQ) or 3 (dQ, dK, dV), 1 side (q) or 2 (q, k), and a sink or not.
enum class Role : int { kAccum, kAux, kScales, kSink, kLse, kDpsum, kOut, kDsink };
constexpr const char* kRoleNames[] = {"accum", "aux", "scales", "learnable_sink", "lse", "dpsum", "out", "dsink"};

// The roles of a call's buffers, in order, into roles[0..]; their count (0 if parts is neither 1 nor 3).
size_t Roles(size_t parts, bool sink, Role* roles) {
  if (parts != 1 && parts != 3) return 0;
  const size_t sides = parts == 1 ? 1 : 2;
  size_t n = 0;
  for (size_t i = 0; i < parts; ++i) roles[n++] = Role::kAccum;
  for (size_t i = 0; i < sides; ++i) roles[n++] = Role::kAux;
  roles[n++] = Role::kScales;
  if (sink) roles[n++] = Role::kSink, roles[n++] = Role::kLse, roles[n++] = Role::kDpsum;
  for (size_t i = 0; i < parts; ++i) roles[n++] = Role::kOut;
  if (sink) roles[n++] = Role::kDsink;
  return n;
}

struct View {
  ffi::DataType type;
  size_t rank;
};

std::string TypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32:
      return "float32";
    case ffi::DataType::BF16:
      return "bfloat16";
    case ffi::DataType::F16:
      return "float16";
    case ffi::DataType::S32:
      return "int32";
    default:
      return "element type " + std::to_string(static_cast<int>(t));
  }
}

// Whether a buffer of this element type and rank can have this role, given the call's output and sink types:
// the accumulators (and lse, dpsum) float32 of rank 3 (dense) or 2 (packed), each output one rank more than its
// accumulator in bf16 or fp16, the int32 sides and the scales of rank 1, dsink in the sink's type or float32.
bool Fits(Role role, View v, View accum, ffi::DataType out, ffi::DataType sink) {
  using T = ffi::DataType;
  switch (role) {
    case Role::kAccum:
    case Role::kLse:
    case Role::kDpsum:
      return v.type == T::F32 && (v.rank == 2 || v.rank == 3);
    case Role::kAux:
      return v.type == T::S32 && v.rank == 1;
    case Role::kScales:
      return v.type == T::F32 && v.rank == 1;
    case Role::kSink:
      return (v.type == T::F32 || v.type == T::BF16 || v.type == T::F16) && v.rank == 1;
    case Role::kOut:
      return v.type == out && (out == T::BF16 || out == T::F16) && v.rank == accum.rank + 1;
    case Role::kDsink:
      return (v.type == sink || v.type == T::F32) && v.rank == 1;
  }
  return false;
}

// The device address of every operand, then of every result, each checked against its role (element type and
// rank), its expected size in bytes (so a buffer never disagrees with the extents the kernel indexes it by) and for
// 16-byte alignment.
ffi::Error CollectBuffers(ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Span<const int64_t> bytes,
                          size_t parts, void** out) {
  const size_t n = args.size() + rets.size();
  if (bytes.size() != n) return ffi::Error::InvalidArgument("jax_dqpost: bytes does not match the call's buffers");
  Role roles[kMaxBuffers] = {};
  const bool sink = rets.size() == parts + 1;
  if (Roles(parts, sink, roles) != n || rets.size() != parts + (sink ? 1 : 0)) {
    return ffi::Error::InvalidArgument("jax_dqpost: the call's buffers do not fit its parts");
  }
  View views[kMaxBuffers] = {};
  for (size_t i = 0; i < n; ++i) {
    void* data = nullptr;
    size_t size = 0;
    if (i < args.size()) {
      auto buf = args.get<ffi::AnyBuffer>(i);
      if (buf.has_error()) return buf.error();
      data = buf->untyped_data(), size = buf->size_bytes();
      views[i] = {buf->element_type(), buf->dimensions().size()};
    } else {
      auto buf = rets.get<ffi::AnyBuffer>(i - args.size());
      if (buf.has_error()) return buf.error();
      data = (*buf)->untyped_data(), size = (*buf)->size_bytes();
      views[i] = {(*buf)->element_type(), (*buf)->dimensions().size()};
    }
    if (static_cast<int64_t>(size) != bytes[i]) {
      return ffi::Error::InvalidArgument("jax_dqpost: buffer " + std::to_string(i) + " has " + std::to_string(size) +
                                         " bytes, expected " + std::to_string(bytes[i]));
    }
    if (!Aligned16(data)) return ffi::Error::InvalidArgument("jax_dqpost: buffers must be 16-byte aligned");
    out[i] = data;
  }
  const size_t first_out = n - rets.size();
  const ffi::DataType out_type = views[first_out].type;
  const ffi::DataType sink_type = sink ? views[parts + (parts == 1 ? 1 : 2) + 1].type : ffi::DataType::INVALID;
  for (size_t i = 0; i < n; ++i) {
    const View accum = roles[i] == Role::kOut ? views[i - first_out] : views[i];
    if (!Fits(roles[i], views[i], accum, out_type, sink_type)) {
      return ffi::Error::InvalidArgument("jax_dqpost: buffer " + std::to_string(i) + " (" +
                                         kRoleNames[static_cast<int>(roles[i])] + ") is " + TypeName(views[i].type) +
                                         " of rank " + std::to_string(views[i].rank) +
                                         ", not what its role takes (abi.BUFFERS)");
    }
  }
  return ffi::Error::Success();
}

// Runs the loaded entry point with these argument addresses (its arguments in order, then the stream and the
// int32 return code: the last two entries of call).
ffi::Error Run(LoadedKernel* kernel, void** call, size_t count) {
  const int err = g_runtime.run(kernel->fn, call, count);
  if (err != 0) return ffi::Error::Internal(RuntimeError("CuteDSLRT_Function_Run", err));
  const int32_t ret = *static_cast<int32_t*>(call[count - 1]);
  if (ret != 0) return ffi::Error::Internal("jax_dqpost: kernel launch failed with CUDA error " + std::to_string(ret));
  return ffi::Error::Success();
}

// ------------------------------------------------------------------------------------------------
// The target: the kernel of jax_dqpost/_kernel/kernel.py, called as jax_dqpost/_kernel/abi.py declares it: every
// operand, then every result, as a device pointer; then kExtentsPerPart int32 extents per part; then the stream.
// Attributes: "bytes", each buffer's size; "extents" (Plan.launch); "ctas", the launch's CTAs (0: nothing to do).
// Its compatibility rule: docs/design.md, "Compatibility".

ffi::Error Execute(CudaStream stream, LoadedKernel* kernel, ffi::RemainingArgs args, ffi::RemainingRets rets,
                   std::string_view /*module: the instantiate stage's*/, std::string_view /*fingerprint*/,
                   ffi::Span<const int64_t> bytes, ffi::Span<const int64_t> extents, int64_t ctas) {
  const size_t n = args.size() + rets.size();
  const size_t num_extents = extents.size();
  if (n > kMaxBuffers || num_extents == 0 || num_extents % kExtentsPerPart != 0 ||
      num_extents > static_cast<size_t>(kMaxParts * kExtentsPerPart)) {
    return ffi::Error::InvalidArgument("jax_dqpost: the call's buffers or extents do not fit the kernel");
  }
  void* ptrs[kMaxBuffers] = {};
  const size_t parts = num_extents / kExtentsPerPart;
  if (ffi::Error err = CollectBuffers(args, rets, bytes, parts, ptrs); err.failure()) return err;
  int32_t ext[kMaxParts * kExtentsPerPart];
  if (!FitsExtents(extents, ext)) return ffi::Error::InvalidArgument("jax_dqpost: extent out of int32 range");
  if (!FitsInt32(ctas)) return ffi::Error::InvalidArgument("jax_dqpost: too many CTAs for one launch");
  if (ctas == 0) return ffi::Error::Success();  // no work
  CudaStream st = stream;
  int32_t ret = 0;
  void* call[kMaxBuffers + kMaxParts * kExtentsPerPart + 2];
  size_t k = 0;
  for (size_t i = 0; i < n; ++i) call[k++] = &ptrs[i];
  for (size_t i = 0; i < num_extents; ++i) call[k++] = &ext[i];
  call[k++] = &st;
  call[k++] = &ret;
  return Run(kernel, call, k);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDqpostInstantiate, Instantiate,
                              ffi::Ffi::BindInstantiate().Attrs<ffi::Dictionary>());

// The binding, exported plain and command-buffer compatible.
#define JAX_DQPOST_EXECUTE_BINDING                                                   \
  ffi::Ffi::Bind()                                                                   \
      .Ctx<ffi::PlatformStream<CudaStream>>()                                       \
      .Ctx<ffi::State<LoadedKernel>>()                                              \
      .RemainingArgs()                                                              \
      .RemainingRets()                                                              \
      .Attr<std::string_view>("module") /* unused here (Instantiate loads it) */    \
      .Attr<std::string_view>("fingerprint")                                        \
      .Attr<ffi::Span<const int64_t>>("bytes")                                      \
      .Attr<ffi::Span<const int64_t>>("extents")                                    \
      .Attr<int64_t>("ctas")

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDqpostExecute, Execute, JAX_DQPOST_EXECUTE_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDqpostExecuteCapturable, Execute, JAX_DQPOST_EXECUTE_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});

// The calling convention as the handler passes it, for the test that pins it to jax_dqpost/_kernel/abi.py.
extern "C" int64_t jax_dqpost_extents_per_part() { return kExtentsPerPart; }
extern "C" int64_t jax_dqpost_max_parts() { return kMaxParts; }
extern "C" int64_t jax_dqpost_max_buffers() { return static_cast<int64_t>(kMaxBuffers); }
// The roles (Role values) of the buffers of a call of `parts` parts, with a sink or not, into roles[0..]: their count.
extern "C" int64_t jax_dqpost_buffer_roles(int64_t parts, int32_t sink, int32_t* roles) {
  Role r[kMaxBuffers];
  const size_t n = Roles(static_cast<size_t>(parts), sink != 0, r);
  for (size_t i = 0; i < n; ++i) roles[i] = static_cast<int32_t>(r[i]);
  return static_cast<int64_t>(n);
}
// The names of the roles, by value, as abi.BUFFERS calls the kinds.
extern "C" const char* jax_dqpost_role_name(int32_t role) {
  return role >= 0 && role < static_cast<int32_t>(sizeof(kRoleNames) / sizeof(kRoleNames[0])) ? kRoleNames[role]
                                                                                             : nullptr;
}

// The state's type, registered with XLA by Python (jax.ffi.register_ffi_type) before the target.
extern "C" void* jax_dqpost_state_type_id() { return &LoadedKernel::id; }
extern "C" const void* jax_dqpost_state_type_info() { return &kLoadedKernelTypeInfo; }

// The XLA FFI API version of the headers this library was compiled against: jax_dqpost/_primitive/ffi.py compares
// it with the running jaxlib's (the same major, a minor no newer) before registering the handler.
extern "C" void jax_dqpost_ffi_api_version(int* major, int* minor) {
  *major = XLA_FFI_API_MAJOR;
  *minor = XLA_FFI_API_MINOR;
}

// Called from Python (ctypes) when it registers the target: the path of libcute_dsl_runtime.so to open at the
// first need, or (path null) the problem that leaves none, which every instance then returns as its error. Ignored
// once the runtime is loaded.
extern "C" void jax_dqpost_set_runtime(const char* path, const char* problem) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_runtime_loaded) return;
  g_runtime_path = path != nullptr ? path : "";
  g_runtime_problem = path != nullptr ? "" : (problem != nullptr ? problem : "jax_dqpost: no CuTe DSL runtime");
}

// Opens the runtime now (see jax_dqpost_set_runtime). Returns 0 on success, else writes why into err (size errlen)
// and returns -1. Idempotent.
extern "C" int jax_dqpost_load_runtime(char* err, size_t errlen) {
  std::lock_guard<std::mutex> lock(g_mutex);
  const std::string problem = LoadRuntime();
  if (problem.empty()) return 0;
  if (err != nullptr && errlen > 0) {
    const size_t n = problem.size() < errlen - 1 ? problem.size() : errlen - 1;
    problem.copy(err, n);
    err[n] = '\0';
  }
  return -1;
}
